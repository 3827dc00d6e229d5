"""Calls whose input requires grad: the module form against the commit before and its peers.

    .venv/bin/python benchmarks/input_grads.py --before <rev>      # writes INPUT_GRADS.md
    .venv/bin/python benchmarks/input_grads.py --before HEAD~3 --runs 1 --steps 10

The model is a later pipeline stage: two GPT blocks (``Block`` of ``differentiable.py``: width
128, 4 heads) on float hidden states (batch 8, sequence 64). Each step runs the stage, a mean
squared error against a target and ``backward()`` in the loop's own code, then an AdamW step.
In the "input" mode the hidden states require grad at every call (as a pipeline schedule hands
them on) and the step also reads their gradient; in the "plain" mode nothing but the weights
requires grad. Each row runs in a fresh process:

- ``eager``: the stage as is;
- ``torch.compile``: ``torch.compile(stage)``, cold (empty Inductor cache and temp dir), which
  recompiles where ``requires_grad`` differs;
- ``module``: ``precompile.module(stage, artifact=precompile.load(pair))`` at this checkout,
  the pair built beforehand from a plain example;
- ``module-before``: the same with the package at ``--before`` (its own ``src`` on
  ``PYTHONPATH``, from a git worktree). It refuses an input that requires grad unless the
  example required grad, so for the "input" mode its pair is built from such an example, as
  its users had to.

Below the table: the build time of each pair, and of the README's MLP (32-64-10) from an
empty Inductor cache, under ``torch.no_grad()`` (one graph) and in grad mode (the graphs for
a later ``backward()``), at this checkout and at ``--before``.

"per step" is the median over ``--steps`` steps after three; "peak memory" is the process's
peak resident memory minus its resident memory just before the first step; "first step" is
the time from the process's start until the first step's weights are updated. Each cell is the
median over ``--runs`` processes, run in rounds (each round runs every row once). The
build time of each pair is reported below the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

from differentiable import MODEL, RSS, TIMING, child

HERE = Path(__file__).resolve().parent
RESULT = "INPUT_GRADS_RESULT "
MODES = ("plain", "input")
TOOLS = ("eager", "torch.compile", "module", "module-before")

STAGE = r"""
class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(2)])

    def forward(self, h):
        return self.blocks(h)


def hidden(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)
"""

_CHILD = r"""
import time
start = time.perf_counter()
import json, os, sys
import torch
import torch.nn.functional as F
namespace = {{}}
exec({model!r}, namespace)
tool, pair, mode, steps = {tool!r}, {pair!r}, {mode!r}, {steps}
torch.manual_seed(1)
stage = namespace["Stage"]()
if tool == "torch.compile":
    run = torch.compile(stage)
elif tool.startswith("module"):
    from torch_precompile import precompile
    run = precompile.module(stage, artifact=precompile.load(pair))
else:
    run = stage
opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)

exec({rss!r})


def step(i):
    h, target = namespace["hidden"](i)
    if mode == "input":
        h.requires_grad_()
    opt.zero_grad()
    loss = F.mse_loss(run(h), target)
    loss.backward()
    opt.step()
    if mode == "input":
        assert h.grad is not None
    return loss


before = rss_kib("VmRSS:")
step(0)
first = time.perf_counter() - start
exec({timing!r})
print({result!r} + json.dumps({{
    "first_s": first, "step_ms": steady_step_ms(step, steps),
    "peak_mib": (rss_kib("VmHWM:") - before) / 1024}}))
"""

_BUILD = r"""
import json, time
import torch
from torch_precompile import precompile
namespace = {{}}
exec({model!r}, namespace)
torch.manual_seed(1)
h, _ = namespace["hidden"](0)
if {requires_grad!r}:
    h.requires_grad_()
t = time.perf_counter()
precompile.module(namespace["Stage"](), h).save({path!r})
print({result!r} + json.dumps({{"build_s": time.perf_counter() - t}}))
"""


_README_BUILD = r"""
import json, time
import torch
from torch_precompile import precompile
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
x = torch.randn(16, 32)
t = time.perf_counter()
with torch.set_grad_enabled({grad!r}):
    precompile(lambda m, x: m(x), model, x)
