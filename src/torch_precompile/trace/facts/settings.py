"""torch settings the traced code reads into Python (``torch.is_grad_enabled()``, the default
dtype, ...): each read becomes a fact the artifact checks at every call.

A branch on ``torch.is_grad_enabled()`` (the gate of gradient checkpointing in many models) or
on the number of threads is decided once, in the trace. So while fn is traced, the functions
that read these settings are wrapped: a read from fn's code (the user's or a library's, not
torch's) is recorded with the value it gave, and the artifact refuses a call where the setting
is another (``AmbientPlan``). The trace runs with gradients on, to see fn's backward; fn's code
is shown the capture's own setting instead, as eager would show it, unless fn turned gradients
on itself (``torch.enable_grad()``) or off (``torch.no_grad()``): those reads do not depend on
the call's setting and are not recorded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from torch_precompile.shipped.driver.call_state import SETTINGS
from torch_precompile.trace.facts.code_homes import PACKAGE_ROOT, TORCH_ROOT
from torch_precompile.trace.facts.listening import Listeners

_GRAD = "torch.is_grad_enabled"
_ENABLE_GRAD = torch.autograd.grad_mode.enable_grad


class SettingReads:
    """Pushed around fn while it is traced: the settings the user's code read, each with the
    value it was shown and the line of its first read."""

    def __init__(self) -> None:
        self.grad_at_capture = torch.is_grad_enabled()  # before the trace turns it on
        self.enabled_by_fn = 0  # torch.enable_grad() blocks fn is inside now
        self.values: dict[str, tuple[Any, str]] = {}

    def __enter__(self) -> SettingReads:
        SETTING_READS.enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        SETTING_READS.exit(self)

    def read(self, name: str, value: Any, frame: FrameType) -> Any:
        """The value the user's code at ``frame`` gets for ``name``; recorded where it depends
        on the call's setting."""
        if name == _GRAD:
            if not value or self.enabled_by_fn:
                return value  # fn's own no_grad or enable_grad decides it, not the call's
            value = self.grad_at_capture
        where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        self.values.setdefault(name, (SETTINGS[name][1](value), where))
        return value

    def records(self) -> tuple[tuple[str, Any, str], ...]:
        """(the call that reads it, the value it gave as the spec holds it, where), in order
        of first read."""
        return tuple((name, value, where) for name, (value, where) in self.values.items())


def _patch() -> Callable[[], None]:
    """Wrap torch's setting readers and ``enable_grad``; return what undoes it."""
    originals = {name: getattr(torch, name.removeprefix("torch.")) for name in SETTINGS}
    enter, leave = _ENABLE_GRAD.__enter__, _ENABLE_GRAD.__exit__
    for name, original in originals.items():
        setattr(torch, name.removeprefix("torch."), _reader(name, original))

    def entering(self: Any) -> None:
        _count_enable_grad(_caller(), 1)
        enter(self)

    def leaving(self: Any, *exc: Any) -> None:
        _count_enable_grad(_caller(), -1)
        leave(self, *exc)

    _ENABLE_GRAD.__enter__ = entering  # type: ignore[method-assign]
    _ENABLE_GRAD.__exit__ = leaving  # type: ignore[method-assign]

    def undo() -> None:
        for name, original in originals.items():
            setattr(torch, name.removeprefix("torch."), original)
        _ENABLE_GRAD.__enter__ = enter  # type: ignore[method-assign]
        _ENABLE_GRAD.__exit__ = leave  # type: ignore[method-assign]

    return undo


def _reader(name: str, original: Callable[[], Any]) -> Callable[[], Any]:
    def read() -> Any:
        value = original()
        listener = SETTING_READS.innermost()
        if listener is not None:
            frame = inspect.currentframe()
            frame = frame.f_back if frame is not None else None
            if frame is not None and _not_torchs(frame.f_code.co_filename):
                return listener.read(name, value, frame)
        return value

    read.__name__ = read.__qualname__ = original.__name__
    return read


def _count_enable_grad(frame: FrameType | None, step: int) -> None:
    """Note fn entering or leaving a ``torch.enable_grad()`` (its own, or one torch enters
    for it, as a decorator or a checkpoint does); the trace's own is entered before any
    listener."""
    listener = SETTING_READS.innermost()
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_ROOT):
        frame = frame.f_back
    if listener is not None and frame is not None and _not_torchs(frame.f_code.co_filename):
        listener.enabled_by_fn += step


def _caller() -> FrameType | None:
    """The frame that called the function calling this."""
    frame = inspect.currentframe()
    try:
        return frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    finally:
        del frame  # a frame held by a local of its own would keep every local alive till GC


def _not_torchs(filename: str) -> bool:
    """Whether code in ``filename`` is fn's: the user's or a library's (a model's library
    branches on these settings as fn's own code does), not torch's or this package's."""
    return not filename.startswith((TORCH_ROOT, PACKAGE_ROOT))


SETTING_READS: Listeners[SettingReads] = Listeners(_patch)
"""The readers are wrapped while any thread traces; each reports to its thread's innermost
listener."""
