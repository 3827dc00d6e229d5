"""The Python values the artifact spec holds, in its encoded kinds (see ``spec.records``): the
one encoder for every value a capture keeps, whatever it is kept for (``Use``).

A kind means one thing wherever it appears: ``"frozen"`` is a record compared field by field
(a frozen dataclass or a named tuple), ``"dataclass"`` a record the artifact builds again
from its init fields (a tensor subclass's flatten context), ``"object"`` an object of the
user's compared by the plain values it holds.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from torch_precompile.shipped.driver.encoded import callable_name, code_digest
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.spec import EncodedValue


class Use(enum.Enum):
    """What a value is kept for, which decides the kinds it may take."""

    INPUT = "input"  # a leaf of fn's inputs, compared at every call: immutable values only
    READ = "read"  # a value the traced code read, compared at every call
    CONTEXT = "context"  # a tensor subclass's flatten context, built again by the artifact
    OPTION = "option"  # an optimizer option baked into the graph, compared as the raw value


_SCALARS = frozenset({"none", "float", "const", "dtype", "device", "enum"})
_CONTAINERS = frozenset({"list", "tuple", "dict"})
_KINDS: dict[Use, frozenset[str]] = {
    Use.INPUT: _SCALARS | {"frozen"},
    Use.READ: _SCALARS
    | _CONTAINERS
    | {"set", "frozenset", "frozen", "numpy", "ndarray", "callable", "code", "object"},
    Use.CONTEXT: _SCALARS | _CONTAINERS | {"size", "frozen", "dataclass"},
    Use.OPTION: frozenset({"const"}),
}
_PLAIN = (bool, int, float, complex, str, bytes)
MOST_ITEMS = 256  # a longer tuple, list or dict read is a table, not a setting: not recorded
OBJECT_DEPTH = 2  # how far a whole object's plain values are followed into objects it holds


def encode(value: Any, use: Use, depth: int = OBJECT_DEPTH) -> EncodedValue | None:
    """``value`` as the spec holds it for ``use``; None where it takes no kind ``use`` allows.
    Objects of the user's inside lists, tuples and dicts are followed ``depth`` deep."""
    if use is Use.OPTION:  # the spec keeps options raw: ("const", 0.9), ("const", (0.9, 0.99))
        plain = (*_PLAIN, type(None))
        flat = value if type(value) is tuple else (value,)
        return ("const", value) if all(type(v) in plain for v in flat) else None
    encoded = _encode(value, use, depth)
    return encoded if encoded is not None and encoded[0] in _KINDS[use] else None


def unencodable_part(value: Any, use: Use) -> Any:
    """The innermost value inside ``value`` that takes no kind ``use`` allows (``value``
    itself where none of its items is to blame), for a message to name."""
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list | tuple | set | frozenset):
        items = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return value
    for item in items:
        if encode(item, use) is None:
            return unencodable_part(item, use)
    return value


def _encode(value: Any, use: Use, depth: int) -> EncodedValue | None:
    scalar = _encode_scalar(value)
    if scalar is not None:
        return scalar
    if type(value) is torch.Size:
        return ("size", tuple(int(s) for s in value))
    if type(value) in (tuple, list, dict, set, frozenset):
        return _encode_container(value, use, depth)
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        names: tuple[str, ...] = cast(Any, value)._fields  # a named tuple
        return _encode_record("frozen", value, names, use, depth)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value, use, depth)
    if use is Use.READ:
        return _encode_read_only(value, depth)
    return None


def _encode_scalar(value: Any) -> EncodedValue | None:
    if value is None:
        return ("none", None)
    if type(value) is float and not math.isfinite(value):
        return ("float", repr(value))
    if type(value) in _PLAIN:
        return ("const", value)
    if isinstance(value, torch.dtype):
        return ("dtype", str(value).removeprefix("torch."))
    if isinstance(value, torch.device):
        return ("device", str(value))
    if isinstance(value, enum.Enum):
        return ("enum", (qualified_name(type(value)), value.name))
    return None


def _encode_container(value: Any, use: Use, depth: int) -> EncodedValue | None:
    """A list, tuple or dict, items in order; a set by its items sorted by their encoding
    (its own order may differ from run to run)."""
    if len(value) > MOST_ITEMS and use is not Use.CONTEXT:
        return None
    kind = type(value).__name__
    if kind == "dict":
        pairs = [(encode(k, use), _encode_item(v, use, depth)) for k, v in value.items()]
        plain = all(k is not None and v is not None for k, v in pairs)
        return ("dict", tuple(pairs)) if plain else None
    if kind in ("set", "frozenset"):
        items = [encode(v, use) for v in value]
        return None if None in items else (kind, tuple(sorted(items, key=repr)))
    items = [_encode_item(v, use, depth) for v in value]
    return None if None in items else (kind, tuple(items))


