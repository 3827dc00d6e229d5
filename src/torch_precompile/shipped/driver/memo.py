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

import copy
import keyword
import operator
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.core import ModelPlan, WalkedModels
from torch_precompile.shipped.driver.guards import (
    _DEREF,
    _HANDLES,
    registration_counter,
    tensor_guard,
)
from torch_precompile.shipped.driver.refusals import GLOBAL_HOOKS, MODULE_HOOKS, TENSOR_HOOKS


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
    for module in walked.submodules:
        check.same(f"type({check.module(module)})", type(module))
        check.same(check.read(module, ("training",)), module.training)
        check.no_other_forward(module)
    for cls in dict.fromkeys(map(type, walked.submodules)):  # a forward patched into a class
        check.same(f"{check.hold('value', cls)}.forward", getattr(cls, "forward", None))
    for index, path in paths:
        module = walked.submodules[index]
        check.same(check.read(module, path), _value_at(module, path))
    members = [d for m in walked.submodules for d in (m._parameters, m._buffers, m._modules) if d]
    for d in members:
        check.terms.append(f"len({check.hold('members', d)}) == {len(d)}")
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
            check.same(f"{check.hold('read', read)}()", read())
    return check.compiled()


class _CheckSource:
    """The generated check being written: its terms, and the objects they name."""

    def __init__(self, models: Sequence[Any]) -> None:
        self.roots = {id(m): f"model{k}" for k, m in enumerate(models)}
        self.held: dict[str, Any] = {}
        self.names: dict[tuple[str, int], str] = {}
        self.terms: list[str] = []

    def hold(self, prefix: str, obj: Any) -> str:
        """The global name ``obj`` goes by, one per object."""
        key = (prefix, id(obj))
        if key not in self.names:
            self.names[key] = f"{prefix}{len(self.names)}"
            self.held[self.names[key]] = obj
        return self.names[key]

    def module(self, module: Any) -> str:
        return self.roots.get(id(module)) or self.hold("module", module)

    def read(self, module: Any, path: Sequence[str]) -> str:
        """Code that reads ``path`` off ``module``: a first attribute that lives in the
        instance dict (as nn.Module keeps its flags and options) is read from that dict."""
        first, rest = path[0], path[1:]
        if first in vars(module) and not hasattr(type(module), first):
            code = f"{self.hold('attributes', vars(module))}[{first!r}]"
        else:
            code = _attribute(self.module(module), first)
        for name in rest:
            code = _attribute(code, name)
        return code

    def no_other_forward(self, module: Any) -> None:
        """A term: no forward set on the instance since the walk (or the same one)."""
        attributes = self.hold("attributes", vars(module))
        if "forward" in vars(module):
            self.same(f"{attributes}['forward']", vars(module)["forward"])
        else:
            self.terms.append(f"'forward' not in {attributes}")

    def same(self, code: str, value: Any) -> None:
        """A term: ``code`` gives the very object ``value`` (a list or dict: an equal one,
        item by item in order, since it can change in place)."""
        if type(value) is list:
            self.terms.append(f"{code} == {self.hold('value', copy.deepcopy(value))}")
            return
        if type(value) is dict:
            items = self.hold("value", copy.deepcopy(list(value.items())))
            self.terms.append(f"list({code}.items()) == {items}")
            return
        if type(value) is types.MethodType:  # a new bound method at every read
            self.terms.append(f"{code}.__func__ is {self.hold('value', value.__func__)}")
            return
        known = (
            repr(value)
            if value is None or value is True or value is False
            else self.hold("value", value)
        )
        self.terms.append(f"{code} is {known}")

    def compiled(self) -> Callable[..., bool]:
        body = "".join(f"\n                {t} and" for t in self.terms)
        source = (
            f"def unchanged({', '.join(self.roots.values())}):\n"
            "    try:\n"
            f"        return ({body}\n                True)\n"
            "    except (AttributeError, KeyError):\n"
            "        return False\n"
        )
        exec(compile(source, "<remembered models>", "exec"), self.held)
        return self.held["unchanged"]


def _attribute(code: str, name: str) -> str:
    """Code that reads attribute ``name`` off the value of ``code``."""
    if name.isidentifier() and not keyword.iskeyword(name):
        return f"{code}.{name}"
    return f"getattr({code}, {name!r})"


def _value_at(module: Any, path: Sequence[str]) -> Any:
    try:
        return operator.attrgetter(".".join(path))(module)
    except AttributeError:
        return _GONE


_GONE = object()  # an attribute the walk found missing: no later read can be this object


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
