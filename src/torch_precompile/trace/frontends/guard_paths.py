"""Dynamo's guard sources as paths the artifact's checks can follow: a walk from ``fn``'s
globals or arguments through attributes, items and closure cells, and what each step reaches
(code, an object of the user's, a module of theirs)."""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

from torch_precompile.internals import dynamo
from torch_precompile.trace.facts.code_homes import TORCH_ROOT, users_file

MISSING: Any = object()


def below(made: tuple[Any, Any, tuple[str, ...]], holder: tuple[Any, Any, tuple[str, ...]]) -> bool:
    return len(made[2]) > len(holder[2]) and made[2][: len(holder[2])] == holder[2]


def walk(frame: dynamo.FrameRead, path: dynamo.GuardPath) -> list[Any]:
    """Each object from the path's root to the guarded value (``MISSING`` past a failed
    step)."""
    scope = frame.arguments if path.root == "local" else frame.globals
    root = scope.get(path.name, MISSING)
    return [root, *walk_from(root, path.steps)]


def walk_from(obj: Any, steps: Sequence[dynamo.Step]) -> list[Any]:
    chain = []
    for step in steps:
        obj = _step(obj, step)
        chain.append(obj)
    return chain


def _step(obj: Any, step: dynamo.Step) -> Any:
    if obj is MISSING:
        return MISSING
    try:
        if step.kind == "attr":
            return getattr(obj, step.key)
        if step.kind == "item":
            return obj[step.key]
        if step.kind == "type":
            return type(obj)
        if step.kind == "typedict":
            return dict(obj.__dict__)
    except Exception:  # a place that no longer exists: nothing to anchor on
        return MISSING
    return MISSING


def attribute_names(
    steps: Sequence[dynamo.Step], through_classes: bool = True, cells: bool = False
) -> tuple[str, ...] | None:
    """The attribute names of ``steps`` where they are all plain attribute reads; with
    ``through_classes``, a class attribute read through an instance (type, class namespace,
    item) reads as its name (as ``getattr`` finds it, not a global's ``__dict__`` walk); with
    ``cells``, ``__closure__`` (a global read's step into a function's closure variable)."""
    names: list[str] = []
    kinds = [s.kind for s in steps]
    i = 0
    while i < len(steps):
        step = steps[i]
        plain = step.kind == "attr" and not str(step.key).startswith("__")
        if plain or (cells and step == _CELLS):
            names.append(str(step.key))
            i += 1
        elif (
            through_classes
            and kinds[i : i + 3] == ["type", "typedict", "item"]
            and isinstance(steps[i + 2].key, str)
        ):
            names.append(steps[i + 2].key)
            i += 3
        else:
            return None
    return tuple(names)


_CELLS = dynamo.Step("attr", "__closure__")


def cells_named(chain: list[Any], path: dynamo.GuardPath) -> tuple[list[Any], dynamo.GuardPath]:
    """``chain`` and ``path`` with each read of a function's cell (``__closure__``, ``[i]``,
    ``cell_contents``) as ``__closure__`` then the closure variable's name (``chain[k]`` is the
    object before ``path.steps[k]``)."""
    steps, objects = list(path.steps), list(chain)
    for k in range(len(steps) - 3, -1, -1):
        function, (cell, index, contents) = objects[k], steps[k : k + 3]
        if not (
            cell == _CELLS
            and isinstance(function, types.FunctionType)
            and index.kind == "item"
            and isinstance(index.key, int)
            and contents == dynamo.Step("attr", "cell_contents")
            and index.key < len(function.__code__.co_freevars)
        ):
            continue
        name = function.__code__.co_freevars[index.key]
        steps[k : k + 3] = [_CELLS, dynamo.Step("attr", name)]
        del objects[k + 2]  # the cell itself: after it, the tuple then the cell's value
    return objects, dynamo.GuardPath(path.root, path.name, tuple(steps))


def covers(
    made: tuple[Any, Any, tuple[str, ...]], wanted: tuple[Any, Any, tuple[str, ...]]
) -> bool:
    """Whether a read the make_fx trace made holds ``wanted`` (the same place, or an object
    on its path, whose values it all holds)."""
    return made[:2] == wanted[:2] and wanted[2][: len(made[2])] == made[2]


def is_code(value: Any) -> bool:
    """Modules, classes, functions and methods: code, not settings."""
    return isinstance(
        value,
        types.ModuleType
        | type
        | types.FunctionType
        | types.BuiltinFunctionType
        | types.MethodType
        | types.MethodWrapperType
        | types.WrapperDescriptorType
        | types.MethodDescriptorType,
    )


def is_object(value: Any) -> bool:
    """An object of the user's holding values (not a plain value, code or a container)."""
    return isinstance(getattr(value, "__dict__", None), dict) and not is_code(value)


def users_module(name: Any) -> bool:
    module = sys.modules.get(name) if isinstance(name, str) else None
    file = getattr(module, "__file__", None)
    if name == "__main__":
        return True
    return isinstance(file, str) and users_file(file) and not file.startswith(TORCH_ROOT)


def shown_briefly(value: Any) -> str:
    text = repr(value)
    if " object at 0x" in text:  # the default repr: an address that differs per process
        return f"a {type(value).__qualname__}"
    return text if len(text) <= 40 else f"{type(value).__name__}(...)"
