"""Per-call time at batch 1 and 16: eager, torch.compile, AOTInductor and ours, side by side.

    .venv/bin/python benchmarks/per_call.py                       # writes benchmarks/PER_CALL.md
    .venv/bin/python benchmarks/per_call.py --workloads deep --batches 1 --rounds 5

Each (workload, batch) runs in ``--processes`` fresh child processes, each with its own Inductor
cache. A child builds every approach first, checks each result against eager, then times them
in alternating rounds (``--calls`` calls per approach per round, one thread) so that drift of
the machine hits all alike; a child's number is the median over rounds of each round's median
call, and a cell is the median over children (one process can run every approach of a row
alike fast or slow, by a third at ~20 us). "ours (default)" is
``precompile``'s default wrapper (the C++ one wherever it can run the graph), next to
``wrapper="python"``; "ours, graph only" is the default artifact's compiled ``call`` without
the driver around it, and "ours, checks only" is the driver's checks of the call without the
graph. Inference runs under ``torch.no_grad()`` for every approach. AOTInductor is built for
inference only, twice: as it is usually built, with the weights baked in (it then neither takes
nor checks them per call), and with the model's parameters and buffers lifted to inputs, the
contract an artifact keeps (the model is passed at every call). That column passes a tuple
built once, so it reads nothing from the model per call: a lower bound for that contract.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKLOADS = ("mlp", "block", "block_train", "deep")
MODES = (
    "eager",
    "torch.compile",
    "AOTInductor",
    "AOTInductor, weights as inputs",
    "torch.compiler.precompile",
    "ours (default)",
    "ours, wrapper='python'",
    "ours, graph only",
    "ours, checks only",
)


def build(workload: str, batch: int) -> tuple[Callable[..., Any], Any, tuple[Any, ...]]:
    """Seeded ``(fn, model, inputs)``: ``mlp`` is 64-256-10; the others are coldstart.py's."""
    import torch
    from torch import nn

    sys.path.insert(0, str(HERE))
    from coldstart import Block, infer, train_step

    torch.manual_seed(0)
    if workload == "mlp":
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).eval()
        return infer, model, (torch.randn(batch, 64),)
    if workload == "block":
        return infer, Block().eval(), (torch.randn(batch, 32, 64),)
    if workload == "block_train":
        return train_step, Block().train(), (torch.randn(batch, 32, 64), torch.randn(batch, 32, 64))
    if workload == "deep":
        layers = [m for _ in range(100) for m in (nn.Linear(8, 8), nn.ReLU())]
        return infer, nn.Sequential(*layers).eval(), (torch.randn(batch, 8),)
    raise ValueError(f"unknown workload {workload!r}")


def approaches(workload: str, batch: int, workdir: Path) -> dict[str, Callable[[], Any]]:
    """Each approach as a no-argument call on the same model and inputs."""
    import torch

    from torch_precompile import precompile

    fn, model, inputs = build(workload, batch)
    runs: dict[str, Callable[[], Any]] = {"eager": lambda: fn(model, *inputs)}
    compiled = torch.compile(fn)
    runs["torch.compile"] = lambda: compiled(model, *inputs)
    if workload != "block_train":
        path = workdir / "model.pt2"
        with torch.no_grad():
            exported = torch.export.export(model, inputs)
            torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
        aoti = torch._inductor.aoti_load_package(str(path))
        runs["AOTInductor"] = lambda: aoti(*inputs)
        lifted, flat = _aoti_weights_as_inputs(model, inputs, workdir / "lifted.pt2")
        runs["AOTInductor, weights as inputs"] = lambda: lifted(*flat)
    builtin = _builtin(fn, model, inputs, workdir)
    if builtin is not None:
        runs["torch.compiler.precompile"] = lambda: builtin(model, *inputs)
    with torch.no_grad():  # inference artifacts, as a server builds them
        forward = precompile.load(*precompile(fn, model, *inputs))
        with_python = precompile.load(*precompile(fn, model, *inputs, wrapper="python"))
    runs["ours (default)"] = lambda: forward(model, *inputs)
    runs["ours, wrapper='python'"] = lambda: with_python(model, *inputs)
    driver = forward._forward  # the artifact's Driver: its compiled call, checked tensors
    state = type(driver).__call__.__globals__["model_tensors"](driver, [model])

    def graph_only() -> Any:
        with torch.no_grad():  # as the driver runs it
            return driver.call([*state, *inputs])

    runs["ours, graph only"] = graph_only
    runs["ours, checks only"] = lambda: driver.checked((model, *inputs), {})
    return runs


