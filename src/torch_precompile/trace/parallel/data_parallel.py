"""DistributedDataParallel in a capture: its module traced, its communication in the graph.

DDP communicates in hooks around the computation: before each forward it broadcasts the
module's buffers from rank 0 (``broadcast_buffers``), and as each parameter's gradient is
accumulated in backward it averages that gradient over the process group. While fn is traced,
the DDP model's forward is its module's forward preceded by that broadcast, and every
parameter carries a post-accumulate hook that puts its gradient in a bucket; a full bucket
(DDP's ``bucket_cap_mb``), or the last gradient of the backward, averages the bucket's
gradients in one all-reduce, as DDP's reducer does, as functional collectives. The graph
therefore holds the communication DDP would run, and ``.grad`` after a call is DDP's. Options
whose effect the graph cannot hold are refused by name.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.distributed import (
    all_reduce_sum,
    broadcast_from,
    data_parallel_options,
)
from torch_precompile.spec import DataParallel

# DDP's group rank whose buffers every forward broadcasts (without the join context, which
# is refused, DDP always takes group rank 0).
_AUTHORITATIVE_RANK = 0


@dataclass
class DataParallelArg:
    """One model argument wrapped in DDP: the wrapper, the name its group has in the graph and
    what the capture found (whether gradients sync, the forward-sync flag before and after)."""

    module: Any
    argument: str
    model: int  # index among the model arguments
    group: str
    sync_grads: bool
    forward_sync: tuple[bool, bool] | None = None

    @property
    def world_size(self) -> int:
        return cast(int, self.module.process_group.size())

    @property
    def broadcasts_buffers(self) -> bool:
        return bool(self.module.broadcast_buffers) and any(True for _ in self.module.buffers())

    def record(self) -> DataParallel:
        return DataParallel(
            argument=self.argument,
            model=self.model,
            group=self.group,
            world_size=self.world_size,
            sync_grads=self.sync_grads,
            forward_sync=self.forward_sync,
        )


def data_parallel_class() -> Any:
    """``DistributedDataParallel`` if anything imported it (else nothing can be one)."""
    module = sys.modules.get("torch.nn.parallel.distributed")
    return None if module is None else module.DistributedDataParallel


def find_data_parallel(
    modules: Sequence[torch.nn.Module], names: Sequence[str]
) -> list[DataParallelArg]:
    """The DDP model arguments; each unsupported option is refused by name."""
    ddp_class = data_parallel_class()
    found = []
    for index, (module, name) in enumerate(zip(modules, names, strict=True)):
        if ddp_class is None or not isinstance(module, ddp_class):
            continue
        _refuse_options(module, name)
        found.append(
            DataParallelArg(
                module=module,
                argument=name,
                model=index,
                group=f"precompile/ddp/{name}",
                sync_grads=bool(module.require_backward_grad_sync),
            )
        )
    return found


def _refuse_options(ddp: Any, name: str) -> None:
    options = data_parallel_options(ddp)
    unsupported = [
        (
            options.find_unused_parameters,
            "find_unused_parameters=True",
            "every parameter of the traced step gets a gradient or none on every rank alike, so "
            "construct DDP without it",
        ),
        (
            options.static_graph,
            "static_graph=True (or _set_static_graph())",
            "the precompiled graph is static by construction: construct DDP without it",
        ),
        (
            options.comm_hook,
            "a communication hook (register_comm_hook) or the python reducer",
            "the graph averages gradients as DDP does by default: construct DDP without a hook",
        ),
        (options.mixed_precision, "mixed_precision", "cast the model yourself before wrapping it"),
        (
            options.ignored_parameters,
            "parameters_to_ignore",
            "wrap the model without ignored parameters",
        ),
        (
            options.join,
            "the Join context manager (uneven inputs)",
            "give every rank the same number of calls",
        ),
        (options.delayed_all_reduce, "delay_all_reduce_named_params", "construct DDP without it"),
        (
            options.buffer_hook,
            "a buffer communication hook",
            "construct DDP without register_buffer_comm_hook",
        ),
    ]
    for present, option, advice in unsupported:
        if present:
            raise PrecompileError(
                f"model argument {name} is a DistributedDataParallel with {option}, which a "
                f"precompiled step does not reproduce; {advice}."
            )
    devices = {p.device for p in ddp.parameters()}
    if len(devices) > 1:
        raise PrecompileError(
            f"model argument {name} is a DistributedDataParallel whose parameters live on "
            f"{len(devices)} devices ({', '.join(sorted(map(str, devices)))}); a precompiled "
            "data-parallel step holds a model on one device per rank."
        )


def refuse_with_dtensors(found: Sequence[DataParallelArg], has_dtensors: bool) -> None:
    if found and has_dtensors:
        raise PrecompileError(
            f"model argument {found[0].argument} is a DistributedDataParallel and the capture "
            "holds DTensors; data parallelism over a tensor-parallel model runs on a (dp, tp) "
            "device mesh (fully_shard on dp, parallelize_module on tp), not on DDP."
        )


@contextlib.contextmanager
def tracing(
    found: Sequence[DataParallelArg], params: Sequence[Sequence[torch.Tensor]]
) -> Iterator[None]:
    """While fn is traced: each DDP's forward as DDP runs it, and each of its parameters'
    gradients averaged in buckets as they are accumulated. ``params[i]`` are ``found[i]``'s
    traced parameters (those that require grad)."""
    with contextlib.ExitStack() as stack:
        buckets = []
        for arg, own in zip(found, params, strict=True):
            stack.enter_context(_forward_as_ddp(arg))
            if arg.sync_grads and own:
                buckets.append(_GradientBuckets(arg, len(own)))
                for param in own:
                    handle = param.register_post_accumulate_grad_hook(buckets[-1].add)
                    stack.callback(handle.remove)
        yield
        for bucket in buckets:
            bucket.refuse_unfinished_reduction()


class _GradientBuckets:
    """One DDP's gradients, averaged a bucket at a time as backward produces them."""

    def __init__(self, arg: DataParallelArg, count: int) -> None:
        self.arg = arg
        self.count = count
        # DDP scales each gradient by 1 / world size as it copies it into its bucket.
        self.scale = 1.0 / arg.world_size
        self.cap = int(getattr(arg.module, "bucket_bytes_cap", 25 * 2**20))
        self.pending: list[torch.Tensor] = []
        self.arrived = 0

    def add(self, param: torch.Tensor) -> None:
        # A post-accumulate-grad hook: every parameter here has its gradient.
        if (
            self.pending
            and cast(torch.Tensor, self.pending[0].grad).dtype
            != cast(torch.Tensor, param.grad).dtype
        ):
            self._flush()  # DDP's buckets hold one dtype each
        self.pending.append(param)
        self.arrived += 1
        if self.arrived == self.count:
            self._flush()
            self.arrived = 0  # a later backward in fn starts over
        elif (
            sum(
                cast(torch.Tensor, p.grad).numel() * cast(torch.Tensor, p.grad).element_size()
                for p in self.pending
            )
            >= self.cap
        ):
            self._flush()

    def _flush(self) -> None:
        grads = [cast(torch.Tensor, param.grad) for param in self.pending]
        flat = torch.cat([grad.reshape(-1) for grad in grads]) * self.scale
        reduced = all_reduce_sum(flat, self.arg.module.process_group)
        start = 0
        for param, grad in zip(self.pending, grads, strict=True):
            param.grad = reduced[start : start + grad.numel()].view_as(grad)
            start += grad.numel()
        self.pending = []

    def refuse_unfinished_reduction(self) -> None:
        if self.arrived:
            raise PrecompileError(
                f"a backward in fn gave gradients to {self.arrived} of the {self.count} "
                f"parameters of model argument {self.arg.argument} (a DistributedDataParallel); "
                "DDP reduces a backward's gradients only once every parameter has one, and "
                "find_unused_parameters is refused. Make each backward reach every parameter, "
                "or freeze the unused ones (requires_grad=False)."
            )


