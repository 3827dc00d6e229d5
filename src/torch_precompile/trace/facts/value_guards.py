"""Value guards: a trace that reads tensor values into Python must re-check them at every call.

A non-strict trace follows the path the example took. Where ``fn`` turns a tensor into a
Python value (``bool(t)``, ``t.item()``, ``torch.equal``, ``torch.allclose``, ``t.tolist()``,
``t.numpy()``) or calls an operator whose output size depends on values (``nonzero``,
boolean-mask indexing, ``pack_padded_sequence``), the trace bakes that decision. Each such read
becomes a guard: a tensor the graph also returns, and the value it had at capture. The driver
compares them after every call, so a call that would have taken another path fails loudly
instead of returning a result computed along the captured one.
"""

from __future__ import annotations

import functools
import itertools
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import FakeTensor, TorchDispatchMode
from torch_precompile.trace.checks import MAX_LITERAL_ELEMENTS
from torch_precompile.trace.facts.code_homes import PACKAGE_ROOT, TORCH_ROOT
from torch_precompile.trace.facts.listening import Listeners, wrap_tensor_methods

aten = torch.ops.aten
_SKIPPED_ROOTS = (TORCH_ROOT, PACKAGE_ROOT)


@dataclass(frozen=True)
class Guard:
    tensor: torch.Tensor  # a tensor of the trace, returned by the graph as an extra output
    expected: bool | int | float
    description: str


