"""One rank of a pipeline-parallel run: ``python pipeline_worker.py RANK WORLD PORT OUT CASES``.

Every rank joins a gloo process group on 127.0.0.1 and, per case, trains its stage of a
4-block model for three AdamW steps under a ``torch.distributed.pipelining`` schedule, the
stage module being a differentiable precompiled artifact of that stage (the module form).
It compares its stage's parameters with single-process eager on the whole model (same seed,
same micro-batches, the loss of each averaged as the schedule scales it) and writes
``OUT/rank{RANK}.json``: per case, the largest difference or the error raised. The case
``save_<backend>`` trains two steps and saves each stage's pair and state; a later run's
``resume_<backend>`` restarts from them and trains the third. In ``onerank_<backend>`` rank 0
builds every stage (``precompile.stages``). ``fsdp_<backend>`` (4 ranks) is PP x FSDP2: two
stages, each sharded over two ranks.
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from torch_precompile import PrecompileError, precompile

STEPS = 3
MICRO_BATCHES = 4
BATCH, DIM = 8, 8
REPLICAS = 2  # data-parallel ranks per stage in the PP x FSDP2 case
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh()) for _ in range(4))
    )


def batches(replicas: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's inputs and targets: ``BATCH`` rows per data-parallel replica."""
    torch.manual_seed(1)
    rows = BATCH * replicas
    return [(torch.randn(rows, DIM), torch.randn(rows, DIM)) for _ in range(STEPS)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def eager_reference(replicas: int = 1) -> torch.nn.Sequential:
    """The whole model trained in one process, micro-batch by micro-batch: every replica's
    micro-batches, each loss scaled as the schedule scales it and data parallelism averages."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    chunks = MICRO_BATCHES * replicas
    for x, t in batches(replicas):
        opt.zero_grad()
        for xm, tm in zip(x.chunk(chunks), t.chunk(chunks), strict=True):
            (loss_fn(model(xm), tm) / chunks).backward()
        opt.step()
    return model


def stage_blocks(rank: int, world: int) -> list[int]:
    per = 4 // world
    return list(range(rank * per, (rank + 1) * per))


def stage_of(whole: torch.nn.Sequential, rank: int, world: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(copy.deepcopy(whole[i]) for i in stage_blocks(rank, world)))


def train(
    wrapped: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    world: int,
    schedule: str,
    steps: range,
    data: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``steps`` of the pipeline schedule over stage ``rank`` of ``world`` (ranks of ``group``)."""
    stage = PipelineStage(wrapped, rank, world, torch.device("cpu"), group=group)
    runner = SCHEDULES[schedule](stage, MICRO_BATCHES, loss_fn=loss_fn)
    for step in steps:
        x, t = (data or batches())[step]
        opt.zero_grad()
        if rank == 0:
            runner.step(x)
        elif rank == world - 1:
            runner.step(target=t)
        else:
            runner.step()
        opt.step()


def compared(
    stage_module: torch.nn.Module, rank: int, world: int, replicas: int = 1
) -> dict[str, float]:
    """The stage's largest difference from eager's whole model, and how far it moved."""
    blocks, whole, reference = stage_blocks(rank, world), make_model(), eager_reference(replicas)
    ours = {
        name: p.full_tensor() if isinstance(p, DTensor) else p
        for name, p in stage_module.named_parameters()
    }
    pairs = [
        (ours[f"{n}.{name}"], reference[i].get_parameter(name), whole[i].get_parameter(name))
        for n, i in enumerate(blocks)
        for name, _ in whole[i].named_parameters()
    ]
    return {
        "max_diff": max((p - r).abs().max().item() for p, r, _ in pairs),
        "moved": max((p - w).abs().max().item() for p, _, w in pairs),
    }


def pipeline_case(rank: int, world: int, schedule: str, backend: str) -> dict[str, Any]:
    stage_module = stage_of(make_model(), rank, world)
    # A plain example, as for a model of one stage: stages after the first receive
    # activations that require grad, which the artifact's form for inputs serves.
    example = torch.randn(BATCH // MICRO_BATCHES, DIM)
    wrapped = precompile.module(stage_module, example, backend=backend)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    train(wrapped, opt, rank, world, schedule, range(STEPS))
    spec = precompile.inspect(wrapped.pair[0])
    for_inputs = spec.autograd_for_inputs
    return {
        **compared(stage_module, rank, world),
        "differentiable": spec.autograd.outputs == (0,)
        and for_inputs is not None
        and for_inputs.outputs == (0,),
    }


def fsdp_case(rank: int, world: int, backend: str) -> dict[str, Any]:
    """PP x FSDP2: stages along one mesh dimension, each sharded over ``REPLICAS`` ranks of the
    other, every replica on its own rows; rank 0 builds both stages' pairs."""
    mesh = init_device_mesh("cpu", (world // REPLICAS, REPLICAS), mesh_dim_names=("pp", "dp"))
    stage, replica, stages = rank // REPLICAS, rank % REPLICAS, world // REPLICAS

    def make_stage(index: int) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
        example = torch.randn(BATCH // MICRO_BATCHES, DIM, requires_grad=index > 0)
        return stage_of(make_model(), index, stages), (example,)

    wrapped = precompile.stages(make_stage, stages, stage, backend=backend)
    fully_shard(wrapped, mesh=mesh["dp"])
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    rows = slice(replica * BATCH, (replica + 1) * BATCH)
    data = [(x[rows], t[rows]) for x, t in batches(REPLICAS)]
    train(wrapped, opt, stage, stages, "1f1b", range(STEPS), data, mesh["pp"].get_group())
    return {
        **compared(wrapped.model, stage, stages, REPLICAS),
        "sharded": isinstance(next(wrapped.parameters()), DTensor),
        "differentiable": precompile.inspect(wrapped.pair[0]).autograd.outputs == (0,),
    }


def inner_shard_case(rank: int, world: int, backend: str) -> dict[str, Any]:
    """A block sharded after capture: the artifact never runs its hooks, so it refuses."""
    mesh = init_device_mesh("cpu", (world,))
    wrapped = precompile.module(stage_of(make_model(), 0, 1), torch.randn(2, DIM), backend=backend)
    fully_shard(wrapped.model[0], mesh=mesh)
    try:
        wrapped(torch.randn(2, DIM))
    except PrecompileError as e:
        return {"refused": str(e)}
    return {"refused": None}


def save_case(rank: int, world: int, backend: str, out: Path) -> dict[str, Any]:
    """Two steps, then this rank's pair, weights and optimizer state on disk."""
    stage_module = stage_of(make_model(), rank, world)
    example = torch.randn(BATCH // MICRO_BATCHES, DIM, requires_grad=rank > 0)
    wrapped = precompile.module(stage_module, example, backend=backend)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    train(wrapped, opt, rank, world, "1f1b", range(STEPS - 1))
    wrapped.save(out / f"stage{rank}_{backend}.py")
    torch.save(
        {"model": wrapped.state_dict(), "opt": opt.state_dict()}, out / f"stage{rank}_{backend}.pt"
    )
    return {}


def resume_case(rank: int, world: int, backend: str, out: Path) -> dict[str, Any]:
    """A restarted rank: its saved pair, weights and optimizer state, then the last step."""
    stage_module = stage_of(make_model(), rank, world)
    wrapped = precompile.module(
        stage_module, artifact=precompile.load(out / f"stage{rank}_{backend}.py")
    )
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    state = torch.load(out / f"stage{rank}_{backend}.pt")
    wrapped.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    train(wrapped, opt, rank, world, "1f1b", range(STEPS - 1, STEPS))
    built = [
        name
        for name in sys.modules
        if name.startswith(("torch_precompile.trace", "torch_precompile.lower"))
    ]
    return {**compared(stage_module, rank, world), "build_modules": built}


def one_rank_case(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Rank 0 builds every stage; each rank trains its own under 1F1B."""

    def make_stage(index: int) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
        example = torch.randn(BATCH // MICRO_BATCHES, DIM, requires_grad=index > 0)
        return stage_of(make_model(), index, world), (example,)

    wrapped = precompile.stages(make_stage, world, rank, backend=backend)
    built = [
        name
        for name in sys.modules
        if name.startswith(("torch_precompile.trace", "torch_precompile.lower"))
    ]
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    train(wrapped, opt, rank, world, "1f1b", range(STEPS))
    return {**compared(wrapped.model, rank, world), "build_modules": built}


def run_case(case: str, rank: int, world: int, out: Path) -> dict[str, Any]:
    kind, backend = case.split("_")
    if kind == "innershard":
        return inner_shard_case(rank, world, backend)
    if kind == "fsdp":
        return fsdp_case(rank, world, backend)
    if kind == "onerank":
        return one_rank_case(rank, world, backend)
    if kind == "save":
        return save_case(rank, world, backend, out)
    if kind == "resume":
        return resume_case(rank, world, backend, out)
    return pipeline_case(rank, world, kind, backend)


def main() -> None:
    rank, world, port, out, cases = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        Path(sys.argv[4]),
        sys.argv[5].split(","),
    )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    report: dict[str, Any] = {}
    try:
        for case in cases:
            try:
                report[case] = run_case(case, rank, world, out)
            except Exception as e:
                report[case] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            dist.barrier()
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
