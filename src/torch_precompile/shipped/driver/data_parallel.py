"""The driver part for data-parallel models: DDP's and FSDP2's state checked, DDP's group bound.

The graph averages each gradient over the DDP model's process group, as DDP does, under a
group name that says which argument it serves. At each call this part checks that the model
is still a DDP over a group of the captured size, and in the captured ``no_sync()`` state;
binds the name to the model's group; and, on the first call, has every rank agree that the
call is servable before any rank enters the graph's collectives. A gradient already on
``.grad`` (left by calls inside ``no_sync()``) is averaged here before the call's own is
added, so the sum equals the average DDP takes of the accumulated gradient.

For a ``fully_shard`` model (whose parameters are DTensors, unwrapped by the distributed part)
each captured param group's module must still be ``fully_shard``-ed with gradient sync on:
the graph reduce-scatters every gradient. FSDP2's state is read through its private
``_get_fsdp_state()._fsdp_param_groups`` (the flags its public setters write).
"""

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.tensor_rules import PrecompileError


class DataParallelSteps:
    """Checks and binds each DDP model argument of a call (``check``), averages gradients
    left from earlier calls (``average_left_gradients``) and keeps DDP's forward-sync flag
    (``finished``)."""

    def __init__(self, driver: Driver) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.ddp_class = DistributedDataParallel
        qualify = len(driver.model_positions) > 1
        interned = driver.model.interned
        self.entries = []
        for record in driver.spec.data_parallel:
            prefix = f"m{record.model}."
            grads = [
                i for i in driver.grad_indices if not qualify or interned[i].name.startswith(prefix)
            ]
            self.entries.append((record, driver.model_positions[record.model], grads))
        self.sharded = [
            (record, driver.model_positions[record.model]) for record in driver.spec.fully_sharded
        ]
        self.agreed = not self.entries  # only DDP's checks need agreeing on here

    def check(self, args: Sequence[Any]) -> None:
        """Each DDP argument checked and its group bound; all ranks agree on the first call."""
        error: PrecompileError | None = None
        try:
            for record, position, _ in self.entries:
                self.check_one(record, args[position])
            for record, position in self.sharded:
                check_sharded(record, args[position])
        except PrecompileError as e:
            error = e
        if self.agreed:
            if error is not None:
                raise error
            return
        self.agree(error, args)

    def check_one(self, record: Any, module: Any) -> None:
        name = record.argument
        if not isinstance(module, self.ddp_class):
            raise PrecompileError(
                f"argument {name} was a DistributedDataParallel at capture, whose gradients "
                f"the artifact averages over its process group; got {type(module).__name__}. "
                "Pass the DDP model."
            )
        group = module.process_group
        if group.size() != record.world_size:
            raise PrecompileError(
                f"argument {name}: its process group has {group.size()} ranks; the artifact "
                f"averages gradients over {record.world_size}. Precompile for this world size."
            )
        if bool(module.require_backward_grad_sync) != record.sync_grads:
            inside = "inside" if record.sync_grads else "outside"
            raise PrecompileError(
                f"argument {name}: this call is {inside} no_sync(), but the artifact was "
                f"captured {'outside' if record.sync_grads else 'inside'} it, so its gradients "
                f"{'are' if record.sync_grads else 'are not'} averaged over the ranks. "
                "Precompile one artifact for each (capture the accumulation step inside "
                "`with model.no_sync():`)."
            )
        if record.forward_sync is not None and (
            bool(module.require_forward_param_sync) != record.forward_sync[0]
        ):
            raise PrecompileError(
                f"argument {name}: DDP would {'not ' if record.forward_sync[0] else ''}"
                "broadcast its buffers from rank 0 at this forward (the previous forward ran "
                f"{'without' if record.forward_sync[0] else 'with'} gradient sync: no_grad or "
                "no_sync), and the artifact was captured the other way. Precompile the step "
                "after the same kind of call, or construct DDP with broadcast_buffers=False."
            )
        bind_group(record.group, group)

    def agree(self, error: PrecompileError | None, args: Sequence[Any]) -> None:
        """A rank that cannot run the call would leave the others waiting in the graph's
        first collective: so on the first call every rank learns whether all can."""
        record, position, _ = self.entries[0]
        module = args[position]
        if not isinstance(module, self.ddp_class):
            raise error or PrecompileError(f"argument {record.argument} is no DDP model")
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        failed = torch.tensor([0 if error is None else 1], device=device)
        torch.distributed.all_reduce(
            failed, torch.distributed.ReduceOp.MAX, group=module.process_group
        )
        if error is not None:
            raise error
        if failed.item():
            raise PrecompileError(
                "another rank of the data-parallel group refused this artifact at its first "
                "call (its own error says why), so no rank runs it: the graph's collectives "
                "would wait for that rank forever."
            )
        self.agreed = True

    def average_left_gradients(self, args: Sequence[Any], state: Sequence[torch.Tensor]) -> None:
        """Average, over the group, each gradient already on ``.grad`` before a syncing call."""
        for record, position, indices in self.entries:
            if not record.sync_grads:
                continue
            left = [g for g in (state[i].grad for i in indices) if g is not None]
            if not left:
                continue
            flat = torch.cat([g.reshape(-1) for g in left])
            flat.mul_(1.0 / record.world_size)
            torch.distributed.all_reduce(flat, group=args[position].process_group)
            offset = 0
            for grad in left:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def finished(self, args: Sequence[Any]) -> None:
        """DDP's flag for whether the next forward broadcasts buffers, as its forward sets it."""
        for record, position, _ in self.entries:
            if record.forward_sync is not None:
                args[position].require_forward_param_sync = record.forward_sync[1]


