"""Python values as the spec encodes them (``("float", "nan")``, ``("dtype", "float16")``, ...):
whether a value at a call is the one captured, and how to show it in a message. Shipped where
a call's Python values are checked (inputs, value guards, values the trace read).
"""

import functools
import hashlib
import math
import types
from collections.abc import Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.module_rules import shown_module
from torch_precompile.shipped.driver.tensor_rules import PrecompileError, qualified_name


def value_matches(encoded: Any, value: Any) -> bool:
    """Whether ``value`` is the Python value the spec encodes (the same type, and equal; a
    float with the same sign, so ``-0.0`` is not ``0.0``)."""
    kind, expected = encoded
    if kind == "float":
        return type(value) is float and (
            math.isnan(value) if expected == "nan" else value == float(expected)
        )
    if kind == "none":
        return value is None
    if kind == "absent":  # an attribute the module did not have (``hasattr(self, "x")``)
        return value is MISSING
    if kind == "dtype":
        return isinstance(value, torch.dtype) and value == getattr(torch, expected)
    if kind == "device":
        return isinstance(value, torch.device) and value == torch.device(expected)
    if kind == "enum":
        return (
            qualified_name(type(value)) == expected[0]
            and getattr(value, "name", None) == expected[1]
        )
    if kind == "callable":
        return callable(value) and callable_name(value) == expected
    if kind == "code":  # a lambda or a nested function: by its code and plain closure values
        return isinstance(value, types.FunctionType) and code_digest(value) == expected[1]
    if kind in ("tuple", "list"):
        return (
            type(value).__name__ == kind
            and len(value) == len(expected)
            and all(value_matches(item, v) for item, v in zip(expected, value, strict=True))
        )
    if kind == "dict":
        return (
            type(value) is dict
            and len(value) == len(expected)
            and all(
                value_matches(k, key) and value_matches(v, item)
                for (k, v), (key, item) in zip(expected, value.items(), strict=True)
            )
        )
    if kind == "frozen":  # a frozen dataclass or a named tuple, field by field
        return qualified_name(type(value)) == expected[0] and all(
            hasattr(value, field) and value_matches(item, getattr(value, field))
            for field, item in expected[1]
        )
    if kind == "object":  # an object of the user's in a list or dict: class and values
        return qualified_name(type(value)) == expected[0] and all(
            value_matches(item, getattr(value, field, MISSING)) for field, item in expected[1]
        )
    if kind in ("set", "frozenset"):
        return _set_matches(kind, expected, value)
    if kind == "numpy":  # a NumPy scalar (numpy.float32(2.0)): its type and its item
        return qualified_name(type(value)) == expected[0] and value_matches(
            expected[1], value.item()
        )
    if kind == "ndarray":  # a small NumPy array: dtype, shape and every element
        dtype, shape, items = expected
        return (
            qualified_name(type(value)) == "numpy.ndarray"
            and str(value.dtype) == dtype
            and tuple(value.shape) == tuple(shape)
            and all(value_matches(e, v) for e, v in zip(items, value.ravel().tolist(), strict=True))
        )
    if type(expected) is float:
        return (
            type(value) is float
            and value == expected
            and math.copysign(1.0, value) == math.copysign(1.0, expected)
        )
    return type(value) is type(expected) and value == expected


_PLAIN = (bool, int, float, complex, str, bytes)


def _plain_key(value: Any) -> tuple[Any, ...]:
    """A plain item as a set compares it here: by type and value, a float by its sign too."""
    return (type(value), value, math.copysign(1.0, value) if type(value) is float else 1.0)


def _set_matches(kind: str, expected: Any, value: Any) -> bool:
    """A set (or frozenset) of the same type and size, each encoded item matched by one of
    its items (a plain one looked up by type and value; others compared one by one)."""
    if type(value) is not (set if kind == "set" else frozenset) or len(value) != len(expected):
        return False
    plain = {_plain_key(v) for v in value if type(v) in _PLAIN}
    return all(
        _plain_key(item[1]) in plain
        if item[0] == "const"
        else any(value_matches(item, v) for v in value)
        for item in expected
    )


_PLAIN_CELLS = (bool, int, float, complex, str, bytes, type(None))


def code_digest(function: types.FunctionType) -> str | None:
    """What tells a lambda or a nested function from another of the same name in any process:
    its code (bytecode, names, constants, nested code) and the plain values it closes over;
    None where it closes over anything else (a tensor, an object), which no digest can hold."""
    cells = []
    for cell in function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet filled
            return None
        if type(value) not in _PLAIN_CELLS:
            return None
        cells.append(repr(value))
    defaults = function.__defaults__ or ()
    if any(type(d) not in _PLAIN_CELLS for d in defaults):
        return None
    digest = hashlib.sha256(repr((cells, [repr(d) for d in defaults])).encode())
    _code_into(digest, function.__code__)
    return digest.hexdigest()[:16]


