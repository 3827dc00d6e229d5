"""A training loop with backward outside the artifact: the module form against its peers.

    .venv/bin/python benchmarks/differentiable.py               # writes DIFFERENTIABLE.md
    .venv/bin/python benchmarks/differentiable.py --runs 1 --steps 10

The model is a 4-block GPT (``GPT`` below: width 128, 4 heads, vocabulary 512, sequence 64,
batch 8). Each step runs the model, a cross-entropy loss and ``backward()`` in the loop's own
code, then an AdamW step. Each tool runs in a fresh process:

- ``eager``: the model as is;
- ``torch.compile``: ``torch.compile(model)``, cold (empty Inductor cache and temp dir);
- ``module``: ``precompile.module(model, artifact=precompile.load(pair))``, the pair built
  beforehand (its build time is reported apart);
- ``whole-step``: this package's whole-step form (forward, loss and backward in one artifact;
  the AdamW step outside, as for the others).

"first step" is the wall time from the process's start (before ``import torch``) until the
first step's parameters are updated; "import torch" is the same process's time to finish
importing torch. "per step" is the median over ``--steps`` steps after three. "peak memory" is
the process's peak resident memory minus its resident memory just before the first step.
Each cell is the median over ``--runs`` processes.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = "DIFFERENTIABLE_RESULT "
TOOLS = ("eager", "torch.compile", "module", "whole-step")

MODEL = r"""
import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, VOCAB, SEQ, BATCH, BLOCKS = 128, 4, 512, 64, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.head(self.norm(self.blocks(self.embed(ids) + self.pos)))


def batch(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def whole_step(model, ids, targets):
    loss = loss_of(model(ids), targets)
    loss.backward()
    return loss.detach()
"""

# Run in each measured process: the median time of ``steps`` steps after three.
TIMING = r"""
def steady_step_ms(step, steps):
    times = []
    for i in range(1, steps + 4):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    steady = sorted(times[3:])
    return 1e3 * steady[len(steady) // 2]
"""

# Run in each measured process: its resident memory ("VmRSS:") or peak ("VmHWM:"), in KiB.
RSS = r"""
def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
"""

_CHILD = r"""
import time
start = time.perf_counter()
import json, os, sys
import torch
torch_imported = time.perf_counter() - start
namespace = {{}}
exec({model!r}, namespace)
tool, pairs, steps = {tool!r}, {pairs!r}, {steps}
torch.manual_seed(1)
model = namespace["GPT"]()
batch, loss_of = namespace["batch"], namespace["loss_of"]
if tool == "torch.compile":
    run = torch.compile(model)
elif tool == "module":
    from torch_precompile import precompile
    run = precompile.module(model, artifact=precompile.load(pairs["module"]))
elif tool == "whole-step":
    from torch_precompile import precompile
    artifact = precompile.load(pairs["whole-step"])
else:
    run = model
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

exec({rss!r})


def step(i):
    ids, targets = batch(i)
    opt.zero_grad()
    if tool == "whole-step":
        loss = artifact(model, ids, targets)
    else:
        loss = loss_of(run(ids), targets)
        loss.backward()
    opt.step()
    return loss


before = rss_kib("VmRSS:")
first_loss = step(0).item()
first = time.perf_counter() - start
exec({timing!r})
print({result!r} + json.dumps({{
    "first_s": first, "import_s": torch_imported, "step_ms": steady_step_ms(step, steps),
    "peak_mib": (rss_kib("VmHWM:") - before) / 1024, "first_loss": first_loss}}))
"""

_BUILD = r"""
import json, time
import torch
from torch_precompile import precompile
namespace = {{}}
exec({model!r}, namespace)
torch.manual_seed(1)
model = namespace["GPT"]()
ids, targets = namespace["batch"](0)
t = time.perf_counter()
wrapped = precompile.module(model, ids)
wrapped.save({module_path!r})
module_s = time.perf_counter() - t
t = time.perf_counter()
precompile.save(*precompile(namespace["whole_step"], model, ids, targets), {step_path!r})
print({result!r} + json.dumps({{"module_s": module_s, "whole_step_s": time.perf_counter() - t}}))
"""


def child(
    code: str, env_dir: Path, result: str = RESULT, pythonpath: str | None = None
) -> dict[str, float]:
    """What ``code`` prints after ``result``, run in a fresh process with Inductor and temp
    dirs of its own under ``env_dir`` (and ``pythonpath``, where given)."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(env_dir / "inductor"),
        "TMPDIR": str(env_dir / "tmp"),
    }
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    (env_dir / "tmp").mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(result)]
    if done.returncode or not lines:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(lines[-1][len(result) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--out", type=Path, default=HERE / "DIFFERENTIABLE.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs = {"module": str(work / "module.py"), "whole-step": str(work / "step.py")}
        build = child(
            _BUILD.format(
                model=MODEL,
                module_path=pairs["module"],
                step_path=pairs["whole-step"],
                result=RESULT,
            ),
            work / "build",
        )
        print(f"built: module {build['module_s']:.1f} s, whole-step {build['whole_step_s']:.1f} s")
        rows = {}
        for tool in args.tools.split(","):
            runs = [
                child(
                    _CHILD.format(
                        model=MODEL,
                        tool=tool,
                        pairs=pairs,
                        steps=args.steps,
                        result=RESULT,
                        timing=TIMING,
                        rss=RSS,
                    ),
                    work / f"{tool}{n}",
                )
                for n in range(args.runs)
            ]
            rows[tool] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(tool, json.dumps(rows[tool]))
    args.out.write_text(_table(rows, build, args))


def _table(
    rows: dict[str, dict[str, float]], build: dict[str, float], args: argparse.Namespace
) -> str:
    eager = rows.get("eager")
    lines = [
        "# Training loop with backward outside the artifact (4-block GPT)",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; medians of {args.runs} fresh processes, "
        f"{args.steps} steps each. Rerun: `.venv/bin/python benchmarks/differentiable.py`.",
        "",
        "| tool | first step (s) | import torch (s) | per step (ms) | peak memory (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for tool, row in rows.items():
        memory = f"{row['peak_mib']:.0f}"
        if eager and tool != "eager":
            memory += f" ({row['peak_mib'] / eager['peak_mib']:.2f}x eager)"
        lines.append(
            f"| {tool} | {row['first_s']:.2f} | {row['import_s']:.2f} | "
            f"{row['step_ms']:.1f} | {memory} |"
        )
    lines += [
        "",
        f"Build time (done once, before): module form {build['module_s']:.1f} s, "
        f"whole-step form {build['whole_step_s']:.1f} s.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
