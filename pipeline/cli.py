"""Command-line entry point: ``sse-pipeline <command>``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sse-pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="the tiny CPU demo")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.output_dir, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
