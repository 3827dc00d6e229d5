"""A minimal traceable tensor subclass for the tests (torchao's mechanism, not torchao):
int8 data and a per-row scale, read as their product by every operation.

Its flatten context holds a frozen dataclass with an enum member and a tuple, so the artifact
must write all of those as source. A module of its own, so fresh processes import it too.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten


class Rounding(enum.Enum):
    NEAREST = "nearest"
    DOWN = "down"


@dataclasses.dataclass(frozen=True)
class Blocks:
    size: tuple[int, ...]
    rounding: Rounding = Rounding.NEAREST


class ScaledTensor(torch.Tensor):
    """``qdata * scale`` (row-wise), behaving as that float tensor in every operation."""

    @staticmethod
    def __new__(
        cls,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        blocks: Blocks,
        dtype: torch.dtype = torch.float32,
    ) -> ScaledTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=False
        )

    def __init__(
        self,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        blocks: Blocks,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.qdata, self.scale, self.blocks = qdata, scale, blocks

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["qdata", "scale"], {"blocks": self.blocks, "dtype": self.dtype}

    @classmethod
    def __tensor_unflatten__(
        cls,
        inner: dict[str, torch.Tensor],
        context: dict[str, Any],
        outer_size: Any,
        outer_stride: Any,
    ) -> ScaledTensor:
        return cls(inner["qdata"], inner["scale"], context["blocks"], context["dtype"])

    @classmethod
    def quantize(cls, weight: torch.Tensor, rows: int = 1) -> ScaledTensor:
        """Rows of ``weight`` in groups of ``rows``, each group with one scale."""
        grouped = weight.detach().reshape(-1, rows * weight.shape[-1])
        scale = (grouped.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-8)
        qdata = (grouped / scale).round().clamp(-128, 127).to(torch.int8)
        return cls(qdata.reshape(weight.shape), scale, Blocks((rows, weight.shape[-1])))

    def dequantize(self) -> torch.Tensor:
        rows = self.blocks.size[0]
        grouped = self.qdata.reshape(-1, rows * self.qdata.shape[-1]).to(self.dtype)
        return (grouped * self.scale).reshape(self.qdata.shape)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ScaledTensor(shape={tuple(self.shape)}, blocks={self.blocks})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (aten.detach.default, aten.alias.default):  # nn.Parameter(...) detaches
            self = args[0]
            return cls(self.qdata, self.scale, self.blocks, self.dtype)
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)


def quantized_linear(model: torch.nn.Module, rows: int = 1) -> torch.nn.Module:
    """``model`` with every Linear weight a frozen ScaledTensor parameter."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(
                ScaledTensor.quantize(module.weight, rows), requires_grad=False
            )
    return model