def _aoti_weights_as_inputs(
    model: Any, inputs: tuple[Any, ...], path: Path
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """AOTInductor on ``model`` with its parameters and buffers as leading inputs."""
    import torch

    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(named)

    class Lifted(torch.nn.Module):
        def forward(self, *flat: Any) -> Any:
            tensors = dict(zip(names, flat[: len(names)], strict=True))
            return torch.func.functional_call(model, tensors, flat[len(names) :])

    flat = (*[t.detach() for t in named.values()], *inputs)
    with torch.no_grad():
        exported = torch.export.export(Lifted(), flat)
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
    return torch._inductor.aoti_load_package(str(path)), flat


def _builtin(
    fn: Callable[..., Any], model: Any, inputs: tuple[Any, ...], workdir: Path
) -> Callable[..., Any] | None:
    """torch's own precompile through its public API, where this torch has one: 2.15's
    file-based capture block, or 2.14's precompile(fn, *inputs)."""
    import torch

    builtin = getattr(torch.compiler, "precompile", None)
    if callable(getattr(builtin, "capture", None)):
        paths = workdir / "builtin.py", workdir / "builtin.cache"
        with builtin.capture(fn, artifact_path=paths[0], cache_path=paths[1]) as cap:
            cap(model, *inputs)
        return builtin.load(*paths)
    if callable(builtin):
        return builtin.load(*builtin(fn, model, *inputs))
    return None


def _check(runs: dict[str, Callable[[], Any]], workload: str) -> None:
    import torch

    expected = runs["eager"]()
    for name, run in runs.items():
        if name == "ours, checks only":  # it computes nothing to compare
            continue
        got = run()
        got = got[0] if isinstance(got, list | tuple) else got
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"{workload}: {name} differs from eager")


def child(workload: str, batch: int, rounds: int, calls: int) -> None:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        runs = approaches(workload, batch, Path(workdir))
        grad = torch.enable_grad() if workload == "block_train" else torch.no_grad()
        with grad:
            _check(runs, workload)
            per_round: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(rounds):
                for name, run in runs.items():
                    for _ in range(calls // 5):
                        run()
                    times = []
                    for _ in range(calls):
                        start = time.perf_counter()
                        run()
                        times.append(time.perf_counter() - start)
                    per_round[name].append(statistics.median(times) * 1e6)
    print(json.dumps({name: statistics.median(v) for name, v in per_round.items()}))


def measure(workload: str, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """The median over ``args.processes`` children of each approach's time."""
    runs = [_measure_once(workload, batch, args.rounds, args.calls) for _ in range(args.processes)]
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


def _measure_once(workload: str, batch: int, rounds: int, calls: int) -> dict[str, float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="per_call_"))
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            workload,
            str(batch),
            "--rounds",
            str(rounds),
            "--calls",
            str(calls),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{workload} batch {batch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: dict[tuple[str, int], dict[str, float]]) -> str:
    lines = [
        "| workload | batch | " + " | ".join(f"{m} us" for m in MODES) + " |",
        "|---|---:|" + "---:|" * len(MODES),
    ]
    for (workload, batch), cells in results.items():
        shown = [f"{cells[m]:,.1f}" if m in cells else "-" for m in MODES]
        lines.append(f"| {workload} | {batch} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=HERE / "PER_CALL.md")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.rounds, args.calls)
        return
    import torch

    sys.path.insert(0, str(HERE))
    from coldstart import interpreter

    results = {}
    for workload in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            results[(workload, batch)] = measure(workload, batch, args)
            print(f"{workload} batch {batch}: {results[(workload, batch)]}", flush=True)
    text = "\n".join(
        [
            "# Per call: eager, torch.compile, AOTInductor and ours",
            "",
            f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} cores, "
            f"one thread; {args.rounds} rounds of {args.calls} calls per approach in each of "
            f"{args.processes} processes. Rerun with `{interpreter()} benchmarks/per_call.py "
            f"--processes {args.processes}`.",
            "",
            table(results),
            "",
        ]
    )
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
