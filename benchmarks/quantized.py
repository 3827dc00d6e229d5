"""int8-quantized models (torchao) served at batch 1 and 16: per call and cold start.

    .venv/bin/python benchmarks/quantized.py --runs 3          # writes benchmarks/QUANTIZED.md
    .venv/bin/python benchmarks/quantized.py --runs 1 --workloads mlp --batches 1   # quick

Workloads are those of ``coldstart.py`` (``mlp``: 256-512-512-10; ``block``: the transformer
block, dim 64, sequence 32), quantized with torchao's ``Int8WeightOnlyConfig`` after a seeded
random init. Modes, each measured in fresh child processes: eager, ``torch.compile`` (its cold
start loads the cache artifacts it saved at build), AOTInductor (``torch.export`` of the
quantized model), ours with the cache, and ours on the float model. Cold start is the wall time
from just before the parent starts the child to its first result, model construction and
quantization included for every mode; ``import torch`` and ``import torch, torchao`` are rows
of their own. Per call is the median over ``--calls`` calls after a warm-up, under no_grad.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_T_TORCH_IMPORTED = time.time()

from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from coldstart import Block  # noqa: E402

MARKER = "QUANTIZED_RESULT "
BUILDS = ("build-ours", "build-ours-float", "build-aoti", "build-compile")
COLD_MODES = ("ours", "ours-float", "compile", "aoti")
STEADY_MODES = ("eager", "compile", "aoti", "ours", "ours-float")
LABELS = {
    "eager": "eager (torchao)",
    "compile": "torch.compile (torchao)",
    "aoti": "AOTInductor (torchao)",
    "ours": "ours (torchao, cached)",
    "ours-float": "ours, float model (cached)",
}


def build_model(workload: str, batch: int, quantized: bool) -> tuple[nn.Module, torch.Tensor]:
    """The seeded model (int8 weight-only unless ``quantized`` is False) and its input."""
    torch.manual_seed(0)
    if workload == "mlp":
        model: nn.Module = nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        x = torch.randn(batch, 256)
    else:
        model, x = Block(), torch.randn(batch, 32, 64)
    model.eval()
    if quantized:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig())
    return model, x


def infer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


# --- child side ------------------------------------------------------------------------------


def _build(mode: str, workload: str, batch: int, workdir: Path) -> dict[str, Any]:
    model, x = build_model(workload, batch, quantized=mode != "build-ours-float")
    start = time.perf_counter()
    if mode in ("build-ours", "build-ours-float"):
        from torch_precompile import precompile

        code, cache = precompile(infer, model, x)
        stem = "ours" if mode == "build-ours" else "ours-float"
        (workdir / f"{stem}.py").write_text(code)
        (workdir / f"{stem}.cache").write_bytes(cache)
    elif mode == "build-aoti":
        exported = torch.export.export(model, (x,))
        torch._inductor.aoti_compile_and_package(exported, package_path=str(workdir / "model.pt2"))
    else:
        torch.compile(infer)(model, x)
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise RuntimeError("torch.compiler.save_cache_artifacts() returned None")
        (workdir / "compile_artifacts.bin").write_bytes(saved[0])
    return {"seconds": time.perf_counter() - start}


def _prepare(mode: str, workdir: Path) -> Callable[..., Any]:
    if mode == "eager":
        return infer
    if mode == "compile":
        torch.compiler.load_cache_artifacts((workdir / "compile_artifacts.bin").read_bytes())
        return torch.compile(infer)
    if mode == "aoti":
        runner = torch._inductor.aoti_load_package(str(workdir / "model.pt2"))
        return lambda _model, x: runner(x)
    from torch_precompile import precompile

    logging.getLogger("torch_precompile").setLevel(logging.ERROR)
    stem = "ours" if mode == "ours" else "ours-float"
    return precompile.load(
        (workdir / f"{stem}.py").read_text(), (workdir / f"{stem}.cache").read_bytes()
    )


def run_child(
    kind: str, mode: str, workload: str, batch: int, workdir: Path, calls: int
) -> dict[str, Any]:
    if mode == "import":
        return {"t_first": _T_TORCH_IMPORTED}
    if mode == "import-torchao":
        import torchao.quantization  # noqa: F401

        return {"t_first": time.time()}
    torch.set_grad_enabled(False)
    if kind == "build":
        return _build(mode, workload, batch, workdir)
    model, x = build_model(workload, batch, quantized=mode != "ours-float")
    run = _prepare(mode, workdir)
    result = run(model, x)
    t_first = time.time()
    error = (result - model(x)).abs().max().item()
    if kind == "cold":
        return {"t_first": t_first, "max_error": error}
    for _ in range(max(10, calls // 10)):
        run(model, x)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run(model, x)
        times.append(time.perf_counter() - start)
    return {"us": statistics.median(times) * 1e6, "max_error": error}


# --- parent side -----------------------------------------------------------------------------


def child(
    kind: str, mode: str, workload: str, batch: int, workdir: Path, calls: int
) -> dict[str, Any]:
    """Run one measurement in a fresh process with its own Inductor cache dir."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / f"inductor-{kind}-{mode}"),
        "TMPDIR": str(workdir),
    }
    if kind != "build":
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=workdir)
    start = time.time()
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            kind,
            mode,
            workload,
            str(batch),
            str(workdir),
            str(calls),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:200]}
    result = json.loads(lines[-1][len(MARKER) :])
    if "t_first" in result:
        result["cold_s"] = result["t_first"] - start
    return result