def _code_into(digest: Any, code: types.CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _code_into(digest, constant)
        else:
            digest.update(_constant(constant).encode())


def _constant(value: Any) -> str:
    """A code constant as text that is the same in every process (a frozenset's order follows
    string hashing, which differs from process to process)."""
    if isinstance(value, frozenset):
        return "frozenset(" + repr(sorted(map(_constant, value))) + ")"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_constant, value)) + ",)"
    return repr(value)


def callable_name(value: Any) -> str:
    """A function by its qualified name, the same in every process; a partial with the plain
    values it binds (``functools.partial(torch.clamp, min=0.0)``)."""
    if isinstance(value, functools.partial):
        bound = [*map(repr, value.args), *(f"{k}={v!r}" for k, v in value.keywords.items())]
        return f"functools.partial({', '.join([callable_name(value.func), *bound])})"
    return qualified_name(value)


def shown_value(encoded: Any) -> str:
    """An encoded value as Python would show it."""
    kind, expected = encoded
    if kind == "float":
        return repr(float(expected))
    if kind == "none":
        return "None"
    if kind == "absent":
        return "missing"
    if kind == "dtype":
        return f"torch.{expected}"
    if kind == "device":
        return f"device({expected!r})"
    if kind == "code":
        return f"{expected[0]} (its code and closure as at capture)"
    if kind in ("enum", "callable"):
        return ".".join(expected) if kind == "enum" else expected
    if kind == "tuple":
        return "(" + ", ".join(map(shown_value, expected)) + (",)" if len(expected) == 1 else ")")
    if kind == "list":
        return "[" + ", ".join(map(shown_value, expected)) + "]"
    if kind == "dict":
        return "{" + ", ".join(f"{shown_value(k)}: {shown_value(v)}" for k, v in expected) + "}"
    if kind == "size":
        return f"torch.Size({list(expected)!r})"
    if kind in ("frozen", "object", "dataclass"):
        fields = ", ".join(f"{field}={shown_value(item)}" for field, item in expected[1])
        return f"{expected[0]}({fields})"
    if kind in ("set", "frozenset"):
        items = "{" + ", ".join(map(shown_value, expected)) + "}" if expected else ""
        return items if kind == "set" and items else f"{kind}({items})"
    if kind == "numpy":
        return f"{expected[0]}({shown_value(expected[1])})"
    if kind == "ndarray":
        dtype, shape, items = expected
        return f"array({_nested(items, tuple(shape))}, dtype={dtype})"
    return repr(expected)


def _nested(items: Sequence[Any], shape: tuple[int, ...]) -> str:
    """An array's encoded elements (flat, in C order) shown as nested lists of ``shape``."""
    if not shape:
        return shown_value(items[0])
    if shape[0] == 0:
        return "[]"
    step = len(items) // shape[0]
    rows = (_nested(items[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0]))
    return "[" + ", ".join(rows) + "]"


MISSING = object()  # an attribute a call's module lacks


def compare_read(expected: Any, where: str, shown: str, value: Any) -> None:
    """A value the trace read (``shown``, at ``where``) against the one it read then."""
    if value_matches(expected, value):
        return
    now = (
        "missing"
        if value is MISSING
        else callable_name(value)
        if expected[0] in ("callable", "code") and callable(value)
        else shown_now(value)
    )
    raise PrecompileError(
        f"{shown} is {now}, but was {shown_value(expected)} when the trace read it "
        f"({where}); the graph holds that value. Set it back, or precompile again with "
        "the new value (a value that changes between calls belongs in a tensor: a buffer or "
        "an input)."
    )


def shown_now(value: Any, depth: int = 2) -> str:
    """A value found at a call as messages show it: an object of the user's (in a list, say)
    by its class and values, as ``shown_value`` shows the captured one."""
    if type(value) in (list, tuple):
        items = ", ".join(shown_now(v, depth) for v in value)
        return f"[{items}]" if type(value) is list else f"({items}{',' * (len(value) == 1)})"
    if type(value) is dict:
        return "{" + ", ".join(f"{k!r}: {shown_now(v, depth)}" for k, v in value.items()) + "}"
    attributes = getattr(value, "__dict__", None)
    own_repr = vars(object)["__repr__"]  # an object that says nothing of its values
    if depth and type(attributes) is dict and getattr(type(value), "__repr__", None) is own_repr:
        fields = ", ".join(f"{k}={shown_now(v, depth - 1)}" for k, v in attributes.items())
        return f"{qualified_name(type(value))}({fields})"
    return repr(value)


def module_read_name(module: str, path: Sequence[str], arguments: Sequence[str] = ()) -> str:
    """How a value read off submodule ``module`` (of the model ``arguments``) at ``path`` is
    named in messages."""
    owner = shown_module(module, arguments)
    if path[0] == "__class__":  # type(self).factor
        return f"class attribute {'.'.join(path[1:])!r} of {owner}'s class"
    return f"attribute {'.'.join(path)!r} of {owner}"
