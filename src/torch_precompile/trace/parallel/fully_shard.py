"""FSDP2 (``fully_shard``) in a capture: each param group gathered where its module runs.

A ``fully_shard`` model's parameters are DTensors sharded ``Shard(0)`` over the data-parallel
mesh, and the graph takes their local shards like any DTensor's. FSDP2's own hooks gather
and reduce with in-place collectives, so while fn is traced they are set aside and the same
schedule is written with DTensor operations instead (as torchtitan's SimpleFSDP does):

- before a sharded module's forward, each of its parameters is ``redistribute``d to
  ``Replicate()`` (an all-gather, in the policy's ``param_dtype``) and the module runs on the
  full tensor; after it, the sharded parameter is back in place;
- the full tensor's gradient is declared ``Partial`` over the mesh and scaled by 1 / world
  size (or ``set_gradient_divide_factor``'s factor), so backward reduce-scatters it (in
  ``reduce_dtype``) into the average over the ranks, a ``Shard(0)`` gradient like FSDP2's;
- with ``reshard_after_forward``, autograd saves no gathered parameter for backward: it
  saves where it came from, and backward gathers it again, so between a module's forward
  and its backward the rank holds only its shards, as FSDP2 does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree
from torch_precompile.internals.distributed import is_dtensor
from torch_precompile.internals.fsdp import (
    ShardedGroup,
    bind_parameter,
    fsdp_groups,
    fsdp_modules,
    view_base,
    without_fsdp_hooks,
)
from torch_precompile.spec import FullyShardedGroup
from torch_precompile.trace.parallel.gather_buckets import bucket_of, gather

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from torch_precompile.trace.parallel.gather_buckets import Bucket


@dataclass(frozen=True)
class FullySharded:
    """The FSDP2 state of a capture's models: every ``fully_shard``-ed module (whose hooks are
    set aside while tracing) and each param group as (model index, module path, group)."""

    modules: tuple[torch.nn.Module, ...] = ()
    groups: tuple[tuple[int, str, ShardedGroup], ...] = ()

    def records(self) -> tuple[FullyShardedGroup, ...]:
        return tuple(
            FullyShardedGroup(
                model=index,
                module="" if path == "(the root)" else path,
                reshard_after_forward=bool(group.reshard_after_forward),
                param_dtype=None if group.param_dtype is None else str(group.param_dtype),
                reduce_dtype=None if group.reduce_dtype is None else str(group.reduce_dtype),
                divide_factor=group.divide_factor,
            )
            for index, path, group in self.groups
        )


def find_fully_sharded(modules: Sequence[torch.nn.Module], names: Sequence[str]) -> FullySharded:
    """Every FSDP2 module and param group; each setting the graph cannot hold is refused by
    name."""
    found = []
    for index, (model, name) in enumerate(zip(modules, names, strict=True)):
        paths = {id(m): path for path, m in model.named_modules()}
        for group in fsdp_groups(model):
            path = paths[id(group.modules[0])] or "(the root)"
            where = f"model argument {name}, module {path}"
            if group.unsupported:
                raise PrecompileError(
                    f"{where} is fully_shard-ed with {group.unsupported[0]}, which a "
                    "precompiled step does not reproduce yet. Shard it with fully_shard's "
                    "defaults (a 1-D mesh, MixedPrecisionPolicy allowed)."
                )
            if not isinstance(group.reshard_after_forward, bool):
                raise PrecompileError(
                    f"{where} reshards after forward to a mesh of {group.reshard_after_forward} "
                    "ranks; precompiled steps reshard fully or not at all "
                    "(reshard_after_forward=True or False)."
                )
            if not group.reduce_grads:
                raise PrecompileError(
                    f"{where} has set_requires_gradient_sync(False): FSDP2 then keeps "
                    "unsharded gradients outside .grad, which an artifact does not hold. "
                    "Precompile the step that syncs, and accumulate by adding the loss of "
                    "several batches inside fn."
                )
            if path == "(the root)" and group.auto_reshard:
                # What fully_shard does at the first forward: the root keeps its parameters.
                group = dataclasses.replace(group, reshard_after_forward=False)
            found.append((index, path, group))
    return FullySharded(tuple(m for model in modules for m in fsdp_modules(model)), tuple(found))


@dataclass(frozen=True)
class _Regather:
    """What autograd saved instead of (a view of) a gathered parameter: how to gather it
    again, and the view's layout (of its local tensor, for a DTensor on ``tp``)."""

    regather: Callable[[], torch.Tensor]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int | torch.SymInt
    dtensor: tuple[Any, tuple[Any, ...], torch.Size, tuple[int, ...]] | None = None


# id(gathered base) -> (that tensor, how to gather it again)
_Gathered = dict[int, tuple[torch.Tensor, Callable[[], torch.Tensor]]]
_Leaves = list[tuple[torch.nn.Module, str, Any]]


