"""Dynamo as a reader: every private name of ``torch._dynamo`` the package uses.

``tracer="dynamo"`` runs ``fn`` once under Dynamo with a backend that compiles nothing (each
graph runs as Dynamo captured it) and keeps, for every frame Dynamo translated, the frame's
code, globals and arguments, the guards Dynamo installed on it, and each graph break with
its reason and user line. Only capture imports this module; the artifact never does.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Step:
    """One step from a guard's root to the value it guards: ``attr`` (a name), ``item`` (a
    key or index), ``type`` (the value's class), ``typedict`` (a class's namespace)."""

    kind: str
    key: Any = None


@dataclass(frozen=True)
class GuardPath:
    """Where a guarded value lives: ``root`` is ``local`` or ``global`` (``name`` in the
    frame's arguments or globals) or ``state`` (torch's thread state, no value)."""

    root: str
    name: str
    steps: tuple[Step, ...] = ()


@dataclass(frozen=True)
class RawGuard:
    """One guard Dynamo installed: its kind (``CONSTANT_MATCH``), what it reads as Dynamo
    writes it (``G['SCALE']``), that place as a path where it is one, and the user line that
    made it (``train.py:12``) where known."""

    kind: str
    text: str
    path: GuardPath | None
    line: str | None
    at_read: Any = None  # what ``read``'s ``note`` said of the value when Dynamo read it


@dataclass(frozen=True)
class FrameRead:
    """A frame Dynamo translated: its code, globals, and arguments as they were on entry."""

    code: types.CodeType
    globals: dict[str, Any]
    arguments: dict[str, Any]
    guards: tuple[RawGuard, ...]


@dataclass(frozen=True)
class GraphBreak:
    """Where Dynamo stopped a graph and ran Python itself, and why."""

    reason: str
    line: str | None  # file:line of the user's code
    text: str | None  # that line's source


@dataclass
class DynamoReading:
    frames: list[FrameRead] = field(default_factory=list)
    breaks: list[GraphBreak] = field(default_factory=list)
    # Why Dynamo gave up on a frame it then ran unread (its reasons, first lines).
    unread: list[str] = field(default_factory=list)


class DynamoFailed(Exception):
    """Dynamo raised while reading fn: fn had run whole in the trace before."""


def read(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    note: Callable[[dict[str, Any], dict[str, Any], GuardPath], Any] | None = None,
) -> tuple[DynamoReading, Any]:
    """Run ``fn(*args)`` once under Dynamo; what it read, and fn's result. ``note(globals,
    arguments, path)`` is told each guarded place as Dynamo reads it, before the frame runs,
    and what it returns is kept as the guard's ``at_read``."""
    import torch._dynamo as dynamo

    reading = DynamoReading()

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            reading.breaks.append(_graph_break(reason))
        return gm.forward

    def export(guards: Any) -> None:
        frame = _frame_being_compiled()
        if frame is None:
            return
        arguments = dict(frame.f_locals)
        raws = [_raw(g) for g in list(guards)]
        if note is not None:
            raws = [
                dataclasses.replace(r, at_read=note(frame.f_globals, arguments, r.path))
                if r.path is not None
                else r
                for r in raws
            ]
        reading.frames.append(FrameRead(frame.f_code, frame.f_globals, arguments, tuple(raws)))

    quiet = logging.getLogger("torch._dynamo")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its graph-break hints name its own settings, not ours
    from torch._dynamo.utils import counters

    known = set(counters["unimplemented"])
    dynamo.reset()
    try:
        with _strict_config(), warnings.catch_warnings():
            # About Dynamo's own guards' speed; the artifact never runs them.
            warnings.filterwarnings("ignore", message="Guards may run slower")
            result = dynamo.optimize(backend, guard_export_fn=export)(fn)(*args)
        reading.unread = [_first_line(r) for r in counters["unimplemented"] if r not in known]
    except Exception as error:
        # fn ran whole in the trace before this, so what is raised here is Dynamo's: its own
        # exceptions, or an internal error (an assertion, a KeyError) of a release's Dynamo.
        raise DynamoFailed(f"{type(error).__name__}: {_first_line(str(error))}") from error
    finally:
        dynamo.reset()
        quiet.setLevel(level)
    return reading, result


def _strict_config() -> Any:
    import torch._dynamo.config as config

    # One reading per capture; a frame must never fall back to eager unread.
    return config.patch(suppress_errors=False, recompile_limit=64)


def _frame_being_compiled() -> Any:
    """The user frame Dynamo is translating: an argument ``frame`` of its callback, further
    up the stack (the export callback is not told which frame it guards)."""
    f: types.FrameType | None = sys._getframe(2)
    try:
        while f is not None:
            candidate = f.f_locals.get("frame")
            if hasattr(candidate, "f_code") and hasattr(candidate, "f_globals"):
                return candidate
            f = f.f_back
        return None
    finally:
        del f


def _graph_break(reason: Any) -> GraphBreak:
    stack = list(getattr(reason, "user_stack", None) or ())
    last = stack[-1] if stack else None
    return GraphBreak(
        reason=_first_line(str(reason.reason)),
        line=f"{last.filename}:{last.lineno}" if last is not None else None,
        text=(last.line or None) if last is not None else None,
    )


def _first_line(text: str) -> str:
    """Dynamo's reason and its explanation, without its hints (its own settings)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    lines = [line.removeprefix("Explanation: ") for line in lines[:2]]
    return "; ".join(lines) if lines else text


def _raw(guard: Any) -> RawGuard:
    stack = getattr(guard, "user_stack", None)
    last = stack[-1] if stack else None
    source = guard.originating_source
    return RawGuard(
        kind=str(guard.create_fn_name()),
        text=str(guard.name),
        path=_path(source),
        line=f"{last.filename}:{last.lineno}" if last is not None else None,
    )


def _path(source: Any) -> GuardPath | None:
    from torch._dynamo import source as sources

    steps: list[Step] = []
    for node in _chain(source):
        if isinstance(node, sources.LocalSource):
            return GuardPath("local", node.local_name, tuple(reversed(steps)))
        if isinstance(node, sources.GlobalSource):
            return GuardPath("global", node.global_name, tuple(reversed(steps)))
        if isinstance(node, sources.GlobalStateSource | sources.ShapeEnvSource):
            return GuardPath("state", type(node).__name__)
        step = _step(node, sources)
        if step is not None:
            steps.append(step)
    return None


def _chain(source: Any) -> Iterator[Any]:
    while source is not None:
        yield source
        source = getattr(source, "base", None)


def _step(node: Any, sources: Any) -> Step | None:
    """The step ``node`` adds to its base; None for a wrapper that adds none; an ``other``
    step (named by the source's class) for one this reader does not follow."""
    if isinstance(node, sources.AttrSource):  # also grads, cells, parameters
        return Step("attr", node.member)
    if isinstance(node, sources.GradSource):
        return Step("attr", node.member)
    if isinstance(node, sources.GetItemSource | sources.DictGetItemSource):
        index = node.index
        return Step("other", "key") if isinstance(index, sources.Source) else Step("item", index)
    if isinstance(node, sources.ClosureSource):  # a function's cells: then [i].cell_contents
        return Step("attr", "__closure__")
    if isinstance(node, sources.TypeSource):
        return Step("type")
    if isinstance(node, sources.TypeDictSource):
        return Step("typedict")
    if isinstance(node, sources.NNModuleSource | sources.OptimizerSource):
        return None
    return Step("other", type(node).__name__)
