"""Seeds set inside ``fn``: replayed by the artifact, or refused; and draws a trace cannot
replay (Python's ``random``, NumPy's generators, the clock): refused.

``torch.manual_seed(0)`` inside fn makes eager draw the same random numbers at every call; a
trace records only the draws. A seed set before fn's first random draw is recorded, and the
driver sets it before the graph runs, so every call draws as eager does. A seed set after a
draw cannot be placed inside a compiled graph: capture refuses it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import TorchDispatchMode
from torch_precompile.trace.facts.code_homes import PACKAGE_ROOT, TORCH_ROOT, users_file
from torch_precompile.trace.facts.listening import Listeners
from torch_precompile.trace.facts.value_guards import _user_location as user_location


class SeedWatch(TorchDispatchMode):
    """While active, notes random draws and the seeds fn sets (``torch.manual_seed``)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.seed: int | None = None
        self.draws = 0
        self.late: str | None = None  # where fn set a seed after a draw
        self.state_use: str | None = None  # where fn read or set the generator's state
        self.saved: tuple[Any, Any] = (torch.manual_seed, torch.random.manual_seed)
        self.saved_state: dict[str, Any] = {}

    def __enter__(self) -> SeedWatch:
        self.saved = (torch.manual_seed, torch.random.manual_seed)
        torch.manual_seed = torch.random.manual_seed = self._manual_seed
        for name in _STATE_FUNCTIONS:
            self.saved_state[name] = original = getattr(torch.random, name)
            watched = self._watched(name, original)
            setattr(torch, name, watched)
            setattr(torch.random, name, watched)
        # torch leaves it unannotated; it returns the mode itself.
        return cast(SeedWatch, super().__enter__())  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: Any) -> None:
        torch.manual_seed, torch.random.manual_seed = self.saved
        for name, original in self.saved_state.items():
            setattr(torch, name, original)
            setattr(torch.random, name, original)
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def _watched(self, name: str, original: Any) -> Any:
        """``original``, noting where the user's code (or ``fork_rng`` on its behalf) calls
        it; torch's own calls (activation checkpointing saves the state) are its business."""

        def watched(*args: Any, **kwargs: Any) -> Any:
            if self.state_use is None and (where := _user_caller()) is not None:
                self.state_use = f"torch.{name} at {where}"
            return original(*args, **kwargs)

        return watched

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
        """The seed the driver sets before each call; refuses one it cannot replay, and
        a generator state fn reads or sets."""
        if self.state_use is not None:
            raise PrecompileError(
                f"fn uses the random generator's state ({self.state_use}). An artifact draws "
                "from the generator as it stands at each call, in the order the trace drew; "
                "a state fn saves, restores (fork_rng, set_rng_state) or reads (initial_seed) "
                "cannot be replayed. Do that outside fn, around the call."
            )
        if self.late is not None:
            raise PrecompileError(
                f"fn sets the random seed at {self.late}, after it drew random numbers. An "
                "artifact sets a seed fn sets before its first random draw, before the graph "
                "runs; a seed set between draws cannot be replayed. Set it before fn's first "
                "random operation, or outside fn."
            )
        return self.seed


# The default generator's state as torch.random (and torch) offer it.
_STATE_FUNCTIONS = ("get_rng_state", "set_rng_state", "initial_seed", "seed")
_TORCH_RANDOM = torch.random.__file__
_SKIPPED = (TORCH_ROOT, PACKAGE_ROOT)


def _user_caller() -> str | None:
    """Where the user's code called a watched function, directly or through ``fork_rng`` (a
    context manager, so through ``contextlib`` too); None for torch's own calls."""
    here = inspect.currentframe()  # _user_caller, then watched, then its caller
    frame: FrameType | None = here.f_back.f_back if here and here.f_back else None
    while frame is not None and frame.f_code.co_filename in (_TORCH_RANDOM, contextlib.__file__):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_SKIPPED):
        return None
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"


