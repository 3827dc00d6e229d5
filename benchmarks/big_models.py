"""Big models: builds without the weights, and repeated blocks compiled once at call time.

    .venv/bin/python benchmarks/big_models.py               # writes BIG_MODELS.md
    .venv/bin/python benchmarks/big_models.py --skip-8b     # the quick rows only

Three tables, every cell from fresh processes with empty Inductor and temp dirs:

- **Build from meta.** A Llama-style config created on the ``meta`` device (no weights in
  memory), its inference artifact built with ``device="cpu"`` by the inductor backend: build
  seconds and the building process's peak resident memory. The 8-billion-parameter row's fp32
  weights alone would take 32 GB.
- **The same recipe with real weights.** A config that fits (2 layers, width 256) built from
  meta, then loaded in a fresh process and called with a real model of random weights: the
  largest difference from eager, on both backends.
- **Per call.** The 24-block transformer stack of ``build_time.py`` (inference and training
  step), built with repeated blocks compiled once (the default) and unrolled
  (``blocks=False``); both then loaded in each fresh process (which first alternates from
  process to process): load seconds, first call, and the calls after it in alternating
  rounds, so that both meet the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from build_time import run_cold, write_report  # noqa: E402

RESULT = "BIG_MODELS_RESULT "

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
LLAMA_SMALL = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

_BUILD_FROM_META = r"""
import json, resource, time, torch, transformers
from torch_precompile import precompile
config = transformers.LlamaConfig(**{config!r})
start = time.perf_counter()
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.zeros(1, 16, dtype=torch.long)
params = sum(p.numel() for p in model.parameters())
with torch.no_grad():
    code, cache = precompile(lambda m, i: m(i, use_cache=False).logits, model, ids,
                             device="cpu", backend={backend!r}, blocks={blocks!r})
seconds = time.perf_counter() - start
open({out!r} + ".py", "w").write(code)
open({out!r} + ".cache", "wb").write(cache)
print({marker!r} + json.dumps({{"seconds": seconds, "params": params,
    "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "source_kib": len(code) / 1024, "cache_kib": len(cache) / 1024,
    "shared": code.count("# Piece ")}}))
"""

_RUN_REAL = r"""
import json, torch, transformers
from torch_precompile import precompile
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{config!r})).eval()
run = precompile.load({out!r} + ".py", {out!r} + ".cache")
worst = 0.0
with torch.no_grad():
    for n in (16, 16, 16):
        ids = torch.randint(0, {vocab}, (1, n))
        expected = model(ids, use_cache=False).logits
        worst = max(worst, (run(model, ids) - expected).abs().max().item())
print({marker!r} + json.dumps({{"max_abs_diff": worst}}))
"""

_BUILD_STACK = r"""
import contextlib, json, sys, time, torch
from torch import nn
sys.path.insert(0, {benchmarks!r})
from coldstart import Block, infer, train_step
from torch_precompile import precompile
torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range({depth})])
inputs = (torch.randn(4, 32, 64),) + ((torch.randn(4, 32, 64),) if {mode!r} == "train" else ())
fn = train_step if {mode!r} == "train" else infer
if {mode!r} == "infer":
    model.eval()
with torch.no_grad() if {mode!r} == "infer" else contextlib.nullcontext():
    code, cache = precompile(fn, model, *inputs, blocks={blocks!r})
open({out!r} + ".py", "w").write(code)
open({out!r} + ".cache", "wb").write(cache)
print({marker!r} + json.dumps({{"pieces": code.count("# Piece ")}}))
"""

_CALL_STACK = r"""
import contextlib, json, sys, time
import torch
from torch import nn
sys.path.insert(0, {benchmarks!r})
from coldstart import Block
from torch_precompile import precompile
torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range({depth})])
inputs = (torch.randn(4, 32, 64),) + ((torch.randn(4, 32, 64),) if {mode!r} == "train" else ())
if {mode!r} == "infer":
    model.eval()
context = torch.no_grad if {mode!r} == "infer" else contextlib.nullcontext
runs, result = {{}}, {{}}
# Each artifact loaded and called once, in turn; which goes first alternates from process to
# process (the first call in a process pays one-time costs: a full garbage collection, say).
for name, out in sorted({outs!r}.items(), reverse={reverse!r}):
    start = time.perf_counter()
    runs[name] = precompile.load(out + ".py", out + ".cache")
    loaded = time.perf_counter()
    with context():
        runs[name](model, *inputs)
    result[name] = {{"load": loaded - start, "first": time.perf_counter() - loaded, "times": []}}
for _ in range({rounds}):  # then in alternating rounds, so that both see the same machine
    for name, run in runs.items():
        t = time.perf_counter()
        with context():
            for _ in range(10):
                run(model, *inputs)
        result[name]["times"].append((time.perf_counter() - t) / 10)
