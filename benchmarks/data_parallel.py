"""Data-parallel training steps: DDP and FSDP2 on 2 ranks, FSDP2 x TP on 4; first step, steady,
memory.

    .venv/bin/python benchmarks/data_parallel.py --runs 3    # writes benchmarks/DATA_PARALLEL.md
    .venv/bin/python benchmarks/data_parallel.py --jobs ddp --out benchmarks/DDP.md

The model is a stack of the transformer blocks of ``distributed.py`` (``--blocks`` of width
``--dim``), ``fully_shard`` on each block and on the root over the ``dp`` mesh dim; on 4 ranks
each block is first tensor-parallel on ``tp`` of a (2, 2) mesh, as torchtitan lays out such a
job. The DDP job wraps the whole stack in ``DistributedDataParallel`` instead. ``fn`` is
forward, mean-square loss and backward; each rank passes its slice of the batch.

Modes, each in fresh processes (one per rank, gloo over 127.0.0.1, OMP_NUM_THREADS=1):

- ``ours``: the pair built beforehand (``compile_on_one_rank``, Inductor), loaded from file;
- ``eager``: the DDP or FSDP2 model itself;
- ``compile``: ``torch.compile`` on each block before DDP or ``fully_shard`` (as torchtitan
  compiles), its cache filled by an earlier run of the same job;
- ``replicated``: eager with every rank holding the whole model (no sharding), for memory.

The package is byte-compiled first, as installing it does (a checkout run from source, under
``PYTHONDONTWRITEBYTECODE``, would compile its modules in every process).

"First step" is the wall time from just before the parent starts a rank to that rank's first
loss; "after the built model" is the same from the moment the model exists (``ours`` imports
torch_precompile at the start, as a training script does at its top with torch). A rank's first
step waits in its first collective for the slowest rank to finish building its model, so that
number also holds how far apart the ranks built theirs (code common to every mode, up to 0.3 s
apart here); "after every rank's model" is the job's view without it: from the moment the last
rank has built its model to the last rank's first loss. Steady state is
the median step after warm-up. Peak memory is the rank's peak resident set (``ru_maxrss``)
minus its resident set just before the model is built: what the model, its gradients, the
step's activations and gathered parameters, and each mode's own machinery add. Each cell is
the slowest (or largest) rank, median over runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from distributed import Block, step, tp_plan

MARKER = "DATA_PARALLEL_RESULT "
MODES = ("ours", "eager", "compile", "replicated")
JOBS = {"ddp": 2, "fsdp": 2, "fsdp_tp": 4}
TITLES = {"ddp": "DDP", "fsdp": "FSDP2", "fsdp_tp": "FSDP2 x TP"}
CHILD_TIMEOUT_S = 1200


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model(job: str, mode: str, args: argparse.Namespace) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    world = JOBS[job]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(args.dim) for _ in range(args.blocks)))
    if mode == "replicated":
        return model
    if job == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        for block in model if mode == "compile" else ():
            block.compile(dynamic=False)
        return DistributedDataParallel(model)
    mesh = init_device_mesh(
        "cpu",
        (2, world // 2) if job == "fsdp_tp" else (world,),
        mesh_dim_names=("dp", "tp") if job == "fsdp_tp" else ("dp",),
    )
    dp = mesh["dp"] if job == "fsdp_tp" else mesh
    for block in model:
        if job == "fsdp_tp":
            parallelize_module(block, mesh["tp"], tp_plan())
        if mode == "compile":
            block.compile(dynamic=False)
        fully_shard(block, mesh=dp)
    return fully_shard(model, mesh=dp)


def _batch(job: str, rank: int, args: argparse.Namespace) -> torch.Tensor:
    replicas = 2
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(replicas * args.batch, args.seq, args.dim, generator=generator)
    replica = rank // (JOBS[job] // replicas) if job == "fsdp_tp" else rank
    return x.chunk(replicas)[replica]


def child(
    job: str, mode: str, rank: int, port: int, t0: float, workdir: Path, args: argparse.Namespace
) -> None:
    import torch.distributed as dist

    if mode in ("ours", "build"):
        import torch_precompile  # noqa: F401  (a script imports it at its top, with torch)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=JOBS[job],
        timeout=datetime.timedelta(seconds=900),
    )
    before = _rss_mb()
    model = _model(job, mode, args)
    x = _batch(job, rank, args)
    built, built_at = time.perf_counter(), time.time()
    result: dict[str, Any] = {"rank": rank, "built_at": built_at}
    if mode == "build":
        from torch_precompile import precompile

        pair = precompile(step, model, x, compile_on_one_rank=True)
        result["build_s"] = time.perf_counter() - built
        if rank == 0:
            precompile.save(*pair, workdir / f"{job}.py")
    else:
        if mode == "ours":
            from torch_precompile import precompile

            run: Any = precompile.load_file(workdir / f"{job}.py")
        else:
            run = step
        loss = run(model, x)
        result["first_at"] = time.time()
        result["first_s"] = result["first_at"] - t0
        result["after_model_s"] = time.perf_counter() - built
        result["loss"] = float(loss)
        times = []
        for i in range(args.steps + 3):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            run(model, x)
            if i >= 3:
                times.append(time.perf_counter() - start)
        result["steady_ms"] = statistics.median(times) * 1e3
        result["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    dist.barrier()
    dist.destroy_process_group()
    print(MARKER + json.dumps(result), flush=True)


def byte_compile_package() -> None:
    """Write torch_precompile's .pyc files, as ``pip install`` does."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("torch_precompile")
    assert spec is not None and spec.submodule_search_locations
    compileall.compile_dir(next(iter(spec.submodule_search_locations)), quiet=1)


