"""Cold start and steady-state speed: torch_precompile next to eager, torch.compile and AOTI.

    .venv/bin/python benchmarks/coldstart.py --runs 5     # full run, writes benchmarks/RESULTS.md
    .venv/bin/python benchmarks/coldstart.py --runs 5 --skip-peers --workloads mlp   # quick check

Every measurement runs in a fresh child process (this same script with ``--child``), each with its
own empty Inductor cache dir and temp dir. "Cold start" is the wall time from just before the
parent starts the child to the moment the child has its first result. Models and inputs are built
deterministically inside each child, after ``import torch``, by the same code for every mode.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import logging
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Stamped right after ``import torch``: what the "import torch" mode reports.
_T_TORCH_IMPORTED = time.time()

RESULT_MARKER = "COLDSTART_RESULT "
CHILD_TIMEOUT_S = 900
WORKLOADS = ("mlp", "block", "block_train", "block_dyn", "deep")
INFERENCE_WORKLOADS = ("mlp", "block", "deep")  # AOTInductor is built for these (static shapes)
# Inference runs under torch.no_grad() in every mode, as a server would call it.
NO_GRAD_WORKLOADS = ("mlp", "block", "block_dyn", "deep")
# Dynamic batch and sequence length: (batch, seq) sizes measured in steady state.
DYNAMIC_SIZES = {"block_dyn": [(1, 16), (4, 32), (16, 64)]}


# --------------------------------------------------------------------------------------------
# Workloads (rebuilt identically in every child)
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, 4-head self-attention, LayerNorm, GELU MLP (4x)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        hd = d // self.heads
        h = self.ln1(x)
        q = self.q(h).view(b, s, self.heads, hd).transpose(1, 2)
        k = self.k(h).view(b, s, self.heads, hd).transpose(1, 2)
        v = self.v(h).view(b, s, self.heads, hd).transpose(1, 2)
        att = torch.softmax((q @ k.transpose(-2, -1)) * (hd**-0.5), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def infer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The inference computation: one forward."""
    return model(x)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training computation: forward, MSE loss, backward (grads land on ``.grad``)."""
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss.detach()


def build_workload(name: str) -> tuple[Callable[..., Any], nn.Module, tuple[torch.Tensor, ...]]:
    """Seeded ``(fn, model, inputs)`` for a workload; it runs as ``fn(model, *inputs)``."""
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        ).eval()
        return infer, model, (torch.randn(32, 256),)
    if name == "block":
        return infer, Block().eval(), (torch.randn(4, 32, 64),)
    if name == "block_train":
        model = Block().train()
        return train_step, model, (torch.randn(4, 32, 64), torch.randn(4, 32, 64))
    if name == "block_dyn":
        return infer, Block().eval(), (torch.randn(4, 32, 64),)
    if name == "deep":  # 201 modules, tiny tensors: the per-call cost of the checks shows
        layers = [m for _ in range(100) for m in (nn.Linear(8, 8), nn.ReLU())]
        return infer, nn.Sequential(*layers).eval(), (torch.randn(1, 8),)
    raise ValueError(f"unknown workload {name!r}")


def mark_dynamic_dims(workload: str, inputs: tuple[torch.Tensor, ...]) -> None:
    """Batch and sequence of a dynamic workload's input: any batch, sequences of 2 or more."""
    if workload in DYNAMIC_SIZES:
        from torch._dynamo.decorators import mark_unbacked

        mark_unbacked(inputs[0], 0)
        mark_unbacked(inputs[0], 1, min=2)


