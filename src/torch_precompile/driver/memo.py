"""A speed-up for artifacts with models: the full model walk, remembered per set of models.

The input tensors' layouts are remembered too, where a call passes positional tensors of
static shapes: inputs laid out as the last ones that passed skip the checks in Python.

The walk's result is kept per set of model objects. While no parameter, buffer or submodule
has been registered anywhere since (the public module-registration hooks of
``torch.nn.modules.module`` count each one), no hook has been registered anywhere (each takes
a new ``RemovableHandle`` id) and no module lost a member or a hook, a call re-checks only each
submodule's training flag, the Python values the trace read off the modules (by identity),
and each tensor's shape, dtype, device, strides and requires_grad, in C++ with
``torch._C._dynamo.guards.TensorGuards`` (torch.compile's own tensor check). Where this torch
has no such check, every call takes the full walk.
"""

import operator
import sys
import threading
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from torch_precompile.driver.core import (
    GLOBAL_HOOKS,
    MODULE_HOOKS,
    TENSOR_HOOKS,
    ModelPlan,
    WalkedModels,
)


class RememberedModels:
    """One set of models that passed the full walk, and what a cheap re-check compares."""

    __slots__ = ("hook_handles", "member_total", "members", "models", "modes_of",
                 "registrations", "submodules", "tensor_guard", "tensors", "values")

    def __init__(self, models: Sequence[Any], walked: WalkedModels, registrations: int,
                 model: ModelPlan) -> None:
        self.models = [weakref.ref(m) for m in models]
        self.registrations = registrations
        self.hook_handles = _HANDLES.next_id
        self.tensors = tuple(walked.tensors)  # handed out as is: no call mutates it
        # Where each submodule's training flag is read: its instance dict when the flag lives
        # there alone (as nn.Module keeps it; a dict read is the cheaper one), else the module.
        plain = all("training" in vars(m) and not hasattr(type(m), "training")
                    for m in walked.submodules)
        self.submodules = [vars(m) for m in walked.submodules] if plain else walked.submodules
        self.modes_of = _TRAINING_IN_DICT if plain else _TRAINING
        # The member and hook dicts the walk found non-empty: a removed member or hook shrinks
        # one of them (one added anywhere is a registration, or a new hook handle).
        hooks = [a for _, a in MODULE_HOOKS]
        self.members = [d for m in walked.submodules
                        for d in (m._parameters, m._buffers, m._modules,
                                  *(getattr(m, a) for a in hooks)) if d]
        self.members += [d for _, a in GLOBAL_HOOKS
                         if (d := getattr(torch.nn.modules.module, a))]
        self.members += [d for t in walked.tensors[:len(model.parameter_hooks)]
                         for _, a in TENSOR_HOOKS if (d := getattr(t, a))]
        self.values = (None if model.facts is None
                       else model.facts.remember_modules(walked.submodules))
        self.member_total = self.member_count()
        self.tensor_guard = tensor_guard(walked.tensors)

    def member_count(self) -> int:
        return sum(map(len, self.members))


class ModelMemo:
    """The last few sets of models a call passed, keyed by their identities."""

    SIZE = 8

    def __init__(self, model: ModelPlan) -> None:
        self.model = model
        self.modes = [training for _, training in model.submodules]
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
        if (entry is not None and entry.registrations == self.registrations[0]
                and all(map(operator.is_, map(_DEREF, entry.models), models))
                and entry.hook_handles == _HANDLES.next_id
                and entry.member_count() == entry.member_total
                and (entry.values is None or entry.values.unchanged())
                and list(map(entry.modes_of, entry.submodules)) == self.modes
                and entry.tensor_guard.check(*entry.tensors)):
            return entry.tensors
        return None

    def remember(self, models: Sequence[Any], walked: WalkedModels) -> None:
        entry = RememberedModels(models, walked, self.registrations[0], self.model)
        if entry.tensor_guard is None:
            return
        with self.lock:
            if len(self.entries) >= self.SIZE:
                self.entries.pop(next(iter(self.entries), None), None)
            self.entries[tuple(map(id, models))] = entry


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """A check, in C++, that tensors keep the type, dtype, device, sizes, strides and
    requires_grad they have now (None where this torch has none). It is stricter than the
    capture's contract (exact strides everywhere): a call it refuses takes the full check,
    which decides."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                            dynamic_dims_strides=[list(t.stride()) for t in tensors],
                            tensor_check_names=[f"t{i}" for i in range(len(tensors))])
    except (ImportError, RuntimeError, TypeError):
        return None


# Every hook registration anywhere (module, global or tensor hook) takes a new handle id.
_HANDLES = torch.utils.hooks.RemovableHandle
_TRAINING = operator.attrgetter("training")
_TRAINING_IN_DICT = operator.itemgetter("training")
_DEREF = weakref.ref.__call__  # a remembered model, or None once it is gone


# The registration count is one per process, in a module of its own shared by every artifact
# loaded (whatever version made it): hooks registered per load would pile up, each keeping its
# artifact alive. bump is compiled into that module, so its globals are the module's and it
# references no artifact. Artifacts of every version read counter[0]: a different layout
# needs a different module name.
_SHARED_COUNT = "_torch_precompile_registration_count"
_SHARED_COUNT_SOURCE = """\
counter = [0]


def bump(*_):
    counter[0] += 1
"""


def registration_counter() -> list[int]:
    """The process-wide count of parameter, buffer and submodule registrations, as a
    one-element list, counted from the process's first memo on: while it stands still, no
    remembered model can have a replaced, re-tied or added member."""
    shared = sys.modules.get(_SHARED_COUNT)
    if shared is None:
        fresh = types.ModuleType(_SHARED_COUNT, "torch_precompile's count of module registrations")
        exec(_SHARED_COUNT_SOURCE, vars(fresh))
        # setdefault is atomic: of two first loads at once, only one registers hooks.
        shared = sys.modules.setdefault(_SHARED_COUNT, fresh)
        if shared is fresh:
            hooks = torch.nn.modules.module
            hooks.register_module_parameter_registration_hook(fresh.bump)
            hooks.register_module_buffer_registration_hook(fresh.bump)
            hooks.register_module_module_registration_hook(fresh.bump)
    return shared.counter