def _encode_item(value: Any, use: Use, depth: int) -> EncodedValue | None:
    """An item of a list, tuple or dict read: a plain value, or an object of the user's
    (``self.specs[0].s``: what is read off it is out of the trace's sight, so it is compared
    whole)."""
    encoded = encode(value, use, depth)
    if encoded is not None or depth <= 0 or use is not Use.READ:
        return encoded
    return _encode_object(value, depth)


def _encode_dataclass(value: Any, use: Use, depth: int) -> EncodedValue | None:
    """A dataclass: compared field by field where frozen; built again where it is a flatten
    context's (from the fields its constructor takes). A read one is an object (its
    attributes are what the code reads)."""
    fields = dataclasses.fields(value)
    if use is Use.READ:
        return None
    if use is Use.CONTEXT:
        names = tuple(f.name for f in fields if f.init)
        return _encode_record("dataclass", value, names, use, depth)
    if not cast(Any, type(value)).__dataclass_params__.frozen:  # not in typeshed
        return None
    return _encode_record("frozen", value, tuple(f.name for f in fields), use, depth)


def _encode_record(
    kind: str, value: Any, names: tuple[str, ...], use: Use, depth: int
) -> EncodedValue | None:
    if len(names) > MOST_ITEMS:
        return None
    fields = [(name, encode(getattr(value, name), use, depth)) for name in names]
    if any(encoded is None for _, encoded in fields):
        return None
    return (kind, (qualified_name(type(value)), tuple(fields)))


def _encode_read_only(value: Any, depth: int) -> EncodedValue | None:
    """The kinds only a read value takes: NumPy values, functions, and (by ``encode_object``)
    objects of the user's."""
    numpy = sys.modules.get("numpy")  # a NumPy value is one where numpy is loaded
    if numpy is not None and isinstance(value, numpy.generic):
        item = encode(value.item(), Use.READ)  # numpy.float32(2.0): 2.0, and the type
        return None if item is None else ("numpy", (qualified_name(type(value)), item))
    if numpy is not None and type(value) is numpy.ndarray and value.size <= MOST_ITEMS:
        items = [encode(v, Use.READ) for v in value.ravel().tolist()]
        if None in items:
            return None
        return ("ndarray", (str(value.dtype), tuple(value.shape), tuple(items)))
    if _named_callable(value):
        return ("callable", callable_name(value))
    if isinstance(value, types.FunctionType) and (digest := code_digest(value)) is not None:
        return ("code", (qualified_name(value), digest))  # a lambda: by what it computes
    return None


def _named_callable(value: Any) -> bool:
    """A callable that its name tells apart from others (``torch.relu``, a function of the
    user's, a method set on a module, a partial binding plain values), not a lambda, whose
    name would say nothing, nor a method bound to some object."""
    if isinstance(value, functools.partial):
        bound = (*value.args, *value.keywords.values())
        return _named_callable(value.func) and all(encode(v, Use.READ) is not None for v in bound)
    if isinstance(value, types.MethodType):
        owner, value = value.__self__, value.__func__
        if not isinstance(owner, torch.nn.Module):
            return False
    if isinstance(value, types.BuiltinFunctionType):
        owner = value.__self__
        return owner is None or isinstance(owner, types.ModuleType)
    return isinstance(value, types.FunctionType) and "<" not in value.__qualname__


def encode_object(value: Any, depth: int = OBJECT_DEPTH) -> EncodedValue | None:
    """An object of the user's as its class and the plain values it holds; None for any
    other value."""
    return _encode_object(value, depth)


def _encode_object(value: Any, depth: int) -> EncodedValue | None:
    """An object of the user's as its class and the plain values it holds (objects it holds
    ``depth`` deep); None for anything else."""
    if not is_plain_object(value) or is_library_object(value):
        return None
    fields = []
    for name, held in list(held_values(value).items()):
        encoded = encode(held, Use.READ, depth - 1)
        if encoded is None and depth > 1:
            encoded = _encode_object(held, depth - 1)
        if encoded is not None:  # a tensor or a module it holds is not a Python value
            fields.append((name, encoded))
    return ("object", (qualified_name(type(value)), tuple(fields)))


# What a lookup that found nothing returns (None may be a value read).
UNSEEN: Any = object()


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


def is_library_object(obj: Any) -> bool:
    """An object of the standard library or of torch: its state is its own (a logger's level),
    not a setting of the user's."""
    module = getattr(type(obj), "__module__", "") or ""
    return module.split(".")[0] in (
        "torch",
        "builtins",
        *sys.stdlib_module_names,
    ) and not isinstance(obj, types.SimpleNamespace)
