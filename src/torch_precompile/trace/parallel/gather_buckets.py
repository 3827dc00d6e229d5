"""One all-gather per FSDP2 param group, and one reduce-scatter of its gradients.

FSDP2 gathers a group's parameters as one flat buffer: each rank's shards side by side in one
row, rows gathered, each parameter copied out of its columns. Its gradients go back the same
way, into one reduce-scatter. A precompiled step does the same where every parameter is an even
dim-0 shard over the data-parallel mesh dim (``Shard(0)``, or ``_StridedShard(0)`` under
tensor parallelism), as an autograd function whose backward is that reduce-scatter;
collectives are few and large instead of one per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_precompile.internals.distributed import all_gather_rows, reduce_scatter_sum
from torch_precompile.internals.fsdp import ShardedGroup

_TensorParallel = tuple[Any, tuple[Any, ...], torch.Size, tuple[int, ...]]


@dataclass(frozen=True)
class Bucket:
    """A param group gathered as one buffer: the data-parallel process group, dtypes and
    scale, and on a (dp, tp) mesh each parameter's DTensor on ``tp`` (None for one that
    ``fully_shard`` put on the dp mesh alone, such as a norm's weight beside tensor-parallel
    projections)."""

    process_group: Any
    size: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    scale: float
    tensor_parallel: tuple[_TensorParallel | None, ...] = ()


def bucket_of(group: ShardedGroup, leaves: Sequence[Any]) -> Bucket | None:
    """The group's bucket, or None where a parameter is not an even dim-0 shard over one
    data-parallel process group (those are gathered one by one, as DTensors). On a (dp, tp)
    mesh the shards gathered over dp make the parameter's tensor-parallel local tensor."""
    size = group.mesh.size()
    process_groups = {
        mesh.get_group(0).group_name: mesh.get_group(0)
        for mesh in {leaf.device_mesh for leaf in leaves}
    }
    if len(process_groups) != 1:
        return None
    tensor_parallel: list[_TensorParallel | None] = []
    for leaf in leaves:
        mesh = leaf.device_mesh
        first, *rest = leaf.placements
        if type(first).__name__ not in ("Shard", "_StridedShard") or first.dim != 0:
            return None
        splits = size * math.prod(
            mesh.size(d + 1) for d, p in enumerate(rest) if getattr(p, "dim", None) == 0
        )
        if leaf.shape[0] % splits:
            return None
        tensor_parallel.append(
            (mesh[mesh.mesh_dim_names[1]], tuple(rest), leaf.shape, leaf.stride()) if rest else None
        )
    return Bucket(
        next(iter(process_groups.values())),
        size,
        group.param_dtype,
        group.reduce_dtype,
        1.0 / (group.divide_factor or size),
        tuple(tensor_parallel) if any(tensor_parallel) else (),
    )


def gather(
    bucket: Bucket, shards: Sequence[torch.Tensor], differentiable: bool
) -> tuple[torch.Tensor, ...]:
    """Each parameter in full (a DTensor on ``tp`` under tensor parallelism), from this
    rank's local ``shards`` (of the parameters' dtype)."""
    if differentiable:
        # torch leaves Function.apply unannotated.
        fulls = _GatherBucket.apply(bucket, *shards)  # type: ignore[no-untyped-call]
    else:
        with torch.no_grad():
            fulls = _gathered(bucket, shards)
    if not bucket.tensor_parallel:
        return tuple(fulls)
    from torch.distributed.tensor import DTensor

    return tuple(
        full
        if on_tp is None
        else DTensor.from_local(
            full, on_tp[0], on_tp[1], run_check=False, shape=on_tp[2], stride=on_tp[3]
        )
        for full, on_tp in zip(fulls, bucket.tensor_parallel, strict=True)
    )


def _gathered(bucket: Bucket, shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    dtype = bucket.param_dtype
    flat = torch.cat([(s if dtype is None else s.to(dtype)).reshape(-1) for s in shards])
    rows = all_gather_rows(flat, bucket.process_group)
    fulls, start = [], 0
    for shard in shards:
        piece = rows[:, start : start + shard.numel()]
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
        rows = [
            (
                torch.zeros((bucket.size * shape[0], *shape[1:]), dtype=dtype)
                if grad is None
                else grad.to(dtype)
            ).reshape(bucket.size, -1)
            for grad, shape in zip(grads, ctx.shapes, strict=True)
        ]
        reduced = reduce_scatter_sum(torch.cat(rows, dim=1) * bucket.scale, bucket.process_group)
        out, start = [], 0
        for shape, param_dtype in zip(ctx.shapes, ctx.dtypes, strict=True):
            count = shape.numel()
            out.append(reduced[start : start + count].view(shape).to(param_dtype))
            start += count
        return (None, *out)
