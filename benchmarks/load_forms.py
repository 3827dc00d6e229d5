"""Load time of each kind of artifact, one checkout against another, in fresh processes.

    .venv/bin/python benchmarks/load_forms.py --src OTHER/src [--runs 11] [--forms grad_mode]

Three small pairs per backend (an MLP of two linear layers): built under ``torch.no_grad()``
(a server's artifact), in grad mode (results carry autograd history: the differentiable
forms), and a training step (forward, loss, backward). Each checkout builds its own pairs
with its own code; then each pair is loaded ``--runs`` times, each load in a fresh process
(``precompile.load_file``, then one call), alternating between the checkouts so that drift
of the machine hits both alike. Medians, in milliseconds; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from load_depth import run_in

HERE = Path(__file__).resolve().parent
FORMS = ("no_grad", "grad_mode", "training")

_COMMON = r"""
import json, logging, sys, time, torch, torch.nn as nn
logging.disable(logging.WARNING)
from torch_precompile import precompile
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
x, t = torch.randn(4, 64), torch.randn(4, 8)
def infer(m, x):
    return m(x)
def train(m, x, t):
    loss = (m(x) - t).square().mean()
    loss.backward()
    return loss.detach()
"""

_BUILD = (
    _COMMON
    + r"""
form, backend, out = {form!r}, {backend!r}, {out!r}
if form == "training":
    pair = precompile(train, model, x, t, backend=backend)
else:
    with torch.set_grad_enabled(form == "grad_mode"):
        pair = precompile(infer, model, x, backend=backend)
precompile.save(*pair, out)
"""
)

_LOAD = (
    _COMMON
    + r"""
began = time.perf_counter()
run = precompile.load_file({path!r})
loaded = time.perf_counter()
run(model, x, t) if {form!r} == "training" else run(model, x)
print("LOAD " + json.dumps(1000 * (loaded - began)))
"""
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="the other checkout's src/")
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--forms", default=",".join(FORMS))
    args = parser.parse_args()
    sides = {"this": HERE.parent / "src", "other": args.src.resolve()}
    forms = args.forms.split(",")
    cases = [(form, backend) for backend in ("eager", "inductor") for form in forms]
    loads: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for (form, backend), (side, src) in ((c, s) for c in cases for s in sides.items()):
            out = str(Path(tmp) / f"{side}-{form}-{backend}.py")
            run_in(_BUILD.format(form=form, backend=backend, out=out), src)
        for _ in range(args.runs):
            for (form, backend), (side, src) in ((c, s) for c in cases for s in sides.items()):
                path = str(Path(tmp) / f"{side}-{form}-{backend}.py")
                said = run_in(_LOAD.format(path=path, form=form), src)
                line = next(x for x in said.splitlines() if x.startswith("LOAD "))
                loads.setdefault((form, backend, side), []).append(json.loads(line[5:]))
    print(f"Medians of {args.runs} fresh processes; `other` is `{args.src}`.\n")
    print("| pair | backend | this, ms | other, ms | ratio |")
    print("|---|---|--:|--:|--:|")
    for form, backend in cases:
        this, other = (statistics.median(loads[form, backend, s]) for s in sides)
        print(f"| {form} | {backend} | {this:.2f} | {other:.2f} | {this / other:.3f}x |")


if __name__ == "__main__":
    main()
