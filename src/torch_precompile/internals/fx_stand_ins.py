"""Stand-ins for parts of torch.fx's tracer while a capture traces, each doing the same
job for less: the user's line of each node, and the fake value that describes it.

Installed on torch's classes and modules while any capture traces (``user_frames_only``);
each does torch's own work where its context is not a capture's (another thread's tracer,
a nested one).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import sysconfig
import threading
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental.proxy_tensor as proxy_tensor
import torch.fx.proxy
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx.experimental.proxy_tensor import PythonKeyTracer

from torch_precompile.internals.origin import shown_path

NOT_USER_CODE = tuple(
    str(directory) + os.sep
    for directory in (
        Path(torch.__file__).parent,
        Path(__file__).parents[1],
        sysconfig.get_paths()["stdlib"],
    )
)
_KEEPING_USER_FRAMES = contextvars.ContextVar("keeping_user_frames", default=False)
_filter_lock = threading.Lock()
_filter_users = 0
# Each file's path as the artifact shows it, while captures trace (a node's file is most
# often the one before it's; sys.path and the working directory stay as they are).
_shown_paths: dict[str, str] = {}


def _innermost_user_frame(self: Any, stack: traceback.StackSummary) -> traceback.StackSummary:
    """Stands in for ``PythonKeyTracer._filter_traceback_frames`` while a capture traces.

    torch's own filter keeps only frames of functions named ``forward``, which drops the
    user's step function; other tracers (another thread's, a nested one) keep it.
    """
    if not _KEEPING_USER_FRAMES.get():
        return _TORCH_FRAME_FILTER(self, stack)
    for frame in reversed(stack):
        if not frame.filename.startswith(NOT_USER_CODE):
            # Shown in the artifact: no absolute path of the build machine.
            shown_as = _shown_paths.get(frame.filename)
            if shown_as is None:
                shown_as = _shown_paths[frame.filename] = shown_path(frame.filename)
            shown = traceback.FrameSummary(
                shown_as,
                frame.lineno,
                frame.name,
                lookup_line=False,
                line=frame.line,
            )
            return traceback.StackSummary.from_list([shown])
    return traceback.StackSummary.from_list([])


class _InnermostUserStack:
    """Stands in for ``CapturedTraceback`` in ``torch.fx.proxy`` while a capture traces.

    fx takes the whole Python stack at every node it records and reads each frame's source
    line (about fifty a node), only for the filter above to keep one frame. Here the stack
    is walked up to the innermost frame of the user's code alone; elsewhere (another
    thread's tracer, a nested one) torch's own capture runs.
    """

    def __init__(self, frame: traceback.FrameSummary | None) -> None:
        self.frame = frame

    @classmethod
    def extract(cls, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not _KEEPING_USER_FRAMES.get():
            return _TORCH_TRACEBACK.extract(*args, **kwargs)
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(NOT_USER_CODE):
            frame = frame.f_back
        if frame is None:
            return cls(None)
        code = frame.f_code
        return cls(traceback.FrameSummary(code.co_filename, frame.f_lineno, code.co_name))

    def summary(self) -> traceback.StackSummary:
        return traceback.StackSummary.from_list([] if self.frame is None else [self.frame])


def _fake_value(value: Any, include_real: bool = False) -> Any:
    """Stands in for make_fx's ``extract_val`` (the fake tensor a node's meta holds) while a
    capture traces.

    For a real tensor, torch dispatches ``empty_strided`` through the fake mode, about a
    quarter of a deep model's trace; here the fake tensor is made as that dispatch makes it
    (an empty meta tensor of the same layout, wrapped), without the dispatch.
    """
    if type(value) is torch.Tensor and _KEEPING_USER_FRAMES.get() and not value.is_sparse:
        mode = detect_fake_mode(value)
        if mode is not None:
            with in_kernel_invocation_manager(mode):
                empty = torch.empty_strided(
                    value.shape, value.stride(), dtype=value.dtype, device="meta"
                )
            return FakeTensor(mode, empty, value.device)
    return _TORCH_EXTRACT_VAL(value, include_real)


_TORCH_EXTRACT_VAL = proxy_tensor.extract_val
_TORCH_TRACEBACK = getattr(torch.fx.proxy, "CapturedTraceback")  # noqa: B009  # not exported
_TORCH_FRAME_FILTER = PythonKeyTracer._filter_traceback_frames
_OWN_FRAME_FILTER = PythonKeyTracer.__dict__.get("_filter_traceback_frames")  # None: inherited


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The stand-ins installed while any capture traces (torch's own restored after)."""
    global _filter_users
    with _filter_lock:
        if _filter_users == 0:
            _shown_paths.clear()
            # A patch of torch's method, which mypy cannot check.
            PythonKeyTracer._filter_traceback_frames = _innermost_user_frame  # type: ignore[assignment]
            setattr(torch.fx.proxy, "CapturedTraceback", _InnermostUserStack)  # noqa: B010
            proxy_tensor.extract_val = _fake_value  # type: ignore[assignment]
        _filter_users += 1
    token = _KEEPING_USER_FRAMES.set(True)
    try:
        yield
    finally:
        _KEEPING_USER_FRAMES.reset(token)
        with _filter_lock:
            _filter_users -= 1
            if _filter_users == 0:
                setattr(torch.fx.proxy, "CapturedTraceback", _TORCH_TRACEBACK)  # noqa: B010
                proxy_tensor.extract_val = _TORCH_EXTRACT_VAL
            if _filter_users == 0 and _OWN_FRAME_FILTER is None:
                del PythonKeyTracer._filter_traceback_frames
            elif _filter_users == 0:
                # Restores torch's own method (not None here), a patch mypy cannot check.
                PythonKeyTracer._filter_traceback_frames = _OWN_FRAME_FILTER  # type: ignore[assignment]
