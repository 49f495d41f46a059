"""``sse-pipeline``: distill, GRPO and evaluate SSE models from a recipe.

    sse-pipeline demo                                   the tiny CPU demo (recipes/demo.yaml)
    sse-pipeline run paper-2b                           all three stages of a recipe
    sse-pipeline grpo my.yaml grpo.steps=50             one stage, with overrides
    sse-pipeline eval paper-2b --checkpoint runs/x/grpo/final
    sse-pipeline run paper-2b --address ray://head:10001   on an existing Ray cluster

Re-running a command continues where it stopped: finished stages are skipped, an unfinished one resumes
from its last checkpoint, an interrupted evaluation from its last generation.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .recipe import RecipeError, load_recipe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sse-pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "distill, then GRPO, then eval"), ("distill", "supervised distillation"),
                       ("grpo", "GRPO with the rollout engine"), ("eval", "benchmark evaluation")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("recipe", help="a recipe file, or a built-in recipe name (demo, paper-2b)")
        sub.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.steps=50")
        sub.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
        sub.add_argument("--checkpoint", default=None, help="start the stage from this model directory")
    demo = commands.add_parser("demo", help="the tiny CPU demo: all three stages in a few minutes")
    demo.add_argument("overrides", nargs="*")
    demo.add_argument("--address", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from .run import STAGES, run_recipe

    try:
        recipe = load_recipe("demo" if args.command == "demo" else args.recipe, args.overrides)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stages = STAGES if args.command in ("run", "demo") else (args.command,)
    report = run_recipe(recipe, stages, address=args.address, checkpoint=getattr(args, "checkpoint", None))
    print(f"\nReport: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
