"""Hooks present at capture: recorded for the driver's checks, and refused where they act in
Python rather than on tensors.

A hook that only computes (scales an output, clips a gradient) runs inside the trace like
``forward`` does, so the graph holds what it computed; the driver then insists on the same
hooks at every call (see ``driver.core.check_hooks``). A hook that keeps something in Python
(activations stored in a dict, a counter) would act once, at capture: capture watches the
containers a hook (or ``fn`` itself) can reach, and refuses the capture when one changed.
"""

from __future__ import annotations

import collections.abc
import dis
import io
import sys
import types
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import BatchNormBase, forward_pre_hooks
from torch_precompile.shipped.driver.hook_values import hook_values
from torch_precompile.shipped.driver.module_rules import (
    GLOBAL_HOOKS,
    MODULE_HOOKS,
    TENSOR_HOOKS,
    hook_name,
    hook_sets,
)
from torch_precompile.spec import HookSet
from torch_precompile.trace.facts.code_homes import runs_as, users_file
from torch_precompile.trace.facts.python_state import Held, Slot

_SIDE_EFFECT_FIX = (
    "A hook or fn that keeps tensors or counts in Python objects would do so once, at "
    "capture, and never again. Return what you need from fn (results may be any nesting of "
    "tuples, lists and dicts of tensors), or remove the hook before precompiling."
)


def module_hooks(module: torch.nn.Module) -> tuple[HookSet, ...]:
    return hook_sets(module, MODULE_HOOKS, hook_values)


def global_hooks() -> tuple[HookSet, ...]:
    return hook_sets(torch.nn.modules.module, GLOBAL_HOOKS, hook_values)


def tensor_hooks(tensor: torch.Tensor) -> tuple[HookSet, ...]:
    return hook_sets(tensor, TENSOR_HOOKS, hook_values)


def hook_functions(
    modules: Sequence[torch.nn.Module], tensors: Sequence[torch.Tensor]
) -> Iterator[tuple[str, Any]]:
    """Every hook the trace may run, with how to name it: module hooks, process-wide module
    hooks and tensor hooks on the model's tensors."""
    for module in modules:
        for kind, attribute in MODULE_HOOKS:
            for hook in getattr(module, attribute).values():
                yield f"{kind} hook {hook_name(hook)}", hook
    for kind, attribute in GLOBAL_HOOKS:
        for hook in getattr(torch.nn.modules.module, attribute).values():
            yield f"global {kind} hook {hook_name(hook)}", hook
    for tensor in tensors:
        for kind, attribute in TENSOR_HOOKS:
            for hook in (getattr(tensor, attribute, None) or {}).values():
                yield f"{kind} hook {hook_name(hook)}", hook


def reachable_containers(functions: Sequence[tuple[str, Any]]) -> list[Slot]:
    """Lists, dicts and sets that ``functions`` can reach without a call: globals they name,
    values they close over, the attributes of the object a bound method belongs to."""
    slots: list[Slot] = []
    seen: set[int] = set()
    for who, function in functions:
        for container, where in _containers(function):
            if id(container) not in seen:
                seen.add(id(container))
                slots.append(
                    Slot(
                        {"value": container},
                        "value",
                        f"{where}, which {who} reaches,",
                        _SIDE_EFFECT_FIX,
                    )
                )
    return slots


def _reached(function: Any, who: str) -> Iterator[tuple[Any, str]]:
    """``function`` and the functions of its own module it calls by name, each once, with how
    to name it (``who``, or ``helper (called by who)``); torch's own code is not followed."""
    pending, seen = [_unwrapped(function)], set()
    while pending:
        current = pending.pop()
        code = getattr(current, "__code__", None)
        if code is None or id(code) in seen or _torch_own(current):
            continue
        seen.add(id(code))
        yield current, f"{current.__qualname__} (called by {who})" if len(seen) > 1 else who
        namespace = current.__globals__
        pending.extend(
            value
            for name in code.co_names
            if isinstance(value := namespace.get(name), types.FunctionType)
            and value.__globals__ is namespace
        )


def assigned_names(functions: Sequence[tuple[str, Any]]) -> list[Slot]:
    """The globals and closure variables that ``functions``, or the functions of their own
    module they call by name, assign or delete (``global steps; steps += 1``, ``nonlocal``):
    a trace runs that assignment once, at capture, and an artifact never again."""
    slots: dict[tuple[int, str], Slot] = {}
    for who, function in functions:
        for current, by in _reached(function, who):
            for name, owner, where in _assignments(current, current.__code__, current.__globals__):
                key = (id(getattr(owner, "cell", owner)), name)  # a cell: one slot
                slots.setdefault(
                    key, Slot(owner, name, f"{where}, which {by} assigns,", _SIDE_EFFECT_FIX)
                )
    return list(slots.values())


