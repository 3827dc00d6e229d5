"""Load time against depth: a transformer training step of 1 to 24 blocks, in fresh processes.

    .venv/bin/python benchmarks/load_depth.py [--depths 1,4,12,24] [--runs 5] [--src OTHER/src]

The workload is ``coldstart.py``'s pre-norm ``Block`` at width 256 (4 heads), stacked
``depth`` times in ``nn.Sequential``, in a training step (forward, MSE loss, backward) on a
batch of 4 sequences of 64. For each depth the inductor pair is built once (a fresh process),
then loaded ``--runs`` times, each in a fresh process that reports: ``import torch``, the
load (``precompile.load_file``: reading the pair, checking it, mapping the kernels, running
the module), the first call, and the median of 5 further calls. With ``--src`` the same is
measured for another checkout's ``src/`` (built and loaded with its own code), alternating
run by run. Each checkout's package is byte-compiled first, as installing it does. Medians;
the table goes to ``--out`` (default ``benchmarks/LOAD_DEPTH.md``).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
MARKER = "LOAD_DEPTH "

_BUILD = r"""
import logging, sys, torch, torch.nn as nn
logging.disable(logging.WARNING)
sys.path.insert(0, {benchmarks!r})
from coldstart import Block, train_step
from torch_precompile import precompile
torch.manual_seed(0)
model = nn.Sequential(*[Block(256, 4) for _ in range({depth})]).train()
x, t = torch.randn(4, 64, 256), torch.randn(4, 64, 256)
precompile.save(*precompile(train_step, model, x, t), {out!r})
"""

_LOAD = r"""
import time
start = time.perf_counter()
import torch
imported = time.perf_counter()
import json, logging, statistics, sys, torch.nn as nn
logging.disable(logging.WARNING)
sys.path.insert(0, {benchmarks!r})
from coldstart import Block
from torch_precompile import precompile
torch.manual_seed(0)
model = nn.Sequential(*[Block(256, 4) for _ in range({depth})]).train()
x, t = torch.randn(4, 64, 256), torch.randn(4, 64, 256)
before = time.perf_counter()
run = precompile.load_file({path!r})
loaded = time.perf_counter()
run(model, x, t)
first = time.perf_counter()
steps = []
for _ in range(5):
    began = time.perf_counter()
    run(model, x, t)
    steps.append(time.perf_counter() - began)
print({marker!r} + json.dumps({{"import_torch": imported - start, "load": loaded - before,
      "first_call": first - loaded, "steady": statistics.median(steps),
      "inductor_imported": "torch._inductor" in sys.modules}}))
"""


def run_in(script: str, src: Path) -> str:
    """Run ``script`` in a fresh process with ``src`` (a checkout's ``src/``) importable; its
    standard output."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return proc.stdout


def _measure(path: Path, depth: int, src: Path) -> dict[str, float]:
    out = run_in(
        _LOAD.format(benchmarks=str(HERE), depth=depth, path=str(path), marker=MARKER), src
    )
    line = next(line for line in out.splitlines() if line.startswith(MARKER))
    result = json.loads(line[len(MARKER) :])
    assert not result.pop("inductor_imported"), "a cached load imported Inductor"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--depths", default="1,4,12,24")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--src", type=Path, help="another checkout's src/, measured alongside")
    parser.add_argument("--out", type=Path, default=HERE / "LOAD_DEPTH.md")
    args = parser.parse_args()
    checkouts = {"this": SRC, **({"other": args.src.resolve()} if args.src else {})}
    for src in checkouts.values():
        compileall.compile_dir(src / "torch_precompile", quiet=1)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for depth in (int(d) for d in args.depths.split(",")):
            paths = {}
            for label, src in checkouts.items():
                paths[label] = Path(work) / f"{label}_{depth}.py"
                began = time.time()
                run_in(_BUILD.format(benchmarks=str(HERE), depth=depth, out=str(paths[label])), src)
                print(f"depth {depth}: {label} built in {time.time() - began:.0f} s", flush=True)
            samples: dict[str, list[dict[str, float]]] = {label: [] for label in checkouts}
            for _ in range(args.runs):
                for label, src in checkouts.items():
                    samples[label].append(_measure(paths[label], depth, src))
            for label in checkouts:
                median = {
                    key: statistics.median(s[key] for s in samples[label])
                    for key in samples[label][0]
                }
                size = paths[label].stat().st_size / 1024
                rows.append((depth, label, size, median))
                print(depth, label, {k: round(v * 1000, 1) for k, v in median.items()}, flush=True)
    _write(args, rows)


def _write(args: argparse.Namespace, rows: list) -> None:
    header = (
        "| blocks | checkout | source, KiB | import torch, ms | load, ms | first call, ms "
        "| steady step, ms |\n|---:|---|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {depth} | {label} | {size:.0f} | {m['import_torch'] * 1e3:.0f} | "
        f"{m['load'] * 1e3:.1f} | {m['first_call'] * 1e3:.0f} | {m['steady'] * 1e3:.0f} |\n"
        for depth, label, size, m in rows
    )
    other = f" `other` is `{args.src}`." if args.src else ""
    args.out.write_text(
        "# Load time against depth\n\n"
        f"`python benchmarks/load_depth.py --depths {args.depths} --runs {args.runs}"
        f"{' --src OTHER/src' if args.src else ''}`: medians of {args.runs} fresh processes "
        f"per row, torch {_torch_version()}, {os.cpu_count()} CPUs.{other} `load` is "
        "`precompile.load_file` on a saved inductor pair with its cache.\n\n" + header + body
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
