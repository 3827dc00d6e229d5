"""Torch internals for distributed captures: DTensor, device meshes, collectives' group names."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.fx

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs

__all__ = [
    "DataParallelOptions",
    "all_gather_rows",
    "all_reduce_sum",
    "broadcast_from",
    "collective_group_names",
    "data_parallel_options",
    "is_dtensor",
    "non_functional_collectives",
    "pretend_coordinate",
    "reduce_scatter_sum",
    "sharding_wrapper",
]

_FUNCTIONAL_NAMESPACE = "_c10d_functional"


def is_dtensor(tensor: Any) -> TypeIs[DTensor]:
    """Whether ``tensor`` is a DTensor (without importing DTensor where nobody did)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def collective_group_names(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, int, str]]:
    """Every functional collective's process-group argument: (node, position, group name)."""
    found = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != (
            _FUNCTIONAL_NAMESPACE
        ):
            continue
        for position, argument in enumerate(target._schema.arguments):
            if argument.name == "group_name" and position < len(node.args):
                found.append((node, position, str(node.args[position])))
    return found


def non_functional_collectives(gm: torch.fx.GraphModule) -> list[str]:
    """Collectives of the in-place ``c10d`` namespace (``dist.all_reduce`` and friends)."""
    return sorted(
        {
            str(node.target)
            for node in gm.graph.nodes
            if node.op == "call_function" and getattr(node.target, "namespace", None) == "c10d"
        }
    )


@contextlib.contextmanager
def pretend_coordinate(meshes: list[Any], coordinates: list[list[int]]) -> Iterator[None]:
    """Let each mesh report another coordinate for this rank while tracing.

    DTensor reads the rank's coordinate when it slices a replicated tensor into shards; a
    trace under another coordinate shows whether the graph depends on it.
    """
    saved = [mesh._coordinate_on_dim for mesh in meshes]
    try:
        for mesh, coordinate, kept in zip(meshes, coordinates, saved, strict=True):
            mesh._coordinate_on_dim = type(kept)(coordinate)  # a list or a tuple by release
        yield
    finally:
        for mesh, coordinate in zip(meshes, saved, strict=True):
            mesh._coordinate_on_dim = coordinate


def sharding_wrapper(module: torch.nn.Module) -> str | None:
    """The data-parallel wrapper that ``module`` or a submodule is, if any, by its API name."""
    if "torch.nn.parallel" in sys.modules and isinstance(
        module, torch.nn.parallel.DistributedDataParallel
    ):
        return "DistributedDataParallel"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for sub in module.modules():
        if fsdp is not None and isinstance(sub, getattr(fsdp, "FSDPModule", ())):
            return "fully_shard"
        if fsdp is not None and isinstance(sub, getattr(fsdp, "FullyShardedDataParallel", ())):
            return "FullyShardedDataParallel"
    return None


@dataclass(frozen=True)
class DataParallelOptions:
    """What a DistributedDataParallel was built with, as far as its communication goes."""

    find_unused_parameters: bool
    static_graph: bool
    comm_hook: bool  # register_comm_hook, or the python reducer
    mixed_precision: bool
    ignored_parameters: bool
    join: bool  # inside the Join context manager (uneven inputs)
    delayed_all_reduce: bool
    buffer_hook: bool


def data_parallel_options(ddp: Any) -> DataParallelOptions:
    """Read off DDP's attributes (several private, which is why this lives here)."""
    return DataParallelOptions(
        find_unused_parameters=bool(ddp.find_unused_parameters),
        static_graph=bool(ddp.static_graph),
        comm_hook=bool(getattr(ddp, "_comm_hooks", ()))
        or bool(getattr(ddp, "_use_python_reducer", False)),
        mixed_precision=getattr(ddp, "mixed_precision", None) is not None,
        ignored_parameters=bool(getattr(ddp, "parameters_to_ignore", ())),
        join=bool(getattr(getattr(ddp, "_join_config", None), "enable", False)),
        delayed_all_reduce=bool(getattr(ddp, "_delay_all_reduce_all_params", False)),
        buffer_hook=hasattr(ddp, "buffer_hook"),
    )


def all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """A functional (traceable) all_reduce summing over ``group``."""
    from torch.distributed import _functional_collectives as funcol

    return cast(torch.Tensor, funcol.all_reduce(tensor, "sum", group))


def broadcast_from(tensor: torch.Tensor, src: int, group: Any) -> torch.Tensor:
    """A functional (traceable) broadcast from group rank ``src``."""
    from torch.distributed import _functional_collectives as funcol

    return cast(torch.Tensor, funcol.broadcast(tensor, src, group))


def all_gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """A functional all-gather of a 1-D tensor: (group size, numel), rank r's in row r."""
    from torch.distributed import _functional_collectives as funcol

    size = group.size()
    # The *_single names replace *_tensor, which warn as deprecated where both exist.
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return gather(tensor, 0, group).view(size, -1)


def reduce_scatter_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """A functional reduce-scatter of a (group size, n) tensor: the sum of the ranks' row r
    on rank r."""
    from torch.distributed import _functional_collectives as funcol

    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return cast(torch.Tensor, scatter(tensor.reshape(-1), "sum", 0, group))