def compiled(workload: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile as a user would for this workload (dynamic=True for a dynamic one)."""
    return torch.compile(fn, dynamic=True) if workload in DYNAMIC_SIZES else torch.compile(fn)


# --------------------------------------------------------------------------------------------
# Child side: one measurement per process
# --------------------------------------------------------------------------------------------


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _max_diff(got: Any, ref: Any) -> float:
    """Largest absolute difference between two results (inf when their structures differ)."""
    a, b = _flat_tensors(got), _flat_tensors(ref)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return math.inf
    return max(
        (float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b, strict=True)),
        default=0.0,
    )


def _check_against_eager(workload: str, result: Any, model: nn.Module) -> float:
    """Max abs difference of a first result (and training grads) from a fresh eager run."""
    fn, ref_model, inputs = build_workload(workload)
    ref = fn(ref_model, *inputs)
    diff = _max_diff(result, ref)
    if workload == "block_train":
        grads = [p.grad for p in model.parameters()]
        ref_grads = [p.grad for p in ref_model.parameters()]
        if any(g is None for g in grads):
            return math.inf
        diff = max(diff, _max_diff(grads, ref_grads))
    return diff


def _emit(payload: dict[str, Any]) -> None:
    print(RESULT_MARKER + json.dumps(payload), flush=True)


def _load_ours(workdir: Path, with_cache: bool, name: str = "ours") -> Callable[..., Any]:
    from torch_precompile import precompile

    logging.getLogger("torch_precompile").setLevel(logging.ERROR)
    code = (workdir / f"{name}.py").read_text()
    cache = (workdir / f"{name}.cache").read_bytes() if with_cache else None
    return precompile.load(code, cache)


def _prepare(mode: str, workload: str, workdir: Path) -> Callable[..., Any]:
    """Make the callable for a mode: ``run(model, *inputs)`` computes the workload's fn."""
    fn, _, _ = build_workload(workload)
    if mode in ("eager", "steady-eager"):
        return fn
    if mode in ("compile-cold", "steady-compile"):
        return compiled(workload, fn)
    if mode == "compile-warm":
        torch.compiler.load_cache_artifacts((workdir / "compile_artifacts.bin").read_bytes())
        return compiled(workload, fn)
    if mode in ("aoti", "steady-aoti"):
        runner = torch._inductor.aoti_load_package(str(workdir / "model.pt2"))
        return lambda _model, *inputs: runner(*inputs)
    if mode in ("ours-cache", "steady-ours"):
        return _load_ours(workdir, with_cache=True)
    if mode in ("ours-cpp-cache", "steady-ours-cpp"):
        return _load_ours(workdir, with_cache=True, name="ours_cpp")
    if mode in ("builtin-cache", "steady-builtin") and BUILTIN_CAPTURES:
        return torch.compiler.precompile.load(workdir / "builtin.py", workdir / "builtin.cache")
    if mode in ("builtin-cache", "steady-builtin"):
        code = (workdir / "builtin.py").read_text()
        return torch.compiler.precompile.load(code, (workdir / "builtin.cache").read_bytes())
    if mode == "ours-nocache":
        return _load_ours(workdir, with_cache=False)
    raise ValueError(f"unknown mode {mode!r}")


def _build(mode: str, workload: str, workdir: Path) -> dict[str, Any]:
    """Build an artifact once, with empty caches; return its build time and size."""
    fn, model, inputs = build_workload(workload)
    if mode == "build-compile":
        compiled_fn = compiled(workload, fn)
        start = time.perf_counter()
        compiled_fn(model, *inputs)
        seconds = time.perf_counter() - start
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise RuntimeError("save_cache_artifacts() returned None")
        path = workdir / "compile_artifacts.bin"
        path.write_bytes(saved[0])
        return {"seconds": seconds, "bytes": path.stat().st_size}
    if mode == "build-aoti":
        start = time.perf_counter()
        ep = torch.export.export(model, inputs)
        path = workdir / "model.pt2"
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
        return {"seconds": time.perf_counter() - start, "bytes": path.stat().st_size}
    if mode == "build-builtin" and BUILTIN_CAPTURES:
        start = time.perf_counter()
        mark_dynamic_dims(workload, inputs)
        paths = workdir / "builtin.py", workdir / "builtin.cache"
        with torch.compiler.precompile.capture(
            fn, artifact_path=paths[0], cache_path=paths[1]
        ) as cap:
            cap(model, *inputs)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "bytes": sum(p.stat().st_size for p in paths)}
    if mode == "build-builtin":
        start = time.perf_counter()
        mark_dynamic_dims(workload, inputs)
        code, cache = torch.compiler.precompile(fn, model, *inputs)
        seconds = time.perf_counter() - start
        (workdir / "builtin.py").write_text(code)
        (workdir / "builtin.cache").write_bytes(cache)
        return {"seconds": seconds, "bytes": len(code.encode()) + len(cache)}
    if mode in ("build-ours", "build-ours-cpp"):
        from torch_precompile import precompile

        wrapper, name = ("cpp", "ours_cpp") if mode == "build-ours-cpp" else ("python", "ours")
        start = time.perf_counter()
        mark_dynamic_dims(workload, inputs)
        # An inference artifact is built under no_grad, as a server builds it: no backward.
        with torch.no_grad() if workload in NO_GRAD_WORKLOADS else contextlib.nullcontext():
            code, cache = precompile(fn, model, *inputs, wrapper=wrapper)
        seconds = time.perf_counter() - start
        (workdir / f"{name}.py").write_text(code)
        (workdir / f"{name}.cache").write_bytes(cache)
        return {"seconds": seconds, "bytes": len(code.encode()) + len(cache)}
    raise ValueError(f"unknown build mode {mode!r}")


