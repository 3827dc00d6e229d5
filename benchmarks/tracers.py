"""The two tracers side by side: build time, cold start, per call and guard cost.

For each workload (``coldstart.py``'s ``mlp``, ``block``, ``block_train``, ``deep``) an
artifact is built with ``tracer="make_fx"`` and one with ``tracer="dynamo"`` (inductor, the
Python wrapper), each in a fresh process; ``torch.compile``'s first call is timed beside them.
Each measurement runs in a fresh process with an empty Inductor cache of its own. Cold start
is ``import torch`` + load + first call; per call loads both artifacts in one process and
times their calls in alternating rounds (the median round), then their checks alone (the
driver's check function, run before the graph at every call, 2000 times a round); guard cost
is the difference of the checks, what Dynamo's guards added to a call. Medians over ``--runs``
processes.

    python benchmarks/tracers.py [--workloads mlp,block] [--runs 3] [--out benchmarks/TRACERS.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WORKLOADS = ("mlp", "block", "block_train", "deep")
TRACERS = ("make_fx", "dynamo")
_PATH = os.environ.get("PYTHONPATH")


def _child_build(workload: str, tracer: str, workdir: Path) -> dict[str, Any]:
    import torch

    from coldstart import NO_GRAD_WORKLOADS, build_workload
    from torch_precompile import precompile

    logging.getLogger("torch_precompile").setLevel(logging.ERROR)
    fn, model, inputs = build_workload(workload)
    start = time.perf_counter()
    with torch.no_grad() if workload in NO_GRAD_WORKLOADS else contextlib.nullcontext():
        code, cache = precompile(fn, model, *inputs, wrapper="python", tracer=tracer)
    seconds = time.perf_counter() - start
    (workdir / f"{tracer}.py").write_text(code)
    (workdir / f"{tracer}.cache").write_bytes(cache)
    spec = precompile.inspect(code)
    return {
        "seconds": seconds,
        "guards": sum(g.count for g in spec.guards),
        "reads": len(spec.read_values),
    }


def _child_compile(workload: str) -> dict[str, Any]:
    import torch

    from coldstart import NO_GRAD_WORKLOADS, build_workload, compiled

    fn, model, inputs = build_workload(workload)
    start = time.perf_counter()
    with torch.no_grad() if workload in NO_GRAD_WORKLOADS else contextlib.nullcontext():
        compiled(workload, fn)(model, *inputs)
    return {"seconds": time.perf_counter() - start}


def _child_cold(workload: str, tracer: str, workdir: Path) -> dict[str, Any]:
    start = time.perf_counter()
    import torch

    imported = time.perf_counter() - start
    from coldstart import NO_GRAD_WORKLOADS, build_workload
    from torch_precompile import precompile

    logging.getLogger("torch_precompile").setLevel(logging.ERROR)
    _, model, inputs = build_workload(workload)
    built = time.perf_counter()
    run = precompile.load(
        (workdir / f"{tracer}.py").read_text(), (workdir / f"{tracer}.cache").read_bytes()
    )
    grad = torch.no_grad() if workload in NO_GRAD_WORKLOADS else contextlib.nullcontext()
    with grad:
        run(model, *inputs)
    return {"import": imported, "first": time.perf_counter() - built + imported}


def _child_steady(workload: str, workdir: Path, calls: int, rounds: int) -> dict[str, Any]:
    """Both artifacts in one process, their calls timed in alternating rounds: the
    difference of their medians is what the dynamo artifact's extra checks cost."""
    import torch

    from coldstart import NO_GRAD_WORKLOADS, build_workload
    from torch_precompile import precompile

    logging.getLogger("torch_precompile").setLevel(logging.ERROR)
    _, model, inputs = build_workload(workload)
    runs = {
        t: precompile.load((workdir / f"{t}.py").read_text(), (workdir / f"{t}.cache").read_bytes())
        for t in TRACERS
    }
    per_call: dict[str, list[float]] = {t: [] for t in TRACERS}
    grad = torch.no_grad() if workload in NO_GRAD_WORKLOADS else contextlib.nullcontext()
    with grad:
        for run in runs.values():
            for _ in range(20):
                run(model, *inputs)
        for _ in range(rounds):
            for tracer, run in runs.items():
                start = time.perf_counter()
                for _ in range(calls):
                    run(model, *inputs)
                per_call[tracer].append((time.perf_counter() - start) / calls * 1e6)
        checks = _check_cost(runs, (model, *inputs), rounds)
    return {t: statistics.median(v) for t, v in per_call.items()} | checks


