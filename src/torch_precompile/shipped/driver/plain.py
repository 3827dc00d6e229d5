"""The runtime of a plain artifact: what its generated checks call, and its ``forward``.

A plain artifact takes at most one model (without hooks), positional tensors and optimizer
arguments, and uses none of the features the generic ``Driver`` is for (nested inputs and
Python values, dynamic dims, sharding, tensor subclasses, results that alias inputs, variants).
Its section 3 opens with ``check_call`` and ``check_models``, generated from its spec one check
a line; ``PlainForward`` runs the graph on the tensors they return.
"""

import operator
import threading
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_precompile.shipped.driver.encoded import MISSING, compare_read, module_read_name
from torch_precompile.shipped.driver.module_rules import (
    GLOBAL_HOOKS,
    GLOBAL_HOOKS_OWNER,
    MODULE_HOOKS,
    TENSOR_HOOKS,
    hook_sets,
    hooks_error,
    members_differ,
    members_missing,
    shown_member,
    shown_module,
    submodules_differ,
    tied_apart,
    tied_since,
)
from torch_precompile.shipped.driver.rechecks import (
    _DEREF,
    _HANDLES,
    _CheckSource,
    module_facts,
    registration_counter,
    tensor_guard,
)
from torch_precompile.shipped.driver.records import SPEC_DEFAULTS, SPEC_RECORDS
from torch_precompile.shipped.driver.tensor_rules import accumulate_grads


