"""Which values a read follows into: the cells a function closes over, the globals and
objects whose attributes a read may follow, and the plain values an object holds (encoded by
``trace.values``)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

from torch_precompile.spec import EncodedValue
from torch_precompile.trace.facts.code_homes import (
    INSTALLED,
    PACKAGE_ROOT,
    STDLIB_ROOTS,
    TORCH_ROOT,
    users_file,
)
from torch_precompile.trace.values import (
    OBJECT_DEPTH,
    Use,
    encode,
    held_values,
    is_library_object,
    is_plain_object,
)


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
    return not callable(value) and encode(value, Use.READ) is not None and value is not None


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


def object_values(
    obj: Any, depth: int = OBJECT_DEPTH
) -> Iterator[tuple[tuple[str, ...], EncodedValue]]:
    """The plain values ``obj`` holds (and the objects it holds, ``depth`` deep), each with
    its attribute path off ``obj``. Objects of the standard library and of torch are not
    followed: their state is theirs (a logger's level), not a setting of the user's."""
    if is_library_object(obj):
        return
    for name, value in list(held_values(obj).items()):
        encoded = encode(value, Use.READ)
        if encoded is not None:
            yield (name,), encoded
        elif depth > 0 and is_plain_object(value):
            for inner, deeper in object_values(value, depth - 1):
                yield (name, *inner), deeper