def _median_call_us(
    run: Callable[..., Any],
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    warmup: int,
    calls: int,
) -> float:
    for _ in range(warmup):
        run(model, *inputs)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run(model, *inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _median_graph_us(
    run: Any, model: nn.Module, inputs: tuple[torch.Tensor, ...], warmup: int, calls: int
) -> float:
    """Our artifact's compiled ``call`` alone, without the driver around it."""
    driver = run._forward  # the artifact's forward: a Driver over its spec and call
    state = type(driver).__call__.__globals__["model_tensors"](driver, [model])

    def graph_only(_model: nn.Module, *args: torch.Tensor) -> Any:
        return driver.call([*state, *args])

    return _median_call_us(graph_only, model, inputs, warmup, calls)


def run_child(mode: str, workload: str, workdir: Path, warmup: int, calls: int) -> None:
    """Entry point of a child process: do one measurement, print it as one marker line."""
    if mode == "import":
        _emit({"t_first": _T_TORCH_IMPORTED})
        return
    if workload in NO_GRAD_WORKLOADS:
        torch.set_grad_enabled(False)
    if mode.startswith("build-"):
        _emit(_build(mode, workload, workdir))
        return
    _, model, inputs = build_workload(workload)
    t_ready = time.time()
    run = _prepare(mode, workload, workdir)
    if mode.startswith("steady-"):
        by_size = {}
        for batch, seq in DYNAMIC_SIZES.get(workload, []):
            sized = (torch.randn(batch, seq, inputs[0].shape[-1]),)
            by_size[f"{batch}x{seq}"] = _median_call_us(run, model, sized, warmup, calls)
        us = _median_call_us(run, model, inputs, warmup, calls)
        graph_us = (
            _median_graph_us(run, model, inputs, warmup, calls)
            if mode in ("steady-ours", "steady-ours-cpp")
            else None
        )
        _emit({"us_per_call": us, "calls": calls, "by_size": by_size, "graph_us": graph_us})
        return
    start = time.perf_counter()
    result = run(model, *inputs)
    t_first = time.time()
    first_call = time.perf_counter() - start
    _emit(
        {
            "t_torch": _T_TORCH_IMPORTED,
            "t_ready": t_ready,
            "t_first": t_first,
            "first_call_s": first_call,
            "max_diff": _check_against_eager(workload, result, model),
        }
    )


# --------------------------------------------------------------------------------------------
# Parent side: orchestration and reporting
# --------------------------------------------------------------------------------------------

COLD_MODES: dict[str, str] = {
    "import": "import torch",
    "eager": "eager",
    "compile-cold": "torch.compile cold",
    "compile-warm": "torch.compile warm (mega-cache)",
    "aoti": "AOTInductor package",
    "builtin-cache": "torch.compiler.precompile, with cache",
    "ours-cache": "ours with wrapper='python', with cache",
    "ours-cpp-cache": "ours with wrapper='cpp' (the default), with cache",
    "ours-nocache": "ours with wrapper='python', without cache",
}
STEADY_MODES: dict[str, str] = {
    "steady-eager": "eager",
    "steady-compile": "torch.compile",
    "steady-aoti": "AOTInductor",
    "steady-builtin": "torch.compiler.precompile",
    "steady-ours": "ours, wrapper='python' (with cache)",
    "steady-ours-cpp": "ours, wrapper='cpp', the default (with cache)",
}
BUILD_MODES: dict[str, str] = {
    "build-compile": "torch.compile (save_cache_artifacts)",
    "build-aoti": "AOTInductor (export + aoti_compile_and_package)",
    "build-builtin": "torch.compiler.precompile",
    "build-ours": "ours (precompile, wrapper='python')",
    "build-ours-cpp": "ours (precompile, wrapper='cpp', the default)",
}
PEER_MODES = {
    "compile-cold", "compile-warm", "aoti", "steady-compile", "steady-aoti",
    "build-compile", "build-aoti", "builtin-cache", "steady-builtin", "build-builtin",
}  # fmt: skip
# torch's own precompile, run as a black box through its public API: torch 2.14 has
# precompile(fn, *inputs) -> (code, cache) and precompile.load(code, cache); torch 2.15 has
# the file-based capture(fn, artifact_path=..., cache_path=...) block and load(paths).
BUILTIN_MODES = {"builtin-cache", "steady-builtin", "build-builtin"}
BUILTIN_CAPTURES = callable(getattr(getattr(torch.compiler, "precompile", None), "capture", None))
HAS_BUILTIN = BUILTIN_CAPTURES or callable(getattr(torch.compiler, "precompile", None))
AOTI_MODES = {"aoti", "steady-aoti", "build-aoti"}
NEEDS_BUILD = {
    "compile-warm": "build-compile",
    "aoti": "build-aoti",
    "steady-aoti": "build-aoti",
    "ours-cache": "build-ours",
    "ours-nocache": "build-ours",
    "steady-ours": "build-ours",
    "ours-cpp-cache": "build-ours-cpp",
    "steady-ours-cpp": "build-ours-cpp",
    "builtin-cache": "build-builtin",
    "steady-builtin": "build-builtin",
}


@dataclass
class Outcome:
    """What one child produced: its parsed payload, or why it failed."""

    payload: dict[str, Any] | None = None
    error: str | None = None
    parent_start: float = 0.0
    background: float = math.nan  # other processes' CPU use while it ran, in cores


@dataclass
class WorkloadResults:
    """Everything measured for one workload."""

    cold: dict[str, list[Outcome]] = field(default_factory=dict)
    steady: dict[str, list[Outcome]] = field(default_factory=dict)
    build: dict[str, Outcome] = field(default_factory=dict)


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _short_reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    reason = (errors or lines or ["no output"])[-1]
    return reason if len(reason) <= 100 else reason[:97] + "..."


def _busy_cpu_seconds() -> float:
    """CPU seconds all processes have used since boot (nan where /proc/stat is missing)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds used by this process and its waited-for descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class CpuMeter:
    """Measures the CPU that processes other than ours used over an interval, in cores."""

    def __init__(self) -> None:
        self.start = (time.monotonic(), _busy_cpu_seconds(), _own_cpu_seconds())

    def cores(self) -> float:
        """Average number of cores busy with other processes' work since construction."""
        wall, busy, own = self.start
        wall = time.monotonic() - wall
        return max(0.0, (_busy_cpu_seconds() - busy - (_own_cpu_seconds() - own)) / wall)


def snapshot_package(root: Path) -> tuple[Path, str]:
    """Copy the torch_precompile sources under ``root`` so that every child runs the same code.

    Returns the directory to put on PYTHONPATH and a description of the copied version.
    """
    spec = importlib.util.find_spec("torch_precompile")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torch_precompile is not importable")
    source = Path(next(iter(spec.submodule_search_locations)))
    dest = root / "snapshot"
    shutil.copytree(source, dest / "torch_precompile", ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(source)]
    sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if sha.returncode != 0:
        return dest, f"{source} (not a git checkout)"
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "."], capture_output=True, text=True
    ).stdout.strip()
    return dest, f"git {sha.stdout.strip()}" + (" plus uncommitted changes" if dirty else "")