def _check_cost(runs: dict[str, Any], args: tuple[Any, ...], rounds: int) -> dict[str, float]:
    """Each artifact's checks alone (its driver's generated check function, which runs before
    the graph at every call), timed in alternating rounds of many calls: the guard cost, free
    of the graph's own noise."""
    checked = {t: run._forward.checked for t, run in runs.items()}
    per_check: dict[str, list[float]] = {t: [] for t in TRACERS}
    for _ in range(rounds):
        for tracer, check in checked.items():
            start = time.perf_counter()
            for _ in range(2000):
                check(args, {})
            per_check[tracer].append((time.perf_counter() - start) / 2000 * 1e6)
    return {f"checks_{t}": statistics.median(v) for t, v in per_check.items()}


def _run_child(*args: str) -> dict[str, Any]:
    """One measurement in a fresh process, with an empty Inductor cache of its own (a build
    must not reuse the kernels of the one before)."""
    with tempfile.TemporaryDirectory() as inductor_cache:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", *args],
            capture_output=True,
            text=True,
            timeout=1800,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [_PATH, str(HERE)])),
                "TORCHINDUCTOR_CACHE_DIR": inductor_cache,
            },
        )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(workload: str, runs: int, calls: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tracer in TRACERS:
            builds = [_run_child("build", workload, tracer, tmp) for _ in range(runs)]
            out[f"build_{tracer}"] = statistics.median(b["seconds"] for b in builds)
            out[f"guards_{tracer}"] = builds[-1]["guards"]
            out[f"reads_{tracer}"] = builds[-1]["reads"]
            colds = [_run_child("cold", workload, tracer, tmp) for _ in range(runs)]
            out[f"import_{tracer}"] = statistics.median(c["import"] for c in colds)
            out[f"first_{tracer}"] = statistics.median(c["first"] for c in colds)
        steady = [_run_child("steady", workload, tmp, str(calls), "9") for _ in range(runs)]
        for tracer in TRACERS:
            out[f"call_{tracer}"] = statistics.median(s[tracer] for s in steady)
            out[f"checks_{tracer}"] = statistics.median(s[f"checks_{tracer}"] for s in steady)
        compiles = [_run_child("compile", workload) for _ in range(runs)]
        out["build_compile"] = statistics.median(c["seconds"] for c in compiles)
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    header = (
        "| workload | build make_fx (s) | build dynamo (s) | dynamo / make_fx | torch.compile "
        "first call (s) | cold start make_fx (s) | cold start dynamo (s) | dynamo / import "
        "torch | per call make_fx (us) | per call dynamo (us) | checks make_fx (us) | checks "
        "dynamo (us) | guard cost (us) | guards | read values make_fx / dynamo |"
    )
    rows = [header, "|" + "---|" * 14]
    for w, r in results.items():
        rows.append(
            f"| {w} | {r['build_make_fx']:.1f} | {r['build_dynamo']:.1f} | "
            f"{r['build_dynamo'] / r['build_make_fx']:.2f}x | {r['build_compile']:.1f} | "
            f"{r['first_make_fx']:.2f} | {r['first_dynamo']:.2f} | "
            f"{r['first_dynamo'] / r['import_dynamo']:.2f}x | {r['call_make_fx']:.1f} | "
            f"{r['call_dynamo']:.1f} | {r['checks_make_fx']:.2f} | {r['checks_dynamo']:.2f} | "
            f"{r['checks_dynamo'] - r['checks_make_fx']:+.2f} | "
            f"{r['guards_dynamo']} | {r['reads_make_fx']} / {r['reads_dynamo']} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=HERE / "TRACERS.md")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "build":
            result = _child_build(rest[0], rest[1], Path(rest[2]))
        elif kind == "compile":
            result = _child_compile(rest[0])
        elif kind == "cold":
            result = _child_cold(rest[0], rest[1], Path(rest[2]))
        else:
            result = _child_steady(rest[0], Path(rest[1]), int(rest[2]), int(rest[3]))
        print(json.dumps(result))
        return
    import torch

    results = {}
    for workload in args.workloads.split(","):
        print(f"measuring {workload} ...", flush=True)
        results[workload] = measure(workload, args.runs, args.calls)
    text = (
        "# The two tracers\n\n"
        f"`python benchmarks/tracers.py --runs {args.runs}` on torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; medians over {args.runs} fresh processes each (inductor, "
        "wrapper='python').\n\n" + table(results) + "\n"
    )
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
