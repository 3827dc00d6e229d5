"""What fn's Python reads of an input tensor's layout and flags (``x.is_contiguous()``,
``x.stride()``, ``x.storage_offset()``, ``x.is_inference()``, ``x.is_neg()``): each answer
decides fn's branches once, in the trace, so each becomes a fact the artifact checks at every
call.

The trace runs fn on copies of the inputs laid out as the examples are (strides and offset
alike), so what fn reads is what it would read of the example. A read by torch's own code is
torch's (it makes a layout work, as ``contiguous()`` does) and is not recorded. An address
(``x.data_ptr()``) differs at every call and cannot be checked: a read of it is refused at
capture.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.trace.facts.code_homes import PACKAGE_ROOT, TORCH_ROOT
from torch_precompile.trace.facts.listening import Listeners, wrap_tensor_methods

# Each method fn may read, and the property of the call's tensor the artifact compares.
_PROPERTIES = {
    "is_contiguous": "stride",
    "stride": "stride",
    "storage_offset": "storage_offset",
    "is_inference": "is_inference",
    "is_neg": "is_neg",
    "is_conj": "is_conj",
    "data_ptr": "data_ptr",
}


def property_of(tensor: torch.Tensor, name: str) -> Any:
    """The value of ``name`` (a property of ``_PROPERTIES``) for ``tensor``, as a spec holds it."""
    if name == "stride":
        return tuple(tensor.stride())
    return getattr(tensor, name)()


class TensorReads:
    """While watching, the properties fn's code read of the given tensors: per tensor (by its
    position), each property with the value it had and where it was first read."""

    def __init__(self) -> None:
        self.watched: dict[int, int] = {}  # id of a tensor fn gets: its position
        self.examples: Sequence[Any] = ()  # the caller's examples, by position
        self.found: dict[int, dict[str, tuple[Any, str]]] = {}

    @contextmanager
    def watching(
        self, tensors: Sequence[tuple[int, torch.Tensor]], examples: Sequence[Any]
    ) -> Iterator[None]:
        """Watch ``tensors`` (position, the tensor fn gets: a copy of the one in
        ``examples``, laid out alike, but without an inference or negative bit it may have)."""
        self.watched = {id(t): position for position, t in tensors}
        self.examples = examples
        TENSOR_READS.enter(self)
        try:
            yield
        finally:
            TENSOR_READS.exit(self)
            self.watched = {}

    def read(self, tensor: torch.Tensor, method: str, where: str) -> None:
        name, position = _PROPERTIES[method], self.watched[id(tensor)]
        if tensor.layout is not torch.strided or tensor.is_nested:
            return  # no strides to read (every call's input is checked dense, as at capture)
        traced = property_of(tensor, name)
        if not all(type(v) in (int, bool) for v in (traced if name == "stride" else (traced,))):
            return  # symbolic strides (dims marked dynamic): the shape environment's guards
        reads = self.found.setdefault(position, {})
        flag = name in ("is_inference", "is_neg", "is_conj")  # what a copy does not keep
        if flag and name not in reads and traced != property_of(self.examples[position], name):
            raise PrecompileError(
                f"fn reads {method}() of an input at {where}, and the trace runs fn on a copy "
                f"of the example, where it gives {traced!r}, not {not traced!r}: the artifact "
                "would decide as for the copy. Pass the example as a normal tensor (.clone() "
                "outside torch.inference_mode(), .resolve_neg(), .resolve_conj())."
            )
        reads.setdefault(name, (traced, where))

    def records(self, position: int) -> tuple[tuple[str, Any, str], ...]:
        """The reads of the tensor at ``position``: (property, value, where)."""
        return tuple(
            (name, value, where) for name, (value, where) in self.found.get(position, {}).items()
        )

    def refuse_addresses(self, names: Sequence[str]) -> None:
        """An address read cannot be checked: refuse it, naming the input and the line."""
        for position, reads in self.found.items():
            if "data_ptr" in reads:
                raise PrecompileError(
                    f"fn reads the address of input {names[position]} "
                    f"(data_ptr() at {reads['data_ptr'][1]}): it differs at every call, and "
                    "the artifact would decide as the capture's address did. Decide on "
                    "something the artifact checks (its shape, dtype, strides), outside fn."
                )


def _patch() -> Callable[[], None]:
    """Wrap the methods of ``_PROPERTIES`` on ``torch.Tensor``; return what undoes it."""
    return wrap_tensor_methods(_PROPERTIES, _reporting)


def _reporting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        listener = TENSOR_READS.innermost()
        if listener is not None and id(tensor) in listener.watched:
            where = _users_line()
            if where is not None:
                listener.read(tensor, name, where)
        return original(tensor, *args, **kwargs)

    return read


def _users_line() -> str | None:
    """Where the caller of the wrapped method is, where that is fn's code (the user's or a
    library's); None for torch's own code and this package's."""
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if caller is None or caller.f_code.co_filename.startswith((TORCH_ROOT, PACKAGE_ROOT)):
            return None
        return f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} ({caller.f_code.co_name})"
    finally:
        del frame  # a frame held by a local of its own would keep every local alive till GC


TENSOR_READS: Listeners[TensorReads] = Listeners(_patch)
"""The methods are wrapped while any thread traces; each reports to its thread's innermost
listener."""
