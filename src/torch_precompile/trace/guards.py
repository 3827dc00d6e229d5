"""Value guards: a trace that reads tensor values into Python must re-check them at every call.

A non-strict trace follows the path the example took. Where ``fn`` turns a tensor into a
Python value (``bool(t)``, ``t.item()``, ``torch.equal``) or calls an operator whose output
size depends on values (``nonzero``, boolean-mask indexing), the trace bakes that decision.
Each such read becomes a guard: a tensor the graph also returns, and the value it had at
capture. The driver compares them after every call, so a call that would have taken another
path fails loudly instead of returning a result computed along the captured one.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import TorchDispatchMode

aten = torch.ops.aten
_SKIPPED_ROOTS = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))


@dataclass(frozen=True)
class Guard:
    tensor: torch.Tensor  # a tensor of the trace, returned by the graph as an extra output
    expected: bool | int | float
    description: str


class GuardRecorder(TorchDispatchMode):
    """Pushed inside the trace, above make_fx's proxy mode: sees each op before it is traced."""

    # Control-flow operators pass straight through; capture rejects them afterwards.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.guards: list[Guard] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._local_scalar_dense.default or func is aten.item.default:
            self._add(args[0], out, "a tensor value read into Python (bool(), .item(), int())")
        elif func is aten.is_nonzero.default:
            self._add(args[0] != 0, out, "a tensor's truth value (if tensor:, bool(tensor))")
        elif func is aten.equal.default:
            if args[0].shape == args[1].shape:
                self._add((args[0] == args[1]).all(), out, "torch.equal")
        elif torch.Tag.dynamic_output_shape in getattr(func, "tags", ()):
            self._guard_output_size(func, args, kwargs, out)
        return out

    def _add(self, tensor: torch.Tensor, value: Any, what: str) -> None:
        self.guards.append(Guard(tensor.detach(), value, f"{what} at {_user_location()}"))

    def _guard_output_size(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        where = f"in {func}"
        if func is aten.index.Tensor:
            masks = [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
            for mask in masks:
                self._add((mask != 0).sum(), int((mask != 0).sum()),
                          f"the number of True entries of a boolean index, {where}")
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


def _user_location() -> str:
    """The innermost frame outside torch and this package: where fn's code made the read."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_SKIPPED_ROOTS):
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "an unknown location"
