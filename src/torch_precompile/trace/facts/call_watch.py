"""A callback at the start of every Python function one thread runs, while entered.

Capture reads each function's bytecode once and looks at the frames of those that read
something (``reads.py``). A trace runs millions of Python calls, nearly all of them torch's,
so the watch must cost next to nothing for code of no interest: on Python 3.12 and newer it
uses ``sys.monitoring``, where such code stops raising events at all once judged; on 3.11,
``sys.settrace``, where it costs one lookup per call. Either runs beside a debugger or
coverage tool already installed.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

_UNSEEN: Any = object()
_MONITORING: Any = getattr(sys, "monitoring", None)  # Python 3.12 and newer
# Tool ids sys.monitoring leaves to other tools than debuggers, coverage, profilers and
# optimizers; one per capture running at once (more fall back to sys.settrace).
_TOOL_IDS = (3, 4)
_TOOL_LOCK = threading.Lock()


class CallWatch:
    """Calls ``on_start(frame)`` at the start of each function whose code ``judge`` (asked
    once per code object, its verdict kept in ``verdicts``) gives a verdict other than None,
    in the thread that enters the watch."""

    def __init__(
        self,
        verdicts: dict[types.CodeType, Any],
        judge: Callable[[types.CodeType], Any],
        on_start: Callable[[types.FrameType], None],
    ) -> None:
        self.verdicts, self.judge, self.on_start = verdicts, judge, on_start
        self.tool: int | None = None
        self.previous: Any = None
        self.tracer: Any = None  # sys.settrace's function, where this watch alone traces
        self.thread = threading.get_ident()

    def __enter__(self) -> CallWatch:
        self.thread = threading.get_ident()
        self.tool = _monitor(self._started) if _MONITORING is not None else None
        if self.tool is None:
            self.previous = sys.gettrace()
            tracer = self._tracer()
            self.tracer = tracer if self.previous is None else None
            sys.settrace(tracer)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tool is None:
            sys.settrace(self.previous)
            self.tracer = None
            return
        _stop_monitoring(self.tool)
        self.tool = None

    def pause(self) -> bool:
        """Switch the watch off in this thread where a trace function slows every frame
        (``sys.settrace`` on 3.11: each instruction then takes the interpreter's slow path),
        unless another tool traces too; whether it did (``resume`` switches it back on)."""
        if self.tracer is None or threading.get_ident() != self.thread:
            return False
        sys.settrace(None)
        return True

    def resume(self) -> None:
        sys.settrace(self.tracer)

    def _verdict(self, code: types.CodeType) -> Any:
        verdict = self.verdicts.get(code, _UNSEEN)
        if verdict is _UNSEEN:
            verdict = self.verdicts[code] = self.judge(code)
        return verdict

    def _started(self, code: types.CodeType, offset: int) -> Any:
        """sys.monitoring's callback (no events are raised while it runs)."""
        if self._verdict(code) is None:
            return _MONITORING.DISABLE  # this code never raises the event again
        if threading.get_ident() == self.thread:
            frame = inspect.currentframe()
            if frame is not None and frame.f_back is not None:
                self.on_start(frame.f_back)  # the frame of the function that started
        return None

    def _tracer(self) -> Callable[[types.FrameType, str, Any], Any]:
        """sys.settrace's function: called at every call, so known code costs one lookup."""
        known, verdict, on_start = self.verdicts.get, self._verdict, self.on_start
        previous = self.previous
        if previous is None:

            def on_call(frame: types.FrameType, event: str, arg: Any) -> Any:
                seen = known(frame.f_code, _UNSEEN)
                if seen is not None and (seen is not _UNSEEN or verdict(frame.f_code) is not None):
                    on_start(frame)
                return None  # no line events for this frame

            return on_call

        def on_call_beside(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "call" and verdict(frame.f_code) is not None:
                on_start(frame)
            return previous(frame, event, arg)

        return on_call_beside


def _monitor(started: Callable[[types.CodeType, int], Any]) -> int | None:
    """Take a free tool id and raise ``started`` at every function start; None where none
    is free."""
    monitoring = _MONITORING
    with _TOOL_LOCK:
        for tool in _TOOL_IDS:
            if monitoring.get_tool(tool) is None:
                monitoring.use_tool_id(tool, "torch_precompile capture")
                break
        else:
            return None
    monitoring.register_callback(tool, monitoring.events.PY_START, started)
    monitoring.set_events(tool, monitoring.events.PY_START)
    return tool


def _stop_monitoring(tool: int) -> None:
    monitoring = _MONITORING
    monitoring.set_events(tool, 0)
    monitoring.register_callback(tool, monitoring.events.PY_START, None)
    with _TOOL_LOCK:
        monitoring.free_tool_id(tool)
    # Code this watch disabled raises events again for whoever uses the id next.
    monitoring.restart_events()
