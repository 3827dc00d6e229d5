"""Serving a causal LM with ``generate()``: time to first token and per-token latency.

    .venv/bin/python benchmarks/serving_llm.py [--layers 4,16] [--batches 1,4] [--runs 3]

A Llama-style config (width 256, 8 heads of 32 with 4 key/value heads, vocabulary 2048, random
weights) of each depth generates from a prompt of 24 tokens with a static KV cache of 128, on
the CPU in float32, in four ways: eager; ``model.forward = torch.compile(model.forward)``
cold (an empty Inductor cache per process) and warm (its on-disk caches filled by an earlier
process); and ``precompile.for_generate`` (the pair built once beforehand, for batch sizes 1
and 4). Every number is from fresh processes, the median of ``--runs``:

- first token: from process start (the parent's clock before it starts the process:
  perf_counter is the system-wide monotonic clock) to the return of a
  ``generate()`` of two new tokens (import, model made from its config, load, prefill, first
  decode step). ``import torch`` alone is measured too.
- per token: after that, ``(t(66 new tokens) - t(2 new tokens)) / 64`` of greedy decoding,
  each time the least of 5 generations.
- peak memory: the process's peak resident set (``ru_maxrss``).

The table goes to ``--out`` (default ``benchmarks/SERVING_LLM.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = "SERVING_LLM "
MODES = ("eager", "compile_cold", "compile_warm", "precompile")
MAX_CACHE_LEN = 128
PROMPT = 24

_MODEL = r"""
import transformers
def make_model(layers):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.max_cache_len = {max_cache_len}
    model.generation_config.disable_compile = True
    return model
"""

_RUN = (
    r"""
import time
import torch
imported = time.perf_counter()
import json, logging, resource, sys
logging.disable(logging.WARNING)
"""
    + _MODEL
    + r"""
model = make_model({layers})
mode = {mode!r}
if mode.startswith("compile"):
    model.forward = torch.compile(model.forward)
elif mode == "precompile":
    from torch_precompile import precompile
    precompile.for_generate(model, {path!r}, max_cache_len={max_cache_len}, batch_sizes=(1, 4))
ids = torch.randint(3, 2048, ({batch}, {prompt}), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)

def generate(new):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False)

generate(2)
first = time.perf_counter()
timings = {{}}
for new in (2, 66):
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        generate(new)
        runs.append(time.perf_counter() - start)
    timings[new] = min(runs)
print({marker!r} + json.dumps({{
    "import_torch": imported, "first_token": first,
    "per_token": (timings[66] - timings[2]) / 64,
    "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
)

_BUILD = (
    r"""
import logging, torch
logging.disable(logging.WARNING)
from torch_precompile import precompile
"""
    + _MODEL
    + r"""
precompile.for_generate(make_model({layers}), {path!r}, max_cache_len={max_cache_len},
                        batch_sizes=(1, 4))
"""
)


def _python(script: str, env: dict[str, str]) -> dict[str, float]:
    started = _now()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith(MARKER))
    result = json.loads(line[len(MARKER) :])
    # perf_counter is CLOCK_MONOTONIC, shared by processes: the child's stamps less our start.
    result["import_torch"] -= started
    result["first_token"] -= started
    return result


def _now() -> float:
    import time

    return time.perf_counter()


def measure(layers: int, batch: int, mode: str, path: str, cache_dir: Path) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    script = _RUN.format(
        layers=layers,
        mode=mode,
        path=path,
        max_cache_len=MAX_CACHE_LEN,
        batch=batch,
        prompt=PROMPT,
        marker=MARKER,
    )
    return _python(script, env)


def run_mode(layers: int, batch: int, mode: str, path: str, runs: int, work: Path) -> list:
    results = []
    warm = work / f"warm-{layers}-{batch}"
    if mode == "compile_warm":
        measure(layers, batch, "compile_warm", path, warm)  # fills the caches
    for run in range(runs):
        cache = warm if mode == "compile_warm" else work / f"{mode}-{layers}-{batch}-{run}"
        results.append(measure(layers, batch, mode, path, cache))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,16")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "SERVING_LLM.md"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for layers in [int(x) for x in args.layers.split(",")]:
            path = str(work / f"llama{layers}.py")
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"build-{layers}")}
            build = _BUILD.format(layers=layers, path=path, max_cache_len=MAX_CACHE_LEN)
            subprocess.run([sys.executable, "-c", build], check=True, env=env)
            for batch in [int(x) for x in args.batches.split(",")]:
                for mode in args.modes.split(","):
                    results = run_mode(layers, batch, mode, path, args.runs, work)
                    row = {
                        key: statistics.median(r[key] for r in results)
                        for key in ("import_torch", "first_token", "per_token", "peak_mb")
                    }
                    rows.append({"layers": layers, "batch": batch, "mode": mode, **row})
                    print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(table(rows, args.runs))
    print(Path(args.out).read_text())


def table(rows: list[dict], runs: int) -> str:
    import datetime
    import platform

    import torch
    import transformers

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    ).stdout.strip()
    lines = [
        "# Serving a causal LM with generate()",
        "",
        f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"{platform.machine()}, os.cpu_count() = {os.cpu_count()}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python "
        f"{platform.python_version()}; torch_precompile git {commit}",
        f"- Command: `.venv/bin/python benchmarks/serving_llm.py --runs {runs}`",
        "",
        f"Medians of {runs} fresh processes each; the workload is in the script's docstring. "
        "First token: process start to two new tokens (import, model made, load, prefill, "
        "first decode step). Per token: greedy decoding, 64 tokens.",
        "",
        "| layers | batch | mode | first token (s) | vs eager | per token (ms) "
        "| vs torch.compile warm | peak memory (MB) | vs eager |",
        "|--:|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        same = [r for r in rows if (r["layers"], r["batch"]) == (row["layers"], row["batch"])]
        eager = next((r for r in same if r["mode"] == "eager"), None)
        warm = next((r for r in same if r["mode"] == "compile_warm"), None)

        def ratio(key: str, base: dict | None, r: dict = row) -> str:
            return f"{r[key] / base[key]:.2f}x" if base else "-"

        lines.append(
            f"| {row['layers']} | {row['batch']} | {row['mode']} | {row['first_token']:.2f} "
            f"| {ratio('first_token', eager)} | {row['per_token'] * 1000:.2f} "
            f"| {ratio('per_token', warm)} | {row['peak_mb']:.0f} | {ratio('peak_mb', eager)} |"
        )
    torch_import = statistics.median(r["import_torch"] for r in rows)
    lines += ["", f"`import torch` alone (median over all processes): {torch_import:.2f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