print({result!r} + json.dumps({{"build_s": time.perf_counter() - t}}))
"""


def _readme_builds(work: Path, before_src: str, runs: int) -> dict[str, float]:
    """The README MLP's build time (median of ``runs`` cold processes) under no_grad, and in
    grad mode at this checkout and at the revision before."""
    cases = {
        "no_grad": (None, False),
        "grad mode": (None, True),
        "grad mode, before": (before_src, True),
    }
    times = {}
    for label, (pythonpath, grad) in cases.items():
        code = _README_BUILD.format(grad=grad, result=RESULT)
        took = [
            _run(code, work / f"readme_{len(times)}_{n}", pythonpath)["build_s"]
            for n in range(runs)
        ]
        times[label] = statistics.median(took)
        print(f"README MLP, {label}: {times[label]:.1f} s")
    return times


def _run(code: str, env_dir: Path, pythonpath: str | None = None) -> dict[str, float]:
    return child(code, env_dir, RESULT, pythonpath)


def _worktree(rev: str, work: Path) -> Path:
    """A checkout of ``rev`` (the package's code as it was there)."""
    path = work / "before"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), rev],
        cwd=HERE,
        check=True,
        capture_output=True,
    )
    return path


def _builds(work: Path, before_src: str) -> tuple[dict[str, str], dict[str, float]]:
    """Each module pair this run loads, by (tool, mode), and its build time."""
    model = MODEL + STAGE
    wanted = {
        ("module", "plain"): (None, False),
        ("module-before", "plain"): (before_src, False),
        ("module-before", "input"): (before_src, True),
    }
    pairs, times = {}, {}
    for (tool, mode), (pythonpath, requires_grad) in wanted.items():
        path = str(work / f"{tool}_{mode}.py")
        code = _BUILD.format(model=model, requires_grad=requires_grad, path=path, result=RESULT)
        built = _run(code, work / f"build_{len(pairs)}", pythonpath)
        pairs[f"{tool}|{mode}"] = path
        times[f"{tool}|{mode}"] = built["build_s"]
        print(f"built {tool} ({mode} example): {built['build_s']:.1f} s")
    pairs["module|input"] = pairs["module|plain"]  # one pair serves both modes
    return pairs, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--out", type=Path, default=HERE / "INPUT_GRADS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tree = _worktree(args.before, work)
        try:
            before_src = str(tree / "src")
            pairs, build = _builds(work, before_src)
            readme = _readme_builds(work, before_src, args.runs)
            measured = _measured(args, pairs, work, before_src)
            rows = {
                key: {field: statistics.median(r[field] for r in runs) for field in runs[0]}
                for key, runs in measured.items()
            }
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=HERE)
    args.out.write_text(_table(rows, build, readme, args))


def _measured(
    args: argparse.Namespace, pairs: dict[str, str], work: Path, before_src: str
) -> dict[tuple[str, str], list[dict[str, float]]]:
    """Every row's runs, interleaved: each round runs every tool and mode once, so a slow
    spell of the machine falls on all rows alike rather than on one."""
    measured: dict[tuple[str, str], list[dict[str, float]]] = {}
    for n in range(args.runs):
        for tool in args.tools.split(","):
            for mode in MODES:
                code = _CHILD.format(
                    model=MODEL + STAGE,
                    tool=tool,
                    pair=pairs.get(f"{tool}|{mode}"),
                    mode=mode,
                    steps=args.steps,
                    result=RESULT,
                    timing=TIMING,
                    rss=RSS,
                )
                pythonpath = before_src if tool.endswith("before") else None
                result = _run(code, work / f"{tool}{mode}{n}", pythonpath)
                measured.setdefault((tool, mode), []).append(result)
                print(tool, mode, n, json.dumps(result))
    return measured


def _table(
    rows: dict[tuple[str, str], dict[str, float]],
    build: dict[str, float],
    readme: dict[str, float],
    args: argparse.Namespace,
) -> str:
    lines = [
        "# Calls whose input requires grad (a later pipeline stage: two GPT blocks)",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; medians of {args.runs} fresh processes, {args.steps} "
        f'steps each; "before" is `{args.before}`. Rerun: `.venv/bin/python '
        f"benchmarks/input_grads.py --before {args.before}`.",
        "",
        "| tool | input requires grad | first step (s) | per step (ms) | peak memory (MiB) |",
        "|---|---|---:|---:|---:|",
    ]
    for (tool, mode), row in rows.items():
        lines.append(
            f"| {tool} | {'yes' if mode == 'input' else 'no'} | {row['first_s']:.2f} | "
            f"{row['step_ms']:.1f} | {row['peak_mib']:.1f} |"
        )
    lines += [
        "",
        "Build time of each pair (done once, before): "
        + ", ".join(
            f"{key.replace('|', ', ')} example {seconds:.1f} s" for key, seconds in build.items()
        )
        + ".",
        "",
        "The README's MLP built from an empty Inductor cache (median of "
        f"{args.runs}): "
        + ", ".join(f"{label} {seconds:.1f} s" for label, seconds in readme.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
