"""What fn does with the ``.grad`` a call finds on the model's parameters.

The trace starts every parameter with no gradient, and the artifact adds the gradients its
backward computed to whatever ``.grad`` a call finds, as eager's backward would. That holds
only while fn leaves the old gradient alone. Where fn reads it first (``clip_grad_norm_``
after its backward, a gradient norm it returns, ``if p.grad is None``), the trace saw none
and eager sees the old one: such a parameter is recorded as ``"read"`` and a call must come
without one. Where fn drops it first (``model.zero_grad()``, ``opt.zero_grad()``, ``p.grad =
None``), the artifact's gradient must replace the old one: ``"replaced"``. So while fn is
traced, the ``grad`` attribute of tensors is watched.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import CodeType
from typing import Any

import torch

from torch_precompile.internals.tracing import GRAD_ATTRIBUTE
from torch_precompile.trace.facts.code_homes import PACKAGE_ROOT
from torch_precompile.trace.facts.listening import Listeners

_GRAD = GRAD_ATTRIBUTE
# This package's code, and optimizers': an optimizer argument's step and zero_grad have
# checks of their own (a stale .grad refused, unless fn's zero_grad() comes first).
_NOT_FNS = (PACKAGE_ROOT, str(Path(torch.optim.__file__).parent))
# zero_grad reads each .grad only to drop it: that read is a drop, not a read.
_ZERO_GRAD = torch.nn.Module.zero_grad.__code__


class GradUse:
    """Pushed around fn while it is traced: for each parameter (by flat index), whether fn
    read the gradient a call comes with, or dropped it before any read."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}
        self.read: set[int] = set()
        self.replaced: set[int] = set()
        self.settled: set[int] = set()  # from here on, the trace's .grad is eager's

    def watching(self, params: Sequence[torch.Tensor]) -> GradUse:
        """Watch ``params`` (the trace's parameters, by flat index) in the next ``with``."""
        self.index = {id(p): i for i, p in enumerate(params)}
        return self

    def __enter__(self) -> GradUse:
        GRAD_USE.enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        GRAD_USE.exit(self)

    def note(self, tensor: torch.Tensor, code: CodeType, writes: bool) -> None:
        index = self.index.get(id(tensor))
        if index is None or index in self.settled or code.co_filename.startswith(_NOT_FNS):
            return
        self.settled.add(index)
        if writes or code is _ZERO_GRAD:
            self.replaced.add(index)
        else:
            self.read.add(index)

    def old_grad(self, index: int) -> str | None:
        """What the spec says of parameter ``index``'s old gradient (None: fn adds to it)."""
        return "read" if index in self.read else "replaced" if index in self.replaced else None


def _patch() -> Callable[[], None]:
    """Give ``torch.Tensor`` a ``grad`` property that reports to the thread's listener."""

    def get(tensor: torch.Tensor) -> Any:
        with _reported(tensor, writes=False):
            return _GRAD.__get__(tensor, type(tensor))

    def put(tensor: torch.Tensor, value: Any) -> None:
        with _reported(tensor, writes=True):
            _GRAD.__set__(tensor, value)

    def drop(tensor: torch.Tensor) -> None:
        with _reported(tensor, writes=True):
            _GRAD.__delete__(tensor)

    torch.Tensor.grad = property(get, put, drop, _GRAD.__doc__)  # type: ignore[assignment]

    def undo() -> None:
        del torch.Tensor.grad

    return undo


@contextlib.contextmanager
def _reported(tensor: torch.Tensor, writes: bool) -> Iterator[None]:
    """Report one access by the code that made it; the same access as a torch function mode
    passes it on (the property again, from the mode's frame) is not another."""
    local = GRAD_USE.local
    listener = GRAD_USE.innermost()
    if listener is not None and not getattr(local, "inside", False):
        listener.note(tensor, _caller(3), writes)
    outer, local.inside = getattr(local, "inside", False), True
    try:
        yield
    finally:
        local.inside = outer


def _caller(depth: int) -> CodeType:
    """The code ``depth`` frames above the one that calls this."""
    frame = inspect.currentframe()
    for _ in range(depth + 1):
        assert frame is not None and frame.f_back is not None
        frame = frame.f_back
    assert frame is not None
    return frame.f_code


GRAD_USE: Listeners[GradUse] = Listeners(_patch)
"""The property is in place while any thread traces; each reports to its thread's innermost
listener."""