class PlainForward:
    """``forward``: ``checks(args, kwargs)`` gives the graph's flat inputs, ``call`` runs it.

    ``names`` names each flat input in messages; ``grads`` are the indices of the model
    tensors whose gradients follow the results; ``autograd`` (``NoHistory``, or
    ``differentiable`` where results can carry history, over the spec's ``autograd_records``)
    decides what a call under grad mode with tensors requiring grad does; ``optimizers``
    (``OptimizerSteps``), where fn steps optimizer arguments, hears that they stepped.
    """

    def __init__(
        self,
        call: Callable[[list[Any]], list[Any]],
        checks: Callable[[Sequence[Any], Any], list[torch.Tensor]],
        out_spec: str,
        names: Sequence[str],
        grads: Sequence[int] = (),
        autograd: Any = None,
        autograd_records: Sequence[Mapping[str, Any] | None] = (),
        optimizers: Any = None,
    ) -> None:
        self.call = call
        self.checks = checks
        self.out_spec = pytree.treespec_loads(out_spec)
        self.single_result = self.out_spec == pytree.tree_flatten(0)[1]
        self.num_results = self.out_spec.num_leaves
        self.names = list(names)
        self.grads = list(grads)
        self.graph_outputs = self.num_results + len(self.grads)
        self.autograd_records = tuple(_autograd(r) for r in autograd_records)
        self.autograd: Any = autograd(self) if autograd is not None else None
        self.optimizers = optimizers

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the precompiled computation on ``args`` (fn's positional arguments)."""
        return self.run(args, self.checked(args, kwargs))

    def checked(self, args: Sequence[Any], kwargs: Any) -> list[torch.Tensor]:
        """The graph's flat inputs, once the call passed every check; nothing runs."""
        return self.checks(args, kwargs)

    def flat_name(self, index: int) -> str:
        return self.names[index]

    def run(self, args: Sequence[Any], flat: list[torch.Tensor]) -> Any:
        """Run the graph on a checked call; its gradients go to ``.grad``."""
        grad_enabled = torch.is_grad_enabled()
        # Results get history where eager's would: under grad mode, from inputs requiring it.
        history = self.autograd.wanted(flat) if grad_enabled and self.autograd else None
        torch._C._set_grad_enabled(history is not None)
        try:
            outputs = self.call(list(flat)) if history is None else self.autograd(flat, history)
            if self.grads:
                accumulate_grads(flat, self.grads, outputs[self.num_results :])
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        if self.optimizers is not None:
            self.optimizers.stepped(args)
        if self.single_result:
            return outputs[0]
        return pytree.tree_unflatten(outputs[: self.num_results], self.out_spec)


def _autograd(literal: Mapping[str, Any] | None) -> Any:
    """An Autograd record of the spec's literal, its left-out fields at the spec's defaults,
    as the autograd part reads it."""
    if literal is None:
        return None
    fields, defaults = SPEC_RECORDS["Autograd"], SPEC_DEFAULTS["Autograd"]
    left_out = dict(zip(fields[len(fields) - len(defaults) :], defaults, strict=True))
    return types.SimpleNamespace(**{**left_out, **literal})


def members(model: Any, argument: str, captured: Sequence[tuple[str, str, Any]]) -> list[Any]:
    """The model's parameters then buffers, where their kinds, names and ties are
    ``captured`` (kind, name, the name it is tied to or None): one tensor per tie."""
    found = [
        *(("parameter", n, t) for n, t in model.named_parameters(remove_duplicate=False)),
        *(("buffer", n, t) for n, t in model.named_buffers(remove_duplicate=False)),
    ]
    for index, (kind, name, _) in enumerate(found):
        if index >= len(captured) or captured[index][:2] != (kind, name):
            expected = (argument, *captured[index][:2]) if index < len(captured) else ("", "", "")
            raise members_differ(expected, (argument, kind, name))
    if len(found) < len(captured):
        missing = captured[len(found) :]
        raise members_missing([f"{kind} {name!r}" for kind, name, _ in missing])
    first_name: dict[int, str] = {}
    tensors = []
    for (kind, name, tensor), (_, _, tied_to) in zip(found, captured, strict=True):
        owner = first_name.get(id(tensor))
        if tied_to is not None:
            if owner != tied_to:
                raise tied_apart(kind, name, tied_to)
            continue
        if owner is not None:
            raise tied_since(kind, name, owner)
        first_name[id(tensor)] = name
        tensors.append(tensor)
    return tensors


def submodules(model: Any, captured: Sequence[str]) -> list[Any]:
    """The model's submodules in walk order, where their names are ``captured``."""
    found = list(model.named_modules(remove_duplicate=False))
    names = [name for name, _ in found]
    if names != list(captured):
        raise submodules_differ(names, captured)
    return [module for _, module in found]


def check_no_hooks(
    modules: Sequence[Any], names: Sequence[str], parameters: Sequence[tuple[str, Any]] = ()
) -> None:
    """The capture ran through no hooks: none may be registered now (on the modules, in the
    process, and on the ``parameters`` a backward inside fn reaches)."""
    for name, module in zip(names, modules, strict=True):
        now = hook_sets(module, MODULE_HOOKS)
        if now:
            raise hooks_error(shown_module(name), (), now)
    now = hook_sets(torch.nn.modules.module, GLOBAL_HOOKS)
    if now:
        raise hooks_error(GLOBAL_HOOKS_OWNER, (), now)
    for name, tensor in parameters:
        now = hook_sets(tensor, TENSOR_HOOKS)
        if now:
            raise hooks_error(shown_member("parameter", name), (), now)


def read_value(module: Any, path: Sequence[str]) -> Any:
    """The value at ``path`` off ``module`` (``MISSING`` where an attribute is gone)."""
    for name in path:
        module = getattr(module, name, MISSING)
    return module


def check_read(module: Any, name: str, path: Sequence[str], expected: Any, where: str) -> None:
    """A value the trace read off submodule ``name`` (at ``where``), as it read it
    (``expected``, encoded)."""
    compare_read(expected, where, module_read_name(name, path), read_value(module, path))


class RememberedCall:
    """The inputs' layouts and the last few models that passed the full checks.

    ``check_models`` is the artifact's full check of its model. A model it passed, while no
    member or hook was registered anywhere since (``rechecks``), is unchanged if its submodules
    keep their classes, modes and forwards and the sizes of their member dicts, and its tensors
    pass a tensor guard in C++.
    """

    SIZE = 8

    def __init__(
        self,
        check_models: Callable[..., tuple[list[Any], list[Any]]] | None,
        reads: Sequence[tuple[int, Sequence[str]]] = (),
        terms: Callable[..., None] | None = None,
    ) -> None:
        self.check_models: Any = check_models
        self.reads = reads  # (submodule index, attribute path) of each value the trace read
        self.read_terms = terms  # what adds their terms to the remembered check, if any
        self.entries: dict[tuple[int, ...], _CheckedModels] = {}
        self.lock = threading.Lock()
        self.registrations = registration_counter()
        self.input_guard: Any = None

    def inputs_unchanged(self, inputs: Sequence[Any]) -> bool:
        guard = self.input_guard
        return guard is not None and guard.check(*inputs)

    def remember_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        self.input_guard = tensor_guard(inputs)

    def model_tensors(self, models: Sequence[Any]) -> list[torch.Tensor]:
        """The models' tensors in the graph's order, checked in full unless remembered."""
        entry = self.entries.get(tuple(map(id, models)))
        if entry is not None and entry.unchanged(models, self.registrations[0]):
            return entry.tensors
        tensors, modules = self.check_models(*models)
        check = _CheckSource(models)
        module_facts(check, modules)
        if self.read_terms is not None:
            self.read_terms(check, modules, self.reads)
        entry = _CheckedModels(models, tensors, check.compiled(), self.registrations[0])
        if entry.guard is not None:
            with self.lock:
                if len(self.entries) >= self.SIZE:
                    self.entries.pop(next(iter(self.entries)), None)
                self.entries[tuple(map(id, models))] = entry
        return tensors


class _CheckedModels:
    """Models as the full check found them, and a function of the models, generated for
    them as one expression (``rechecks.module_facts``, as the generic memo's), that tells
    whether each fact the full check compared in Python still holds."""

    def __init__(
        self,
        models: Sequence[Any],
        tensors: list[Any],
        facts_hold: Callable[..., bool],
        registrations: int,
    ) -> None:
        self.models = [weakref.ref(m) for m in models]
        self.registrations = registrations
        self.hook_handles = _HANDLES.next_id
        self.tensors = tensors  # handed out as is: no call mutates it
        self.facts_hold = facts_hold
        self.guard = tensor_guard(tensors)

    def unchanged(self, models: Sequence[Any], registrations: int) -> bool:
        return (
            registrations == self.registrations
            and self.hook_handles == _HANDLES.next_id
            and all(map(operator.is_, map(_DEREF, self.models), models))
            and self.facts_hold(*models)
            and self.guard.check(*self.tensors)
        )
