"""A value the trace read, encoded as the spec holds it, or None where it is no plain value:
numbers, strings, enums, functions, containers, named tuples, NumPy values, and the plain
objects of the user's (to a bounded depth), with what a function closes over."""

from __future__ import annotations

import enum
import functools
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.shipped.driver.encoded import callable_name, code_digest
from torch_precompile.shipped.driver.refusals import qualified_name
from torch_precompile.spec import EncodedValue
from torch_precompile.trace.code_homes import (
    INSTALLED,
    PACKAGE_ROOT,
    STDLIB_ROOTS,
    TORCH_ROOT,
    users_file,
)
from torch_precompile.trace.inputs import encode_value

# What a lookup that found nothing returns (None may be a value read).
UNSEEN: Any = object()


def closure_cells(function: types.FunctionType) -> Mapping[str, Any]:
    """A function's filled closure cells by variable name."""
    cells = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=False):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
    return cells


def is_closure_constant(value: Any) -> bool:
    """Whether a value read from a closure is one the graph may hold as a constant: a plain
    value, not code (a helper function) or an object."""
    return not callable(value) and encode_read(value) is not None and value is not None


def is_followed(value: Any) -> bool:
    """Whether a read follows attributes off a global: a plain object, or a module of the
    user's own (not torch, the standard library or an installed package, whose constants are
    theirs)."""
    if isinstance(value, types.ModuleType):
        file = getattr(value, "__file__", None)
        return (
            isinstance(file, str)
            and not file.startswith((TORCH_ROOT, *STDLIB_ROOTS, PACKAGE_ROOT))
            and not any(p in file for p in INSTALLED)
        )
    if isinstance(value, type):  # a class of the user's as settings (``Config.SCALE``)
        file = getattr(sys.modules.get(value.__module__), "__file__", None)
        return isinstance(file, str) and users_file(file)
    return is_plain_object(value)


def held_values(value: Any) -> Mapping[str, Any]:
    """What an object holds: its instance dict, and the values in its slots (``__slots__``)."""
    held = getattr(value, "__dict__", None)
    slots = _slots(type(value))
    if not slots:
        return held if held is not None else {}
    found = {s: v for s in slots if (v := getattr(value, s, UNSEEN)) is not UNSEEN}
    return {**found, **(held or {})}


def _slots(cls: type) -> tuple[str, ...]:
    """The slot names a class and its bases declare (not ``__dict__`` or ``__weakref__``)."""
    names: list[str] = []
    for klass in cls.__mro__:
        declared = vars(klass).get("__slots__", ())
        names += [declared] if isinstance(declared, str) else list(declared)
    return tuple(n for n in names if n not in ("__dict__", "__weakref__"))


def is_plain_object(value: Any) -> bool:
    """An object whose attributes a read may follow (a config), not a module or tensor."""
    return (hasattr(value, "__dict__") or bool(_slots(type(value)))) and not isinstance(
        value,
        torch.nn.Module
        | torch.Tensor
        | type
        | types.ModuleType
        | types.FunctionType
        | types.MethodType
        | Callable,
    )


_MOST_ITEMS = 256  # a longer tuple, list or dict read is a table, not a setting: not recorded
_OBJECT_DEPTH = 2  # how far a whole object's plain values are followed into objects it holds


def object_values(
    obj: Any, depth: int = _OBJECT_DEPTH
) -> Iterator[tuple[tuple[str, ...], EncodedValue]]:
    """The plain values ``obj`` holds (and the objects it holds, ``depth`` deep), each with
    its attribute path off ``obj``. Objects of the standard library and of torch are not
    followed: their state is theirs (a logger's level), not a setting of the user's."""
    if _library_object(obj):
        return
    for name, value in list(held_values(obj).items()):
        encoded = encode_read(value)
        if encoded is not None:
            yield (name,), encoded
        elif depth > 0 and is_plain_object(value):
            for inner, deeper in object_values(value, depth - 1):
                yield (name, *inner), deeper


def _library_object(obj: Any) -> bool:
    """An object of the standard library or of torch: its state is its own (a logger's level),
    not a setting of the user's."""
    module = getattr(type(obj), "__module__", "") or ""
    return module.split(".")[0] in (
        "torch",
        "builtins",
        *sys.stdlib_module_names,
    ) and not isinstance(obj, types.SimpleNamespace)


def _encode_item(value: Any, depth: int) -> EncodedValue | None:
    """An item of a list, tuple or dict read: a plain value, or an object of the user's
    (``self.specs[0].s``: what is read off it is out of the trace's sight, so it is compared
    whole)."""
    encoded = encode_read(value, depth)
    return encoded if encoded is not None or depth <= 0 else _encode_object(value, depth)


