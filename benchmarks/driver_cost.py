"""Per-call cost of the artifact, one checkout against another, side by side in one process.

    .venv/bin/python benchmarks/driver_cost.py --src /path/to/other/checkout/src [--rounds 20]

For each workload of ``coldstart.py`` named in ``--workloads`` (default ``mlp,deep``), each
checkout (this one, and the one whose ``src/`` is ``--src``) builds its inductor artifact pair in
a fresh process. One more fresh process loads both pairs with this checkout's ``load`` and times
single calls (under ``torch.no_grad()``, batch as in ``coldstart.py``, one thread), alternating
between the two artifacts in blocks of ``--calls`` so that drift of the machine hits both alike.
The table shows each artifact's median call, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

_BUILD = r"""
import logging, sys, torch
logging.disable(logging.WARNING)
sys.path.insert(0, {benchmarks!r})
from coldstart import build_workload
from torch_precompile import precompile
fn, model, inputs = build_workload({workload!r})
with torch.no_grad():  # an inference artifact, as a server builds it
    code, cache = precompile(fn, model, *inputs)
open({out!r} + ".py", "w").write(code)
open({out!r} + ".cache", "wb").write(cache)
"""

_MEASURE = r"""
import json, logging, sys, time, torch
logging.disable(logging.WARNING)
torch.set_num_threads(1)  # kernels' scheduling noise would drown the driver's cost
sys.path.insert(0, {benchmarks!r})
from coldstart import build_workload
from torch_precompile import precompile
_, model, inputs = build_workload({workload!r})
runs = [precompile.load(open(p + ".py").read(), open(p + ".cache", "rb").read())
        for p in {paths!r}]
times = [[] for _ in runs]
with torch.no_grad():
    for run in runs:
        for _ in range(100):
            run(model, *inputs)
    for _ in range({rounds}):
        for run, kept in zip(runs, times):
            for _ in range({calls}):
                start = time.perf_counter()
                run(model, *inputs)
                kept.append(time.perf_counter() - start)
print("RESULT", json.dumps([sorted(t)[len(t) // 2] * 1e6 for t in times]))
"""


def _run(script: str, src: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd="/tmp",
    )
    if done.returncode != 0:
        raise RuntimeError(f"a child with {src} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="the other checkout's src/")
    parser.add_argument("--workloads", default="mlp,deep")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    here = HERE.parent / "src"
    print("| workload | this checkout, us per call | other, us per call | ratio |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            paths = [str(Path(tmp) / f"{workload}-{side}") for side in ("this", "other")]
            for src, out in zip((here, args.src.resolve()), paths, strict=True):
                _run(_BUILD.format(benchmarks=str(HERE), workload=workload, out=out), src)
            output = _run(
                _MEASURE.format(
                    benchmarks=str(HERE),
                    workload=workload,
                    paths=paths,
                    rounds=args.rounds,
                    calls=args.calls,
                ),
                here,
            )
            line = next(x for x in output.splitlines() if x.startswith("RESULT "))
            ours, other = json.loads(line.removeprefix("RESULT "))
            print(f"| {workload} | {ours:.1f} | {other:.1f} | {ours / other:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