class Runner:
    """Starts children, each with a fresh empty Inductor cache dir and temp dir under one root."""

    def __init__(
        self, root: Path, warmup: int, calls: int, quiet_wait: float, pythonpath: Path
    ) -> None:
        self.root = root
        self.pythonpath = pythonpath
        self.warmup = warmup
        self.calls = calls
        self.quiet_wait = quiet_wait
        self._count = 0

    def wait_for_quiet(self, threshold: float = 0.25, window: float = 0.5) -> None:
        """Wait (up to ``quiet_wait`` s) until other processes use under ``threshold`` cores."""
        deadline = time.monotonic() + self.quiet_wait
        logged = False
        while time.monotonic() < deadline:
            meter = CpuMeter()
            time.sleep(window)
            load = meter.cores()
            if not load >= threshold:  # also true for nan (no /proc/stat)
                return
            if not logged:
                log(f"  other processes busy ({load:.2f} cores); waiting up to {self.quiet_wait} s")
                logged = True

    def fresh_dirs(self, label: str) -> dict[str, str]:
        """Environment variables pointing at new empty cache and temp dirs."""
        self._count += 1
        base = self.root / "runs" / f"{self._count:04d}-{label}"
        env = {}
        for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TMPDIR", "tmp")):
            (base / sub).mkdir(parents=True)
            env[var] = str(base / sub)
        return env

    def child(self, mode: str, workload: str, workdir: Path) -> Outcome:
        """Run one child with empty caches; time from just before its start is in the outcome."""
        env = {**os.environ, **self.fresh_dirs(f"{workload}-{mode}")}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.pythonpath), os.environ.get("PYTHONPATH")) if p
        )
        env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
        cmd = [
            sys.executable, str(Path(__file__).resolve()),
            "--child", mode, workload, str(workdir),
            "--warmup", str(self.warmup), "--calls", str(self.calls),
        ]  # fmt: skip
        self.wait_for_quiet()
        meter = CpuMeter()
        start = time.time()
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return Outcome(error=f"timeout after {CHILD_TIMEOUT_S} s", parent_start=start)
        background = meter.cores()
        markers = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
        if proc.returncode != 0 or not markers:
            reason = _short_reason(proc.stderr)
            return Outcome(error=reason, parent_start=start, background=background)
        payload = json.loads(markers[-1][len(RESULT_MARKER) :])
        return Outcome(payload=payload, parent_start=start, background=background)