def _encode_object(value: Any, depth: int) -> EncodedValue | None:
    """An object of the user's as its class and the plain values it holds (objects it holds
    ``depth`` deep); None for anything else."""
    if not is_plain_object(value) or _library_object(value):
        return None
    fields = []
    for name, held in list(held_values(value).items()):
        encoded = encode_read(held, depth - 1)
        if encoded is None and depth > 1:
            encoded = _encode_object(held, depth - 1)
        if encoded is not None:  # a tensor or a module it holds is not a Python value
            fields.append((name, encoded))
    return ("object", (qualified_name(type(value)), tuple(fields)))


def encode_object(value: Any) -> EncodedValue | None:
    """An object of the user's as its class and the plain values it holds; None for any
    other value."""
    return _encode_object(value, _OBJECT_DEPTH)


def encode_read(value: Any, depth: int = _OBJECT_DEPTH) -> EncodedValue | None:
    """A read value as the spec holds it; None for a value that is not a plain one. Objects
    of the user's inside lists, tuples and dicts are followed ``depth`` deep."""
    if value is None:
        return ("none", None)
    if type(value) in (tuple, list) and len(value) <= _MOST_ITEMS:
        items = [_encode_item(v, depth) for v in value]  # a list: compared by value each call
        kind = type(value).__name__
        return None if any(i is None for i in items) else (kind, tuple(items))
    if type(value) is dict and len(value) <= _MOST_ITEMS:
        pairs = [(encode_read(k), _encode_item(v, depth)) for k, v in value.items()]
        plain = all(k is not None and v is not None for k, v in pairs)
        return ("dict", tuple(pairs)) if plain else None  # compared item by item, in order
    if type(value) in (set, frozenset) and len(value) <= _MOST_ITEMS:
        items = [encode_read(v) for v in value]  # in a set's order, which may differ by run
        kind = type(value).__name__
        return None if any(i is None for i in items) else (kind, tuple(sorted(items, key=repr)))
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return _encode_named_tuple(value)
    numpy = sys.modules.get("numpy")  # a NumPy value is one where numpy is loaded
    if numpy is not None and isinstance(value, numpy.generic):
        item = encode_read(value.item())  # numpy.float32(2.0): 2.0, and the type
        return None if item is None else ("numpy", (qualified_name(type(value)), item))
    if numpy is not None and type(value) is numpy.ndarray and value.size <= _MOST_ITEMS:
        items = [encode_read(v) for v in value.ravel().tolist()]
        if any(i is None for i in items):
            return None
        return ("ndarray", (str(value.dtype), tuple(value.shape), tuple(items)))
    if _named_callable(value):
        return ("callable", callable_name(value))
    if isinstance(value, types.FunctionType) and (digest := code_digest(value)) is not None:
        return ("code", (qualified_name(value), digest))  # a lambda: by what it computes
    if isinstance(value, enum.Enum | torch.dtype | torch.device) or type(value) in (
        bool,
        int,
        float,
        complex,
        str,
        bytes,
    ):
        try:
            return encode_value("a read value", value)
        except PrecompileError:
            return None
    return None


def _encode_named_tuple(value: tuple[Any, ...]) -> EncodedValue | None:
    """A named tuple as a frozen record: its class by qualified name, and each field."""
    if len(value) > _MOST_ITEMS:
        return None
    names: tuple[str, ...] = cast(Any, value)._fields
    fields = [(name, encode_read(getattr(value, name))) for name in names]
    if any(encoded is None for _, encoded in fields):
        return None
    return ("frozen", (qualified_name(type(value)), tuple(fields)))


def _named_callable(value: Any) -> bool:
    """A callable that its name tells apart from others (``torch.relu``, a function of the
    user's, a method set on a module, a partial binding plain values), not a lambda, whose
    name would say nothing, nor a method bound to some object."""
    if isinstance(value, functools.partial):
        bound = (*value.args, *value.keywords.values())
        return _named_callable(value.func) and all(encode_read(v) is not None for v in bound)
    if isinstance(value, types.MethodType):
        owner, value = value.__self__, value.__func__
        if not isinstance(owner, torch.nn.Module):
            return False
    if isinstance(value, types.BuiltinFunctionType):
        owner = value.__self__
        return owner is None or isinstance(owner, types.ModuleType)
    return isinstance(value, types.FunctionType) and "<" not in value.__qualname__
