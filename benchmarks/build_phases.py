"""Where a build's time goes as the model deepens: tracing, Inductor's Python, the C++ compiler.

    .venv/bin/python benchmarks/build_phases.py                  # writes BUILD_PHASES.md
    .venv/bin/python benchmarks/build_phases.py --depths 2,24 --modes train --runs 1

The model is that of ``build_time.py``: N identical transformer blocks (``coldstart.Block``),
one forward under ``torch.no_grad()`` (``infer``) or a training step (``train``). Each build
runs ``precompile()`` (default ``wrapper="auto"``) in a fresh process with empty Inductor and
temp dirs. Its time is split into the trace (the progress log's step), the C++ compiler's wall
time (every compiler run Inductor starts, overlapping runs counted once) and the rest of the
lowering (Inductor's Python: lowering, scheduling, code generation). Beside them: the compiler
runs, the kernels the artifact defines (identical ones are defined once) and the kernel calls
its wrapper makes (one per kernel per block).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from build_time import run_cold, write_report

HERE = Path(__file__).resolve().parent
RESULT = "BUILD_PHASES_RESULT "

_CHILD = r"""
import contextlib, json, logging, re, sys, threading, time
import torch
from torch import nn
import torch._inductor.cpp_builder as cpp_builder
logging.getLogger().setLevel(logging.ERROR)
steps = {{}}


class Steps(logging.Handler):
    def emit(self, record):
        done = re.match(r"(\w+).*: done in ([0-9.]+) s$", record.getMessage())
        if done:
            steps[done[1]] = float(done[2])


progress = logging.getLogger("torch_precompile.progress")
progress.setLevel(logging.INFO)
progress.addHandler(Steps())
progress.propagate = False
runs, lock, compile_command = [], threading.Lock(), cpp_builder.run_compile_cmd


def timed(*args, **kwargs):
    start = time.perf_counter()
    try:
        return compile_command(*args, **kwargs)
    finally:
        with lock:
            runs.append((start, time.perf_counter()))


cpp_builder.run_compile_cmd = timed
sys.path.insert(0, {benchmarks!r})
from coldstart import Block, infer, train_step
from torch_precompile import precompile
depth, mode = {depth}, {mode!r}
torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range(depth)])
inputs = (torch.randn(4, 32, 64),)
fn = train_step if mode == "train" else infer
if mode == "train":
    inputs += (torch.randn(4, 32, 64),)
else:
    model.eval()
start = time.perf_counter()
with torch.no_grad() if mode == "infer" else contextlib.nullcontext():
    code, cache = precompile(fn, model, *inputs)
seconds = time.perf_counter() - start
wall, end = 0.0, 0.0  # the union of the compiler runs' intervals
for a, b in sorted(runs):
    wall += max(0.0, b - max(a, end))
    end = max(end, b)
defined = set(re.findall(r"\b(cpp_fused_\w+) = ", code)) or set(
    re.findall(r"\b(cpp_fused_\w+)\(", code))
calls = len(re.findall(r"\bcpp_fused_\w+\(", code))
print({marker!r} + json.dumps({{
    "seconds": seconds, "trace": steps.get("tracing"), "lower": steps.get("lowering"),
    "compiler": wall, "compiler_runs": len(runs), "kernels": len(defined), "calls": calls,
    "wrapper": "C++" if "cpp_wrapper_src" in code else "Python"}}))
"""


def build_once(depth: int, mode: str) -> dict[str, float | str]:
    """One cold build in a fresh process, split into its phases."""
    script = _CHILD.format(benchmarks=str(HERE), depth=depth, mode=mode, marker=RESULT)
    return run_cold(lambda tmp: script, RESULT, f"depth {depth} ({mode})")


def measure(depth: int, mode: str, runs: int) -> dict[str, float | str]:
    results = [build_once(depth, mode) for _ in range(runs)]
    summary: dict[str, float | str] = {"wrapper": str(results[0]["wrapper"])}
    for key in ("seconds", "trace", "lower", "compiler", "compiler_runs", "kernels", "calls"):
        summary[key] = statistics.median(float(r[key] or 0.0) for r in results)
    return summary


def table(rows: dict[tuple[int, str], dict[str, float | str]]) -> list[str]:
    head = (
        "| mode | blocks | build s | trace s | Inductor's Python s | C++ compiler s (runs) "
        "| kernels defined | kernel calls | wrapper |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (depth, mode), r in rows.items():
        python = float(r["lower"]) - float(r["compiler"])
        lines.append(
            f"| {mode} | {depth} | {float(r['seconds']):.1f} | {float(r['trace']):.1f} "
            f"| {python:.1f} | {float(r['compiler']):.1f} ({float(r['compiler_runs']):.0f}) "
            f"| {float(r['kernels']):.0f} | {float(r['calls']):.0f} | {r['wrapper']} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="2,12,24")
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "BUILD_PHASES.md")
    args = parser.parse_args()
    rows: dict[tuple[int, str], dict[str, float | str]] = {}
    for mode in args.modes.split(","):
        for depth in (int(d) for d in args.depths.split(",")):
            rows[(depth, mode)] = measure(depth, mode, args.runs)
            print(depth, mode, rows[(depth, mode)], flush=True)
    write_report(
        args.out,
        "Where a build's time goes at depth",
        f"{args.runs} fresh process(es) per row, median; every build cold",
        f"build_phases.py --runs {args.runs}",
        table(rows),
    )


if __name__ == "__main__":
    main()
