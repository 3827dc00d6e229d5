"""The built-in example: precompile a small MLP, reload it in a fresh process, compare to eager.

``python -m torch_precompile demo`` runs it and prints a report.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from torch_precompile.storage import cache_path

SEED = 0
BATCH = 16


class DemoMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.fc2(F.relu(self.bn(self.fc1(x)))))


def infer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return cast(torch.Tensor, model(x))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), target)
    loss.backward()
    return loss.detach()


def example(kind: str) -> tuple[Any, ...]:
    """The same model and inputs in every process (fixed seed)."""
    torch.manual_seed(SEED)
    model = DemoMLP()
    x = torch.randn(BATCH, 32)
    if kind == "infer":
        return model.eval(), x
    return model.train(), x, torch.randint(0, 10, (BATCH,))


WORKLOADS: dict[str, Callable[..., torch.Tensor]] = {"infer": infer, "train": train_step}

# Run in a fresh interpreter: time import, load and first call, then check against eager.
_CHECK = """
import time
start = time.perf_counter()
import torch
imported = time.perf_counter()
import copy, json, sys
from torch_precompile import precompile
from torch_precompile.demo import WORKLOADS, example
kind, code_path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
run = precompile.load_file(code_path)
t1 = time.perf_counter()
args = example(kind)
eager_args = copy.deepcopy(args)
out = run(*args)
t2 = time.perf_counter()
report = {"import_torch_s": imported - start, "load_s": t1 - t0, "first_call_s": t2 - t1}
# Read now: torch.optim, used below for the comparison, imports Inductor itself.
report["inductor_imported"] = "torch._inductor" in sys.modules
from torch_precompile.artifact.kernel_payload import loaded_objects
report["loaded"] = sorted(loaded_objects().values())  # what load mapped from the cache
fn = WORKLOADS[kind]
diffs = [(out - fn(*eager_args)).abs().max().item()]
if kind == "train":
    opt = torch.optim.SGD(args[0].parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager_args[0].parameters(), lr=0.1)
    for _ in range(3):
        opt.step(); eager_opt.step(); opt.zero_grad(); eager_opt.zero_grad()
        diffs.append((run(*args) - fn(*eager_args)).abs().max().item())
    for a, b in zip(args[0].state_dict().values(), eager_args[0].state_dict().values()):
        diffs.append((a.double() - b.double()).abs().max().item())
report["max_abs_diff"] = max(diffs)
print(json.dumps(report))
"""


def _prebuilt_note(code: str, cache: bytes, report: dict[str, Any]) -> tuple[str, bool]:
    """What the fresh process loaded from the cache, and whether that is what ``inspect``
    says a load of the pair does (the same judgement)."""
    from torch_precompile.artifact.judgement import judge
    from torch_precompile.artifact.kernel_payload import count_objects

    judged = judge(code, cache)
    loaded = count_objects(report["loaded"])
    built = (
        "built here (a compiler ran)"
        if report["inductor_imported"]
        else "nothing built, no compiler run"
    )
    note = f"\n                 {loaded} loaded from the cache, {built}"
    agrees = sorted(judged.prebuilt) == report["loaded"] and (
        report["inductor_imported"] == bool(judged.to_build)
    )
    if not agrees:
        note += f"\n                 MISMATCH: inspect says a load {judged.outcome}"
    return note, agrees


def run_demo(out_dir: Path, backend: str) -> int:
    from torch_precompile import precompile

    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"torch-precompile demo: backend={backend!r}, artifacts in {out_dir}/\n")
    failures = 0
    for kind, fn in WORKLOADS.items():
        args = example(kind)
        start = time.perf_counter()
        # An inference artifact is built under no_grad, as a server builds it: no backward.
        with torch.no_grad() if kind == "infer" else contextlib.nullcontext():
            code, cache = precompile(fn, *args, backend=backend)
        build_s = time.perf_counter() - start
        path = precompile.save(code, cache, out_dir / f"mlp_{kind}.py")
        spec = precompile.inspect(code)
        proc = subprocess.run(
            [sys.executable, "-c", _CHECK, kind, str(path)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            print(f"[{kind}] FAILED in the fresh process:\n{proc.stderr[-3000:]}")
            failures += 1
            continue
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        ok = report["max_abs_diff"] < 1e-4
        note, agrees = _prebuilt_note(code, cache, report) if backend == "inductor" else ("", True)
        failures += (not ok) + (not agrees)
        grads = sum(t.gets_grad for t in spec.model)
        print(f"[{kind}] {'inference (eval mode)' if kind == 'infer' else 'training step'}")
        print(
            f"  captured : {len(spec.parameters)} parameters, {len(spec.buffers)} buffers, "
            f"inputs {[leaf.path for leaf in spec.inputs]}"
            f"{f', {grads} gradients harvested' if grads else ''}"
        )
        print(
            f"  artifact : {path.name} {len(code) / 1024:.1f} KiB, "
            f"{cache_path(path, code).name} {len(cache) / 1024:.1f} KiB, "
            f"built in {build_s:.2f} s"
        )
        print(
            f"  fresh process: import torch {report['import_torch_s']:.2f} s, "
            f"load {report['load_s']:.3f} s, first call {report['first_call_s']:.3f} s"
            f"{note}"
        )
        checked = "output" if kind == "infer" else "loss, gradients, buffers over 4 SGD steps"
        print(
            f"  vs eager ({checked}): max abs diff {report['max_abs_diff']:.2e} "
            f"-> {'OK' if ok else 'MISMATCH'}\n"
        )
    print("demo passed" if not failures else f"demo FAILED ({failures} problem(s))")
    return 1 if failures else 0