def measure_workload(
    runner: Runner, workload: str, runs: int, steady_repeats: int, skip_peers: bool
) -> WorkloadResults:
    """Builds, then interleaved rounds of cold starts, then interleaved steady-state processes."""
    workdir = runner.root / "artifacts" / workload
    workdir.mkdir(parents=True)
    inference = workload in INFERENCE_WORKLOADS
    res = WorkloadResults()

    def wanted(mode: str) -> bool:
        if mode in BUILTIN_MODES and not HAS_BUILTIN:
            return False
        return not (skip_peers and mode in PEER_MODES) and (inference or mode not in AOTI_MODES)

    for mode in BUILD_MODES:
        if wanted(mode):
            log(f"[{workload}] building {mode} ...")
            res.build[mode] = out = runner.child(mode, workload, workdir)
            log(f"[{workload}] {mode}: {_describe(out, 'seconds')}")

    def blocked(mode: str) -> Outcome | None:
        build = res.build.get(NEEDS_BUILD.get(mode, ""))
        if build is not None and build.error is not None:
            return Outcome(error=f"build: {build.error}")
        return None

    cold_modes = [m for m in COLD_MODES if wanted(m)]
    for i in range(runs):
        for mode in cold_modes:
            out = blocked(mode) or runner.child(mode, workload, workdir)
            res.cold.setdefault(mode, []).append(out)
            log(f"[{workload}] round {i + 1}/{runs} {mode}: {_describe(out, 'cold')}")
    steady_modes = [m for m in STEADY_MODES if wanted(m)]
    for i in range(steady_repeats):
        for mode in steady_modes:
            out = blocked(mode) or runner.child(mode, workload, workdir)
            res.steady.setdefault(mode, []).append(out)
            log(f"[{workload}] {i + 1}/{steady_repeats} {mode}: {_describe(out, 'us_per_call')}")
    return res


def _cold_seconds(out: Outcome) -> float:
    assert out.payload is not None
    return out.payload["t_first"] - out.parent_start


def _describe(out: Outcome, key: str) -> str:
    """One progress-line summary of an outcome."""
    if out.payload is None:
        return f"failed: {out.error}"
    if key == "cold":
        text = f"{_cold_seconds(out):.3f} s"
        diff = out.payload.get("max_diff")
        if diff is not None and not diff <= 1e-3:
            text += f"  (WARNING: max diff from eager {diff:.3g})"
    else:
        text = f"{out.payload[key]:.3f} {'us' if key == 'us_per_call' else 's'}"
    if out.background >= 0.1:
        text += f"  [other processes used {out.background:.2f} cores meanwhile]"
    return text


def background_note(res: WorkloadResults) -> str:
    """How busy other processes kept the machine while this workload's children ran."""
    outs = [
        *(o for group in res.cold.values() for o in group),
        *(o for group in res.steady.values() for o in group),
        *res.build.values(),
    ]
    loads = [o.background for o in outs if not math.isnan(o.background)]
    if not loads:
        return "Other processes' CPU use during these measurements: unknown."
    busy = sum(load >= 0.1 for load in loads)
    return (
        f"Other processes' CPU use while these {len(loads)} children ran: median "
        f"{_median(loads):.2f} cores, max {max(loads):.2f} (of {os.cpu_count()}); "
        f"{busy} children ran next to >= 0.1 cores of other work."
    )


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _first_error(outs: list[Outcome]) -> str | None:
    return next((o.error for o in outs if o.error is not None), None)


