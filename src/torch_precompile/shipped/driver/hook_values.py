"""The driver part for artifacts whose models had hooks at capture: the plain values each hook
holds (a closure's cells, a callable object's attributes, a partial's keywords), which its code
computed with in the graph. They are part of the hook as the spec names it (``pkg.scale
k=1.0``), so a call where one differs is refused like a hook replaced.
"""

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch


def hook_values(hook: Any) -> list[tuple[str, str, Callable[[], Any]]]:
    """The plain values a hook holds, which its code computed with at capture: a partial's
    keywords, the cells it closes over, the attributes of a callable object (or of the
    object a method is bound to, unless a module's, whose reads are checked as the model's).
    Each as (name, value shown, a function that reads it again)."""
    found: list[tuple[str, str, Callable[[], Any]]] = []
    while isinstance(hook, functools.partial):
        found += [
            (k, _plain(v), functools.partial(hook.keywords.get, k))
            for k, v in hook.keywords.items()
        ]
        hook = hook.func
    owner = getattr(hook, "__self__", None if hasattr(hook, "__code__") else hook)
    if _holds_settings(owner):
        held = vars(owner)
        found += [(k, _plain(v), functools.partial(held.get, k)) for k, v in held.items()]
    function = getattr(hook, "__func__", hook)
    names = getattr(getattr(function, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, getattr(function, "__closure__", None) or (), strict=True):
        try:
            shown = _plain(cell.cell_contents)
            found.append((name, shown, functools.partial(getattr, cell, "cell_contents")))
        except ValueError:  # a cell not filled yet
            continue
    return [entry for entry in found if entry[1]]


def _holds_settings(owner: Any) -> bool:
    """Whether the attributes of a hook's object are settings of the user's: not a module's
    (checked as the model's), nor those of a builtin or of the standard library."""
    home = (getattr(type(owner), "__module__", None) or "builtins").split(".")[0]
    return (
        hasattr(owner, "__dict__")
        and not isinstance(owner, torch.nn.Module | type)
        and home not in ("builtins", *sys.stdlib_module_names)
    )


def _plain(value: Any, depth: int = 0) -> str:
    """``value`` shown, where it is a plain value (numbers, strings, dtypes, containers of
    those); "" for anything else, which a hook's label leaves out."""
    if value is None or type(value) in (bool, int, float, complex, str, torch.dtype):
        return repr(value)
    if depth > 3:
        return ""
    users = (type(value).__module__ or "").split(".")[0] != "torch"
    # Settings it reads off it (a callable object of the user's too: functions, methods and
    # modules hold none of theirs).
    if users and _holds_settings(value):
        fields = ((k, _plain(v, depth + 1)) for k, v in vars(value).items())
        return f"{type(value).__qualname__}({', '.join(f'{k}={v}' for k, v in fields if v)})"
    if type(value) not in (tuple, list, dict) or len(value) > 256:
        return ""
    if type(value) is dict:
        pairs = [(_plain(k, depth + 1), _plain(v, depth + 1)) for k, v in value.items()]
        plain = all(k and v for k, v in pairs)
        return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}" if plain else ""
    items = [_plain(v, depth + 1) for v in value]
    if not all(items):
        return ""
    if type(value) is list:
        return "[" + ", ".join(items) + "]"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
