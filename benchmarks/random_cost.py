"""What drawing eager's random numbers costs: a training step with dropout, one checkout
against another.

    .venv/bin/python benchmarks/random_cost.py --src /path/to/other/checkout/src [--runs 4]

An MLP (256 -> 512 -> 512 -> 10, dropout 0.1 after each hidden layer) with SGD inside ``fn``,
batch 64, built with the inductor backend. Each run is a fresh process per checkout, the two
alternating so that drift of the machine hits both alike; a run times 7 blocks of 100 steps
after 20 warm-up steps and reports its median step. The table shows the median of the runs.
Since 0.15.0 the inductor backend runs random ops on ATen's kernels (``fallback_random``), so
a seeded call draws what eager draws; before, Inductor generated its own random kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

_STEP = r"""
import logging, statistics, time, torch
from torch import nn
logging.disable(logging.WARNING)
from torch_precompile import precompile
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(256, 512), nn.Dropout(0.1), nn.ReLU(), nn.Linear(512, 512),
                  nn.Dropout(0.1), nn.ReLU(), nn.Linear(512, 10))
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
def step(m, opt, x, y):
    loss = nn.functional.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()
run = precompile.load(*precompile(step, m, opt, x, y))
for _ in range(20):
    run(m, opt, x, y)
blocks = []
for _ in range(7):
    start = time.perf_counter()
    for _ in range(100):
        run(m, opt, x, y)
    blocks.append((time.perf_counter() - start) / 100 * 1e6)
print(statistics.median(blocks))
"""


def step_us(src: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, "-c", _STEP], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="the other checkout's src/")
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    this, other = Path(__file__).resolve().parents[1] / "src", args.src.resolve()
    times: dict[Path, list[float]] = {this: [], other: []}
    for _ in range(args.runs):
        for src in (this, other):
            times[src].append(step_us(src))
    mine, theirs = statistics.median(times[this]), statistics.median(times[other])
    print("| training step with dropout | this checkout, us | other, us | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| MLP + SGD, batch 64 | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f}x |")


if __name__ == "__main__":
    main()