def cold_table(res: WorkloadResults, inference: bool) -> list[list[str]]:
    """Rows: mode, median seconds, ratio to import torch, min-max, approach-specific part."""
    ok_import = [_cold_seconds(o) for o in res.cold.get("import", []) if o.payload]
    base = _median(ok_import) if ok_import else math.nan
    rows = []
    for mode, label in COLD_MODES.items():
        outs = res.cold.get(mode)
        if outs is None:
            if mode == "aoti" and not inference:
                rows.append([label, "n/a", "", "", "", ""])
            continue
        error = _first_error(outs)
        if error is not None:
            rows.append([label, f"failed: {error}", "", "", "", ""])
            continue
        secs = [_cold_seconds(o) for o in outs]
        med = _median(secs)
        if mode == "import":
            own, diff = "", ""
        else:
            own = f"{_median([o.payload['t_first'] - o.payload['t_ready'] for o in outs]):.3f}"
            diff = f"{max(o.payload['max_diff'] for o in outs):.1e}"
        rows.append(
            [
                label,
                f"{med:.3f}",
                f"{med / base:.2f}x",
                f"{min(secs):.3f}-{max(secs):.3f}",
                own,
                diff,
            ]
        )
    return rows


def _steady_us(res: WorkloadResults, mode: str) -> float:
    """Best (lowest) per-process median us/call of a steady-state mode; nan when it failed."""
    outs = res.steady.get(mode, [])
    if not outs or _first_error(outs) is not None:
        return math.nan
    return min(o.payload["us_per_call"] for o in outs if o.payload)


def steady_table(res: WorkloadResults, inference: bool) -> list[list[str]]:
    """Rows: approach, best per-process median us/call, all medians, ratios."""
    eager_us, comp_us = _steady_us(res, "steady-eager"), _steady_us(res, "steady-compile")
    rows = []
    for mode, label in STEADY_MODES.items():
        outs = res.steady.get(mode)
        if outs is None:
            if mode == "steady-aoti" and not inference:
                rows.append([label, "n/a", "", "", ""])
            continue
        error = _first_error(outs)
        if error is not None:
            rows.append([label, f"failed: {error}", "", "", ""])
            continue
        us = _steady_us(res, mode)
        each = ", ".join(f"{o.payload['us_per_call']:.0f}" for o in outs if o.payload)
        vs_comp = "" if math.isnan(comp_us) else f"{us / comp_us:.2f}x"
        vs_eager = "" if math.isnan(eager_us) else f"{us / eager_us:.2f}x"
        graph = [o.payload["graph_us"] for o in outs if o.payload and o.payload.get("graph_us")]
        if graph:  # how much of a call is the driver (checks, gradients, result) vs call()
            label = f"{label} (driver {us - min(graph):.0f} us, call() {min(graph):.0f} us)"
        rows.append([label, f"{us:.1f}", each, vs_comp, vs_eager])
    return rows


def dynamic_table(res: WorkloadResults) -> list[list[str]]:
    """Rows: size, best per-process us/call of eager, torch.compile(dynamic=True), ours."""

    def best(mode: str, size: str) -> float:
        outs = [o for o in res.steady.get(mode, []) if o.payload and size in o.payload["by_size"]]
        return min((o.payload["by_size"][size] for o in outs), default=math.nan)

    sizes = next(
        (
            list(o.payload["by_size"])
            for group in res.steady.values()
            for o in group
            if o.payload and o.payload.get("by_size")
        ),
        [],
    )
    rows = []
    for size in sizes:
        eager, comp, ours = (
            best(m, size) for m in ("steady-eager", "steady-compile", "steady-ours")
        )
        rows.append([size, f"{eager:.1f}", f"{comp:.1f}", f"{ours:.1f}", f"{ours / comp:.2f}x"])
    return rows


DYNAMIC_HEADER = [
    "batch x seq",
    "eager us/call",
    "torch.compile(dynamic=True) us/call",
    "ours us/call",
    "ours vs torch.compile",
]