@contextlib.contextmanager
def _forward_as_ddp(arg: DataParallelArg) -> Iterator[None]:
    ddp = arg.module
    before = bool(ddp.require_forward_param_sync)
    broadcasts = arg.broadcasts_buffers

    def forward(*inputs: Any, **kwargs: Any) -> Any:
        if bool(ddp.require_backward_grad_sync) != arg.sync_grads:
            raise PrecompileError(
                f"fn enters no_sync() of model argument {arg.argument} (or leaves it) "
                "itself; the artifact's gradients either sync or not. Call the artifact "
                "inside `with model.no_sync():` and precompile it there."
            )
        if broadcasts and ddp.require_forward_param_sync:
            with torch.no_grad():
                for buffer in ddp.module.buffers():
                    buffer.copy_(broadcast_from(buffer, _AUTHORITATIVE_RANK, ddp.process_group))
        result = ddp.module(*inputs, **kwargs)
        ddp.require_forward_param_sync = torch.is_grad_enabled() and arg.sync_grads
        return result

    ddp.forward = forward
    try:
        yield
    finally:
        del ddp.forward
        if broadcasts:
            arg.forward_sync = (before, bool(ddp.require_forward_param_sync))
        ddp.require_forward_param_sync = before


def stable_group_names(found: Sequence[DataParallelArg]) -> dict[str, str]:
    """This process's group name of each DDP's process group -> the graph's name for it, and
    that name bound to the group here (for lowering, and a call in this process)."""
    from torch_precompile.shipped.driver.data_parallel import bind_group

    names = {}
    for arg in found:
        bind_group(arg.group, arg.module.process_group)
        names[arg.module.process_group.group_name] = arg.group
    return names