for r in result.values():
    r["per_call_ms"] = 1000 * sorted(r.pop("times"))[{rounds} // 2]
print({marker!r} + json.dumps(result))
"""


def _cold(template: str, what: str, **fields: Any) -> dict[str, Any]:
    return run_cold(
        lambda tmp: template.format(marker=RESULT, benchmarks=str(HERE), **fields),
        RESULT,
        what,
    )


def build_from_meta(config: dict[str, Any], backend: str, blocks: Any, out: str) -> dict[str, Any]:
    return _cold(
        _BUILD_FROM_META,
        f"meta build ({backend})",
        config=config,
        backend=backend,
        blocks=blocks,
        out=out,
    )


def meta_rows(skip_8b: bool, workdir: Path) -> list[str]:
    lines = [
        "| config | parameters | blocks | build s | peak RSS MiB | source KiB | cache KiB |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    cases = [] if skip_8b else [("Llama 8B (32 layers, d 4096)", LLAMA_8B)]
    cases.append(("Llama small (2 layers, d 256)", LLAMA_SMALL))
    for name, config in cases:
        for blocks in (None, False) if config is LLAMA_8B else (None,):
            r = build_from_meta(config, "inductor", blocks, str(workdir / "meta"))
            print(name, blocks, r, flush=True)
            shared = "compiled once" if r["shared"] else "unrolled (not cut)"
            lines.append(
                f"| {name} | {r['params'] / 1e6:,.0f} M | {shared} | {r['seconds']:.1f} | "
                f"{r['peak_mib']:,.0f} | {r['source_kib']:,.0f} | {r['cache_kib']:,.0f} |"
            )
    return lines


def real_rows(workdir: Path) -> list[str]:
    lines = ["| backend | build s (from meta) | max abs diff from eager |", "|---|---:|---:|"]
    for backend in ("eager", "inductor"):
        out = str(workdir / f"small-{backend}")
        built = build_from_meta(LLAMA_SMALL, backend, True, out)
        ran = _cold(
            _RUN_REAL,
            f"real run ({backend})",
            config=LLAMA_SMALL,
            vocab=LLAMA_SMALL["vocab_size"],
            out=out,
        )
        print(backend, built, ran, flush=True)
        lines.append(f"| {backend} | {built['seconds']:.1f} | {ran['max_abs_diff']:.2e} |")
    return lines


def call_rows(workdir: Path, depth: int, runs: int, rounds: int) -> list[str]:
    lines = [
        "| mode | blocks | pieces | load s | first call s | per call ms | per call / unrolled |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    forms = ((None, "compiled once"), (False, "unrolled"))
    for mode in ("infer", "train"):
        outs, pieces = {}, {}
        for blocks, shown in forms:
            outs[shown] = str(workdir / f"stack-{mode}-{blocks}")
            built = _cold(
                _BUILD_STACK,
                "stack build",
                depth=depth,
                mode=mode,
                blocks=blocks,
                out=outs[shown],
            )
            pieces[shown] = built["pieces"]
        results = [
            _cold(
                _CALL_STACK,
                "stack calls",
                depth=depth,
                mode=mode,
                outs=outs,
                rounds=rounds,
                reverse=bool(i % 2),
            )
            for i in range(runs)
        ]
        measured = {
            shown: {
                key: statistics.median(r[shown][key] for r in results)
                for key in ("load", "first", "per_call_ms")
            }
            for _, shown in forms
        }
        print(mode, measured, flush=True)
        for _, shown in forms:
            m = measured[shown]
            ratio = m["per_call_ms"] / measured["unrolled"]["per_call_ms"]
            lines.append(
                f"| {mode} | {shown} | {pieces[shown]} | {m['load']:.3f} | {m['first']:.3f} | "
                f"{m['per_call_ms']:.2f} | {ratio:.2f}x |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out", type=Path, default=HERE / "BIG_MODELS.md")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        tables = [
            "## Build from meta (inductor, inference)",
            "",
            *meta_rows(args.skip_8b, workdir),
            "",
            "## The same recipe with real weights (built from meta, run with random weights)",
            "",
            *real_rows(workdir),
            "",
            f"## Per call: {args.depth} transformer blocks, compiled once against unrolled",
            "",
            *call_rows(workdir, args.depth, args.runs, args.rounds),
        ]
    write_report(
        args.out,
        "Big models",
        "every cell from fresh processes with empty Inductor and temp dirs; per call: both "
        f"artifacts in one process, {args.rounds} alternating rounds of 10 calls, the median "
        f"round, median over {args.runs} processes",
        "big_models.py",
        tables,
    )


if __name__ == "__main__":
    main()
