"""Per-call cost of the artifact, one checkout against another, side by side.

    .venv/bin/python benchmarks/driver_cost.py --src /path/to/other/checkout/src [--rounds 3]

For each workload of ``coldstart.py`` named in ``--workloads`` (default ``mlp,deep``) and each
``src`` (this checkout's first, then ``--src``), a fresh process builds the inductor artifact,
loads it, warms it up and times single calls (under ``torch.no_grad()``, batch as in
``coldstart.py``). Rounds alternate between the checkouts so drift of the machine hits both;
the table shows the median over rounds of each process's median call, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

_CHILD = r"""
import json, logging, sys, time, torch
logging.disable(logging.WARNING)
sys.path.insert(0, {benchmarks!r})
from coldstart import build_workload
from torch_precompile import precompile
fn, model, inputs = build_workload({workload!r})
code, cache = precompile(fn, model, *inputs)
run = precompile.load(code, cache)
times = []
with torch.no_grad():
    for _ in range(100):
        run(model, *inputs)
    for _ in range({calls}):
        start = time.perf_counter()
        run(model, *inputs)
        times.append(time.perf_counter() - start)
times.sort()
print("RESULT", json.dumps({{"median_us": times[len(times) // 2] * 1e6}}))
"""


def measure(src: Path, workload: str, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    script = _CHILD.format(benchmarks=str(HERE), workload=workload, calls=calls)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900, cwd="/tmp")
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{workload} with {src} failed:\n{done.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="the other checkout's src/")
    parser.add_argument("--workloads", default="mlp,deep")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    sources = {"this checkout": HERE.parent / "src", "other": args.src.resolve()}
    print("| workload | this checkout, us per call | other, us per call | ratio |")
    print("|---|---:|---:|---:|")
    for workload in args.workloads.split(","):
        results: dict[str, list[float]] = {name: [] for name in sources}
        for _ in range(args.rounds):
            for name, src in sources.items():
                results[name].append(measure(src, workload, args.calls)["median_us"])
        ours, other = (statistics.median(results[name]) for name in sources)
        print(f"| {workload} | {ours:.1f} | {other:.1f} | {ours / other:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