def reachable_state(
    functions: Sequence[tuple[str, Any]], modules: Sequence[tuple[str, torch.nn.Module]]
) -> list[Held]:
    """What of the user's own code ``functions`` (and the functions of their module they
    call) reach beyond the arguments, whose attributes are Python state a trace would change
    once: plain objects named as globals or closed over (a stats holder), the user's modules
    they name (``config.STATE``), and, for the model's ``modules`` (each with how messages
    name it), the plain objects they hold as attributes (``self.stats``) and their classes of
    the user's (a class-level counter). Objects of torch, the standard library and installed
    packages keep their own."""
    found: dict[int, Held] = {}
    for who, function in functions:
        owner = runs_as(function)
        if owner is not None:  # a trainer's ``self.steps += 1``
            kind = type(owner).__name__
            shown = (
                f"attribute {{name!r}} of {who}, a callable {kind}"
                if owner is function
                else f"attribute {{name!r}} of the {kind} that {who} belongs to"
            )
            found.setdefault(id(owner), Held(vars(owner), shown))
        for current, by in _reached(function, who):
            for value, where in _named_values(current):
                if _plain_object(value):
                    shown = f"attribute {{name!r}} of {where}, which {by} reaches"
                    found.setdefault(id(value), Held(vars(value), shown))
                elif isinstance(value, types.ModuleType) and _users(value):
                    shown = f"global {{name!r}} of module {value.__name__}, which {by} reaches"
                    found.setdefault(id(value), Held(vars(value), shown))
    for shown_module, module in modules:
        for attribute, value in vars(module).items():
            if _plain_object(value):
                shown = f"attribute {{name!r}} of {attribute!r} of {shown_module}"
                found.setdefault(id(value), Held(vars(value), shown))
        for cls in type(module).__mro__:
            if _users(sys.modules.get(cls.__module__)):
                shown = f"attribute {{name!r}} of class {cls.__qualname__}"
                found.setdefault(id(cls), Held(_ClassAttributes(cls), shown))
    return list(found.values())


class _ClassAttributes(MutableMapping[str, Any]):
    """A class's own attributes as a mapping a Slot can read and restore (its ``__dict__``
    is read-only)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __getitem__(self, key: str) -> Any:
        return vars(self.cls)[key]

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self.cls, key, value)

    def __delitem__(self, key: str) -> None:
        delattr(self.cls, key)

    def __iter__(self) -> Iterator[str]:
        return iter(list(vars(self.cls)))

    def __len__(self) -> int:
        return len(vars(self.cls))


def _users(module: Any) -> bool:
    """Whether ``module`` is one of the user's own (not torch, the standard library, this
    package or an installed package)."""
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and users_file(file)


def refuse_iterators(functions: Sequence[tuple[str, Any]]) -> None:
    """An iterator ``fn`` names as a global or closes over (``next(counter)``): what it gave at
    capture would be baked into the graph and it would never advance; refused by name."""
    for who, function in functions:
        for current, by in _reached(function, who):
            for value, where in _named_values(current):
                if isinstance(value, collections.abc.Iterator) and not isinstance(value, io.IOBase):
                    raise PrecompileError(
                        f"{by} reads {where}, an iterator ({type(value).__name__}): what it "
                        "yields at capture would become constants of the graph, and it would "
                        "never advance at a call. Pass what it yields as an argument of fn."
                    )


def _named_values(function: Any) -> Iterator[tuple[Any, str]]:
    """The globals ``function`` names and the values it closes over, with their names."""
    code, namespace = function.__code__, function.__globals__
    for name in code.co_names:
        if name in namespace:
            yield namespace[name], f"global {name!r} of module {namespace.get('__name__')}"
    for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
        try:
            yield cell.cell_contents, f"the {name!r} it closes over"
        except ValueError:  # an empty cell
            continue


def _plain_object(value: Any) -> bool:
    """An instance of a class of the user's own code holding attributes (a stats holder): not
    a module, tensor, class, function or other callable, nor an iterator (refused apart).
    Objects of torch, the standard library and installed packages (a logger, whose caches fill
    as it is used) keep their own state."""
    users = _users(sys.modules.get(type(value).__module__))
    return (
        users
        and hasattr(value, "__dict__")
        and not isinstance(
            value,
            torch.nn.Module
            | torch.Tensor
            | torch.optim.Optimizer
            | type
            | types.ModuleType
            | collections.abc.Callable
            | collections.abc.Iterator,
        )
    )


def _torch_own(function: Any) -> bool:
    """torch's own hooks (DDP's, FSDP's) keep their state by design; capture handles them."""
    module = str(function.__globals__.get("__name__", ""))
    return module == "torch" or module.startswith("torch.")


