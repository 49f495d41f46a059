"""Variants of a recipe side by side, from one shared start; prints and writes a markdown table.

    python -m scripts.sweep smollm2-135m --out runs/sweep --shared align \\
        --set grpo.enabled=false "eval.benchmarks=[gsm8k,word_problems]" \\
        --variant recipe --variant kl09 distill.teacher_kl=0.9 --variant lr3e-4 distill.learning_rate=3e-4
    python -m scripts.sweep smollm2-135m --out runs/arms --gpus 0,1,2,3 --variant sse-h-seed0 seed=0 \\
        --variant sse-h-seed1 seed=1 --variant transformer-seed0 smollm2-135m-transformer seed=0 \\
        --variant transformer-seed1 smollm2-135m-transformer seed=1

``--shared align`` runs the recipe's align stage once (its other stages off) into ``OUT/shared``; every variant then
runs the rest of the recipe from that model (``--checkpoint``, its align stage off), each with its own overrides
after the common ``--set`` ones, scoring its last model (``eval.models=[last]``, or the models ``--set`` names).
``--shared distill`` shares align and distillation (variants of GRPO), ``--shared grpo`` every training stage
(variants of the evaluation). Without ``--shared`` each variant runs the whole recipe, or another recipe named after
its name (the second example: both arms, two seeds each, a GPU each), and scores the models the recipe names. The
variants run side by side (``--parallel`` at a time, default all), each a ``sse-pipeline run`` process with a Ray of
its own, on the GPUs the sweep sees: a small model leaves the GPU waiting on its host, so variants side by side take
little longer than one (``--parallel`` where their memory would not fit at once). ``--gpus 0,1,2`` spreads them
instead: the shared run on the first, each variant on the one running the fewest (``CUDA_VISIBLE_DEVICES``), so that
a variant alone on its GPU times what the recipe alone would; ``--gpus 0+1,2+3`` gives each run a group of GPUs
(GRPO split into trainers and engines, ``ray.num_gpus=2``). Each keeps its usual folder, ``OUT/<variant>``, and its
log, ``OUT/<variant>.log``; ``OUT/sweep.md`` and ``OUT/sweep.json`` hold, per variant, its recipe and overrides,
wall time, the last logged distillation metrics, GRPO's reward and completion lengths, and for each evaluated model
every benchmark's avg@n with its 95% interval, the share of boxed answers and their accuracy alone. A variant that
ran out of GPU memory beside others runs again first (from its last checkpoint), and from then on the sweep runs
only as many at a time as ran beside it. Variants that stopped otherwise (the machine gone) run again by the same
command: every finished stage of every variant is skipped (an evaluation scores its model's generations again,
generating nothing), and the table covers them all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eval.report import accuracy_cell

from common.files import atomic_write

from pipeline.metrics import first_last_means, logged_values, read_metrics
from pipeline.recipe import load_recipe

# the distillation's last logged values: its loss (CE, or the mix with the teacher's KL), and with a teacher both parts;
# the held-out solutions' loss (distill.eval_data), where conversion's settings are chosen
DISTILL_KEYS = ("loss", "ce", "teacher_kl", "mean_token_accuracy", "eval_loss")
GRPO_KEYS = {"reward": "reward", "completion tokens": "completions/mean_length", "clipped": "completions/clipped_ratio"}
GRPO_LOGS = 8  # GRPO's curves are noisy: the mean of the first and of the last 8 logged steps
RUN_ENV = {"RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1"}  # each run a Ray of its own, whatever else runs
STATUS_EVERY_S = 60
SHAREABLE = ("align", "distill", "grpo")  # the training stages in order: a shared run stops after one of them


@dataclass
class Variant:
    name: str
    overrides: list[str] = field(default_factory=list)
    recipe: str | None = None  # another recipe than the sweep's (another arm: the Transformer beside SSE-H)


def parse_variant(values: list[str]) -> Variant:
    """``NAME [RECIPE] [KEY=VALUE ...]`` from the command line; a name is a folder name, an override has an ``=``,
    and a second word without one names the variant's own recipe."""
    from pipeline.recipe import RecipeError, resolve_recipe_path

    name, *overrides = values
    if "=" in name or "/" in name or name in ("shared", ""):
        raise ValueError(f"--variant {' '.join(values)}: the first word names the variant (a folder under --out, "
                         f"not 'shared'), then its recipe if not the sweep's, then its overrides KEY=VALUE")
    recipe = None
    if overrides and "=" not in overrides[0]:
        try:
            resolve_recipe_path(overrides[0])
            recipe, overrides = overrides[0], overrides[1:]
        except RecipeError as error:
            raise ValueError(f"--variant {name}: {overrides[0]!r} is no override (KEY=VALUE), and no recipe: "
                             f"{error}") from None
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"--variant {name}: {bad[0]!r} is no override (KEY=VALUE)")
    return Variant(name, overrides, recipe)