def measure(workload: str, batch: int, runs: int, calls: int, root: Path) -> dict[str, Any]:
    workdir = root / f"{workload}-b{batch}"
    workdir.mkdir()
    builds = {m: child("build", m, workload, batch, workdir, calls) for m in BUILDS}
    cold = {
        m: [child("cold", m, workload, batch, workdir, calls) for _ in range(runs)]
        for m in COLD_MODES
    }
    steady = {
        m: [child("steady", m, workload, batch, workdir, calls) for _ in range(runs)]
        for m in STEADY_MODES
    }
    return {"builds": builds, "cold": cold, "steady": steady}


def _median(results: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


def _error(results: list[dict[str, Any]]) -> str:
    return next((r["error"] for r in results if "error" in r), "")


def report(
    measured: dict[tuple[str, int], dict[str, Any]],
    imports: dict[str, float],
    args: argparse.Namespace,
) -> str:
    lines = [
        "# int8-quantized models (torchao): per call and cold start",
        "",
        f"Made by `benchmarks/quantized.py --runs {args.runs} --calls {args.calls}` on "
        f"{time.strftime('%Y-%m-%d')}: torch {torch.__version__}, torchao "
        f"{_torchao_version()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}). Medians over {args.runs} fresh "
        "processes per cell. Inference under no_grad, int8 weight-only "
        "(`Int8WeightOnlyConfig`).",
        "",
        "## Per call (us)",
        "",
        "| workload | batch | "
        + " | ".join(LABELS[m] for m in STEADY_MODES)
        + " | ours / torch.compile |",
        "|---|---:|" + "---:|" * (len(STEADY_MODES) + 1),
    ]
    for (workload, batch), m in measured.items():
        cells = []
        for mode in STEADY_MODES:
            us = _median(m["steady"][mode], "us")
            cells.append(f"{us:,.0f}" if us is not None else f"failed: {_error(m['steady'][mode])}")
        ours, peer = _median(m["steady"]["ours"], "us"), _median(m["steady"]["compile"], "us")
        ratio = f"{ours / peer:.2f}x" if ours and peer else "-"
        lines.append(f"| {workload} | {batch} | " + " | ".join(cells) + f" | {ratio} |")
    torch_s, ao_s = imports["import"], imports["import-torchao"]
    lines += [
        "",
        "## Cold start to the first result (s)",
        "",
        f"`import torch`: {torch_s:.2f} s; `import torch` then `import torchao."
        f"quantization`: {ao_s:.2f} s (torchao's own import: {ao_s - torch_s:.2f} s, "
        "most of it `torch._dynamo`, which torchao imports). Every quantized mode pays "
        "it: its model is built with torchao.",
        "",
        "| workload | batch | "
        + " | ".join(LABELS[m] for m in COLD_MODES)
        + " | ours / import torch | ours / import torch + torchao |",
        "|---|---:|" + "---:|" * (len(COLD_MODES) + 2),
    ]
    for (workload, batch), m in measured.items():
        cells = []
        for mode in COLD_MODES:
            s = _median(m["cold"][mode], "cold_s")
            cells.append(f"{s:.2f}" if s is not None else f"failed: {_error(m['cold'][mode])}")
        ours = _median(m["cold"]["ours"], "cold_s")
        ratios = f" | {ours / torch_s:.2f}x | {ours / ao_s:.2f}x |" if ours else " | - | - |"
        lines.append(f"| {workload} | {batch} | " + " | ".join(cells) + ratios)
    lines += ["", "## Results against eager (max abs difference, first call)", ""]
    for (workload, batch), m in measured.items():
        errors = {mode: _median(m["cold"][mode], "max_error") for mode in COLD_MODES}
        shown = ", ".join(f"{LABELS[k]} {v:.1e}" for k, v in errors.items() if v is not None)
        lines.append(f"- {workload}, batch {batch}: {shown}")
    lines += [
        "",
        "Build times (s, one each): "
        + "; ".join(
            f"{w} b{b}: "
            + ", ".join(
                f"{k.removeprefix('build-')} "
                + (f"{v['seconds']:.1f}" if "seconds" in v else "failed")
                for k, v in m["builds"].items()
            )
            for (w, b), m in measured.items()
        ),
        "",
    ]
    return "\n".join(lines)


def _torchao_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torchao")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, mode, workload, batch, workdir, calls = sys.argv[2:8]
        print(
            MARKER
            + json.dumps(run_child(kind, mode, workload, int(batch), Path(workdir), int(calls)))
        )
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--workloads", default="mlp,block")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "QUANTIZED.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        imports = {
            mode: statistics.median(
                child("cold", mode, "mlp", 1, root, 0)["cold_s"] for _ in range(args.runs)
            )
            for mode in ("import", "import-torchao")
        }
        measured = {}
        for workload in args.workloads.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                print(f"measuring {workload} batch {batch}", file=sys.stderr)
                measured[(workload, batch)] = measure(workload, batch, args.runs, args.calls, root)
        text = report(measured, imports, args)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
