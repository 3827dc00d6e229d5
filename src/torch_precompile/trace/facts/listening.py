"""A process-wide patch that reports to per-thread listeners.

Capture watches a few things by wrapping them for as long as a trace runs (``Tensor.tolist``,
``os.environ``'s ``__getitem__``). Traces may run in several threads at once: the patch is
applied while any thread listens and undone when the last stops, and a patched function
reports to its own thread's innermost listener, so other threads only pay a lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import torch

Listener = TypeVar("Listener")


class Listeners(Generic[Listener]):
    """``patch`` applies the wrapping and returns what undoes it."""

    def __init__(self, patch: Callable[[], Callable[[], None]]) -> None:
        self._patch = patch
        self._lock = threading.Lock()
        self._users = 0
        self._undo: Callable[[], None] | None = None
        self.local = threading.local()  # per-thread state a patched function may keep

    def enter(self, listener: Listener) -> None:
        with self._lock:
            if self._users == 0:
                self._undo = self._patch()
            self._users += 1
        self._stack().append(listener)

    def exit(self, listener: Listener) -> None:
        stack = self._stack()
        if listener in stack:
            del stack[len(stack) - 1 - stack[::-1].index(listener)]
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._undo is not None:
                self._undo()
                self._undo = None

    def innermost(self) -> Listener | None:
        """This thread's innermost listener; None where it has none."""
        stack = self._stack()
        return stack[-1] if stack else None

    def _stack(self) -> list[Listener]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        stack: list[Listener] = self.local.stack
        return stack


def wrap_tensor_methods(
    names: Iterable[str], wrapped: Callable[[str, Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Set ``wrapped(name, original)`` as each method ``name`` of ``torch.Tensor`` (a patch
    for ``Listeners``); return what puts the originals back (a method torch.Tensor inherits
    is deleted again rather than set)."""
    saved = {name: (name in vars(torch.Tensor), getattr(torch.Tensor, name)) for name in names}
    for name, (_, original) in saved.items():
        setattr(torch.Tensor, name, wrapped(name, original))

    def undo() -> None:
        for name, (own, original) in saved.items():
            if own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)

    return undo
