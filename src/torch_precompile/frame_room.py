"""Run a build on a fresh stretch of CPython's frame stack.

CPython (3.11 to 3.13) keeps Python frames in chunks of 16 KiB that it maps when a call
needs a new one and unmaps as soon as the first frame in it returns. A trace dispatches
every operator through dozens of nested Python calls; where those calls straddle a chunk's
edge, each one maps and unmaps it, with page faults. A 48-block training step traced that
way made about a million such pairs (10 s of system time, a 28 s build instead of 16 s), and
whether a build hits an edge depends on how deep its caller's stack happens to be.

``with_frame_room`` calls the build from a frame too large for the chunk in use, so CPython
gives that frame a chunk of its own, 128 KiB, and the build's calls nest in the 64 KiB left
behind it: a few hundred frames deep before the next edge.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_SLOTS = 8192  # local variables: 64 KiB of frame, more than a 16 KiB chunk holds


@functools.cache
def _frame_of_slots(slots: int) -> Callable[[Callable[[], Any]], Any]:
    """A function ``f(call) -> call()`` whose frame has ``slots`` local variables (never
    assigned: the names only size the frame)."""
    names = " = ".join(f"_{i}" for i in range(slots))
    source = f"def room(call):\n    if False:\n        {names} = None\n    return call()\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<frame room>", "exec"), namespace)
    return namespace["room"]  # type: ignore[no-any-return]


def with_frame_room(call: Callable[[], T]) -> T:
    """``call()``, its frames nested on a fresh, large stretch of the frame stack."""
    return _frame_of_slots(_SLOTS)(call)  # type: ignore[no-any-return]
