"""Pipeline stages as differentiable artifacts: first and steady step per rank, side by side.

    .venv/bin/python benchmarks/pipeline.py                # writes PIPELINE.md
    .venv/bin/python benchmarks/pipeline.py --runs 1

A 4-block GPT body (``differentiable.GPT``'s blocks, width 128, sequence 64) split into 2
stages on 2 ranks (gloo on 127.0.0.1), trained under ``Schedule1F1B`` with 4 micro-batches of
2 and AdamW. Each rank's stage module is, per tool:

- ``eager``: the stage itself;
- ``torch.compile``: ``torch.compile(stage)``, cold (empty Inductor cache and temp dir);
- ``module``: ``precompile.module(stage, artifact=precompile.load(pair))``, the pairs built
  beforehand by ``precompile.stages`` (their build time is reported apart).

"first step" is the wall time from the rank's process start (before ``import torch``) until
its first step's update; "per step" the median over ``--steps`` steps after three. Each cell
is the median over ``--runs`` runs of the slower rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from differentiable import MODEL, TIMING  # noqa: E402  (the same GPT blocks and timing)

RESULT = "PIPELINE_RESULT "
TOOLS = ("eager", "torch.compile", "module")

_RANK = r"""
import time
start = time.perf_counter()
import datetime, json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
namespace = {{}}
exec({model!r}, namespace)
tool, rank, world, port, steps, pairs = {tool!r}, {rank}, 2, {port}, {steps}, {pairs!r}
DIM, SEQ, MICRO = namespace["DIM"], namespace["SEQ"], 4
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=1800))


def make_stage(index):
    torch.manual_seed(index)
    stage = torch.nn.Sequential(*[namespace["Block"]() for _ in range(2)])
    return stage, (torch.randn(2, SEQ, DIM, requires_grad=index > 0),)


if tool == "build":
    from torch_precompile import precompile
    t = time.perf_counter()
    wrapped = precompile.stages(make_stage, world, rank)
    wrapped.save(pairs[rank])
    print({result!r} + json.dumps({{"build_s": time.perf_counter() - t}}))
    dist.destroy_process_group()
    sys.exit(0)
stage_module, _ = make_stage(rank)
if tool == "torch.compile":
    run = torch.compile(stage_module)
elif tool == "module":
    from torch_precompile import precompile
    run = precompile.module(stage_module, artifact=precompile.load(pairs[rank]))
else:
    run = stage_module
loss_fn = lambda out, target: torch.nn.functional.mse_loss(out, target)
schedule = Schedule1F1B(PipelineStage(run, rank, world, torch.device("cpu")), MICRO,
                        loss_fn=loss_fn)
opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)


def step(i):
    g = torch.Generator().manual_seed(i)
    x, t = torch.randn(8, SEQ, DIM, generator=g), torch.randn(8, SEQ, DIM, generator=g)
    opt.zero_grad()
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=t)
    opt.step()


step(0)
first = time.perf_counter() - start
exec({timing!r})
print({result!r} + json.dumps({{"first_s": first, "step_ms": steady_step_ms(step, steps)}}))
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(tool: str, steps: int, pairs: list[str], work: Path) -> list[dict[str, float]]:
    """Both ranks of one run; each rank's result."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env_dir = work / f"{tool}-{rank}"
        (env_dir / "tmp").mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": "lo",
            "TORCHINDUCTOR_CACHE_DIR": str(env_dir / "inductor"),
            "TMPDIR": str(env_dir / "tmp"),
        }
        code = _RANK.format(
            model=MODEL,
            tool=tool,
            rank=rank,
            port=port,
            steps=steps,
            pairs=pairs,
            result=RESULT,
            timing=TIMING,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        lines = [line for line in out.splitlines() if line.startswith(RESULT)]
        if proc.returncode or not lines:
            raise RuntimeError(err[-3000:])
        results.append(json.loads(lines[-1][len(RESULT) :]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=HERE / "PIPELINE.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs = [str(work / f"stage{rank}.py") for rank in range(2)]
        build = max(r["build_s"] for r in _world("build", 0, pairs, work / "build"))
        print(f"built both stages on rank 0 in {build:.1f} s")
        rows = {}
        for tool in TOOLS:
            runs = [_world(tool, args.steps, pairs, work / f"{tool}{n}") for n in range(args.runs)]
            rows[tool] = {
                key: statistics.median(max(r[key] for r in ranks) for ranks in runs)
                for key in ("first_s", "step_ms")
            }
            print(tool, json.dumps(rows[tool]))
    lines = [
        "# Pipeline stages: 2 ranks, Schedule1F1B, 4 micro-batches (4-block GPT body)",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; medians of {args.runs} runs of the slower rank, "
        f"{args.steps} steps each. Rerun: `.venv/bin/python benchmarks/pipeline.py`.",
        "",
        "| stage module | first step (s) | per step (ms) |",
        "|---|---:|---:|",
        *(
            f"| {tool} | {row['first_s']:.2f} | {row['step_ms']:.1f} |"
            for tool, row in rows.items()
        ),
        "",
        f"Both stages built on rank 0 by `precompile.stages` beforehand: {build:.1f} s.",
        "",
    ]
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
