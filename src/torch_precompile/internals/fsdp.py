"""Torch internals for FSDP2 (``fully_shard``): its param groups, settings and forward hooks."""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.shipped.driver.data_parallel import resolved_dtypes

__all__ = [
    "ShardedGroup",
    "bind_parameter",
    "fsdp_groups",
    "fsdp_module_class",
    "fsdp_modules",
    "view_base",
    "without_fsdp_hooks",
]


@dataclass(frozen=True)
class ShardedGroup:
    """One FSDP2 param group: the modules whose forward gathers it, and what it holds.

    ``params`` are (owning module, attribute name, sharded DTensor parameter).
    ``reshard_after_forward`` is True, False, or the size of a smaller mesh to reshard to;
    ``auto_reshard`` says fully_shard chose it (then a root module keeps its parameters).
    ``unsupported`` names each setting whose effect a traced graph does not hold.
    """

    modules: tuple[torch.nn.Module, ...]
    params: tuple[tuple[torch.nn.Module, str, torch.Tensor], ...]
    mesh: Any
    reshard_after_forward: bool | int
    auto_reshard: bool
    reduce_grads: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool
    divide_factor: float | None
    unsupported: tuple[str, ...]


def fsdp_module_class() -> Any:
    """``FSDPModule`` if anything imported FSDP2 (else nothing can be one)."""
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    return None if module is None else module.FSDPModule


def fsdp_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module under ``root`` (itself included) that ``fully_shard`` was applied to."""
    fsdp_class = fsdp_module_class()
    if fsdp_class is None:
        return []
    return [module for module in root.modules() if isinstance(module, fsdp_class)]


def fsdp_groups(root: torch.nn.Module) -> list[ShardedGroup]:
    """Every FSDP2 param group under ``root``, in module order."""
    groups = []
    try:
        for module in fsdp_modules(root):
            state = cast(Any, module)._get_fsdp_state()  # an FSDPModule
            if state._modules[0] is not module:
                continue  # a grouped fully_shard([a, b]): read once, at its first module
            for group in state._fsdp_param_groups:
                groups.append(_read_group(state, group))
    except AttributeError as e:
        raise PrecompileError(
            f"this torch's FSDP2 keeps its state differently from the releases "
            f"torch-precompile reads ({torch.__version__}: {e}); precompile the model before "
            "fully_shard and shard it with DTensor (parallelize_module), or use a supported "
            "torch release."
        ) from e
    return groups


def _read_group(state: Any, group: Any) -> ShardedGroup:
    after = group.post_forward_mesh_info
    reshard: bool | int = after is not None
    if after is not None and after.mesh is not group.mesh_info.mesh:
        reshard = after.mesh.size()
    policy = state._mp_policy
    # Each parameter's resolved dtypes (per parameter since torch 2.15).
    dtypes = {resolved_dtypes(p, group) for p in group.fsdp_params}
    grad_dtypes = {getattr(p, "_has_sharded_grad_dtype_override", False) for p in group.fsdp_params}
    param_dtype, reduce_dtype = next(iter(dtypes)) if dtypes else (None, None)
    unsupported = [
        name
        for name, present in (
            ("parameters of different mixed-precision dtypes in one group", len(dtypes) > 1),
            ("gradients of another dtype than their parameters", True in grad_dtypes),
            (
                "offload_policy (CPU offload)",
                type(group.offload_policy).__name__ != "OffloadPolicy",
            ),
            ("a 2-D (HSDP) mesh", group.mesh_info.mesh.ndim != 1),
            (
                "parameters on a mesh of more than two dims, or an unnamed one",
                any(
                    p.sharded_param.device_mesh.ndim > 2
                    or (
                        p.sharded_param.device_mesh.ndim == 2
                        and not p.sharded_param.device_mesh.mesh_dim_names
                    )
                    for p in group.fsdp_params
                ),
            ),
            ("set_custom_all_gather", type(group._all_gather_comm).__name__ != "DefaultAllGather"),
            (
                "set_custom_reduce_scatter",
                type(group._reduce_scatter_comm).__name__ != "DefaultReduceScatter",
            ),
            ("set_all_reduce_hook", group._all_reduce_hook is not None),
            ("set_force_sum_reduction_for_comms", bool(group.force_sum_reduction_for_comms)),
            ("fully_shard over a list of modules", len(state._modules) != 1),
        )
        if present
    ]
    return ShardedGroup(
        modules=tuple(state._modules),
        params=tuple(
            (p._module_info.module, p._module_info.param_name, p.sharded_param)
            for p in group.fsdp_params
        ),
        mesh=group.mesh_info.mesh,
        reshard_after_forward=reshard,
        auto_reshard=bool(getattr(state, "_auto_reshard_after_forward", False)),
        reduce_grads=bool(group.reduce_grads),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=bool(policy.cast_forward_inputs),
        divide_factor=group.gradient_divide_factor,
        unsupported=tuple(unsupported),
    )


@contextlib.contextmanager
def without_fsdp_hooks(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run ``modules`` without FSDP2's forward hooks (they gather and reduce with in-place
    collectives, outside any trace); hooks registered meanwhile are dropped afterwards."""
    fsdp_class = fsdp_module_class()
    saved = []
    for module in modules:
        if fsdp_class is None or not isinstance(module, fsdp_class):
            continue
        state = module._get_fsdp_state()
        own = {state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id}
        saved.append((module, module._forward_pre_hooks, module._forward_hooks))
        module._forward_pre_hooks = OrderedDict(
            (k, v) for k, v in module._forward_pre_hooks.items() if k not in own
        )
        module._forward_hooks = OrderedDict(
            (k, v) for k, v in module._forward_hooks.items() if k not in own
        )
    try:
        yield
    finally:
        for module, pre, post in saved:
            module._forward_pre_hooks, module._forward_hooks = pre, post


def bind_parameter(owner: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``owner.<name>`` read ``tensor`` (a plain tensor or DTensor, not a Parameter), as
    FSDP2 itself swaps gathered parameters in."""
    # torch types this dict as Parameters only, but FSDP2 stores plain tensors in it too.
    owner._parameters[name] = tensor  # type: ignore[assignment]


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``tensor`` views (itself when it is no view)."""
    return tensor if tensor._base is None else tensor._base
