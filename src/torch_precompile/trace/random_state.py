"""Seeds set inside ``fn``: replayed by the artifact, or refused; and draws a trace cannot
replay (Python's ``random``, NumPy's generators, the clock): refused.

``torch.manual_seed(0)`` inside fn makes eager draw the same random numbers at every call; a
trace records only the draws. A seed set before fn's first random draw is recorded, and the
driver sets it before the graph runs, so every call draws as eager does. A seed set after a
draw cannot be placed inside a compiled graph: capture refuses it.
"""

from __future__ import annotations

import random
import sys
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import TorchDispatchMode
from torch_precompile.trace.guards import _user_location as user_location


class SeedWatch(TorchDispatchMode):
    """While active, notes random draws and the seeds fn sets (``torch.manual_seed``)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.seed: int | None = None
        self.draws = 0
        self.late: str | None = None  # where fn set a seed after a draw
        self.saved: tuple[Any, Any] = (torch.manual_seed, torch.random.manual_seed)

    def __enter__(self) -> SeedWatch:
        self.saved = (torch.manual_seed, torch.random.manual_seed)
        torch.manual_seed = torch.random.manual_seed = self._manual_seed
        # torch leaves it unannotated; it returns the mode itself.
        return cast(SeedWatch, super().__enter__())  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: Any) -> None:
        torch.manual_seed, torch.random.manual_seed = self.saved
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def _manual_seed(self, seed: int) -> Any:
        if self.draws:
            self.late = self.late or user_location()
        else:
            self.seed = int(seed)
        return self.saved[1](seed)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self.draws += 1
        return func(*args, **(kwargs or {}))

    def replayed_seed(self) -> int | None:
        """The seed the driver sets before each call; refuses one it cannot replay."""
        if self.late is not None:
            raise PrecompileError(
                f"fn sets the random seed at {self.late}, after it drew random numbers. An "
                "artifact sets a seed fn sets before its first random draw, before the graph "
                "runs; a seed set between draws cannot be replayed. Set it before fn's first "
                "random operation, or outside fn."
            )
        return self.seed


class PythonDraws:
    """While active (``with``), notes whether fn draws from Python's global ``random``
    generator or NumPy's global one: eager fn draws anew at every call, the graph would repeat
    the capture's number. (Their states are compared before and after: watching every call
    would slow the trace by half.)"""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.before: tuple[Any, Any] = (None, None)

    def __enter__(self) -> PythonDraws:
        self.before = (random.getstate(), _numpy_state())
        return self

    def __exit__(self, *exc: object) -> None:
        python_before, numpy_before = self.before
        if random.getstate() != python_before:
            self.found.append("Python's random module (random.random, random.randint, ...)")
        numpy_after = _numpy_state()
        if numpy_before is not None and not _same_numpy_state(numpy_before, numpy_after):
            self.found.append("NumPy's global random generator (numpy.random.rand, ...)")

    def refuse(self) -> None:
        """Refuse a capture during which fn drew such a number."""
        if self.found:
            raise PrecompileError(
                f"fn drew from {' and '.join(self.found)} while it was traced. The numbers it "
                "got are baked into the graph, so every call would repeat them where eager "
                "draws anew. Draw with torch (torch.rand, torch.randint: the artifact draws at "
                "every call), or pass the numbers in as inputs."
            )


def _numpy_state() -> Any:
    """NumPy's global generator state, where NumPy is loaded (fn cannot use it otherwise)."""
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state()


def _same_numpy_state(before: Any, after: Any) -> bool:
    numpy = sys.modules["numpy"]
    return bool(before[2:] == after[2:] and numpy.array_equal(before[1], after[1]))
