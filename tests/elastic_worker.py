"""A worker that ``torchrun`` starts: ``elastic_worker.py MODE OUT``.

``two_nodes``: one of two simulated nodes' workers (two ``torchrun --nnodes 2`` launches). Global
rank 0 precompiles a fully_shard training step for everyone (``compile_on_one_rank``); each
rank writes the digest of the pair it got and the worst difference of its three SGD steps from
single-process eager on the full batches.

``restart``: an elastic job (``torchrun --max-restarts 1``). The first attempt precompiles on
rank 0, saves the pair, and trains, checkpointing every rank's shards after each step; rank 1
dies mid-training. The restarted workers load the saved pair (nothing compiles), resume from
the last checkpoint and finish; rank 0 writes the final full parameters and each rank the
seconds from its process start to its first resumed step. The restarted workers run with
compilers that fail (and record the attempt) and an empty Inductor cache.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import datetime  # noqa: E402  (the clock starts before the imports)
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++")


def _poison_compilers(out: Path) -> Path:
    """A restarted worker gets compilers that record being called and fail, and an empty
    Inductor cache: it must run from the saved pair alone."""
    bin_dir, marker = out / "restart-bin", out / "compiler-was-called"
    bin_dir.mkdir(exist_ok=True)
    for name in COMPILERS:
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "$0 $@" >> {marker}\nexit 1\n')
        tool.chmod(0o755)
    cache = out / f"restart-inductor-cache-{os.environ.get('RANK')}"
    cache.mkdir(exist_ok=True)
    os.environ.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        CXX=str(bin_dir / "g++"),
        CC=str(bin_dir / "gcc"),
        TORCHINDUCTOR_CACHE_DIR=str(cache),
    )
    return marker


if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
    _poison_compilers(Path(sys.argv[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from torch_precompile import precompile  # noqa: E402

STEPS, KILLED_AFTER, LR = 6, 3, 0.1


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def make() -> MLP:
    torch.manual_seed(0)
    return MLP()


def train_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


def batches(world: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2 * world, 8, generator=generator) for _ in range(count)]


def sgd(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def sharded(mesh: object) -> MLP:
    model = make()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def eager_final(world: int) -> dict[str, torch.Tensor]:
    model = make()
    for x in batches(world, STEPS):
        train_step(model, x)
        sgd(model)
    return dict(model.named_parameters())


def two_nodes(out: Path) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = sharded(mesh)
    data = batches(world, STEPS)
    pair = precompile(
        train_step, model, data[0].chunk(world)[rank], backend="eager", compile_on_one_rank=True
    )
    step = precompile.load(*pair)
    for x in data:
        step(model, x.chunk(world)[rank])
        sgd(model)
    reference = eager_final(world)
    worst = max(
        float((p.detach().full_tensor() - reference[n].detach()).abs().max())
        for n, p in model.named_parameters()
    )
    return {
        "digest": hashlib.sha256(pair[0].encode() + pair[1]).hexdigest(),
        "param": worst,
        "node": os.environ.get("GROUP_RANK"),
        "local_rank": os.environ.get("LOCAL_RANK"),
    }


def restart(out: Path) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = sharded(mesh)
    data = batches(world, STEPS)
    artifact = out / "step.py"
    if attempt == 0:
        pair = precompile(
            train_step,
            model,
            data[0].chunk(world)[rank],
            backend="inductor",
            compile_on_one_rank=True,
        )
        if rank == 0:
            precompile.save(*pair, artifact)
        dist.barrier()
    step = precompile.load_file(artifact) if attempt else precompile.load(*pair)
    start = _resume(model, out / f"checkpoint{rank}.pt")
    first_resumed = None
    for index in range(start, STEPS):
        step(model, data[index].chunk(world)[rank])
        sgd(model)
        if first_resumed is None:
            first_resumed = time.perf_counter() - STARTED
        _checkpoint(model, index + 1, out / f"checkpoint{rank}.pt")
        if attempt == 0 and index + 1 == KILLED_AFTER and rank == 1:
            dist.barrier()
            (out / "lost-rank").write_text(str(rank))
            os._exit(17)  # a lost rank: torchrun restarts every worker
        if attempt == 0 and index + 1 == KILLED_AFTER:
            dist.barrier()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    reference = eager_final(world)
    worst = max(float((full[n] - reference[n]).detach().abs().max()) for n in full)
    return {
        "attempt": attempt,
        "resumed_from": start,
        "param": worst,
        "seconds_to_first_resumed_step": first_resumed,
        "compiler_called": (out / "compiler-was-called").exists(),
    }


def _checkpoint(model: torch.nn.Module, steps_done: int, path: Path) -> None:
    shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
    partial = path.with_suffix(".partial")
    torch.save({"steps_done": steps_done, "shards": shards}, partial)
    partial.replace(path)


def _resume(model: torch.nn.Module, path: Path) -> int:
    if not path.exists():
        return 0
    saved = torch.load(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(saved["shards"][name])
    return int(saved["steps_done"])


def _join_process_group() -> None:
    """Join over torchrun's store under a prefix of this attempt: the store outlives a
    restart, and gloo would otherwise read the dead workers' addresses from it."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=120)
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not hosted_by_agent and rank == 0,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    _join_process_group()
    result = {"two_nodes": two_nodes, "restart": restart}[mode](out)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    Path(out, f"{mode}-rank{dist.get_rank()}-attempt{attempt}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    # Everything is written: skip the interpreter's teardown, where torch 2.14's c10d threads
    # sometimes abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
