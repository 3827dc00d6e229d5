"""Environment variables the traced code reads (``os.environ.get("SCALE")``, ``os.getenv``):
each becomes a global read of ``os.environ``, checked at every call like any other.

Every read goes through ``os.environ``'s ``__getitem__`` (``get``, ``getenv`` and ``in`` call
it), so that method is wrapped while a trace runs, and each read is reported with the frame
that made it; the listener keeps the user's (torch and this package read their own settings).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from torch_precompile.trace.facts.listening import Listeners

# Frames of the mapping machinery between the reading code and ``__getitem__``.
# (Both may be frozen modules, named "<frozen os>": their code objects say so.)
_PASSED = frozenset({__file__, os.getenv.__code__.co_filename, Mapping.get.__code__.co_filename})
_ENVIRON_CLASS = type(os.environ)

# A read: the variable, its value (None where unset), and the frame that made it.
Listener = Callable[[str, str | None, FrameType], None]


def _patch_environ() -> Callable[[], None]:
    """Wrap ``os.environ``'s ``__getitem__``; return what undoes it."""
    original = _ENVIRON_CLASS.__getitem__

    def getitem(environ: Any, key: str) -> str:
        try:
            value = original(environ, key)
        except KeyError:
            _report(key, None)
            raise
        _report(key, value)
        return value

    _ENVIRON_CLASS.__getitem__ = getitem  # type: ignore[method-assign]

    def undo() -> None:
        _ENVIRON_CLASS.__getitem__ = original  # type: ignore[method-assign]

    return undo


def _report(key: str, value: str | None) -> None:
    listener = ENVIRONMENT_READS.innermost()
    if listener is not None and isinstance(key, str) and (frame := _reader()) is not None:
        listener(key, value, frame)


def _reader() -> FrameType | None:
    """The frame that read the variable, past the mapping machinery."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename in _PASSED:
        frame = frame.f_back
    return frame


ENVIRONMENT_READS: Listeners[Listener] = Listeners(_patch_environ)
