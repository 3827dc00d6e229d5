"""A training step with AdamW inside fn: per step, cold start to the first step, peak memory.

    .venv/bin/python benchmarks/optimizer_step.py --runs 3     # writes benchmarks/OPTIMIZER.md

The workload is the transformer block of ``coldstart.py`` (dim 64, 4 heads, seq 32, batch 4):
forward, MSE, backward, ``AdamW.step()``, ``zero_grad()``. Modes, each in a fresh child process
(this script with ``--child``) with its own empty Inductor cache:

- ``eager``, ``eager fused``: the step in eager mode, AdamW foreach / fused.
- ``torch.compile``: ``torch.compile`` of the whole step (optimizer included), empty caches.
- ``ours``: this package, optimizer inside fn, backend inductor, loaded with its cache.
- ``ours, opt outside``: this package for forward and backward; ``opt.step()`` eager (fused).

Cold start is the wall time from spawning the child to its first step done; it includes
building the model and the optimizer, whose first use makes torch import ``torch._dynamo``
(about 1.8 s here, in every mode), so the table also gives it without that setup. Steady
state is the median of ``--steps`` steps after ``--warmup``. Peak memory: the child's peak
resident set (``ru_maxrss``), and the step's peak tensor memory: the most bytes the CPU
allocator held during one steady step, above what it held before it (torch.profiler's memory
events). Every mode's weights after its steps are compared with eager's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

_T_TORCH_IMPORTED = time.time()
sys.path.insert(0, str(Path(__file__).parent))
from coldstart import Block, machine_description, md_table  # noqa: E402

MARKER = "OPTIMIZER_STEP_RESULT "
MODES = ("import torch", "eager", "eager fused", "torch.compile", "ours", "ours, opt outside")


def build(
    fused: bool = False,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Block(64, 4).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=not fused, fused=fused)
    g = torch.Generator().manual_seed(1)
    return model, opt, torch.randn(4, 32, 64, generator=g), torch.randn(4, 32, 64, generator=g)


def step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def forward_backward(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss.detach()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _step_peak_mib(run: Any) -> float:
    """The most tensor memory held during one call of ``run``, above what was held before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [
            e["args"]
            for e in json.loads(trace.read_text())["traceEvents"]
            if e.get("name") == "[memory]"
        ]
    if not events:
        return 0.0
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return (max(e["Total Allocated"] for e in events) - start) / 2**20


def _stepper(
    mode: str, workdir: Path
) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, ...]]:
    model, opt, x, target = build(fused=mode in ("eager fused", "ours, opt outside"))
    if mode in ("eager", "eager fused"):
        return lambda: step(model, opt, x, target), model, opt, (x, target)
    if mode == "torch.compile":
        compiled = torch.compile(step)
        return lambda: compiled(model, opt, x, target), model, opt, (x, target)
    from torch_precompile import precompile

    name = "inside" if mode == "ours" else "outside"
    code = (workdir / f"{name}.py").read_text()
    run = precompile.load(code, (workdir / f"{name}.cache").read_bytes())
    if mode == "ours":
        return lambda: run(model, opt, x, target), model, opt, (x, target)

    def outside() -> torch.Tensor:
        loss = run(model, x, target)
        opt.step()
        opt.zero_grad()
        return loss

    return outside, model, opt, (x, target)


def child(mode: str, workdir: Path, warmup: int, steps: int, spawned: float) -> None:
    if mode == "import torch":
        print(MARKER + json.dumps({"first": _T_TORCH_IMPORTED - spawned, "setup": 0.0}))
        return
    import logging

    logging.getLogger("torch_precompile").setLevel(logging.ERROR)
    started = time.time()
    run, model, _, _ = _stepper(mode, workdir)
    setup = time.time() - started
    run()
    first = time.time() - spawned
    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e6)
    weights = [p.detach().flatten()[:8].tolist() for p in model.parameters()]
    step_mib = _step_peak_mib(run)
    print(
        MARKER
        + json.dumps(
            {
                "first": first,
                "setup": setup,
                "step_us": statistics.median(times),
                "peak_mib": _peak_mib(),
                "step_mib": step_mib,
                "weights": weights,
            }
        )
    )


