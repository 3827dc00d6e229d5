"""A speed-up for artifacts with models: the full model walk, remembered per set of models.

The input tensors' layouts are remembered too, where a call passes positional tensors of
static shapes: inputs laid out as the last ones that passed skip the checks in Python.

The walk's result is kept per set of model objects. While no parameter, buffer or submodule
has been registered anywhere since (the public module-registration hooks of
``torch.nn.modules.module`` count each one) and no module lost a member, a call re-checks only
each submodule's training flag and each tensor's shape, dtype, device, strides and
requires_grad, in C++ with ``torch._C._dynamo.guards.TensorGuards`` (torch.compile's own
tensor check). Where this torch has no such check, every call takes the full walk.
"""

import operator
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from torch_precompile.driver.core import ModelPlan, WalkedModels


class RememberedModels:
    """One set of models that passed the full walk, and what a cheap re-check compares."""

    __slots__ = ("member_total", "members", "models", "modes_of", "registrations",
                 "submodules", "tensor_guard", "tensors")

    def __init__(self, models: Sequence[Any], walked: WalkedModels, registrations: int) -> None:
        self.models = [weakref.ref(m) for m in models]
        self.registrations = registrations
        self.tensors = tuple(walked.tensors)  # handed out as is: no call mutates it
        # Where each submodule's training flag is read: its instance dict when the flag lives
        # there alone (as nn.Module keeps it; a dict read is the cheaper one), else the module.
        plain = all("training" in vars(m) and not hasattr(type(m), "training")
                    for m in walked.submodules)
        self.submodules = [vars(m) for m in walked.submodules] if plain else walked.submodules
        self.modes_of = _TRAINING_IN_DICT if plain else _TRAINING
        # The member dicts the walk found non-empty: a removed member shrinks one of them (one
        # added anywhere is a registration).
        self.members = [d for m in walked.submodules
                        for d in (m._parameters, m._buffers, m._modules) if d]
        self.member_total = self.member_count()
        self.tensor_guard = tensor_guard(walked.tensors)

    def member_count(self) -> int:
        return sum(map(len, self.members))


class ModelMemo:
    """The last few sets of models a call passed, keyed by their identities."""

    SIZE = 8

    def __init__(self, model: ModelPlan) -> None:
        self.modes = [training for _, training in model.submodules]
        self.entries: dict[tuple[int, ...], RememberedModels] = {}
        self.lock = threading.Lock()
        self.input_guard: Any = None
        REGISTRATIONS.start()

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
        if (entry is not None and entry.registrations == REGISTRATIONS.value
                and all(map(operator.is_, map(_DEREF, entry.models), models))
                and entry.member_count() == entry.member_total
                and list(map(entry.modes_of, entry.submodules)) == self.modes
                and entry.tensor_guard.check(*entry.tensors)):
            return entry.tensors
        return None

    def remember(self, models: Sequence[Any], walked: WalkedModels) -> None:
        entry = RememberedModels(models, walked, REGISTRATIONS.value)
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


_TRAINING = operator.attrgetter("training")
_TRAINING_IN_DICT = operator.itemgetter("training")
_DEREF = weakref.ref.__call__  # a remembered model, or None once it is gone


class RegistrationCount:
    """Registrations of parameters, buffers and submodules anywhere in the process, counted
    from the first memo on: while the count stands still, no remembered model can have a
    replaced, re-tied or added member."""

    def __init__(self) -> None:
        self.value = 0
        self.counting = False

    def start(self) -> None:
        if self.counting:
            return
        self.counting = True
        hooks = torch.nn.modules.module
        hooks.register_module_parameter_registration_hook(self.bump)
        hooks.register_module_buffer_registration_hook(self.bump)
        hooks.register_module_module_registration_hook(self.bump)

    def bump(self, *_: Any) -> None:
        self.value += 1


REGISTRATIONS = RegistrationCount()
