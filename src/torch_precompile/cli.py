"""Command line: ``python -m torch_precompile demo``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torch-precompile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="precompile a built-in MLP and check it end to end")
    demo.add_argument("--out", type=Path, default=Path("demo-out"),
                      help="folder for the artifact pairs (default: ./demo-out)")
    demo.add_argument("--backend", default="inductor", choices=["inductor", "eager"],
                      help="how the captured graph runs (default: inductor)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.command == "demo":
        from torch_precompile.demo import run_demo

        return run_demo(args.out, args.backend)
    return 2


if __name__ == "__main__":
    sys.exit(main())