def launch(
    job: str, mode: str, workdir: Path, cache_dir: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
    }
    options = [f"--{k}={getattr(args, k)}" for k in ("dim", "blocks", "batch", "seq", "steps")]
    t0 = time.time()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                job,
                mode,
                str(rank),
                str(port),
                repr(t0),
                str(workdir),
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for rank in range(JOBS[job])
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
        lines = [line for line in out.splitlines() if line.startswith(MARKER)]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{job} {mode} failed:\n{out[-3000:]}")
        results.append(json.loads(lines[-1][len(MARKER) :]))
    return results


def measure(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for job in args.jobs.split(","):
            ours_cache, compile_cache = workdir / f"{job}-ours", workdir / f"{job}-compile"
            build = launch(job, "build", workdir, ours_cache, args)
            samples[f"{job}/build_s"] = [max(r["build_s"] for r in build)]
            launch(job, "compile", workdir, compile_cache, args)  # fills its cache
            for _ in range(args.runs):
                for mode in MODES:
                    cache = workdir / f"{job}-{mode}-run"
                    shutil.rmtree(cache, ignore_errors=True)
                    if mode == "compile":
                        shutil.copytree(compile_cache, cache)
                    ranks = launch(job, mode, workdir, cache, args)
                    for key in ("first_s", "after_model_s", "steady_ms", "peak_mb"):
                        samples.setdefault(f"{job}/{mode}/{key}", []).append(
                            max(r[key] for r in ranks)
                        )
                    samples.setdefault(f"{job}/{mode}/after_all_built_s", []).append(
                        max(r["first_at"] for r in ranks) - max(r["built_at"] for r in ranks)
                    )
                    samples[f"{job}/{mode}/loss"] = ranks[0]["loss"]
    return samples


def report(samples: dict[str, Any], args: argparse.Namespace) -> str:
    def cell(key: str, digits: int) -> str:
        return f"{statistics.median(samples[key]):,.{digits}f}"

    jobs = args.jobs.split(",")
    names = {
        "ours": "torch_precompile, cache",
        "eager": "eager {title}",
        "compile": "torch.compile per block, warm cache",
        "replicated": "eager, model replicated (no sharding)",
    }
    lines = [
        f"# Data parallelism: {', '.join(TITLES[job] for job in jobs)} training steps",
        "",
        f"Written by `benchmarks/data_parallel.py --runs {args.runs} --jobs {args.jobs}`. "
        f"{args.blocks} "
        f"transformer blocks of width {args.dim} (4 heads, MLP 4x), per-replica batch "
        f"{args.batch}, sequence {args.seq}; `fn` = forward, mean-square loss, backward. "
        "DDP: the stack in `DistributedDataParallel` over 2 ranks. "
        "FSDP2: `fully_shard` on each block and the root over 2 ranks. FSDP2 x TP: each block "
        "tensor-parallel on `tp` and `fully_shard` on `dp` of a (2, 2) mesh, 4 ranks. Medians "
        f"of {args.runs} fresh-process runs; each number is the slowest (largest) rank.",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} "
        f"CPUs ({platform.machine()}), OMP_NUM_THREADS=1 per rank",
        f"- {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "Peak memory counts everything a rank's resident set gains after the process group "
        "exists: tensors, and the code each mode loads on the way (FSDP2 and DTensor, torch's "
        "compiler stack, kernels). At this model size (3.2 M parameters, 12.6 MB in float32) "
        "that code is a large part of it; the replicated row loads neither FSDP2 nor DTensor.",
        "",
        '"After the built model" is from the moment a rank has its model to its first loss; a '
        "rank waits there, in its first collective, for the slowest rank to build its model, "
        "which takes the same code in every mode. \"After every rank's model\" is the job's "
        "view without that spread: from the moment the last rank has its model to the last "
        "rank's first loss.",
        "",
    ]
    for job in jobs:
        world = JOBS[job]
        losses = ", ".join(f"{m} {samples[f'{job}/{m}/loss']:.6f}" for m in MODES)
        lines += [
            f"## {TITLES[job]}, {world} ranks",
            "",
            f"First losses (rank 0): {losses}. Building the pair (compile_on_one_rank): "
            f"{samples[f'{job}/build_s'][0]:.1f} s.",
            "",
            "| mode | first step, s | after the built model, s | after every rank's model, s | "
            "steady step, ms | peak memory, MB |",
            "|---|---:|---:|---:|---:|---:|",
            *(
                f"| {names[m].format(title=TITLES[job])} | {cell(f'{job}/{m}/first_s', 2)} | "
                f"{cell(f'{job}/{m}/after_model_s', 3)} | "
                f"{cell(f'{job}/{m}/after_all_built_s', 3)} | {cell(f'{job}/{m}/steady_ms', 1)} | "
                f"{cell(f'{job}/{m}/peak_mb', 1)} |"
                for m in MODES
            ),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--jobs", default="fsdp,fsdp_tp", help=f"among {','.join(JOBS)}")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("DATA_PARALLEL.md"))
    parser.add_argument("--child", nargs=6)
    args = parser.parse_args()
    if args.child:
        job, mode, rank, port, t0, workdir = args.child
        child(job, mode, int(rank), int(port), float(t0), Path(workdir), args)
        return
    byte_compile_package()
    samples = measure(args)
    text = report(samples, args)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
