"""Python state that ``fn`` changes while it is traced, found by comparing before and after.

A trace records tensor operations. A counter attribute that ``forward`` increments, a list it
appends to, or an optimizer option it sets would change once, at capture, and an artifact
would replay every call as that first one: a silently wrong result. So capture takes a
snapshot of the Python state reachable from the arguments (each submodule's attributes, each
optimizer's param groups and state dict), compares it after the trace, puts back what changed
and refuses the capture, naming it. (An optimizer's state tensors are lifted instead: the
trace steps copies of them, see ``optimizers``.)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import member_dicts

# Members of nn.Module that capture lifts or walks itself; the rest are plain Python state.
_MODULE_MEMBERS = frozenset({"_parameters", "_buffers", "_modules"})
_MODULE_FIX = (
    "Keep such state in a tensor the model registers (register_buffer) and update it "
    "in place, or change it outside fn."
)
_MEMBER_FIX = (
    "Register it before capture (in __init__, or with one eager call of fn first): an "
    "artifact takes the members the model had at capture."
)
_OBJECT_FIX = (
    "Change it outside fn (from what fn returns), or keep such state in a tensor the model "
    "registers and update it in place."
)
_OPTIMIZER_FIX = (
    "Change optimizer options between calls, outside fn (lr, which an LR "
    "scheduler sets, is read at every call); or call opt.step() outside the "
    "artifact."
)


@dataclass(frozen=True)
class Slot:
    """One place that holds Python state, ``owner[name]``: described as ``where``, with
    ``fix`` saying what to do instead."""

    owner: MutableMapping[str, Any]
    name: str
    where: str
    fix: str = _MODULE_FIX


@dataclass(frozen=True)
class Snapshot:
    """The value in each slot before the trace, a shallow copy of its contents (containers are
    put back in place, keeping their identity), and what it looked like."""

    slots: tuple[Slot, ...]
    values: tuple[Any, ...]
    contents: tuple[Any, ...]
    looks: tuple[Any, ...]
    # Each module's attribute dict and its parameter, buffer and submodule dicts, the names
    # each had, and how to name an entry fn adds: an attribute (a tensor it creates on the
    # first call and keeps) or a registered member is state too.
    namespaces: tuple[tuple[MutableMapping[str, Any], frozenset[str], str, str], ...] = ()


@dataclass(frozen=True)
class Held:
    """Attributes of something ``fn`` reaches beyond its arguments (a plain object of the
    user's, a module or class of the user's code): ``names`` maps each to its value, ``where``
    names one (a format with ``{name!r}``)."""

    names: MutableMapping[str, Any]
    where: str


def take_snapshot(
    modules: Sequence[tuple[str, torch.nn.Module]],
    optimizers: Sequence[tuple[str, torch.optim.Optimizer]],
    extra: Sequence[Slot] = (),
    held: Sequence[Held] = (),
) -> Snapshot:
    """The state reachable from the arguments, the ``extra`` slots (containers a hook or fn
    reaches) and the attributes of what ``held`` names (dunder names aside)."""
    attributes = [
        Slot(h.names, name, h.where.format(name=name) + ",", _OBJECT_FIX)
        for h in held
        for name in list(h.names)
        if not name.startswith("__")
    ]
    slots = (*_slots(modules, optimizers), *extra, *attributes)
    values = tuple(slot.owner.get(slot.name, _ABSENT) for slot in slots)
    contents = tuple(copy.copy(v) if isinstance(v, list | dict | set) else None for v in values)
    namespaces = tuple(
        (names, frozenset(names), f"{kind} {{name!r}} of {shown} ({verb} by fn)", fix)
        for module, shown in _walked_modules(modules)
        for names, kind, verb, fix in (
            (vars(module), "attribute", "added", _MODULE_FIX),
            *((d, k, "registered", _MEMBER_FIX) for d, k in member_dicts(module)),
        )
    ) + tuple((h.names, frozenset(h.names), f"{h.where} (added by fn)", _OBJECT_FIX) for h in held)
    return Snapshot(slots, values, contents, tuple(_look(v) for v in values), namespaces)


def _with_added(snapshot: Snapshot) -> Snapshot:
    """The snapshot with a slot, absent before, for every attribute fn added to a module."""
    added = tuple(
        Slot(owner, name, where.format(name=name), fix)
        for owner, names, where, fix in snapshot.namespaces
        for name in list(owner)
        if name not in names and not name.startswith("_")
    )
    return dataclasses.replace(
        snapshot,
        slots=snapshot.slots + added,
        values=snapshot.values + (_ABSENT,) * len(added),
        contents=snapshot.contents + (None,) * len(added),
        looks=snapshot.looks + (_look(_ABSENT),) * len(added),
    )


def refuse_changes(snapshot: Snapshot) -> None:
    """Put everything back; then raise, naming the first slot the trace changed."""
    snapshot = _with_added(snapshot)
    changed = [
        slot
        for slot, value, look in zip(snapshot.slots, snapshot.values, snapshot.looks, strict=True)
        if slot.owner.get(slot.name, _ABSENT) is not value
        or _look(slot.owner.get(slot.name, _ABSENT)) != look
    ]
    put_back(snapshot)
    if not changed:
        return
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    raise PrecompileError(
        f"fn changed {changed[0].where}{more} while it was traced. An artifact replays "
        "tensor operations only: this Python state would change once, at capture, and every "
        f"call would then act like that first one. {changed[0].fix} (Capture put the old "
        "value back.)"
    )


def put_back(snapshot: Snapshot) -> None:
    """Every slot as it was before the trace."""
    snapshot = _with_added(snapshot)
    for slot, value, content in zip(
        snapshot.slots, snapshot.values, snapshot.contents, strict=True
    ):
        if value is _ABSENT:
            slot.owner.pop(slot.name, None)
            continue
        slot.owner[slot.name] = value
        if isinstance(value, list):
            value[:] = content
        elif isinstance(value, dict | set):
            value.clear()
            value.update(content)


def _slots(
    modules: Sequence[tuple[str, torch.nn.Module]],
    optimizers: Sequence[tuple[str, torch.optim.Optimizer]],
) -> Iterator[Slot]:
    for module, shown in _walked_modules(modules):
        for attr in list(vars(module)):
            if attr not in _MODULE_MEMBERS and not attr.startswith("_"):
                yield Slot(vars(module), attr, f"attribute {attr!r} of {shown}")
    for arg, optimizer in optimizers:
        yield Slot(vars(optimizer), "state", f"the state of optimizer {arg}", _OPTIMIZER_FIX)
        for index, group in enumerate(optimizer.param_groups):
            for key in list(group):
                if key != "params":
                    yield Slot(
                        group,
                        key,
                        f"{key!r} of param group {index} of optimizer {arg}",
                        _OPTIMIZER_FIX,
                    )


def _walked_modules(
    modules: Sequence[tuple[str, torch.nn.Module]],
) -> Iterator[tuple[torch.nn.Module, str]]:
    for arg, root in modules:
        for name, module in root.named_modules(remove_duplicate=False):
            yield module, f"module {name!r} of {arg}" if name else f"model {arg}"


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _look(value: Any) -> Any:
    """What a value looks like, shallowly: a change of any member shows as a difference."""
    if isinstance(value, float):  # by its bits: nan equals itself
        return ("float", value.hex())
    if isinstance(value, int | str | bytes | bool | type(None) | torch.dtype):
        return value
    if isinstance(value, list | tuple):
        return (type(value), tuple(_member(v) for v in value))
    if isinstance(value, dict):  # the optimizer's state: each parameter's entries too
        return (
            type(value),
            tuple(
                (_member(k), _member(v), _look(v) if isinstance(v, dict) else None)
                for k, v in value.items()
            ),
        )
    if isinstance(value, set | frozenset):
        return (type(value), frozenset(_member(v) for v in value))
    return id(value)


def _member(value: Any) -> Any:
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, int | str | bytes | bool | type(None)):
        return value
    return id(value)