def shared_overrides(shared: str) -> tuple[list[str], list[str]]:
    """What turns the recipe into the shared run (the stages after ``shared`` off) and into a variant's (``shared``
    and the stages before it off: the variant starts from the shared run's model)."""
    if shared not in SHAREABLE:
        raise ValueError(f"--shared {shared}: one of {SHAREABLE} (the stages before the variants differ)")
    cut = SHAREABLE.index(shared) + 1
    return ([f"{s}.enabled=false" for s in (*SHAREABLE[cut:], "eval")],
            [f"{s}.enabled=false" for s in SHAREABLE[:cut]])


def variant_overrides(common: list[str], variant: Variant, shared: str | None) -> list[str]:
    """A variant's overrides: the common ones, its own, the shared stages off. From a shared start only its last
    model is scored (unless the common ones or its own name more): the models before are the shared run's, alike
    in every variant; a whole run scores the models its recipe names (GRPO's gain needs the model it started
    from)."""
    if not shared:
        return [*common, *variant.overrides]
    return ["eval.models=[last]", *common, *variant.overrides, *shared_overrides(shared)[1]]


def commands(recipe: str, out: Path, common: list[str], variants: list[Variant], shared: str | None
             ) -> tuple[list[str] | None, dict[str, list[str]]]:
    """The shared run's command (None without ``shared``) and each variant's, as ``sse-pipeline run`` argv."""
    run = [sys.executable, "-m", "pipeline.cli", "run", recipe]
    first, start = None, []
    if shared is not None:
        first = [*run, f"output_dir={out / 'shared'}", *common, *shared_overrides(shared)[0]]
        start = ["--checkpoint", str(out / "shared" / shared / "final")]
    return first, {v.name: [*run[:-1], v.recipe or recipe, f"output_dir={out / v.name}",
                            *variant_overrides(common, v, shared), *start] for v in variants}