class PythonDraws:
    """While active (``with``), notes whether fn draws from a generator outside torch: Python's
    global ``random`` generator, NumPy's global one, a ``random.Random`` object the user's
    code draws from, or a NumPy ``Generator`` or ``RandomState`` object that existed before the
    trace (held in a global, a closure or a module). Eager fn draws anew at every call; the
    graph would repeat the capture's numbers. (Global states are compared before and after:
    watching every call would slow the trace by half.)"""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.before: tuple[Any, Any] = (None, None)
        self.objects: list[tuple[Any, Any]] = []
        self.own: dict[str, str] = {}  # where the user's code drew from a random.Random
        self.made: set[int] = set()  # random.Random objects made while traced

    def __enter__(self) -> PythonDraws:
        self.before = (random.getstate(), _numpy_state())
        self.objects = [(g, _state_of(g)) for g in _numpy_generators()]
        RANDOM_OBJECT_DRAWS.enter(self)
        return self

    def made_generator(self, generator: random.Random) -> None:
        """A generator made inside fn draws the same numbers at every call, as the graph."""
        self.made.add(id(generator))

    def drew(self, generator: random.Random, where: str) -> None:
        if id(generator) not in self.made:
            self.own.setdefault("random.Random", where)

    def __exit__(self, *exc: object) -> None:
        RANDOM_OBJECT_DRAWS.exit(self)
        self.made.clear()
        python_before, numpy_before = self.before
        if random.getstate() != python_before:
            self.found.append("Python's random module (random.random, random.randint, ...)")
        numpy_after = _numpy_state()
        if numpy_before is not None and not _same_numpy_state(numpy_before, numpy_after):
            self.found.append("NumPy's global random generator (numpy.random.rand, ...)")
        self.found.extend(f"a {kind} object ({where})" for kind, where in self.own.items())
        kinds = {_kind(g) for g, state in self.objects if not _same_state(state, _state_of(g))}
        self.found.extend(f"a {kind} object of its own" for kind in sorted(kinds))
        self.objects = []

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


def _patch_random_objects() -> Callable[[], None]:
    """Every ``random.Random`` draw goes through ``random`` or ``getrandbits`` (``randint``,
    ``choice``, ``uniform``, ``shuffle`` call them): wrap both on the class while a trace runs,
    and ``__init__``, to know the generators made meanwhile; return what undoes it. (Python's
    global generator is compared by state instead.)"""
    original_init = random.Random.__init__

    def init(generator: random.Random, *args: Any, **kwargs: Any) -> None:
        listener = RANDOM_OBJECT_DRAWS.innermost()
        if listener is not None:
            listener.made_generator(generator)
        original_init(generator, *args, **kwargs)

    for name in _DRAWS:
        setattr(random.Random, name, _reporting(getattr(random.Random, name)))
    random.Random.__init__ = init  # type: ignore[method-assign,assignment]

    def undo() -> None:
        for name in _DRAWS:
            delattr(random.Random, name)
        random.Random.__init__ = original_init  # type: ignore[method-assign]

    return undo


_DRAWS = ("random", "getrandbits")
# The generator behind the random module's functions.
_GLOBAL_RANDOM = random.random.__self__  # type: ignore[attr-defined]
_RANDOM_MODULE = random.__file__


def _reporting(draw: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(draw)
    def reported(generator: random.Random, *args: Any) -> Any:
        listener = RANDOM_OBJECT_DRAWS.innermost()
        if listener is not None and generator is not _GLOBAL_RANDOM:
            frame = inspect.currentframe()
            frame = frame.f_back if frame else None
            while frame is not None and frame.f_code.co_filename == _RANDOM_MODULE:
                frame = frame.f_back  # randint, choice, ...: to the code that called them
            # The user's own code: the standard library (tempfile's names), torch and the
            # libraries it uses (sympy) draw for their own purposes, not for the graph.
            if frame is not None and users_file(frame.f_code.co_filename):
                code = frame.f_code
                where = f"{Path(code.co_filename).name}:{frame.f_lineno} ({code.co_name})"
                listener.drew(generator, where)
        return draw(generator, *args)

    return reported


RANDOM_OBJECT_DRAWS: Listeners[PythonDraws] = Listeners(_patch_random_objects)


def _numpy_generators() -> list[Any]:
    """Every NumPy ``Generator`` and ``RandomState`` object the process holds, but the global
    one (compared on its own, with a message of its own). Their methods cannot be wrapped, so
    the collector's objects are scanned: a few tens of milliseconds per capture."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return []
    classes = (numpy.random.Generator, numpy.random.RandomState)
    shared = numpy.random.rand.__self__  # the generator behind numpy.random's functions
    # type(), not isinstance(): some objects answer __class__ with a property that warns.
    return [g for g in gc.get_objects() if issubclass(type(g), classes) and g is not shared]


def _state_of(generator: Any) -> Any:
    if hasattr(generator, "bit_generator"):  # numpy.random.Generator
        return generator.bit_generator.state
    return generator.get_state()  # numpy.random.RandomState


def _same_state(before: Any, after: Any) -> bool:
    if isinstance(before, tuple):  # RandomState: holds an array
        return _same_numpy_state(before, after)
    return bool(before == after)


def _kind(generator: Any) -> str:
    return f"NumPy {type(generator).__name__}"