class GuardRecorder(TorchDispatchMode):
    """Pushed inside the trace, above make_fx's proxy mode: sees each op before it is traced.

    While it is entered, ``Tensor.tolist`` and ``Tensor.numpy`` (which read the data in C++,
    never reaching a dispatch mode) are patched to report their reads to it.
    """

    # Control-flow operators pass straight through; capture rejects them afterwards.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.guards: list[Guard] = []
        self._ops_seen = 0  # dispatches this recorder received: tells a live read from print's
        self._depth = 0  # > 0 while an operator is being dispatched (reads there are torch's)
        self._fixed: list[torch.Tensor] = []  # batch sizes of packings: fixed by a guard

    def __enter__(self) -> GuardRecorder:
        super().__enter__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        try:
            _READS.enter(self)
        except BaseException:
            super().__exit__(None, None, None)  # type: ignore[no-untyped-call]  # unannotated
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _READS.exit(self)
        finally:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self._ops_seen += 1
        self._depth += 1
        try:
            return self._dispatch(func, args, kwargs)
        finally:
            self._depth -= 1

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        if func is aten._pack_padded_sequence.default and not _is_fake(args[1]):
            return self._pack_padded_sequence(func, *args, **kwargs)
        out = func(*args, **kwargs)
        if func is aten._local_scalar_dense.default or func is aten.item.default:
            if not self._is_fixed(args[0]):
                self._add(args[0], out, "a tensor value read into Python (bool(), .item(), int())")
        elif func is aten.is_nonzero.default:
            self._add(args[0] != 0, out, "a tensor's truth value (if tensor:, bool(tensor))")
        elif func is aten.equal.default:
            if args[0].shape == args[1].shape:
                self._add((args[0] == args[1]).all(), out, "torch.equal")
        elif func is aten.allclose.default:  # compares in C++, below any mode
            self._add(aten.isclose.default(*args, **kwargs).all(), out, "torch.allclose")
        elif torch.Tag.dynamic_output_shape in getattr(func, "tags", ()):
            self._guard_output_size(func, args, kwargs, out)
        return out

    def _add(self, tensor: torch.Tensor, value: Any, what: str, after: str = "") -> None:
        self.guards.append(Guard(tensor.detach(), value, f"{what} at {_user_location()}{after}"))

    def record_read(self, tensor: torch.Tensor, method: str) -> None:
        """Guard the values ``tensor.<method>()`` just read, unless torch itself read them
        (inside an operator, or with the modes switched off, as printing a tensor does)."""
        if self._depth or tensor.numel() == 0 or _is_fake(tensor) or self._is_fixed(tensor):
            return
        seen = self._ops_seen
        try:
            if tensor.numel() == 1 and not tensor.is_complex():
                guard = tensor.detach().reshape(())
                # A 0-dim tensor's .tolist() is one number (torch's stub says a list).
                expected = cast("bool | int | float", _TOLIST(guard))
                what, after = f"the value of a tensor read with .{method}()", ""
            else:
                guard, expected = _equals_captured(tensor, method), True
                what = f"whether the values of a tensor read with .{method}()"
                after = " equal those at capture"
        except PrecompileError:
            raise
        except Exception as e:  # a tensor subclass that cannot be compared with a literal
            raise PrecompileError(
                f"fn reads the values of a {type(tensor).__name__} with .{method}() at "
                f"{_user_location()}, and precompile cannot check them at every call "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Keep the "
                "computation on tensors, or move the read out of fn."
            ) from e
        if self._ops_seen != seen:  # the comparison was traced: the read was fn's
            self._add(guard, expected, what, after)

    def _pack_padded_sequence(
        self, func: Any, data: torch.Tensor, lengths: torch.Tensor, batch_first: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packing as fixed-index operations, with the lengths it was built for guarded.

        The operator reads ``lengths`` in C++ and its outputs' sizes follow them, so the
        graph can hold it only for those lengths (and Inductor cannot lower it at all).
        """
        values = _TOLIST(lengths) if lengths.dim() == 1 else []
        if values:
            shown = f" ({values})" if len(values) <= 16 else ""
            self._add(
                (lengths == torch.tensor(values, dtype=lengths.dtype)).all(),
                True,
                "whether the lengths given to pack_padded_sequence (aten._pack_padded_sequence)",
                f" equal those at capture{shown}",
            )
        if not _packable(data, lengths, values, batch_first):
            # raises the operator's own error
            return cast("tuple[torch.Tensor, torch.Tensor]", func(data, lengths, batch_first))
        steps = data.transpose(0, 1) if batch_first else data  # (time, batch, *features)
        width = steps.shape[1]
        sizes = [sum(1 for n in values if n > t) for t in range(values[0])]
        rows = [t * width + b for t, size in enumerate(sizes) for b in range(size)]
        flat = steps.reshape(steps.shape[0] * width, *steps.shape[2:])
        packed = flat.index_select(0, torch.tensor(rows, device=data.device))
        batch_sizes = torch.tensor(sizes, dtype=torch.int64)
        self._fixed.append(batch_sizes)  # the RNN reads batch_sizes[0]: no guard of its own
        return packed, batch_sizes

    def _is_fixed(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views the batch sizes of a packing, which the lengths' guard
        already fixes."""
        if (
            not self._fixed
            or tensor.device.type != "cpu"
            or tensor.layout is not torch.strided
            or _is_fake(tensor)
        ):
            return False
        address = tensor.untyped_storage().data_ptr()
        return any(address == f.untyped_storage().data_ptr() for f in self._fixed)

    def _guard_output_size(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        where = f"in {func}"
        if func is aten.index.Tensor:
            masks = [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
            for mask in masks:
                self._add(
                    (mask != 0).sum(),
                    int((mask != 0).sum()),
                    f"the number of True entries of a boolean index, {where}",
                )
            return
        if func is aten.nonzero.default:
            self._add((args[0] != 0).sum(), out.shape[0], f"the number of nonzero entries, {where}")
            return
        if func is aten.masked_select.default:
            mask = args[1].expand(torch.broadcast_shapes(args[0].shape, args[1].shape))
            self._add(mask.sum(), out.numel(), f"the number of selected entries, {where}")
            return
        raise PrecompileError(
            f"fn calls {func} at {_user_location()}, whose output size depends on tensor values; "
            "a precompiled graph has fixed sizes and cannot check this one. Express it with "
            "fixed-size operations (torch.where, masked arithmetic) or move it out of fn."
        )


def _equals_captured(tensor: torch.Tensor, method: str) -> torch.Tensor:
    """A traced 0-dim bool: whether ``tensor`` holds the values it holds now (NaN equal to
    NaN), compared with a literal built inside the trace."""
    real = torch.view_as_real(tensor.detach()) if tensor.is_complex() else tensor.detach()
    if real.numel() > MAX_LITERAL_ELEMENTS:
        raise PrecompileError(
            f"fn reads {real.numel()} values of a tensor with .{method}() at "
            f"{_user_location()}; the artifact would bake them all and has to check them at "
            f"every call, which it does for at most {MAX_LITERAL_ELEMENTS}. Keep the "
            "computation on tensors (torch operations instead of Python lists), or move the "
            "read out of fn."
        )
    values = _flat(_TOLIST(real))
    if not real.is_floating_point():
        captured = torch.tensor(values, dtype=real.dtype, device=real.device)
        return (real == captured.reshape(real.shape)).all()
    # The literal holds finite values only (the artifact writes literals as source); the
    # others are put in by the graph, where nan and inf are named constants.
    finite = [v if math.isfinite(v) else 0.0 for v in values]
    captured = torch.tensor(finite, dtype=real.dtype, device=real.device).reshape(real.shape)
    for special in (math.inf, -math.inf, math.nan):
        at = [v == special or (math.isnan(v) and math.isnan(special)) for v in values]
        if any(at):
            mask = torch.tensor(at, device=real.device).reshape(real.shape)
            captured = torch.where(mask, special, captured)
    return ((real == captured) | (real.isnan() & captured.isnan())).all()


def _flat(values: Any) -> list[Any]:
    """The numbers of a nested list (as ``tolist`` returns), in order."""
    if not isinstance(values, list):
        return [values]
    return [v for item in values for v in _flat(item)]


def _packable(
    data: torch.Tensor, lengths: torch.Tensor, values: list[int], batch_first: bool
) -> bool:
    """Whether ``aten._pack_padded_sequence`` accepts these arguments: lengths a 1-D CPU int64
    tensor, one per sequence, decreasing, positive, none beyond the padded length."""
    if (
        data.dim() < 2
        or data.numel() == 0
        or lengths.dtype != torch.int64
        or lengths.device.type != "cpu"
        or not values
    ):
        return False
    time, batch = (data.shape[1], data.shape[0]) if batch_first else data.shape[:2]
    return (
        len(values) == batch
        and values[-1] > 0
        and values[0] <= time
        and all(later <= earlier for earlier, later in itertools.pairwise(values))
    )


def _is_fake(tensor: Any) -> bool:
    return isinstance(tensor, FakeTensor)


_VALUE_METHODS = ("tolist", "numpy")


def _patch_value_reads() -> Callable[[], None]:
    """Wrap ``Tensor.tolist`` and ``Tensor.numpy`` so that a read reports to this thread's
    innermost recorder; return what undoes it."""
    return wrap_tensor_methods(_VALUE_METHODS, _reporting)


def _reporting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder, local = _READS.innermost(), _READS.local
        if recorder is None or getattr(local, "reading", False):
            # A torch function mode hands the call back here, and so does the guard's own
            # read: only the outermost read is fn's.
            return original(tensor, *args, **kwargs)
        local.reading = True
        try:
            value = original(tensor, *args, **kwargs)
            if isinstance(tensor, torch.Tensor):
                recorder.record_read(tensor, name)
        finally:
            local.reading = False
        return value

    return read


_READS: Listeners[GuardRecorder] = Listeners(_patch_value_reads)
_TOLIST = torch.Tensor.tolist  # reads the data without dispatch (and without the patch)


def _user_location() -> str:
    """The innermost frame outside torch and this package: where fn's code made the read."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_SKIPPED_ROOTS):
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "an unknown location"
