"""Where captured code came from, as an artifact may show it: file names without the build
machine's absolute paths."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any


def shown_path(filename: str) -> str:
    """``filename`` relative to the working directory when inside it, else to the ``sys.path``
    entry it is imported from (``transformers/models/...``), else its base name."""
    if filename.startswith("<") or not os.path.isabs(filename):
        return filename
    roots = sorted((p for p in sys.path if p and os.path.isabs(p)), key=len, reverse=True)
    with contextlib.suppress(FileNotFoundError):  # a removed working directory is no root
        roots.insert(0, os.getcwd())
    for root in roots:
        if filename.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(filename, root)
    return os.path.basename(filename)


def describe_callable(fn: Callable[..., Any]) -> str:
    """``fn``'s qualified name and where it is defined: ``step (train.py, line 12)``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    target = inspect.unwrap(fn) if callable(fn) else fn
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target).__call__
    name = getattr(target, "__qualname__", type(target).__name__)
    code = getattr(inspect.unwrap(getattr(target, "__func__", target)), "__code__", None)
    if code is None:
        return name
    return f"{name} ({shown_path(code.co_filename)}, line {code.co_firstlineno})"
