"""A 2-rank tensor-parallel training step of a transformer block: build, first result, steady.

    .venv/bin/python benchmarks/distributed.py --runs 3     # writes benchmarks/DISTRIBUTED.md

Every measurement starts fresh processes, one per rank, on gloo over 127.0.0.1 (this script
with ``--child``), each with OMP_NUM_THREADS=1 and its own empty Inductor cache dir, except
``torch.compile warm``, whose cache dir was filled by an earlier run of the same step. "First
result" is the wall time from just before the parent starts a rank's process to the moment that
rank has its first loss. "import torch + process group" is the same for a child that only
imports torch, joins the process group and builds the device mesh; "tensor-parallel imports"
also imports ``torch.distributed.tensor.parallel`` (which any such job imports); "torch._dynamo"
also imports that, which torch's ``distribute_tensor`` does on its first call (through its
dynamo-disable wrapper), whatever runs the step; "model built" also builds the block and
parallelizes it (every mode does that before its first step). Build
time is the wall time of the ``precompile`` call on each rank (max over ranks). Steady state is
the median of per-step times after warm-up, each step putting fresh gradients on ``.grad``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
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

WORLD = 2
DIM, HEADS, BATCH, SEQ = 64, 4, 8, 64
MARKER = "DISTRIBUTED_RESULT "
# The job's own setup, step by step: what each of these modes imports after the process group.
SETUP_IMPORTS = {
    "baseline": (),
    "imports": ("torch.distributed.tensor.parallel",),
    # what parallelize_module's first distribute_tensor imports
    "dynamo": ("torch.distributed.tensor.parallel", "torch._dynamo"),
}
SETUP_MODES = (*SETUP_IMPORTS, "model")
FIRST_MODES = (*SETUP_MODES, "ours", "eager", "compile")
BUILD_MODES = ("build_every", "build_one")
CHILD_TIMEOUT_S = 900


class Block(torch.nn.Module):
    """Pre-norm block: causal self-attention (separate q, k, v, o projections) and a GELU MLP."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.head_dim = dim // HEADS
        self.ln_attn, self.ln_mlp = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.fc_in, self.fc_out = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_attn(x)
        batch, seq, _ = x.shape
        split = [
            p(h).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for p in (self.wq, self.wk, self.wv)
        ]  # local heads under tensor parallelism
        attended = torch.nn.functional.scaled_dot_product_attention(*split, is_causal=True)
        x = x + self.wo(attended.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.fc_out(torch.nn.functional.gelu(self.fc_in(self.ln_mlp(x))))


def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


def _parallel_model(mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    return parallelize_module(Block(), mesh, tp_plan())


def tp_plan() -> dict[str, Any]:
    """The block's tensor-parallel plan: q, k, v, fc_in colwise; o, fc_out rowwise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "wq": ColwiseParallel(),
        "wk": ColwiseParallel(),
        "wv": ColwiseParallel(),
        "wo": RowwiseParallel(),
        "fc_in": ColwiseParallel(),
        "fc_out": RowwiseParallel(),
    }


def _steady_ms(run: Any, model: torch.nn.Module, x: torch.Tensor, steps: int) -> float:
    times = []
    for i in range(steps + 5):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        run(model, x)
        if i >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def child(mode: str, rank: int, port: int, t0: float, workdir: Path, steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    result: dict[str, Any] = {"rank": rank}
    if mode in SETUP_IMPORTS:
        for module in SETUP_IMPORTS[mode]:
            importlib.import_module(module)
        result["first_s"] = time.time() - t0
    elif mode == "model":  # what every mode does before its first step
        _parallel_model(mesh)
        result["first_s"] = time.time() - t0
    elif mode in BUILD_MODES:
        from torch_precompile import precompile

        model, x = _parallel_model(mesh), torch.randn(BATCH, SEQ, DIM)
        start = time.perf_counter()
        pair = precompile(step, model, x, compile_on_one_rank=mode == "build_one")
        result["build_s"] = time.perf_counter() - start
        if mode == "build_one":
            (workdir / f"rank{rank}").mkdir(parents=True, exist_ok=True)
            precompile.save(*pair, workdir / f"rank{rank}" / "step.py")
    else:
        model, x = _parallel_model(mesh), torch.randn(BATCH, SEQ, DIM)
        built = time.perf_counter()
        if mode == "ours":
            from torch_precompile import precompile

            run = precompile.load_file(workdir / f"rank{rank}" / "step.py")
        else:
            run = torch.compile(step, dynamic=False) if mode == "compile" else step
        loss = run(model, x)
        result["first_s"] = time.time() - t0
        result["after_model_s"] = time.perf_counter() - built
        result["loss"] = float(loss)
        result["steady_ms"] = _steady_ms(run, model, x, steps)
    dist.barrier()
    dist.destroy_process_group()
    print(MARKER + json.dumps(result), flush=True)


def launch(mode: str, workdir: Path, cache_dir: Path, steps: int) -> list[dict[str, Any]]:
    """Start one process per rank; each rank's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    procs = []
    for rank in range(WORLD):
        t0 = time.time()
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    mode,
                    "--rank",
                    str(rank),
                    "--port",
                    str(port),
                    "--t0",
                    repr(t0),
                    "--workdir",
                    str(workdir),
                    "--steps",
                    str(steps),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        lines = [line for line in out.splitlines() if line.startswith(MARKER)]
        if proc.returncode or not lines:
            raise RuntimeError(f"{mode}: a rank failed:\n{err[-3000:]}")
        results.append(json.loads(lines[-1][len(MARKER) :]))
    return results


def measure(runs: int, steps: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    root = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    warm_cache = root / "compile-cache"
    try:
        launch("compile", root, warm_cache, steps)  # fills the warm torch.compile cache
        for run in range(runs):
            workdir = root / f"run{run}"
            for mode in BUILD_MODES:
                ranks = launch(mode, workdir, workdir / f"cache-{mode}", steps)
                samples.setdefault(mode, []).append(max(r["build_s"] for r in ranks))
            for mode in FIRST_MODES:
                cache = warm_cache if mode == "compile" else workdir / f"cache-{mode}"
                ranks = launch(mode, workdir, cache, steps)
                samples.setdefault(f"{mode}:first", []).append(max(r["first_s"] for r in ranks))
                if mode not in SETUP_MODES:
                    samples.setdefault(f"{mode}:steady", []).append(
                        max(r["steady_ms"] for r in ranks)
                    )
                    samples.setdefault(f"{mode}:loss", []).append(ranks[0]["loss"])
                    samples.setdefault(f"{mode}:after_model", []).append(
                        max(r["after_model_s"] for r in ranks)
                    )
            print(
                f"run {run + 1}/{runs}: "
                + ", ".join(f"{k} {v[-1]:.3f}" for k, v in samples.items()),
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return samples


def report(samples: dict[str, list[float]], runs: int, steps: int) -> str:
    med = {key: statistics.median(values) for key, values in samples.items()}
    base = med["baseline:first"]
    losses = {mode: samples[f"{mode}:loss"][0] for mode in ("ours", "eager", "compile")}
    lines = [
        "# Distributed: a 2-rank tensor-parallel training step",
        "",
        f"Written by `benchmarks/distributed.py --runs {runs} --steps {steps}`. Transformer "
        f"block (dim {DIM}, {HEADS} heads, MLP 4x) under `parallelize_module` (q, k, v, fc_in "
        f"colwise; o, fc_out rowwise) on a (2,) gloo mesh over 127.0.0.1; batch {BATCH}, "
        f"sequence {SEQ}; `fn` = forward, mean-square loss, backward. Medians of {runs} "
        "fresh-process runs; each number is the slower of the two ranks.",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), OMP_NUM_THREADS=1 per rank",
        f"- {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- first losses agree: ours {losses['ours']:.6f}, eager {losses['eager']:.6f}, "
        f"torch.compile {losses['compile']:.6f}",
        "",
        "## First result per rank (process start to first loss)",
        "",
        "| mode | seconds | x (import torch + process group) | x (... + model built) |",
        "|---|---:|---:|---:|",
    ]
    names = {
        "baseline": "import torch + process group + mesh",
        "imports": "... + DTensor and tensor-parallel imports",
        "dynamo": "... + torch._dynamo (imported by the first distribute_tensor)",
        "model": "... + model built and parallelized",
        "ours": "torch_precompile, cache",
        "eager": "eager",
        "compile": "torch.compile, warm cache",
    }
    built = med["model:first"]
    for mode in FIRST_MODES:
        lines.append(
            f"| {names[mode]} | {med[f'{mode}:first']:.2f} | "
            f"{med[f'{mode}:first'] / base:.2f} | {med[f'{mode}:first'] / built:.2f} |"
        )
    lines += [
        "",
        "From the built model to the first loss, inside the same processes (what each "
        "mode itself adds: imports, loading, compiling, the first step):",
        "",
        "| mode | seconds |",
        "|---|---:|",
    ]
    for mode in ("ours", "eager", "compile"):
        lines.append(f"| {names[mode]} | {med[f'{mode}:after_model']:.3f} |")
    lines += [
        "",
        "## Build (wall time of the precompile call, slower rank)",
        "",
        "| how | seconds |",
        "|---|---:|",
        f"| every rank compiles | {med['build_every']:.1f} |",
        f"| compile_on_one_rank | {med['build_one']:.1f} |",
        "",
        "## Steady state per step",
        "",
        "| mode | ms | x torch.compile |",
        "|---|---:|---:|",
    ]
    for mode in ("ours", "eager", "compile"):
        lines.append(
            f"| {names[mode]} | {med[f'{mode}:steady']:.2f} | "
            f"{med[f'{mode}:steady'] / med['compile:steady']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).with_name("DISTRIBUTED.md")))
    parser.add_argument("--child", choices=(*FIRST_MODES, *BUILD_MODES))
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--t0", type=float)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rank, args.port, args.t0, args.workdir, args.steps)
        return
    text = report(measure(args.runs, args.steps), args.runs, args.steps)
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
