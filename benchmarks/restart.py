"""An elastic restart of a 2-rank FSDP2 job: time from the restart to the first resumed step.

    .venv/bin/python benchmarks/restart.py --runs 3     # writes benchmarks/RESTART.md

Each run is one ``torchrun --max-restarts 1`` job on 127.0.0.1 (gloo): the transformer blocks
of ``data_parallel.py``, ``fully_shard`` on each and on the root; every step checkpoints each
rank's shards; after ``KILLED_AFTER`` steps rank 1 dies, torchrun restarts both workers, and
they resume from the checkpoint. A restarted worker records the seconds from its own start
(before ``import torch``) to its first resumed step. Modes:

- ``ours``: the pair saved before the job (``compile_on_one_rank``), loaded with
  ``precompile.load_file``;
- ``eager``: the FSDP2 model as is;
- ``compile``: ``torch.compile`` on each block; the first attempt saves
  ``torch.compiler.save_cache_artifacts()`` per rank, the restarted worker loads them with
  ``load_cache_artifacts`` before its first step.

Restarted workers get an empty Inductor cache directory of their own, so only what each mode
saved on purpose helps it.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402  (the clock starts before the imports)
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

MODES = ("ours", "eager", "compile")
STEPS, KILLED_AFTER = 6, 3
LAUNCH_TIMEOUT_S = 1800


def worker(mode: str, out: Path, dim: int, blocks: int) -> None:
    import torch
    import torch.distributed as dist

    from data_parallel import JOBS, _batch, _model
    from distributed import step

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=900)
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not hosted_by_agent and rank == 0,
        timeout=timeout,
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    options = argparse.Namespace(dim=dim, blocks=blocks, batch=4, seq=64)
    model = _model("fsdp", "compile" if mode == "compile" else "eager", options)
    x = _batch("fsdp", rank, options)
    assert JOBS["fsdp"] == world
    artifacts = out / f"compile-artifacts-{rank}.bin"
    if mode == "ours":
        from torch_precompile import precompile

        run = precompile.load_file(out / "fsdp.py")
    else:
        if mode == "compile" and attempt:
            torch.compiler.load_cache_artifacts(artifacts.read_bytes())
        run = step
    checkpoint = out / f"{mode}-checkpoint{rank}.pt"
    start = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(saved["shards"][name])
        start = saved["done"]
    for index in range(start, STEPS):
        run(model, x)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        if index == start and attempt:
            (out / f"{mode}-resumed{rank}.json").write_text(
                json.dumps({"seconds": time.perf_counter() - STARTED})
            )
        torch.save(
            {
                "done": index + 1,
                "shards": {n: p.to_local().clone() for n, p in model.named_parameters()},
            },
            checkpoint,
        )
        if mode == "compile" and index == 0 and not attempt:
            artifacts.write_bytes(torch.compiler.save_cache_artifacts()[0])
        if not attempt and index + 1 == KILLED_AFTER:
            dist.barrier()
            if rank == 1:
                os._exit(17)
    dist.barrier()
    dist.destroy_process_group()


def _env(cache: Path) -> dict[str, str]:
    here = str(Path(__file__).parent)
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }


def _build_two_ranks(out: Path, args: argparse.Namespace) -> None:
    """The pair, built once before the jobs (``data_parallel.py``'s build: fsdp.py + cache)."""
    from data_parallel import launch

    launch(
        "fsdp",
        "build",
        out,
        out / "build-cache",
        argparse.Namespace(dim=args.dim, blocks=args.blocks, batch=4, seq=64, steps=1),
    )


def job(mode: str, out: Path, args: argparse.Namespace) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--local-addr",
        "127.0.0.1",
        __file__,
        "--worker",
        mode,
        str(out),
        str(args.dim),
        str(args.blocks),
    ]
    cache = out / f"{mode}-inductor-cache"
    done = subprocess.run(
        command, env=_env(cache), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} job failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return max(
        json.loads((out / f"{mode}-resumed{r}.json").read_text())["seconds"] for r in range(2)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--worker", nargs=4)
    args = parser.parse_args()
    if args.worker:
        mode, out, dim, blocks = args.worker
        worker(mode, Path(out), int(dim), int(blocks))
        return
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp, "built")
        built.mkdir()
        _build_two_ranks(built, args)
        for run in range(args.runs):
            for mode in MODES:
                out = Path(tmp, f"{mode}-{run}")
                out.mkdir()
                for path in built.glob("fsdp.*"):
                    (out / path.name).write_bytes(path.read_bytes())
                samples[mode].append(job(mode, out, args))
    import torch

    names = {
        "ours": "torch_precompile, saved pair",
        "eager": "eager FSDP2",
        "compile": "torch.compile per block, saved cache artifacts",
    }
    lines = [
        "# Restart: from a restarted worker's start to its first resumed step",
        "",
        f"Written by `benchmarks/restart.py --runs {args.runs}`. A 2-rank FSDP2 job "
        f"({args.blocks} transformer blocks of width {args.dim}) under `torchrun "
        f"--max-restarts 1`; rank 1 dies after {KILLED_AFTER} steps and both workers "
        "restart from the checkpoint. Each number is the slower rank, median of "
        f"{args.runs} jobs.",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, OMP_NUM_THREADS=1 per rank",
        f"- {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "| mode | seconds to the first resumed step | runs |",
        "|---|---:|---|",
        *(
            f"| {names[m]} | {statistics.median(samples[m]):.2f} | "
            f"{', '.join(f'{v:.2f}' for v in samples[m])} |"
            for m in MODES
        ),
    ]
    text = "\n".join(lines)
    Path(__file__).with_name("RESTART.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