def build_table(res: WorkloadResults, inference: bool) -> list[list[str]]:
    """Rows: approach, build seconds, artifact size."""
    rows = []
    for mode, label in BUILD_MODES.items():
        out = res.build.get(mode)
        if out is None:
            if mode == "build-aoti" and not inference:
                rows.append([label, "n/a", ""])
            continue
        if out.payload is None:
            rows.append([label, f"failed: {out.error}", ""])
            continue
        seconds = out.payload["seconds"]
        if mode == "build-compile":
            # The cold cold-start runs each compiled from scratch too: use their median.
            firsts = [o.payload["first_call_s"] for o in res.cold.get("compile-cold", [])
                      if o.payload]  # fmt: skip
            seconds = _median([seconds, *firsts]) if firsts else seconds
        rows.append([label, f"{seconds:.2f}", f"{out.payload['bytes'] / 1024:.0f} KiB"])
    return rows


COLD_HEADER = [
    "mode", "seconds (median)", "vs import torch", "min-max", "load+first call", "max diff",
]  # fmt: skip
STEADY_HEADER = ["approach", "us/call", "per-process medians", "vs torch.compile", "vs eager"]
BUILD_HEADER = ["approach", "build seconds", "artifact size"]


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain aligned table for the terminal."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (numbers right-aligned)."""
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


WORKLOAD_TITLES = {
    "mlp": "`mlp`: MLP 256-512-512-10 forward, batch 32, eval",
    "block": "`block`: pre-norm transformer block forward (dim 64, 4 heads, seq 32, batch 4), eval",
    "block_train": "`block_train`: the same block's training step (forward, MSE, backward), train",
    "block_dyn": "`block_dyn`: the block's forward with dynamic batch and sequence length (ours: "
    "mark_unbacked, seq min 2; torch.compile(dynamic=True)), eval",
    "deep": "`deep`: nn.Sequential of 100 x (Linear(8, 8), ReLU), 201 modules, batch 1, eval: "
    "the per-call cost of checking a call shows",
}

EXPLANATION = """\
Every cold-start number is the wall time from just before the parent starts a fresh child process
(`subprocess.run` with `sys.executable`) to the `time.time()` the child takes right after its first
result (for `import torch`, right after `import torch`); each child builds the model and inputs
(seeded) after `import torch` with the same code for every mode, and runs with its own empty
`TORCHINDUCTOR_CACHE_DIR` and `TMPDIR`. *import torch*: interpreter start plus `import torch`, the
floor. *eager*: `fn(model, x)` in plain PyTorch. *torch.compile cold*: `torch.compile(fn)` with
empty caches, so the first call traces, compiles and builds its C++ kernels. *torch.compile warm*:
a setup process compiled and called once and saved `torch.compiler.save_cache_artifacts()`; the
measured process calls `torch.compiler.load_cache_artifacts()` on those bytes (included in the
time), then `torch.compile(fn)` and the first call. *AOTInductor*: a package built once with
`torch.export.export` and `aoti_compile_and_package` (weights baked in), loaded with
`aoti_load_package` and called on the inputs (inference only). *ours, with cache*: `code, cache =
precompile(fn, model, ...)` built once; the measured process runs `precompile.load(code, cache)`
and calls it with the model. *ours, without cache*: `precompile.load(code, None)`, so the kernels
are built from the source in the measured process. "load+first call" is the part after the model
and inputs exist (load, compile, first call); "max diff" is the largest absolute difference of the
first result (and gradients, for training) from a fresh eager run, over all runs. Steady state: per
process, after warm-up calls, the median of per-call `time.perf_counter()` times (torch.compile
compiles first, with empty caches; ours loads with its cache); the lowest of the processes' medians
is reported, to damp interference; training steps are called repeatedly without zeroing gradients
(they accumulate alike everywhere). Inference workloads run under `torch.no_grad()` in every mode.
`block_dyn` uses one artifact (ours) or one `torch.compile(fn, dynamic=True)` for every size; its
steady state is measured at each listed size in the same processes. Build time: once per
workload with empty caches; for torch.compile, the median first compiled call over the setup
process and all cold runs."""