def _spawn(mode: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-")}
    spawned = time.time()
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--workdir",
            str(workdir),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
            "--spawned",
            repr(spawned),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode or not lines:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARKER) :])


def _build_pairs(workdir: Path) -> None:
    from torch_precompile import precompile

    model, opt, x, target = build()
    code, cache = precompile(step, model, opt, x, target, backend="inductor")
    (workdir / "inside.py").write_text(code)
    (workdir / "inside.cache").write_bytes(cache)
    code, cache = precompile(forward_backward, model, x, target, backend="inductor")
    (workdir / "outside.py").write_text(code)
    (workdir / "outside.cache").write_bytes(cache)


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(u - v) for xs, ys in zip(a, b, strict=True) for u, v in zip(xs, ys, strict=True))


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    base = med("import torch", "first")
    eager_step = med("eager", "step_us")
    compile_step = med("torch.compile", "step_us")
    reference = results["eager"][0]["weights"]
    rows = []
    for mode in MODES:
        if mode == "import torch":
            rows.append([mode, f"{base:.2f}", "", "1.00x", "", "", "", "", ""])
            continue
        bare = med(mode, "first") - med(mode, "setup")
        rows.append(
            [
                mode,
                f"{med(mode, 'first'):.2f}",
                f"{med(mode, 'setup'):.2f}",
                f"{bare / base:.2f}x",
                f"{med(mode, 'step_us'):,.0f}",
                f"{med(mode, 'step_us') / compile_step:.2f}x",
                f"{med(mode, 'peak_mib'):.0f}",
                f"{med(mode, 'step_mib'):.2f}",
                f"{_max_diff(results[mode][0]['weights'], reference):.1e}",
            ]
        )
    header = [
        "mode",
        "first step (s)",
        "of which setup (s)",
        "less setup, vs import torch",
        "step (us)",
        "vs torch.compile",
        "peak RSS (MiB)",
        "step's peak tensors (MiB)",
        "weights vs eager",
    ]
    return "\n".join(
        [
            "# A training step with AdamW inside fn",
            "",
            f"Made by `{' '.join([Path(sys.executable).name, *sys.argv])}` on "
            f"{time.strftime('%Y-%m-%d')}; {machine_description()}.",
            "",
            "The transformer block of `coldstart.py` (dim 64, 4 heads, seq 32, batch 4): forward, "
            "MSE, backward, `AdamW.step()`, `zero_grad()`. Each number is the median of "
            f"{args.runs} fresh processes; a step is the median of {args.steps} steps after "
            f"{args.warmup}. `torch.compile` compiles the whole step (optimizer included) with "
            "empty caches; `ours` loads a pair built beforehand (optimizer inside fn, backend "
            "inductor) with its cache. Setup is building the model and the optimizer (the "
            "optimizer's first use imports torch._dynamo, in every mode). The step's peak tensors "
            "are the most bytes the CPU allocator held during one steady step above what it held "
            "before (torch.profiler memory events). Eager (foreach AdamW) is the reference for "
            f"the weights after {1 + args.warmup + args.steps} steps.",
            "",
            md_table(header, rows),
            "",
            f"Per step: ours {med('ours', 'step_us') / compile_step:.2f}x torch.compile, "
            f"{med('ours', 'step_us') / eager_step:.2f}x eager. First step: ours "
            f"{med('ours', 'first') / base:.2f}x import torch, "
            f"{(med('ours', 'first') - med('ours', 'setup')) / base:.2f}x without the setup every "
            f"mode pays. Step's peak tensors: ours {med('ours', 'step_mib'):.2f} MiB, eager "
            f"{med('eager', 'step_mib'):.2f} MiB, eager fused {med('eager fused', 'step_mib'):.2f} "
            "MiB.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("OPTIMIZER.md"))
    parser.add_argument("--child")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--spawned", type=float)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.workdir, args.warmup, args.steps, args.spawned)
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        _build_pairs(workdir)
        results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for run in range(args.runs):
            for mode in MODES:  # interleaved, so that drift hits every mode alike
                results[mode].append(_spawn(mode, workdir, args))
                print(
                    f"run {run + 1}/{args.runs} {mode}: "
                    f"{results[mode][-1].get('step_us', 0):,.0f} us/step",
                    flush=True,
                )
    text = report(results, args)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
