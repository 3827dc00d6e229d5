"""Build time at depth: precompile() against torch.compile's cold first call and AOTInductor.

    .venv/bin/python benchmarks/build_time.py                       # writes BUILD_TIME.md
    .venv/bin/python benchmarks/build_time.py --depths 1,4 --runs 1 --modes infer

The model is N identical pre-norm transformer blocks (``coldstart.Block``: width 64, 4 heads,
batch 4, sequence 32). Two computations: ``infer`` (one forward under ``torch.no_grad()``) and
``train`` (forward, MSE loss, backward). Each build runs in a fresh process with empty Inductor
and temp dirs, so every tool starts cold: its compilers, vector-unit probes and kernel caches
included. The time is from just after the model is built until

- ``precompile``: ``precompile()`` returns the pair (default ``wrapper="auto"``);
- ``precompile-unrolled``: the same with ``blocks=False`` (every block compiled apart, as
  before repeated blocks were compiled once);
- ``precompile-cpp``: the same with ``wrapper="cpp"`` (the C++ wrapper at any depth);
- ``torch.compile``: the compiled function's first call returns;
- ``aoti``: ``torch.export`` and ``aoti_compile_and_package`` return (inference only);
- ``precompile-against`` (with ``--against OTHER/src``): ``precompile`` with the package of
  another checkout, a change's before and after on one machine state.

Import time is left out for every tool. Each cell is the median over ``--runs`` processes,
the tools of a row taking turns run by run; the peak resident memory of the building process
is reported beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULT = "BUILD_TIME_RESULT "
TOOLS = ("precompile", "precompile-unrolled", "precompile-cpp", "torch.compile", "aoti")
AGAINST = "precompile-against"  # precompile, its package from the --against source tree

_CHILD = r"""
import contextlib, json, logging, os, re, resource, sys, time
import torch
from torch import nn
logging.getLogger().setLevel(logging.ERROR)
steps = {{}}  # precompile's progress: each step's seconds


class Steps(logging.Handler):
    def emit(self, record):
        done = re.match(r"(\w+).*: done in ([0-9.]+) s$", record.getMessage())
        if done:
            steps[done[1]] = float(done[2])


progress = logging.getLogger("torch_precompile.progress")
progress.setLevel(logging.INFO)
progress.addHandler(Steps())
progress.propagate = False
sys.path.insert(0, {benchmarks!r})
from coldstart import Block, infer, train_step
tool, depth, mode, out = {tool!r}, {depth}, {mode!r}, {out!r}
torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range(depth)])
inputs = (torch.randn(4, 32, 64),)
if mode == "train":
    inputs += (torch.randn(4, 32, 64),)
    fn = train_step
else:
    model.eval()
    fn = infer
start = time.perf_counter()
if tool.startswith("precompile"):
    from torch_precompile import precompile
    wrapper = "cpp" if tool == "precompile-cpp" else "auto"
    blocks = False if tool == "precompile-unrolled" else None
    with torch.no_grad() if mode == "infer" else contextlib.nullcontext():  # no backward
        code, cache = precompile(fn, model, *inputs, wrapper=wrapper, blocks=blocks)
    kind = "C++" if "cpp_wrapper_src" in code else "Python"
elif tool == "torch.compile":
    compiled = torch.compile(fn)
    if mode == "infer":
        with torch.no_grad():
            compiled(model, *inputs)
    else:
        compiled(model, *inputs)
    kind = ""
else:
    with torch.no_grad():
        exported = torch.export.export(model, inputs)
        torch._inductor.aoti_compile_and_package(exported, package_path=out + ".pt2")
    kind = ""
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
size = len(code) if tool.startswith("precompile") else None
print({marker!r} + json.dumps({{"seconds": seconds, "peak_mib": peak, "wrapper": kind,
                                 "source_kib": size and size / 1024,
                                 "trace": steps.get("tracing"), "lower": steps.get("lowering")}}))
