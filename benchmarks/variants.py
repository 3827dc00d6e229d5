"""Per call with 3 variants in one artifact against 1: what picking a variant costs.

    .venv/bin/python benchmarks/variants.py                # writes benchmarks/VARIANTS.md

One fresh child process per workload (``mlp`` and ``block`` of per_call.py, inference) with its
own Inductor cache. It builds, for batch sizes 1, 4 and 16, one single-variant artifact per
batch (``precompile``) and one artifact holding all three (a ``capture`` block of three calls),
checks every result against eager, then times in alternating rounds (``--calls`` calls each,
one thread; a cell is the median over rounds of each round's median call):

- "1 variant": the single-variant artifact of that batch;
- "3 variants, same batch": the three-variant artifact, called with that batch again and again
  (the variant that ran last is tried first);
- "3 variants, rotating": the three-variant artifact called with batches 1, 4, 16, 1, ... in
  turn, so that every call first fails the last variant's checks; each call is timed alone
  and the cell is its batch's calls. "1 variant, rotating" is the same stream over the three
  single-variant artifacts (the caller picks the artifact).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKLOADS = ("mlp", "block")
BATCHES = (1, 4, 16)
MODES = ("1 variant", "3 variants, same batch", "1 variant, rotating", "3 variants, rotating")


def _artifacts(workload: str, workdir: Path) -> tuple[Any, dict[int, tuple], dict[int, Any], Any]:
    """(fn, per-batch arguments, per-batch single-variant artifacts, three-variant one)."""
    from torch_precompile import capture, precompile

    sys.path.insert(0, str(HERE))
    from per_call import build

    calls = {}
    for batch in BATCHES:
        fn, model, inputs = build(workload, batch)
        calls[batch] = (model, *inputs)
    model = calls[BATCHES[0]][0]
    calls = {b: (model, *args[1:]) for b, args in calls.items()}  # one model for all
    single = {b: precompile.load(*precompile(fn, *args)) for b, args in calls.items()}
    path = workdir / "variants.py"
    with capture(fn, artifact_path=path) as cap:
        for args in calls.values():
            cap(*args)
    return fn, calls, single, precompile.load(path)


def _timed(run: Callable[..., Any], args: tuple) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def child(workload: str, rounds: int, calls: int) -> None:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir, torch.no_grad():
        fn, arguments, single, variants = _artifacts(workload, Path(workdir))
        for batch, args in arguments.items():
            for run in (single[batch], variants):
                if not torch.allclose(run(*args), fn(*args), rtol=1e-4, atol=1e-5):
                    raise SystemExit(f"{workload} batch {batch}: a result differs from eager")
        cells: dict[tuple[str, int], list[float]] = {}
        for _ in range(rounds):
            for batch, args in arguments.items():
                for mode, run in (
                    ("1 variant", single[batch]),
                    ("3 variants, same batch", variants),
                ):
                    for _ in range(calls // 5):
                        run(*args)
                    times = [_timed(run, args) for _ in range(calls)]
                    cells.setdefault((mode, batch), []).append(statistics.median(times))
            for mode in ("1 variant, rotating", "3 variants, rotating"):
                times: dict[int, list[float]] = {b: [] for b in BATCHES}
                for _ in range(calls):
                    for batch, args in arguments.items():
                        run = single[batch] if mode.startswith("1") else variants
                        times[batch].append(_timed(run, args))
                for batch in BATCHES:
                    cells.setdefault((mode, batch), []).append(statistics.median(times[batch]))
    print(
        json.dumps(
            {f"{mode}|{batch}": statistics.median(v) * 1e6 for (mode, batch), v in cells.items()}
        )
    )


def measure(workload: str, rounds: int, calls: int) -> dict[tuple[str, int], float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="variants_"))
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            workload,
            "--rounds",
            str(rounds),
            "--calls",
            str(calls),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{workload} failed:\n{proc.stderr[-3000:]}")
    cells = json.loads(proc.stdout.strip().splitlines()[-1])
    return {(key.split("|")[0], int(key.split("|")[1])): value for key, value in cells.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=HERE / "VARIANTS.md")
    parser.add_argument("--child", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rounds, args.calls)
        return
    import torch

    sys.path.insert(0, str(HERE))
    from coldstart import interpreter

    lines = [
        "| workload | batch | " + " | ".join(f"{m} us" for m in MODES) + " |",
        "|---|---:|" + "---:|" * len(MODES),
    ]
    for workload in args.workloads.split(","):
        cells = measure(workload, args.rounds, args.calls)
        print(workload, cells, flush=True)
        for batch in BATCHES:
            lines.append(
                f"| {workload} | {batch} | "
                + " | ".join(f"{cells[(m, batch)]:,.1f}" for m in MODES)
                + " |"
            )
    text = "\n".join(
        [
            "# Per call: one artifact with 3 variants against single-variant artifacts",
            "",
            f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} cores, "
            f"one thread; {args.rounds} rounds of {args.calls} calls. Rerun with "
            f"`{interpreter()} benchmarks/variants.py`.",
            "",
            *lines,
            "",
        ]
    )
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
