"""Command line: compile, inspect, verify and demo.

    torch-precompile compile MODULE:FACTORY -o PATH   # FACTORY() returns (fn, example_inputs)
    torch-precompile inspect PATH                      # reads the pair; executes nothing
    torch-precompile verify PATH [--key-file KEY]      # pairing, kernels, signature
    torch-precompile demo                              # the built-in end-to-end example

Exit status: 0 on success; 1 when the work failed (or verification found a problem); 2 for a
usage error (a malformed command line, or one naming a file, module or factory that is not
there); 3 from ``verify`` for a signed pair checked without its key (nothing else found wrong,
but the signature is unverified).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import sys
import types
from pathlib import Path
from typing import Any, cast

PROG = "torch-precompile"
EXIT_FAILED, EXIT_USAGE, EXIT_UNVERIFIED_SIGNATURE = 1, 2, 3
EXIT_STATUS = (
    "Exit status: 0 success, 1 failure (or a pair that does not verify), 2 usage "
    "error, 3 a signed pair verified without its key (signature unchecked)."
)


class UsageError(Exception):
    """The command line names something that cannot be used: exit 2, as argparse does."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format=f"{PROG}: %(message)s")
    # Progress keeps its own handler (in place on a terminal), not the one-line error format.
    logging.getLogger("torch_precompile.progress").propagate = False
    try:
        return cast(int, args.run(args))
    except KeyboardInterrupt:
        return 130
    except UsageError as e:  # worded like argparse's own usage errors
        args.command_parser.print_usage(sys.stderr)
        print(f"{args.command_parser.prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # one line for the user; the traceback only on request
        if getattr(args, "debug", False):
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_FAILED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Precompile PyTorch computations ahead of time.",
        epilog=EXIT_STATUS,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    compile_cmd = commands.add_parser(
        "compile",
        help="precompile FACTORY's fn and save the pair",
        description="Import MODULE, call FACTORY() -> (fn, example_inputs), precompile it and "
        "save the pair at PATH (the source) with its cache beside it.",
    )
    compile_cmd.add_argument("target", type=_target, metavar="MODULE:FACTORY")
    compile_cmd.add_argument("-o", "--output", required=True, type=_output_path, metavar="PATH")
    compile_cmd.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    compile_cmd.add_argument(
        "--tracer",
        default="make_fx",
        choices=["make_fx", "dynamo"],
        help="dynamo: Dynamo also reads fn's Python and its guards become checks",
    )
    compile_cmd.add_argument(
        "--require-all-guards",
        action="store_true",
        help="with --tracer dynamo: refuse a capture that dropped a guard no call can check",
    )
    compile_cmd.add_argument(
        "--sign-key-file",
        type=_key_file,
        dest="sign_key",
        metavar="FILE",
        help="sign the pair with the key in FILE",
    )
    compile_cmd.add_argument(
        "--inference",
        action="store_true",
        help="precompile under torch.no_grad(): no backward is built, and "
        "results carry no autograd history",
    )
    compile_cmd.set_defaults(run=_compile, command_parser=compile_cmd)

    inspect_cmd = commands.add_parser(
        "inspect",
        help="describe a saved pair without executing it",
        description="Print the calling convention, parameters, inputs (with dynamic dims), "
        "kernels, sizes, fingerprint and signature state of a saved pair.",
    )
    inspect_cmd.add_argument("path", type=_existing_file, metavar="PATH")
    inspect_cmd.add_argument("--json", action="store_true", help="print JSON")
    inspect_cmd.set_defaults(run=_inspect, command_parser=inspect_cmd)

    verify_cmd = commands.add_parser(
        "verify",
        help="check a saved pair: pairing, kernels, signature",
        description="Check that the cache belongs to the source, that its kernels are intact "
        "and built for this machine, and (with --key-file) the signature. A signed "
        "pair checked without its key exits 3: its signature is unverified.",
        epilog=EXIT_STATUS,
    )
    verify_cmd.add_argument("path", type=_existing_file, metavar="PATH")
    verify_cmd.add_argument(
        "--key-file",
        type=_key_file,
        dest="key",
        metavar="FILE",
        help="the key the pair was signed with",
    )
    verify_cmd.set_defaults(run=_verify, command_parser=verify_cmd)

    demo = commands.add_parser("demo", help="precompile a built-in MLP and check it end to end")
    demo.add_argument(
        "--out",
        type=_out_dir,
        default=Path("demo-out"),
        help="folder for the artifact pairs (default: ./demo-out)",
    )
    demo.add_argument(
        "--backend",
        default="inductor",
        choices=["inductor", "eager"],
        help="how the captured graph runs (default: inductor)",
    )
    demo.set_defaults(run=_demo, command_parser=demo)
    return parser


def _compile(args: argparse.Namespace) -> int:
    import torch

    from torch_precompile import precompile, progress, storage

    module_name, _, factory_name = args.target.partition(":")
    # The build's own steps (trace, lower, kernels, source) are logged by the package.
    with progress.step(f"importing {module_name}"):
        sys.path.insert(0, str(Path.cwd()))
        module = _import(module_name)
    factory = _factory(module, factory_name)  # after the step: the import itself went fine
    with progress.step(f"calling {factory_name}()"):
        made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise ValueError(f"{args.target}() must return (fn, example_inputs)")
    fn, inputs = made
    with torch.no_grad() if args.inference else contextlib.nullcontext():
        code, cache = precompile(
            fn,
            *inputs,
            backend=args.backend,
            tracer=args.tracer,
            require_all_guards=args.require_all_guards,
        )
    with progress.step(f"saving {args.output}"):
        storage.save(code, cache, args.output, sign_key=args.sign_key)
    print(
        f"{args.output} ({len(code) / 1024:.1f} KiB) and "
        f"{storage.cache_path(args.output, code).name} ({len(cache) / 1024:.1f} KiB)"
    )
    return 0


def _import(module_name: str) -> types.ModuleType:
    """MODULE; a UsageError when the command line names a module that is not there (an error
    raised inside MODULE itself is the work's)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not f"{module_name}.".startswith(f"{e.name}."):
            raise  # a module that MODULE imports is missing: MODULE's own failure
        raise UsageError(
            f"no module named {module_name!r}: run from the folder that holds "
            "it, or add that folder to PYTHONPATH"
        ) from None


_MOST_LISTED = 8  # a module defining more functions is not listed


def _factory(module: types.ModuleType, factory_name: str) -> Any:
    """MODULE's FACTORY; a UsageError naming the functions MODULE defines (a few) when it has
    none by that name, or has a value there that cannot be called."""
    factory = getattr(module, factory_name, None)
    if callable(factory):
        return factory
    defined = [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and isinstance(value, types.FunctionType)
        and value.__module__ == module.__name__
    ]
    if not defined:
        there = "; it defines no function"
    elif len(defined) <= _MOST_LISTED:
        there = f"; it defines {', '.join(defined)}"
    else:
        there = f"; it defines {len(defined)} functions"
    found = "has no" if factory is None else "has a non-callable"
    raise UsageError(
        f"module {module.__name__!r} {found} {factory_name!r}{there}. FACTORY names a "
        "function of MODULE that returns (fn, example_inputs)."
    )


def _inspect(args: argparse.Namespace) -> int:
    from torch_precompile import inspection

    report = inspection.describe(args.path)
    print(json.dumps(report, indent=2) if args.json else inspection.render(report))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from torch_precompile import inspection

    result = inspection.verify(args.path, args.key)
    for line in result.checked:
        print(f"ok: {line}")
    for line in result.notes:
        print(f"note: {line}")
    for line in result.problems:
        print(f"FAILED: {line}")
    if result.problems:
        print(f"{args.path}: NOT verified")
        return EXIT_FAILED
    if result.unchecked is not None:
        print(f"UNCHECKED: {result.unchecked}")
        print(
            f"{args.path}: NOT verified: signed, signature unchecked (exit status "
            f"{EXIT_UNVERIFIED_SIGNATURE})"
        )
        return EXIT_UNVERIFIED_SIGNATURE
    done = "signature valid" if args.key is not None else "unsigned: no signature to check"
    print(f"{args.path}: verified ({done})")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from torch_precompile.demo import run_demo

    return run_demo(args.out, args.backend)


def _target(text: str) -> str:
    module_name, _, factory_name = text.partition(":")
    if not module_name or not factory_name:
        raise argparse.ArgumentTypeError(
            f"expected MODULE:FACTORY (say mymodels:make_step), got {text!r}"
        )
    return text


def _key_file(text: str) -> bytes:
    try:
        key = Path(text).read_bytes().strip()
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot read the key file {text}: {e.strerror or e}"
        ) from None
    if not key:
        raise argparse.ArgumentTypeError(f"the key file {text} is empty: put the key in it")
    return key


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        found = "is a directory" if path.is_dir() else "does not exist"
        raise argparse.ArgumentTypeError(
            f"{text} {found}: give the path of an artifact's source file (the .py that "
            "precompile.save or compile wrote)"
        )
    return path


def _output_path(text: str) -> Path:
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        found = "is a directory" if path.is_dir() else f"{path.parent} is not a directory"
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: {found}; give a file path in an existing folder"
        )
    return path


def _out_dir(text: str) -> Path:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder: give a folder")
    return path


if __name__ == "__main__":
    sys.exit(main())
