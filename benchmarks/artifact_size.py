"""How much an artifact holds: lines and bytes, the driver's share, Inductor's generated share.

    .venv/bin/python benchmarks/artifact_size.py [--src DIR]

Builds the eager ``Linear(4, 4)`` artifact, the two inductor artifacts of ``make demo``
(inference and training step) and an inductor MLP training step with AdamW inside ``fn``, and
prints one row each. ``--src`` measures another checkout's ``src/`` (for a before/after
comparison); the default is this one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_MEASURE = r"""
import json, logging, re, sys
import torch
logging.disable(logging.WARNING)
import torch_precompile.lower.inductor as inductor
from torch_precompile import precompile
from torch_precompile import demo

generated = []
original = inductor.wrapper_with_stand_ins
def recording(*args, **kwargs):
    source = original(*args, **kwargs)
    generated.append(len(source.splitlines()))
    return source
inductor.wrapper_with_stand_ins = recording

def driver_lines(code):
    lines = code.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"# \d\. The driver", line)]
    return len(lines) - starts[0] + 1 if starts else None

rows = []
def measure(name, code):
    rows.append({"artifact": name, "lines": len(code.splitlines()), "bytes": len(code.encode()),
                 "driver_lines": driver_lines(code),
                 "generated_lines": generated.pop() if generated else 0})

with torch.no_grad():  # inference artifacts, as a server builds them
    measure("eager Linear(4, 4)", precompile(lambda m, x: m(x), torch.nn.Linear(4, 4),
                                             torch.randn(2, 4), backend="eager")[0])
    measure("inductor demo infer", precompile(demo.WORKLOADS["infer"], *demo.example("infer"))[0])
measure("inductor demo train", precompile(demo.WORKLOADS["train"], *demo.example("train"))[0])

def adamw_step(model, opt, x, target):
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
measure("inductor MLP + AdamW step",
        precompile(adamw_step, mlp, opt, torch.randn(16, 32), torch.randint(0, 10, (16,)))[0])
print(json.dumps(rows))
"""


def measure(src: Path) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd="/tmp",
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=Path(__file__).parents[1] / "src")
    args = parser.parse_args()
    print("| artifact | lines | bytes | driver lines | Inductor-generated lines | the rest |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in measure(args.src.resolve()):
        rest = int(row["lines"]) - int(row["generated_lines"])
        print(
            f"| {row['artifact']} | {row['lines']} | {row['bytes']} | {row['driver_lines']} "
            f"| {row['generated_lines']} | {rest} |"
        )


if __name__ == "__main__":
    main()