@contextlib.contextmanager
def tracing(
    found: FullySharded, originals: Sequence[torch.Tensor], flat: Sequence[torch.Tensor]
) -> Iterator[None]:
    """While fn is traced: FSDP2's hooks set aside, gathers and reduce-scatters written in.

    ``originals`` are the model tensors in flat order (the parameters FSDP2 holds) and
    ``flat`` the traced flat inputs, DTensors rebuilt.
    """
    if not found.modules:
        yield
        return
    index_of = {id(t): i for i, t in enumerate(originals)}
    gathered: _Gathered = {}
    groups = [group for _, _, group in found.groups]
    with contextlib.ExitStack() as stack:
        stack.enter_context(without_fsdp_hooks(found.modules))
        stack.enter_context(
            torch.autograd.graph.saved_tensors_hooks(lambda t: _pack(t, gathered), _unpack)
        )
        for group in groups:
            leaves = [
                (owner, attr, flat[index_of[id(sharded)]]) for owner, attr, sharded in group.params
            ]
            for module in group.modules:
                stack.callback(
                    module.register_forward_pre_hook(
                        _before(group, leaves, gathered), with_kwargs=True
                    ).remove
                )
                stack.callback(module.register_forward_hook(_after(group, leaves)).remove)
        yield


def _before(group: ShardedGroup, leaves: _Leaves, gathered: _Gathered) -> Any:
    bucket = bucket_of(group, [leaf for _, _, leaf in leaves])
    again: dict[str, tuple[torch.Tensor, ...]] = {}  # one regather of the bucket per trace

    def regathered(index: int) -> torch.Tensor:
        if "fulls" not in again:
            again["fulls"] = gather(  # only called where there is a bucket
                cast("Bucket", bucket),
                [leaf.to_local() for _, _, leaf in leaves],
                differentiable=False,
            )
        return again["fulls"][index]

    def gather_group(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if bucket is None:
            fulls = [_gather(leaf, group, differentiable=True) for _, _, leaf in leaves]
            sources = [functools.partial(_gather, leaf, group, False) for _, _, leaf in leaves]
        else:
            fulls = list(
                gather(bucket, [leaf.to_local() for _, _, leaf in leaves], differentiable=True)
            )
            sources = [functools.partial(regathered, i) for i in range(len(leaves))]
        # Where no communication ran (a data-parallel dim of size 1), a full parameter views
        # storage the group's parameters share: a tensor of its own keeps what backward saves
        # of each parameter apart (see _pack).
        fulls = [full if view_base(full) is full else full.clone() for full in fulls]
        for (owner, attr, _), full, source in zip(leaves, fulls, sources, strict=True):
            bind_parameter(owner, attr, full)
            if group.reshard_after_forward:
                base = view_base(full)
                gathered[id(base)] = (base, source)
        if group.param_dtype is not None and group.cast_forward_inputs:
            return _cast_floating((args, kwargs), group.param_dtype)
        return None

    return gather_group


def _after(group: ShardedGroup, leaves: list[tuple[torch.nn.Module, str, torch.Tensor]]) -> Any:
    def reshard_group(module: torch.nn.Module, args: Any, output: Any) -> Any:
        for owner, attr, leaf in leaves:
            bind_parameter(owner, attr, leaf)
        if group.output_dtype is not None:
            return _cast_floating(output, group.output_dtype)
        return None

    return reshard_group


def _gather(leaf: Any, group: ShardedGroup, differentiable: bool) -> torch.Tensor:
    """The parameter gathered over the data-parallel mesh dim; backward reduce-scatters its
    gradient's average. On a (dp, tp) mesh it stays a DTensor on ``tp``, as FSDP2 leaves it."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh, tensor_parallel = leaf.device_mesh, tuple(leaf.placements[1:])
    full = leaf.redistribute(
        mesh,
        [Replicate(), *tensor_parallel],
        forward_dtype=group.param_dtype,
        backward_dtype=group.reduce_dtype,
    )
    local: torch.Tensor
    if not differentiable:
        local = full.to_local()
    else:
        local = full.to_local(grad_placements=[Partial("sum"), *tensor_parallel])
        scale = 1.0 / (group.divide_factor or group.mesh.size())
        local.register_hook(lambda grad: grad * scale)
    if not tensor_parallel:
        return local
    return DTensor.from_local(
        local,
        mesh[mesh.mesh_dim_names[1]],
        tensor_parallel,
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )


def _pack(tensor: torch.Tensor, gathered: _Gathered) -> Any:
    base = view_base(tensor)
    entry = gathered.get(id(base))
    if entry is None or entry[0] is not base:
        return tensor
    if not is_dtensor(tensor):
        return _Regather(
            entry[1],
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset() - base.storage_offset(),
        )
    local, base_local = tensor.to_local(), cast("DTensor", base).to_local()  # a DTensor's base
    return _Regather(
        entry[1],
        tuple(local.shape),
        tuple(local.stride()),
        local.storage_offset() - base_local.storage_offset(),
        (tensor.device_mesh, tuple(tensor.placements), tensor.shape, tuple(tensor.stride())),
    )


def _unpack(saved: Any) -> Any:
    if not isinstance(saved, _Regather):
        return saved
    with torch.no_grad():
        full = saved.regather()
    if saved.dtensor is None:
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)
    from torch.distributed.tensor import DTensor

    local = cast("DTensor", full).to_local()  # regathered on tp: a DTensor
    view = local.as_strided(saved.size, saved.stride, local.storage_offset() + saved.offset)
    mesh, placements, shape, stride = saved.dtensor
    return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape, stride=stride)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )
