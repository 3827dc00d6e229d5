"""A speed-up for artifacts with models: the full model walk, remembered per set of models.

The input tensors' layouts are remembered too, where a call passes positional tensors of
static shapes: inputs laid out as the last ones that passed skip the checks in Python.

The walk's result is kept per set of model objects. While no parameter, buffer or submodule
has been registered anywhere since (the public module-registration hooks of
``torch.nn.modules.module`` count each one) and no hook has been registered anywhere (each takes
a new ``RemovableHandle`` id), a call runs one function generated for that set of models: it
compares each submodule's class, training flag and forward (none set on the instance, none
patched into its class), the number of members of each dict the walk found non-empty (a
removed one shrinks it), the very hooks the walk found and the values each holds, and the
Python values the trace read off the modules, each by identity with what the walk saw.
Then each tensor's shape, dtype, device, strides and requires_grad are compared in C++ with
``torch._C._dynamo.guards.TensorGuards`` (torch.compile's own tensor check). Where this torch
has no such check, every call takes the full walk.
"""

import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.core import ModelPlan, WalkedModels
from torch_precompile.shipped.driver.module_rules import GLOBAL_HOOKS, MODULE_HOOKS, TENSOR_HOOKS
from torch_precompile.shipped.driver.rechecks import (
    _DEREF,
    _HANDLES,
    _CheckSource,
    module_facts,
    read_facts,
    registration_counter,
    same_value,
    tensor_guard,
)


class RememberedModels:
    """One set of models that passed the full walk, and what a cheap re-check compares."""

    __slots__ = ("hook_handles", "models", "registrations", "tensor_guard", "tensors", "unchanged")

    def __init__(
        self, models: Sequence[Any], walked: WalkedModels, registrations: int, model: ModelPlan
    ) -> None:
        self.models = [weakref.ref(m) for m in models]
        self.registrations = registrations
        self.hook_handles = _HANDLES.next_id
        self.tensors = tuple(walked.tensors)  # handed out as is: no call mutates it
        paths = [] if model.facts is None else model.facts.module_paths()
        self.unchanged = module_check(models, walked, paths, model)
        self.tensor_guard = tensor_guard(walked.tensors)


def module_check(
    models: Sequence[Any],
    walked: WalkedModels,
    paths: Sequence[tuple[int, tuple[str, ...]]],
    model: ModelPlan,
) -> Callable[..., bool]:
    """A function of the models that tells whether every fact the walk checked in Python
    still holds as the walk saw it. It is generated as one expression, so each fact costs a
    few bytecodes, less than a loop over the modules does. What it compares with are its
    globals (submodules included); the models themselves are its arguments, so it does not
    keep them alive."""
    check = _CheckSource(models)
    module_facts(check, walked.submodules)
    read_facts(check, walked.submodules, paths)
    hooks = [d for m in walked.submodules for _, a in MODULE_HOOKS if (d := getattr(m, a))]
    hooks += [d for _, a in GLOBAL_HOOKS if (d := getattr(torch.nn.modules.module, a))]
    hooks += [
        d
        for t in walked.tensors[: len(model.parameter_hooks)]
        for _, a in TENSOR_HOOKS
        if (d := getattr(t, a))
    ]
    same_objects = check.hold("op", operator.is_)
    for d in hooks:  # the very hooks the walk found, each holding the values it held
        held, now = check.hold("value", list(d.values())), check.hold("hooks", d)
        check.terms.append(f"len({now}) == {len(d)}")
        check.terms.append(f"all(map({same_objects}, {now}.values(), {held}))")
        for _, _, read in (v for hook in d.values() for v in model.hook_values(hook)):
            same_value(check, f"{check.hold('read', read)}()", read())
    return check.compiled()


class ModelMemo:
    """The last few sets of models a call passed, keyed by their identities."""

    SIZE = 8

    def __init__(self, model: ModelPlan) -> None:
        self.model = model
        self.entries: dict[tuple[int, ...], RememberedModels] = {}
        self.lock = threading.Lock()
        self.input_guard: Any = None
        self.registrations = registration_counter()

    def inputs_unchanged(self, leaves: Sequence[torch.Tensor]) -> bool:
        """Whether the input tensors match, in C++, the last ones that passed every check
        (their type, dtype, device, sizes, strides and requires_grad)."""
        guard = self.input_guard
        return guard is not None and guard.check(*leaves)

    def remember_inputs(self, leaves: Sequence[torch.Tensor]) -> None:
        self.input_guard = tensor_guard(leaves)

    def lookup(self, models: Sequence[Any]) -> Sequence[torch.Tensor] | None:
        """The models' tensors if nothing about them can have changed since they passed."""
        entry = self.entries.get(tuple(map(id, models)))
        if (
            entry is not None
            and entry.registrations == self.registrations[0]
            and all(map(operator.is_, map(_DEREF, entry.models), models))
            and entry.hook_handles == _HANDLES.next_id
            and entry.unchanged(*models)
            and entry.tensor_guard.check(*entry.tensors)
        ):
            return entry.tensors
        return None

    def remember(self, models: Sequence[Any], walked: WalkedModels) -> None:
        entry = RememberedModels(models, walked, self.registrations[0], self.model)
        if entry.tensor_guard is None:
            return
        with self.lock:
            if len(self.entries) >= self.SIZE:
                self.entries.pop(next(iter(self.entries)), None)
            self.entries[tuple(map(id, models))] = entry
