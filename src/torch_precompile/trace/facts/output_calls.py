"""Calls of ``print``, ``logging`` and ``warnings.warn`` that the user's code makes while fn is
traced: they run once, at capture, and never at a call of the artifact (the graph holds tensor
operations only), so capture names them.

``builtins.print``, ``warnings.warn`` and the logging methods of ``logging.Logger`` (which the
module's own ``logging.info`` and friends call) are wrapped while a trace runs, and each call
is reported with the frame that made it; the listener keeps the user's (torch, installed
packages and the standard library print, log and warn for their own reasons). A name bound
before the trace (``from warnings import warn``) calls the original and goes unseen.
"""

from __future__ import annotations

import builtins
import inspect
import logging
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch_precompile.trace.facts.listening import Listeners

# A call: what was called (``print``, ``logging.info``) and the frame that called it.
Listener = Callable[[str, FrameType], None]

_LOGGER_METHODS = frozenset(
    {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"}
)
# Frames between the user's call and a wrapped method: logging's module functions call the
# root logger's methods, and ``exception`` calls ``error``.
_PASSED = frozenset({__file__, logging.__file__})


def _patch() -> Callable[[], None]:
    """Wrap print, warnings.warn and the Logger methods; return what undoes it."""
    original_print, original_warn = builtins.print, warnings.warn
    # Those this Python's Logger defines (a release may drop a deprecated alias).
    defined = vars(logging.Logger)
    originals = {name: defined[name] for name in _LOGGER_METHODS if name in defined}

    def printed(*args: Any, **kwargs: Any) -> None:
        _report("print")
        original_print(*args, **kwargs)

    def warned(
        message: Any, category: Any = None, stacklevel: int = 1, *args: Any, **kwargs: Any
    ) -> None:
        _report("warnings.warn")
        # One frame more: this one, so the warning names the same line as without it.
        original_warn(message, category, stacklevel + 1, *args, **kwargs)

    def logged(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(logger: logging.Logger, *args: Any, **kwargs: Any) -> Any:
            _report(f"logging.{name}")
            # One frame more: this one, so the record names the same line as without it.
            kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
            return method(logger, *args, **kwargs)

        return call

    builtins.print = printed
    warnings.warn = warned
    for name, method in originals.items():
        setattr(logging.Logger, name, logged(name, method))

    def undo() -> None:
        builtins.print, warnings.warn = original_print, original_warn
        for name, method in originals.items():
            setattr(logging.Logger, name, method)

    return undo


def _report(what: str) -> None:
    listener = OUTPUT_CALLS.innermost()
    if listener is None:
        return
    frame = inspect.currentframe()
    frame = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    while frame is not None and frame.f_code.co_filename in _PASSED:
        frame = frame.f_back
    if frame is not None:
        listener(what, frame)


OUTPUT_CALLS: Listeners[Listener] = Listeners(_patch)