"""


def run_cold(
    script_in: Callable[[str], str], marker: str, what: str, src: Path = HERE.parent / "src"
) -> dict[str, Any]:
    """Run the script ``script_in(tmp)`` gives in a fresh process whose Inductor cache and temp
    dir are the new empty folder ``tmp``, the package imported from ``src``; return the JSON
    it prints after ``marker``."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
            "TMPDIR": tmp,
            "PYTHONPATH": os.pathsep.join(
                [str(src), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        done = subprocess.run(
            [sys.executable, "-c", script_in(tmp)],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
            cwd=tmp,
        )
    line = next((x for x in done.stdout.splitlines() if x.startswith(marker)), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line.removeprefix(marker))
    return result


def build_once(
    tool: str, depth: int, mode: str, against: Path | None = None
) -> dict[str, float | str]:
    """One cold build in a fresh process: its seconds, peak memory, and (ours) the wrapper;
    ``AGAINST`` builds with the package of the ``against`` source tree."""
    return run_cold(
        lambda tmp: _CHILD.format(
            benchmarks=str(HERE),
            tool=tool,
            depth=depth,
            mode=mode,
            out=str(Path(tmp) / "model"),
            marker=RESULT,
        ),
        RESULT,
        f"{tool} at depth {depth} ({mode})",
        against if tool == AGAINST and against else HERE.parent / "src",
    )


def measure(
    tools: list[str], depth: int, mode: str, runs: int, against: Path | None
) -> dict[str, dict[str, float | str]]:
    """Each tool's median cell; the tools take turns run by run, so that a machine that slows
    down for a while slows each of them alike."""
    results: dict[str, list[dict[str, float | str]]] = {tool: [] for tool in tools}
    for _ in range(runs):
        for tool in tools:
            results[tool].append(build_once(tool, depth, mode, against))
    return {tool: _median(cells) for tool, cells in results.items()}


def _median(results: list[dict[str, float | str]]) -> dict[str, float | str]:
    summary: dict[str, float | str] = {"wrapper": str(results[0]["wrapper"])}
    for key in ("seconds", "peak_mib", "trace", "lower", "source_kib"):
        if all(r.get(key) is not None for r in results):
            summary[key] = statistics.median(float(r[key]) for r in results)
    return summary


def table(
    rows: dict[tuple[str, int, str], dict[str, float | str]],
    depths: list[int],
    modes: list[str],
    tools: list[str],
) -> list[str]:
    """One row per mode and depth: each tool's seconds (and peak MiB), ours against peers and
    against our own build at the smallest depth, and the artifact's source size."""
    shown = [t for t in tools if any(k[0] == t for k in rows)]
    head = [
        "mode",
        "blocks",
        *(f"{t} s (peak MiB)" for t in shown),
        "precompile / torch.compile",
        *(["precompile / against"] if AGAINST in shown else []),
        f"precompile / its {depths[0]}-block build",
        "source KiB (unrolled)",
        "precompile: trace + lower s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
    for mode in modes:
        for depth in depths:
            cells = []
            for tool in shown:
                r = rows.get((tool, depth, mode))
                wrapper = f", {r['wrapper']}" if r and r["wrapper"] else ""
                cells.append(
                    "-"
                    if r is None
                    else f"{float(r['seconds']):.1f} ({float(r['peak_mib']):,.0f}{wrapper})"
                )
            ours, peer, base, unrolled = (
                rows.get(("precompile", depth, mode)),
                rows.get(("torch.compile", depth, mode)),
                rows.get(("precompile", depths[0], mode)),
                rows.get(("precompile-unrolled", depth, mode)),
            )
            ratio = _ratio(ours, peer, "seconds")
            if AGAINST in shown:
                ratio += f" | {_ratio(ours, rows.get((AGAINST, depth, mode)), 'seconds')}"
            growth = _ratio(ours, base, "seconds")
            size = f"{float(ours['source_kib']):.0f}" if ours and "source_kib" in ours else "-"
            if unrolled and "source_kib" in unrolled:
                size += f" ({float(unrolled['source_kib']):.0f})"
            split = (
                f"{float(ours['trace']):.1f} + {float(ours['lower']):.1f}"
                if ours and "trace" in ours and "lower" in ours
                else "-"
            )
            lines.append(
                f"| {mode} | {depth} | "
                + " | ".join(cells)
                + f" | {ratio} | {growth} | {size} | {split} |"
            )
    return lines


def _ratio(a: dict[str, float | str] | None, b: dict[str, float | str] | None, key: str) -> str:
    return f"{float(a[key]) / float(b[key]):.2f}x" if a and b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="2,12,24,48")
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument(
        "--tools",
        default="precompile,precompile-unrolled,torch.compile,aoti",
        help=f"any of {', '.join(TOOLS)}",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        help=f"the src folder of another checkout: adds {AGAINST}, the same build with that "
        "package, run by run in turn with the others (a change's A/B on one machine state)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "BUILD_TIME.md")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    modes, tools = args.modes.split(","), args.tools.split(",")
    if args.against:
        tools.append(AGAINST)
    rows: dict[tuple[str, int, str], dict[str, float | str]] = {}
    for mode in modes:
        for depth in depths:
            # AOTInductor compiles inference graphs only.
            cell_tools = [t for t in tools if not (t == "aoti" and mode == "train")]
            for tool, cell in measure(cell_tools, depth, mode, args.runs, args.against).items():
                rows[(tool, depth, mode)] = cell
                print(tool, depth, mode, cell, flush=True)

    write_report(
        args.out,
        "Build time at depth",
        f"{args.runs} fresh process(es) per cell, median; every build cold (empty Inductor cache)",
        f"build_time.py --runs {args.runs}",
        table(rows, depths, modes, tools),
    )


def write_report(out: Path, title: str, method: str, rerun: str, rows: list[str]) -> None:
    """Write (and print) a benchmark's markdown: the title, the machine and ``method``, how
    to rerun it, the table, the date."""
    import torch

    lines = [
        f"# {title}",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} cores; "
        f"{method}. Rerun with `.venv/bin/python benchmarks/{rerun}`.",
        "",
        *rows,
        "",
        f"Written by `{rerun.split()[0]}` on {datetime.date.today().isoformat()}.",
    ]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
