"""The watch capture reads Python calls through: every start of interesting code in its own
thread, nothing else, paused inside torch's own operators, and it leaves the interpreter as it
found it."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_precompile.trace.facts.call_watch import CallWatch
from torch_precompile.trace.facts.reads import OperatorsUnwatched


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


def test_a_pause_switches_the_watch_off_only_where_it_slows_every_frame() -> None:
    """On Python 3.11 (sys.settrace) a pause stops the watch in its own thread until resumed;
    sys.monitoring (3.12 and newer) has nothing to pause; another thread has no watch to pause."""
    started: list[str] = []
    elsewhere: list[bool] = []
    with watch_of(started) as watch:
        paused = watch.pause()
        dull(1)
        if paused:
            watch.resume()
        dull(2)
        other = threading.Thread(target=lambda: elsewhere.append(watch.pause()))
        other.start()
        other.join()
    assert elsewhere == [False]
    if hasattr(sys, "monitoring"):
        assert not paused and started == ["interesting"] * 2
    else:
        assert paused and started == ["interesting"]
    assert sys.gettrace() is None


def test_no_pause_beside_a_tracer_already_installed() -> None:
    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: None)
    try:
        with watch_of([]) as watch:
            assert not watch.pause()
    finally:
        sys.settrace(previous)


class Inner(TorchDispatchMode):
    """Below the pausing mode: notes, for each operator, whether a trace function was set."""

    def __init__(self) -> None:
        super().__init__()
        self.traced: dict[str, bool] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.traced[func.__name__.split(".")[0]] = sys.gettrace() is not None
        interesting(0)
        return func(*args, **(kwargs or {}))


class Pinging(torch.Tensor):
    """A tensor subclass of the user's, whose dispatch is the user's Python."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Pinging:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        interesting(0)
        plain = [a.inner if isinstance(a, Pinging) else a for a in args]
        return func(*plain, **(kwargs or {}))


def test_torch_operators_run_unwatched_and_a_users_dispatch_watched() -> None:
    """Torch's operators on torch's tensors run with the watch paused where it slows every
    frame; an operator on a user's tensor subclass runs its dispatch watched everywhere."""
    started: list[str] = []
    inner = Inner()
    with watch_of(started) as watch, inner, OperatorsUnwatched(watch):
        torch.relu(torch.ones(2))
        seen_before = len(started)
        torch.neg(Pinging(torch.ones(2)))
    if hasattr(sys, "monitoring"):  # nothing to pause: the mode below is seen (ones, relu)
        assert seen_before >= 1
    else:  # no trace function below the pausing mode: the mode below is not seen
        assert inner.traced["relu"] is False and seen_before == 0
    assert started[seen_before:].count("interesting") >= 1  # the subclass's dispatch