def machine_description() -> str:
    """CPU model, platform.processor() and os.cpu_count()."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    parts = [p for p in (model, platform.processor() or platform.machine()) if p]
    return f"{', '.join(parts)}; os.cpu_count() = {os.cpu_count()}; {platform.platform()}"


def interpreter() -> str:
    """The running interpreter, relative to the working directory where it can be."""
    with contextlib.suppress(ValueError):
        return os.path.relpath(sys.executable)
    return sys.executable


def command_line() -> str:
    """The command as it was invoked, with the interpreter relative to the working directory."""
    return shlex.join([interpreter(), *sys.argv])


def report(
    results: dict[str, WorkloadResults], args: argparse.Namespace, elapsed: float
) -> tuple[str, str]:
    """The terminal text and the Markdown document."""
    text, md = [], []
    md.append("# Cold start and steady state: torch_precompile vs eager, torch.compile, AOTI\n")
    md.append(
        f"- Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}\n"
        f"- Machine: {machine_description()}\n"
        f"- torch {torch.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} intra-op threads; torch_precompile {args.version}\n"
        f"- Command: `{command_line()}`\n"
        f"- N = {args.runs} cold-start runs per mode (median reported); steady state: "
        f"{args.steady_repeats} processes per approach, each {args.warmup} warm-up calls then "
        f"the median of {args.calls} timed calls; the lowest process median is reported\n"
        f"- Total run time: {elapsed / 60:.1f} min; before each child the script waited up to "
        f"{args.quiet_wait:g} s for other processes to go idle\n"
    )
    md.append(EXPLANATION + "\n")
    for name, res in results.items():
        inference = name in INFERENCE_WORKLOADS
        sections = [
            ("Cold start (seconds, process start to first result)", COLD_HEADER,
             cold_table(res, inference)),
            ("Steady state (microseconds per call)", STEADY_HEADER, steady_table(res, inference)),
            ("Build time (once, empty caches)", BUILD_HEADER, build_table(res, inference)),
        ]  # fmt: skip
        if name in DYNAMIC_SIZES:
            sections.insert(
                2,
                (
                    "Steady state at several sizes, one artifact (microseconds per call)",
                    DYNAMIC_HEADER,
                    dynamic_table(res),
                ),
            )
        md.append(f"## {WORKLOAD_TITLES[name]}\n")
        text.append(f"\n=== {name} ===")
        for title, header, rows in sections:
            md.append(f"### {title}\n\n{md_table(header, rows)}\n")
            text.append(f"\n{title}\n{text_table(header, rows)}")
        note = background_note(res)
        md.append(f"{note}\n")
        text.append(f"\n{note}")
    return "\n".join(text) + "\n", "\n".join(md)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (``--child`` is internal)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="cold-start runs per mode (default 5)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    p.add_argument("--out", default="benchmarks/RESULTS.md", help="Markdown output path")
    p.add_argument(
        "--skip-peers", action="store_true", help="only import torch, eager and ours (quick check)"
    )
    p.add_argument("--warmup", type=int, default=50, help="steady-state warm-up calls (>= 20)")
    p.add_argument("--calls", type=int, default=500, help="steady-state timed calls (>= 200)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        help="seconds to wait, before each child, for other processes to go idle (default 30)",
    )
    p.add_argument(
        "--steady-repeats", type=int, default=3, help="steady-state processes per approach"
    )
    p.add_argument(
        "--child", nargs=3, metavar=("MODE", "WORKLOAD", "WORKDIR"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    if args.runs < 1 or args.warmup < 20 or args.calls < 200 or args.steady_repeats < 1:
        p.error("need --runs >= 1, --warmup >= 20, --calls >= 200 and --steady-repeats >= 1")
    args.workload_list = workloads
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the whole comparison (or, with ``--child``, one measurement)."""
    args = parse_args(argv)
    if args.child:
        mode, workload, workdir = args.child
        run_child(mode, workload, Path(workdir), args.warmup, args.calls)
        return
    if args.runs < 5:
        log(f"note: --runs {args.runs} < 5; use at least 5 for committed results")
    started = time.time()
    root = Path(tempfile.mkdtemp(prefix="coldstart-"))
    try:
        snapshot, args.version = snapshot_package(root)
        runner = Runner(root, args.warmup, args.calls, args.quiet_wait, snapshot)
        log(f"children import torch_precompile from a copy of {args.version} in {snapshot}")
        log(f"scratch root {root}; warming the page cache with one discarded child")
        runner.child("import", "mlp", root)
        results = {
            w: measure_workload(runner, w, args.runs, args.steady_repeats, args.skip_peers)
            for w in args.workload_list
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text, md = report(results, args, time.time() - started)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    log(f"wrote {out}; total {(time.time() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
