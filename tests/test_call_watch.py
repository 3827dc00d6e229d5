"""The watch capture reads Python calls through: every start of interesting code in its own
thread, nothing else, and it leaves the interpreter as it found it."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

from torch_precompile.trace.facts.call_watch import CallWatch


def interesting(x: int) -> int:
    return x + 1


def dull(x: int) -> int:
    return interesting(x) * 2


def watch_of(started: list[str]) -> CallWatch:
    def judge(code: types.CodeType) -> Any:
        return code.co_name if code.co_name == "interesting" else None

    return CallWatch({}, judge, lambda frame: started.append(frame.f_code.co_name))


def test_each_start_of_interesting_code_in_its_thread_is_seen() -> None:
    started: list[str] = []
    other = threading.Thread(target=lambda: [dull(i) for i in range(3)])
    with watch_of(started):
        for i in range(3):
            dull(i)
        other.start()
        other.join()
    dull(0)  # after the watch: not seen
    assert started == ["interesting"] * 3


def test_a_tracer_already_installed_keeps_running() -> None:
    calls: list[str] = []

    def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            calls.append(frame.f_code.co_name)
        return None

    started: list[str] = []
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with watch_of(started):
            dull(1)
        installed = sys.gettrace()
    finally:
        sys.settrace(previous)
    assert installed is tracer
    assert started == ["interesting"]
    assert "dull" in calls and "interesting" in calls


def test_the_monitoring_tool_id_is_given_back() -> None:
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:  # Python 3.11: sys.settrace, checked above
        return
    free = [t for t in (3, 4) if monitoring.get_tool(t) is None]
    with watch_of([]) as watch:
        assert watch.tool in free
    assert [t for t in (3, 4) if monitoring.get_tool(t) is None] == free