def visible(gpus: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a place in ``--gpus``: one GPU (``2``) or a group of them (``2+3``)."""
    return gpus.replace("+", ",")


def least_busy(gpus: list[str], running: list[str]) -> str:
    """The GPU of ``gpus`` that the fewest of ``running`` (each run's GPU) use; the first of those on a tie."""
    return min(gpus, key=running.count)


OUT_OF_MEMORY = ("OutOfMemoryError", "CUDA out of memory")  # what a run that ran out of GPU memory prints


def ran_out_of_memory(log: Path) -> bool:
    """Whether the last run written to ``log`` (after its ``### sweep`` header) stopped out of GPU memory."""
    text = log.read_text(errors="replace")[-200_000:].rsplit("### sweep ", 1)[-1]
    return any(mark in text for mark in OUT_OF_MEMORY)


def _run_all(runs: dict[str, list[str]], out: Path, parallel: int, gpus: list[str] | None = None
             ) -> dict[str, dict]:
    """Runs the commands, ``parallel`` at a time (each one's output to ``out/<name>.log``; with ``gpus``, each on
    the least busy of them), printing each as it ends; a variant's wall time counts from its own start (every
    attempt of a retried one). A run that ran out of GPU memory beside others (on its GPU, with ``gpus``) runs again
    next (it resumes from its last checkpoint; ``retried`` in its result), and the sweep lowers ``parallel`` to the
    runs that were beside it: they fit, with one more they did not. Each such lowering leaves fewer beside a run, so
    the retries end; a run out of memory alone fails."""
    env = {**os.environ, **RUN_ENV}
    waiting, procs, results, placed = list(runs), {}, {}, {}
    crowded, retried = set(), set()  # runs that ran beside another; runs started again after running out of memory
    spent = {}  # seconds of a retried run's earlier attempts: its wall time counts them too
    start, shown = time.time(), time.time()
    while waiting or procs:
        if time.time() - shown >= STATUS_EVERY_S:  # a line a minute while the variants run (their logs hold more)
            shown = time.time()
            print(f"sweep: {len(results)} done, running {', '.join(procs)}, {len(waiting)} waiting; "
                  f"{(shown - start) / 60:.1f} min", flush=True)
        while waiting and len(procs) < parallel:
            name = waiting.pop(0)
            log = (out / f"{name}.log").open("a")  # a re-run resumes: its log follows the first run's
            log.write(f"### sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(runs[name])}\n")
            log.flush()
            own = env
            if gpus:
                placed[name] = least_busy(gpus, [placed[n] for n in procs])
                own = {**env, "CUDA_VISIBLE_DEVICES": visible(placed[name])}
            procs[name] = (subprocess.Popen(runs[name], stdout=log, stderr=subprocess.STDOUT, env=own), log,
                           time.time())
            crowded.discard(name)  # this start's company counts, not an earlier one's
        where = [placed[n] if gpus else "" for n in procs]  # each run's GPUs; without ``gpus``, all of them
        crowded.update(n for n, at in zip(procs, where) if where.count(at) > 1)
        for name, (proc, log, started) in list(procs.items()):
            if proc.poll() is None:
                continue
            log.close()
            del procs[name]
            if proc.returncode and name in crowded and ran_out_of_memory(out / f"{name}.log"):
                parallel = max(1, min(parallel - 1, len(procs)))
                retried.add(name)
                spent[name] = spent.get(name, 0.0) + time.time() - started
                waiting.insert(0, name)
                print(f"{name}: out of GPU memory beside other runs; it runs again next, {parallel} at a time from "
                      "now on", flush=True)
                continue
            results[name] = {"returncode": proc.returncode, "wall_s": time.time() - started + spent.get(name, 0.0),
                             **({"gpu": placed[name]} if gpus else {}),
                             **({"retried": True} if name in retried else {})}
            print(f"{name}: {'done' if proc.returncode == 0 else f'failed ({proc.returncode})'} in "
                  f"{results[name]['wall_s']:.0f} s; {len(procs)} running, {len(waiting)} waiting", flush=True)
        time.sleep(1)
    return results


def _benchmarks(summary: Path) -> dict:
    """Each benchmark's metrics in an evaluation's summary, without the per-problem answers."""
    return {name: {k: v for k, v in m.items() if k != "per_problem"}
            for name, m in json.loads(summary.read_text())["benchmarks"].items()}


def collect(folder: Path) -> dict:
    """What a finished variant left: the last logged distillation metrics, GRPO's reward, completion length and
    clipped share (first and last logs), and every evaluation (``eval/``: its last model; ``eval/<name>/``: the
    others ``eval.models`` named)."""
    row: dict = {}
    logged = read_metrics(folder / "distill" / "metrics.jsonl")
    last = {k: next(r[k] for r in reversed(logged) if k in r) for k in DISTILL_KEYS if any(k in r for r in logged)}
    if last:
        row["distill"] = last
    grpo = read_metrics(folder / "grpo" / "metrics.jsonl")
    curves = {name: logged_values(grpo, key) for name, key in GRPO_KEYS.items()}
    if any(curves.values()):
        row["grpo"] = {name: first_last_means(values, GRPO_LOGS)[:2] for name, values in curves.items() if values}
    evals = {}
    if (folder / "eval" / "summary.json").exists():
        evals["last"] = _benchmarks(folder / "eval" / "summary.json")
    for summary in sorted((folder / "eval").glob("*/summary.json")):
        evals[summary.parent.name] = _benchmarks(summary)
    if evals:
        row["eval"] = evals
    return row


def markdown(rows: dict[str, dict], variants: list[Variant], common: list[str], shared: str | None) -> str:
    """Two tables: each variant's training (distillation's last logged metrics, GRPO's curves), and each evaluated
    model's accuracies."""
    lines = ["| variant | overrides | wall s | distill loss | CE | KL to teacher | token acc | held-out loss "
             "| GRPO reward | completion tokens | clipped |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        r = rows[v.name]
        d, g = r.get("distill", {}), r.get("grpo", {})
        cells = [v.name, " ".join(f"`{o}`" for o in ([v.recipe] if v.recipe else []) + v.overrides)
                 or "(the recipe's)",
                 f"{r['wall_s']:.0f}" + (f" (GPU {r['gpu']})" if "gpu" in r else "")
                 + ("" if r["returncode"] == 0 else f" (failed, {r['returncode']})")]
        cells += [f"{d[k]:.3f}" if k in d else "" for k in DISTILL_KEYS]
        reward, length, clipped = (g.get(k) for k in GRPO_KEYS)
        cells += [f"{reward[0]:.3f} -> {reward[1]:.3f}" if reward else "",
                  f"{length[0]:.0f} -> {length[1]:.0f}" if length else "",
                  f"{100 * clipped[1]:.0f}%" if clipped else ""]
        lines.append("| " + " | ".join(cells) + " |")
    evaluated = [(v.name, model, bench) for v in variants for model, bench in rows[v.name].get("eval", {}).items()]
    benchmarks = list(dict.fromkeys(b for *_, bench in evaluated for b in bench))
    lines += ["", "| variant | model | " + " | ".join(f"{b} avg@n (95% CI)" for b in benchmarks) + " |",
              "|---|---|" + "---|" * len(benchmarks)]
    for name, model, bench in evaluated:
        cells = [accuracy_cell(bench[b]) if b in bench else "" for b in benchmarks]
        lines.append(f"| {name} | {model} | " + " | ".join(cells) + " |")
    lines += ["", f"Every variant: {' '.join(f'`{o}`' for o in common) or 'the recipe as it is'}"
              + (f", from the shared {shared} stage's model." if shared else "."),
              "Wall time of each variant from its own start; GRPO: the mean of the first and of the last 8 logged "
              "steps (clipped: the last 8); accuracies in %, boxed: the share of answers given in a box, and their "
              "accuracy alone."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe name or YAML path")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shared", choices=SHAREABLE, default=None,
                        help="the last stage the variants share (it and the stages before it run once)")
    parser.add_argument("--set", dest="common", nargs="+", default=[], metavar="KEY=VALUE",
                        help="overrides of every run, the shared one included")
    parser.add_argument("--variant", dest="variants", nargs="+", action="append", required=True,
                        metavar="NAME [RECIPE] [KEY=VALUE",
                        help="a variant: its name, its recipe if not the sweep's, then its overrides")
    parser.add_argument("--parallel", type=int, default=None,
                        help="variants running at once (default: all; fewer where their memory would not fit)")
    parser.add_argument("--gpus", type=lambda s: s.split(","), default=None, metavar="0,1,...",
                        help="spread the runs over these GPUs (CUDA_VISIBLE_DEVICES): the shared run on the first, "
                             "each variant on the least busy; 0+1,2+3 gives each run a pair (split placement)")
    args = parser.parse_args(argv)
    variants = [parse_variant(v) for v in args.variants]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        parser.error(f"--variant: a name given twice: {names}")
    if args.shared and any(v.recipe for v in variants):
        parser.error(f"--shared {args.shared}: every variant starts from the shared model of {args.recipe}; a "
                     "variant of another recipe cannot")
    if args.shared:
        from pipeline.run import stage_runs

        if not stage_runs(load_recipe(args.recipe, args.common), args.shared):
            parser.error(f"--shared {args.shared}: {args.recipe} does not run its {args.shared} stage (disabled, or "
                         "for align: it converts no layer into SSE); share an earlier stage or none")
    for v in variants:  # every variant's recipe is checked before anything runs
        load_recipe(v.recipe or args.recipe,
                    [f"output_dir={args.out / v.name}", *variant_overrides(args.common, v, args.shared)])
    args.out.mkdir(parents=True, exist_ok=True)
    first, runs = commands(args.recipe, args.out, args.common, variants, args.shared)
    if first is not None:
        print(f"shared {args.shared}: {' '.join(first[3:])}", flush=True)
        start = time.time()
        env = {**os.environ, **RUN_ENV, **({"CUDA_VISIBLE_DEVICES": visible(args.gpus[0])} if args.gpus else {})}
        with (args.out / "shared.log").open("a") as log:
            code = subprocess.run(first, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        if code:
            print(f"shared {args.shared} failed ({code}): see {args.out / 'shared.log'}", file=sys.stderr)
            return code
        print(f"shared {args.shared}: done in {time.time() - start:.0f} s", flush=True)
    if args.parallel is not None and args.parallel < 1:  # nothing would ever start: the loop waited forever
        parser.error(f"--parallel {args.parallel}: at least 1")
    parallel = args.parallel or len(runs)
    print(f"{len(runs)} variants, {parallel} at a time{f' on GPUs {args.gpus}' if args.gpus else ''}: "
          f"{', '.join(runs)}", flush=True)
    results = _run_all(runs, args.out, parallel, args.gpus)
    rows = {name: {**results[name], **collect(args.out / name)} for name in runs}
    table = markdown(rows, variants, args.common, args.shared)
    atomic_write(args.out / "sweep.md", table)
    atomic_write(args.out / "sweep.json", json.dumps({"recipe": args.recipe, "shared": args.shared,
                                                      "common": args.common, "variants": {
                                                          v.name: {"recipe": v.recipe or args.recipe,
                                                                   "overrides": v.overrides, **rows[v.name]}
                                                          for v in variants}}, indent=1))
    print("\n" + table)
    return 0 if all(r["returncode"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
