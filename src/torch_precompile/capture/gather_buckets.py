"""One all-gather per FSDP2 param group, and one reduce-scatter of its gradients.

FSDP2 gathers a group's parameters as one flat buffer: each rank's shards side by side in one
row, rows gathered, each parameter copied out of its columns. Its gradients go back the same
way, into one reduce-scatter. A precompiled step does the same where every parameter is an even
``Shard(0)`` of one 1-D mesh, as an autograd function whose backward is that reduce-scatter;
collectives are few and large instead of one per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_precompile.internals.distributed import all_gather_rows, reduce_scatter_sum
from torch_precompile.internals.fsdp import ShardedGroup


@dataclass(frozen=True)
class Bucket:
    """A param group gathered as one buffer: its mesh's process group, dtypes and scale."""

    process_group: Any
    size: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    scale: float


def bucket_of(group: ShardedGroup, leaves: Sequence[Any]) -> Bucket | None:
    """The group's bucket, or None where a parameter is not an even ``Shard(0)`` of the
    group's 1-D mesh (those are gathered one by one, as DTensors)."""
    size = group.mesh.size()
    for leaf in leaves:
        placements = [type(p).__name__ + str(getattr(p, "dim", "")) for p in leaf.placements]
        if placements != ["Shard0"] or leaf.shape[0] % size or leaf.device_mesh != group.mesh:
            return None
    return Bucket(group.mesh.get_group(), size, group.param_dtype, group.reduce_dtype,
                  1.0 / (group.divide_factor or size))


def gather(bucket: Bucket, shards: Sequence[torch.Tensor], differentiable: bool
           ) -> tuple[torch.Tensor, ...]:
    """Each parameter in full, from this rank's local ``shards`` (of the parameters' dtype)."""
    if differentiable:
        return _GatherBucket.apply(bucket, *shards)
    with torch.no_grad():
        return _gathered(bucket, shards)


def _gathered(bucket: Bucket, shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    dtype = bucket.param_dtype
    flat = torch.cat([(s if dtype is None else s.to(dtype)).reshape(-1) for s in shards])
    rows = all_gather_rows(flat, bucket.process_group)
    fulls, start = [], 0
    for shard in shards:
        piece = rows[:, start:start + shard.numel()]
        fulls.append(piece.reshape(bucket.size * shard.shape[0], *shard.shape[1:]))
        start += shard.numel()
    return tuple(fulls)


class _GatherBucket(torch.autograd.Function):
    """Forward: all-gather the group's shards. Backward: reduce-scatter its gradients (scaled,
    in the reduce dtype) back to shards of the parameters' dtype."""

    @staticmethod
    def forward(ctx: Any, bucket: Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        ctx.shapes = [s.shape for s in shards]
        ctx.dtypes = [s.dtype for s in shards]
        return _gathered(bucket, shards)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        bucket = ctx.bucket
        dtype = bucket.reduce_dtype or bucket.param_dtype or ctx.dtypes[0]
        rows = [(torch.zeros((bucket.size * shape[0], *shape[1:]), dtype=dtype)
                 if grad is None else grad.to(dtype)).reshape(bucket.size, -1)
                for grad, shape in zip(grads, ctx.shapes, strict=True)]
        reduced = reduce_scatter_sum(torch.cat(rows, dim=1) * bucket.scale,
                                     bucket.process_group)
        out, start = [], 0
        for shape, param_dtype in zip(ctx.shapes, ctx.dtypes, strict=True):
            count = shape.numel()
            out.append(reduced[start:start + count].view(shape).to(param_dtype))
            start += count
        return (None, *out)