def _assignments(
    function: Any, code: types.CodeType, namespace: dict[str, Any]
) -> Iterator[tuple[str, MutableMapping[str, Any], str]]:
    """Each global and closure variable ``code`` stores to: its name, its holder, its words."""
    for instruction in dis.get_instructions(code):
        name = instruction.argval
        if instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            yield name, namespace, f"global {name!r} of module {namespace.get('__name__')}"
        elif instruction.opname in ("STORE_DEREF", "DELETE_DEREF") and name in code.co_freevars:
            cell = function.__closure__[code.co_freevars.index(name)]
            yield "value", _CellContents(cell), f"the {name!r} it closes over"


class _CellContents(MutableMapping[str, Any]):
    """A closure cell as a mapping of one entry, ``value``: what a Slot reads and puts back."""

    def __init__(self, cell: types.CellType) -> None:
        self.cell = cell

    def __getitem__(self, key: str) -> Any:
        try:
            return self.cell.cell_contents
        except ValueError:  # empty
            raise KeyError(key) from None

    def __setitem__(self, key: str, value: Any) -> None:
        self.cell.cell_contents = value

    def __delitem__(self, key: str) -> None:
        del self.cell.cell_contents

    def __iter__(self) -> Iterator[str]:
        return iter(["value"][: len(self)])

    def __len__(self) -> int:
        try:
            _ = self.cell.cell_contents
        except ValueError:  # empty
            return 0
        return 1


def _unwrapped(function: Any) -> Any:
    """The plain function behind a ``functools.partial`` or a bound method."""
    while hasattr(function, "func") and not isinstance(function, types.FunctionType):
        function = function.func
    return getattr(function, "__func__", function)


def _containers(function: Any) -> Iterator[tuple[Any, str]]:
    while hasattr(function, "func") and not isinstance(function, types.FunctionType):
        function = function.func  # functools.partial
    owner = getattr(function, "__self__", None)
    if owner is not None and not isinstance(owner, torch.nn.Module | types.ModuleType):
        for name, value in vars(owner).items() if hasattr(owner, "__dict__") else ():
            if _is_container(value):
                yield value, f"attribute {name!r} of its {type(owner).__name__}"
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None:
        return
    namespace = getattr(function, "__globals__", {})
    for name in code.co_names:
        value = namespace.get(name)
        if _is_container(value):
            yield value, f"global {name!r} of module {namespace.get('__name__')}"
    for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if _is_container(value):
            yield value, f"the {name!r} it closes over"


def _is_container(value: Any) -> bool:
    return type(value) in (list, dict, set)


def named_function(fn: Callable[..., Any]) -> tuple[str, Any]:
    return (f"fn ({getattr(fn, '__qualname__', type(fn).__name__)})", fn)


# The legacy reparametrizations, by their hook's class: each sets ``weight`` at every call.
_LEGACY_WEIGHT_HOOKS = {"WeightNorm": "weight_norm", "SpectralNorm": "spectral_norm"}


def refuse_unreplayable_modules(modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
    """Modules whose forward keeps Python state a graph cannot, named before anything runs."""
    for shown, module in modules:
        for hook in forward_pre_hooks(module):
            legacy = _LEGACY_WEIGHT_HOOKS.get(type(hook).__name__)
            if legacy is not None:
                raise PrecompileError(
                    f"{shown} uses torch.nn.utils.{legacy}, whose forward pre-hook sets "
                    "'weight' as a plain attribute at every call: an artifact computes the "
                    "weight inside its graph but would leave that attribute as it was at "
                    f"capture. Use torch.nn.utils.parametrizations.{legacy} (its weight is "
                    "computed where it is read, which the artifact carries)."
                )
        if (
            isinstance(module, BatchNormBase)
            and module.training
            and module.track_running_stats
            and module.momentum is None
        ):
            raise PrecompileError(
                f"{shown} is a {type(module).__name__} with momentum=None (a cumulative "
                "average): in training it reads num_batches_tracked into Python at every call "
                "(as the factor 1 / num_batches_tracked), so an artifact could only run the "
                "step it was captured on. Give it a momentum (the default is 0.1), or capture "
                "it in eval mode."
            )