def check_sharded(record: Any, model: Any) -> None:
    """The module of a captured FSDP2 param group is still ``fully_shard``-ed, syncing."""
    where = f"module {record.module or '(the model itself)'}"
    try:
        module = model.get_submodule(record.module) if record.module else model
        groups = module._get_fsdp_state()._fsdp_param_groups
    except (AttributeError, TypeError) as e:
        raise PrecompileError(
            f"{where} was fully_shard-ed at capture, and the artifact gathers and "
            f"reduce-scatters its parameters; this model's is not ({type(e).__name__}). Pass "
            "the model sharded as at capture."
        ) from None
    factors = {group.gradient_divide_factor for group in groups}
    if factors != {record.divide_factor}:
        raise PrecompileError(
            f"{where} divides gradients by {_factor(factors.pop())} (set_gradient_divide_factor); "
            f"the artifact was captured dividing by {_factor(record.divide_factor)}. Set it "
            "back, or precompile again."
        )
    dtypes = {
        tuple(None if d is None else str(d) for d in resolved_dtypes(param, group))
        for group in groups
        for param in group.fsdp_params
    } or {(None, None)}
    if dtypes != {(record.param_dtype, record.reduce_dtype)}:
        now = " / ".join(_shown_dtypes(*pair) for pair in sorted(dtypes, key=str))
        raise PrecompileError(
            f"{where} has a MixedPrecisionPolicy that {now}; the artifact was captured with "
            f"one that {_shown_dtypes(record.param_dtype, record.reduce_dtype)}, and its "
            "graph holds those casts. Shard the model with the capture's policy, or "
            "precompile again."
        )
    if not all(group.reduce_grads for group in groups):
        raise PrecompileError(
            f"{where} has set_requires_gradient_sync(False), under which FSDP2 keeps "
            "unsharded gradients aside; the artifact reduce-scatters every gradient. Call it "
            "with gradient sync on."
        )


def resolved_dtypes(param: Any, group: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(gather dtype, reduce dtype) of one FSDP2 parameter as FSDP2 resolves its policy at
    the first forward (None: its own dtype): the group's policy, or since 2.15 the
    parameter's."""
    policy = getattr(param, "mp_policy", None) or group.mp_policy
    dtype = param.sharded_param.dtype
    gather = policy.param_dtype
    if gather == dtype or not dtype.is_floating_point:
        gather = None
    reduce = policy.reduce_dtype
    return gather, None if reduce == (gather or dtype) else reduce


def _shown_dtypes(gather: str | None, reduce: str | None) -> str:
    return (
        f"gathers parameters in {gather or 'their own dtype'} and reduces gradients in "
        f"{reduce or 'the gathered dtype'}"
    )


def _factor(factor: Any) -> str:
    return "the world size" if factor is None else repr(factor)


# Graph group name -> the process group it resolves to in this process now.
_BOUND_GROUPS: dict[str, Any] = {}


def bind_group(name: str, group: Any) -> None:
    """Make the graph's group ``name`` resolve to ``group`` in this process."""
    if _BOUND_GROUPS.get(name) is group:
        return
    registry: Any = torch._C._distributed_c10d  # private; its stubs differ between releases
    with contextlib.suppress(RuntimeError, KeyError, ValueError):  # not bound here yet
        registry._unregister_process_group(name)
    registry._register_process_group(name, group)
    _BOUND_GROUPS[name] = group
