"""Command line: compile, inspect, verify and demo.

    torch-precompile compile MODULE:FACTORY -o PATH   # FACTORY() returns (fn, example_inputs)
    torch-precompile inspect PATH                      # reads the pair; executes nothing
    torch-precompile verify PATH [--key-file KEY]      # pairing, kernels, signature
    torch-precompile demo                              # the built-in end-to-end example

Exit status: 0 on success, 1 when the work failed (or verification found a problem),
2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

PROG = "torch-precompile"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format=f"{PROG}: %(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line for the user; the traceback only on request
        if getattr(args, "debug", False):
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Precompile PyTorch computations ahead of time.",
        epilog="Exit status: 0 success, 1 failure, 2 usage error.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    compile_cmd = commands.add_parser(
        "compile", help="precompile FACTORY's fn and save the pair",
        description="Import MODULE, call FACTORY() -> (fn, example_inputs), precompile it and "
                    "save the pair at PATH (the source) with its cache beside it.",
    )
    compile_cmd.add_argument("target", metavar="MODULE:FACTORY")
    compile_cmd.add_argument("-o", "--output", required=True, type=Path, metavar="PATH")
    compile_cmd.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    compile_cmd.add_argument("--sign-key-file", type=Path, metavar="FILE",
                             help="sign the pair with the key in FILE")
    compile_cmd.set_defaults(run=_compile)

    inspect_cmd = commands.add_parser(
        "inspect", help="describe a saved pair without executing it",
        description="Print the calling convention, parameters, inputs (with dynamic dims), "
                    "kernels, sizes, fingerprint and signature state of a saved pair.",
    )
    inspect_cmd.add_argument("path", type=Path, metavar="PATH")
    inspect_cmd.add_argument("--json", action="store_true", help="print JSON")
    inspect_cmd.set_defaults(run=_inspect)

    verify_cmd = commands.add_parser(
        "verify", help="check a saved pair: pairing, kernels, signature",
        description="Check that the cache belongs to the source, that its kernels are intact "
                    "and built for this machine, and (with --key-file) the signature.",
    )
    verify_cmd.add_argument("path", type=Path, metavar="PATH")
    verify_cmd.add_argument("--key-file", type=Path, metavar="FILE")
    verify_cmd.set_defaults(run=_verify)

    demo = commands.add_parser("demo", help="precompile a built-in MLP and check it end to end")
    demo.add_argument("--out", type=Path, default=Path("demo-out"),
                      help="folder for the artifact pairs (default: ./demo-out)")
    demo.add_argument("--backend", default="inductor", choices=["inductor", "eager"],
                      help="how the captured graph runs (default: inductor)")
    demo.set_defaults(run=_demo)
    return parser


def _compile(args: argparse.Namespace) -> int:
    from torch_precompile import precompile, storage

    module_name, _, factory_name = args.target.partition(":")
    if not module_name or not factory_name:
        raise ValueError(f"expected MODULE:FACTORY, got {args.target!r}")
    sign_key = _read_key(args.sign_key_file) if args.sign_key_file else None
    with _Progress(sys.stderr) as progress:
        progress.stage(f"importing {module_name}")
        sys.path.insert(0, str(Path.cwd()))
        factory = getattr(importlib.import_module(module_name), factory_name)
        progress.stage(f"calling {factory_name}()")
        made = factory()
        if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
            raise ValueError(f"{args.target}() must return (fn, example_inputs)")
        fn, inputs = made
        stages = {"capture": "capturing fn (one traced run)",
                  "lower": f"lowering ({args.backend}; builds kernels)",
                  "render": "writing the artifact source"}
        code, cache = precompile(fn, *inputs, backend=args.backend,
                                 progress=lambda s: progress.stage(stages[s]))
        progress.stage(f"saving {args.output}")
        storage.save(code, cache, args.output, sign_key=sign_key)
    print(f"{args.output} ({len(code) / 1024:.1f} KiB) and "
          f"{storage.cache_path(args.output, code).name} ({len(cache) / 1024:.1f} KiB)")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from torch_precompile import inspection

    report = inspection.describe(args.path)
    print(json.dumps(report, indent=2) if args.json else inspection.render(report))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from torch_precompile import inspection

    key = _read_key(args.key_file) if args.key_file else None
    problems, notes = inspection.verify(args.path, key)
    for note in notes:
        print(f"ok: {note}")
    for problem in problems:
        print(f"FAILED: {problem}")
    print(f"{args.path}: {'verified' if not problems else 'NOT verified'}")
    return 1 if problems else 0


def _demo(args: argparse.Namespace) -> int:
    from torch_precompile.demo import run_demo

    return run_demo(args.out, args.backend)


def _read_key(path: Path) -> bytes:
    key = path.read_bytes().strip()
    if not key:
        raise ValueError(f"the key file {path} is empty")
    return key


class _Progress:
    """Stage lines: redrawn in place with a running clock on a terminal, plain otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.live = stream.isatty()
        self.current: str | None = None
        self.started = time.perf_counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> _Progress:
        if self.live:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self._finish("done" if kind is None else "failed")
        self._stop.set()

    def stage(self, text: str) -> None:
        self._finish("done")
        with self._lock:
            self.current, self.started = text, time.perf_counter()
            if not self.live:
                print(f"{PROG}: {text}...", file=self.stream, flush=True)

    def _finish(self, outcome: str) -> None:
        with self._lock:
            if self.current is not None:
                elapsed = time.perf_counter() - self.started
                prefix = "\r\033[K" if self.live else ""
                print(f"{prefix}{PROG}: {self.current}: {outcome} in {elapsed:.1f} s",
                      file=self.stream, flush=True)
            self.current = None

    def _tick(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                if self.current is not None:
                    elapsed = time.perf_counter() - self.started
                    self.stream.write(f"\r\033[K{PROG}: {self.current}... {elapsed:.1f} s")
                    self.stream.flush()


if __name__ == "__main__":
    sys.exit(main())
