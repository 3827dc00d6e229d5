"""How a call's arguments are laid out for the trace: which are models (their state interned
to one tensor per tie), optimizers and runtime inputs, and the flat tensors the graph takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.distributed import sharding_wrapper
from torch_precompile.trace import dynamic
from torch_precompile.trace.inputs import (
    UserInputs,
    arg_names_of,
    flatten_user_inputs,
    refuse_unplain_tensors,
)
from torch_precompile.trace.optimizers import OptimizerArg, read_optimizers
from torch_precompile.trace.parallel import data_parallel, fully_shard
from torch_precompile.trace.parallel.data_parallel import DataParallelArg
from torch_precompile.trace.parallel.dtensor import Distribution, find_dtensors
from torch_precompile.trace.parallel.fully_shard import FullySharded
from torch_precompile.trace.stand_ins import StandIns
from torch_precompile.trace.state import ModelState, intern_model_state
from torch_precompile.trace.subclasses import Wrapping, find_wrapped, refuse_mixed


@dataclass(frozen=True)
class Layout:
    """Where each of ``args`` goes: modules and their lifted state, flat user inputs, marks."""

    args: tuple[Any, ...]
    arg_names: list[str]
    module_positions: list[int]
    modules: list[torch.nn.Module]
    state: ModelState
    inputs: UserInputs
    tensor_positions: list[int]  # indices into inputs.leaves
    sharding: Distribution | None
    wrapping: Wrapping
    marks: list[dict[int, dynamic.Mark]]
    optimizer_positions: list[int]
    optimizers: list[OptimizerArg]
    data_parallel: list[DataParallelArg]
    fully_sharded: FullySharded

    @property
    def num_params(self) -> int:
        return self.state.num_params

    @property
    def num_state(self) -> int:
        return len(self.state.tensors)

    @property
    def optimizer_start(self) -> int:
        """The flat index of the first optimizer state tensor (after the input tensors)."""
        return self.num_state + len(self.tensor_positions)

    @property
    def num_optimizer_state(self) -> int:
        return sum(len(o.entries) for o in self.optimizers)


def read_layout(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str,
    on_fakes: bool,
    stand_ins: StandIns | None = None,
) -> Layout:
    arg_names = arg_names_of(fn, len(args))
    module_positions = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
    modules: list[torch.nn.Module] = [args[i] for i in module_positions]
    _refuse_sharding_wrappers(modules, [arg_names[i] for i in module_positions])
    model_names = [arg_names[i] for i in module_positions]
    ddp = data_parallel.find_data_parallel(modules, model_names)
    sharded_groups = fully_shard.find_fully_sharded(modules, model_names)
    state = intern_model_state(modules)
    optimizer_positions = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
    optimizers = read_optimizers(
        [args[i] for i in optimizer_positions],
        [arg_names[i] for i in optimizer_positions],
        state,
        backend,
    )
    input_positions = [
        i for i in range(len(args)) if i not in module_positions and i not in optimizer_positions
    ]
    inputs = flatten_user_inputs(
        tuple(args[i] for i in input_positions), [arg_names[i] for i in input_positions]
    )
    tensor_positions = inputs.tensor_positions
    flat = [*state.tensors, *(inputs.leaves[i] for i in tensor_positions)]
    flat_names = [
        *(f"model parameter {n!r}" for n in state.param_names),
        *(f"model buffer {n!r}" for n in state.buffer_names),
        *(f"input {inputs.names[i]}" for i in tensor_positions),
    ]
    refuse_unplain_tensors(flat, flat_names)
    wrapping = find_wrapped(flat, flat_names, fakes_are_plain=stand_ins is not None)
    # An optimizer's state follows the flat inputs; that of DTensor parameters is DTensors.
    state_names = [
        f"state {e.key!r} of model parameter {state.param_names[e.param]!r} in optimizer {o.name}"
        for o in optimizers
        for e in o.entries
    ]
    sharding = find_dtensors(
        [*flat, *(e.example for o in optimizers for e in o.entries)], [*flat_names, *state_names]
    )
    refuse_mixed(wrapping, sharding is not None)
    data_parallel.refuse_with_dtensors(ddp, sharding is not None)
    marks = dynamic.read_marks(inputs.leaves, inputs.names)
    if optimizers and any(marks):
        raise PrecompileError(
            f"optimizer {optimizers[0].name} steps inside fn, which is carried for dims of "
            "static shape; with dims marked dynamic, call its step outside the artifact (loss "
            "= run(model, x, t); opt.step(); opt.zero_grad())."
        )
    if any(marks) and stand_ins is not None:
        raise PrecompileError(
            "dims marked with mark_unbacked (dynamic shapes) are not supported in a build "
            "without the weights yet; leave the dims static, or build with the real weights."
        )
    if any(marks) and (sharding is not None or on_fakes):
        raise PrecompileError(
            "dims marked with mark_unbacked (dynamic shapes) are not supported together with "
            "DTensors or compile_on_one_rank yet; leave the dims static."
        )
    return Layout(
        args,
        arg_names,
        module_positions,
        modules,
        state,
        inputs,
        tensor_positions,
        sharding,
        wrapping,
        marks,
        optimizer_positions,
        optimizers,
        ddp,
        sharded_groups,
    )


def _refuse_sharding_wrappers(modules: list[torch.nn.Module], names: list[str]) -> None:
    for name, module in zip(names, modules, strict=True):
        wrapper = sharding_wrapper(module)
        if wrapper in (None, "DistributedDataParallel", "fully_shard"):
            continue
        raise PrecompileError(
            f"model argument {name} is wrapped in {wrapper}, whose parameters are gathered and "
            "gradients reduce-scattered in module and autograd hooks, which a precompiled "
            f"graph does not replay yet. Precompile the model built without {wrapper}: "
            "wrapped in DistributedDataParallel (data parallelism, carried), or with its "
            "parameters sharded as DTensors (parallelize_module)."
        )
