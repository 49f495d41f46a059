"""Finished runs side by side: ``sse-pipeline compare [LABEL=]RUN ... --out DIR`` writes ``compare.md`` and
``compare.png``.

From each run folder it reads what the stages left there: every evaluation (``summary.json`` under the run, one row
each, named by the stage whose model it scored), GRPO's curves (``grpo/metrics.jsonl``: reward and accuracy per
step) and its rollout engines (generated tokens/s over the logged steps, the recurrent state one sequence holds,
``grpo/engines.json``). The table gives avg@n with its 95% interval per benchmark, the answers' mean length (and,
where the evaluation counted them, the share of answers given in a box and the accuracy of boxed answers alone: near
the floor they tell a model that answers from noise read by the fallback, and a stage that gains by dropping the
asked format). A second table
gives each stage's change over the stage before it, and each run's difference from the first run's at the same
stage, and a run whose training started from another run's model (``<stage>/started_from.json``, e.g. GRPO variants
from one distilled model) against that model's evaluation, one model scored by two runs whose evaluations differ
(``eval.engine.backend=vllm`` on another run's checkpoint) against itself, and the mean of runs whose recipes
differ in the seed alone (draws of one variant from one model) against it, paired over the same problems where the summaries kept
each problem's accuracy (and again counting boxed answers alone, where they kept that too): tighter than two
separate intervals, whose overlap hides a change that most problems share. Whole runs of one recipe (the seed aside),
and runs of one recipe from one shared model (a sweep's ``--shared`` stage), are draws of one arm: each stage's
evaluations get a pooled row ("mean of A, B, ...") and, against the first run's arm's draws of the most alike
settings, a pooled difference, since one draw's distance from the other arm is as noisy as the draws.
The figure puts the accuracies with their intervals on the left and both arms' GRPO curves on the right, so an
arm's gain reads against the other's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common.files import atomic_write, read_text
from eval.metrics import bootstrap_ci, hierarchical_bootstrap, percentile_interval, prediction_interval
from eval.report import accuracy, accuracy_cell, answer_style, baseline_cell, boxed_headline, percent_ci

from .metrics import first_last_means, moving_average, read_metrics
from .recipe import stage_settings

# what produced a model, read off the path of the checkpoint an evaluation names (its ``model`` field)
STAGE_OF_PATH = (("/grpo/final", "after GRPO"), ("/distill/final", "after distillation"),
                 ("/align/final", "after alignment"), ("/initial", "before training"))
# the training stages whose settings made each stage's model
CHAIN = {"before training": (), "after alignment": ("align",), "after distillation": ("align", "distill"),
         "after GRPO": ("align", "distill", "grpo")}
# each problem's readings an evaluation's summary keeps (``per_problem``), which runs pool and changes pair: the
# lenient and the boxed accuracy, and on the word problems the share right by every step (eval/worked_steps.py)
READINGS = ("accuracy", "boxed_accuracy", "right_by_every_step")


@dataclass
class Evaluation:
    stage: str
    benchmarks: dict[str, dict]  # name -> its metrics in the evaluation's summary
    model: str = ""  # the checkpoint it scored, with its fingerprint (the summary's ``model``)
    # a pool of independent runs (:func:`pooled`): each member evaluation, whose spread the intervals resample
    members: list["Evaluation"] = field(default_factory=list)
    # the labels of the runs whose evaluations the members are, in order: two pools of the same runs (one arm's draws
    # before and after a stage) pair each run with itself
    runs: tuple[str, ...] = ()

    def accuracies(self, benchmark: str, reading: str = "accuracy") -> dict[str, float]:
        """Each problem's accuracy (id -> mean over its samples), where the summary kept them; ``reading``
        "boxed_accuracy": counting boxed answers alone."""
        return {p["id"]: p[reading] for p in self.benchmarks[benchmark].get("per_problem", []) if reading in p}

    def draws(self, benchmark: str, reading: str = "accuracy") -> list[dict[str, float]]:
        """Each independent run's problem accuracies: the members of a pool, or this evaluation alone."""
        return [e.accuracies(benchmark, reading) for e in (self.members or [self])]


@dataclass
class Run:
    label: str
    folder: Path
    evaluations: list[Evaluation] = field(default_factory=list)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # reward, accuracy: (step, value)
    tokens_per_s: float | None = None
    state_bytes: int | None = None
    starts: dict[str, str] = field(default_factory=dict)  # stage ("after GRPO") -> the model its training started from
    # stage -> its settings but the seed (the run's recipe.yaml): runs that differ in the seed alone are draws of one
    # variant, pooled against the model they started from
    variants: dict[str, str] = field(default_factory=dict)
    # stage -> the settings that made and scored its model, the seed aside, where the run made it from its own
    # earlier stages: whole runs of one recipe are draws of one arm, pooled stage by stage
    lineage: dict[str, str] = field(default_factory=dict)
    # the evaluation's settings, the seed aside: one model scored with other settings (another engine backend) is
    # paired with itself, which measures the evaluation rather than the model
    evaluated_with: str | None = None
    seeds: str | None = None  # every seed of the recipe (its own, each data set's): runs alike in all are one draw
    rollouts_per_step: int | None = None  # GRPO's rollouts an optimizer step trains on (its recipe's)


def stage_of(model: str, where: Path, run: Path) -> str:
    """The stage whose model an evaluation scored: from the checkpoint path it names (a stored URI too), else the
    evaluation's folder."""
    for pattern, stage in STAGE_OF_PATH:
        if pattern in model.split(" [")[0]:
            return stage
    return str(where.relative_to(run)) if where != run else "eval"


def read_run(label: str, folder: Path) -> Run:
    """What a finished run left in ``folder``; an error names the folder when it holds no evaluation."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such run folder")
    run = Run(label, folder)
    for path in sorted([*folder.rglob("summary.json"), *(p.with_suffix("") for p in folder.rglob("summary.json.gz"))]):
        if ".replaced-" in str(path.relative_to(folder)):  # outputs a --redo moved aside
            continue
        if any((parent / "report.md").exists() for parent in path.parents if parent != folder
               and parent.is_relative_to(folder)):  # another run (a kept copy) inside this one: not its evaluation
            continue
        summary = read_json(path, dict)
        model = summary.get("model") or ""
        run.evaluations.append(Evaluation(stage_of(model, path.parent, folder), summary.get("benchmarks", {}), model))
    order = [stage for _, stage in reversed(STAGE_OF_PATH)]  # the pipeline's order; other evaluations last
    run.evaluations.sort(key=lambda e: order.index(e.stage) if e.stage in order else len(order))
    if not run.evaluations:
        raise ValueError(f"{folder}: no evaluation (summary.json) in this run; run its eval stage first")
    recipe = folder / "recipe.yaml"
    try:
        resolved = yaml.safe_load(recipe.read_text()) if recipe.exists() else None
    except yaml.YAMLError as error:
        raise ValueError(f"{recipe}: not YAML ({error})") from None
    borrowed = {}  # training stage -> the model another run made that it started from (--checkpoint)
    for pattern, stage in STAGE_OF_PATH:  # what each training stage started from (pipeline.stages.base.record_start)
        name = pattern.split("/")[1]
        record = folder / name / "started_from.json"
        if pattern.endswith("/final") and record.exists():
            run.starts[stage] = read_json(record, dict).get("model", "")
            if isinstance(resolved, dict):
                run.variants[stage] = json.dumps(_settings(resolved, name), sort_keys=True, default=str)
                if not made_in(run.starts[stage], resolved.get("output_dir", "")):
                    borrowed[name] = run.starts[stage]
    if isinstance(resolved, dict):
        run.seeds = json.dumps(_seeds(resolved), sort_keys=True)
        grpo = resolved.get("grpo") or {}
        if all(isinstance(grpo.get(k), int) for k in ("prompts_per_batch", "num_generations", "mini_batches")):
            run.rollouts_per_step = grpo["prompts_per_batch"] * grpo["num_generations"] // grpo["mini_batches"]
        run.evaluated_with = json.dumps(_settings(resolved, "eval"), sort_keys=True, default=str)
        for stage, chain in CHAIN.items():
            # a borrowed start: the lineage names that model and the stages from it on (draws from one shared
            # model pool with each other, not with whole runs); a stage left out with no record means its model
            # came from elsewhere (runs before started_from.json was recorded)
            cut = max((i for i, name in enumerate(chain) if name in borrowed), default=None)
            made = chain if cut is None else chain[cut:]
            if all((resolved.get(name) or {}).get("enabled", True) for name in made):
                start = {} if cut is None else {"start": borrowed[chain[cut]]}
                run.lineage[stage] = json.dumps({"model": resolved.get("model"), "eval": _settings(resolved, "eval"),
                                                 **start, **{name: _settings(resolved, name) for name in made}},
                                                sort_keys=True, default=str)
    rows = read_metrics(folder / "grpo" / "metrics.jsonl")
    for key, name in (("reward", "reward"), ("rewards/accuracy/mean", "accuracy")):
        points = sorted({r["step"]: r[key] for r in rows if isinstance(r.get(key), (int, float))}.items())
        if points:
            run.curves[name] = points
    rates = [r["tokens/generated_per_s"] for r in rows if "tokens/generated_per_s" in r]
    run.tokens_per_s = sum(rates) / len(rates) if rates else None
    engines = folder / "grpo" / "engines.json"
    if engines.exists():
        run.state_bytes = next(iter(read_json(engines, list)), {}).get("per_slot_bytes")
    return run


def _seeds(resolved: dict, prefix: str = "") -> dict:
    """Every seed a resolved recipe sets (``seed``, ``distill.data.seed``, ...): what makes two runs of one recipe
    independent draws."""
    found = {}
    for key, value in resolved.items():
        if isinstance(value, dict):
            found.update(_seeds(value, f"{prefix}{key}."))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    found.update(_seeds(item, f"{prefix}{key}[{i}]."))
        elif key == "seed":
            found[f"{prefix}{key}"] = value
    return found


def independent(members: list[tuple["Run", Evaluation]]) -> list[tuple["Run", Evaluation]]:
    """The members of a pool that are independent draws: of runs alike in every seed (one model made twice, up to
    the GPU's nondeterminism) only the first counts."""
    kept, seen = [], set()
    for run, e in members:
        if run.seeds is None or run.seeds not in seen:
            kept.append((run, e))
            seen.add(run.seeds)
    return kept


def read_json(path: Path, kind: type):
    """A file of a run that must hold JSON of ``kind`` (or its gzip, as a kept run stores it); a damaged one is an
    error naming it (not a traceback)."""
    try:
        value = json.loads(read_text(path))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not readable JSON ({error}); restore it or leave the run out") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path}: expected a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def made_in(model: str, output_dir: str) -> bool:
    """Whether a recorded model (its resolved path and fingerprint) lies in a run's own ``output_dir``. The records
    hold resolved paths, so a relative ``output_dir`` (the recipes' own, ``runs/<name>``) is found as a run of the
    path's folders with a folder of the run's below it; an absolute one must be the path's start."""
    path, root = Path(model.rsplit(" [", 1)[0]), Path(output_dir)
    if root.is_absolute():
        return path != root and path.is_relative_to(root)
    parts, n = path.parts, len(root.parts)
    return any(parts[i:i + n] == root.parts for i in range(len(parts) - n))


def fingerprint(model: str) -> str:
    """The fingerprint an evaluation's ``model`` names after its path (``.../grpo/final [7d82308b1c95]``), or ""."""
    return model.rsplit(" [", 1)[1].rstrip("]") if " [" in model else ""


def _settings(resolved: dict, stage: str) -> dict:
    """A stage's settings but the seed: what runs that are draws of one variant share."""
    return {k: v for k, v in stage_settings(resolved, stage).items() if k != "seed"}


def paired_change(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, float] | None:
    """The mean change of accuracy over the problems both evaluations scored, with its 95% interval from resampling
    those problems (paired: each problem's own difference, so the problems' spread in difficulty drops out)."""
    shared = [key for key in after if key in before]
    if not shared:
        return None
    diffs = [after[key] - before[key] for key in shared]
    return (sum(diffs) / len(diffs), *bootstrap_ci(diffs))


def difference(before: Evaluation, after: Evaluation, benchmark: str,
               reading: str) -> tuple[float, float, float] | None:
    """``after - before`` on the problems both scored: :func:`paired_change` for two runs; where either is a pool of
    runs, the hierarchical bootstrap (runs and problems), so the runs' spread is in the interval."""
    if not (before.members or after.members):
        return paired_change(before.accuracies(benchmark, reading), after.accuracies(benchmark, reading))
    samples = hierarchical_bootstrap([before.draws(benchmark, reading), after.draws(benchmark, reading)],
                                     paired=same_runs(before, after))
    if not samples:
        return None
    b, a = (pooled_mean(e.draws(benchmark, reading)) for e in (before, after))
    return (a - b, *percentile_interval([y - x for x, y in samples]))


def same_runs(before: Evaluation, after: Evaluation) -> bool:
    """Whether two pools hold the same runs in one order (an arm's draws at two stages), to resample as pairs."""
    return bool(before.runs) and before.runs == after.runs and len(before.members) == len(after.members)


def ratio(before: Evaluation, after: Evaluation, benchmark: str, reading: str) -> tuple[float, float, float] | None:
    """``after / before`` of two pools' mean accuracies, with its hierarchical bootstrap interval: a claim that one
    arm is at least a fraction of another reads this interval's lower bound."""
    samples = [(x, y) for x, y in hierarchical_bootstrap([before.draws(benchmark, reading),
                                                           after.draws(benchmark, reading)],
                                                          paired=same_runs(before, after)) if x > 0]
    b, a = (pooled_mean(e.draws(benchmark, reading)) for e in (before, after))
    if not samples or not b:
        return None
    return (a / b, *percentile_interval([y / x for x, y in samples]))


def pooled_mean(draws: list[dict[str, float]]) -> float:
    """The mean over draws of each draw's mean over the problems they all scored."""
    shared = [k for k in draws[0] if all(k in d for d in draws)]
    return sum(d[k] for d in draws for k in shared) / (len(draws) * len(shared)) if shared else float("nan")


def pooled(stage: str, evaluations: list[Evaluation], runs: tuple[str, ...] = ()) -> Evaluation:
    """One evaluation whose problems' readings (:data:`READINGS`) are the means over ``evaluations``, on the
    problems all of them scored: what several draws of one variant gained on average, to pair against the model
    they started from as one run is. The answers' mean length and boxed share are the
    draws' means, where every draw has them."""
    benchmarks = {}
    for benchmark in set.intersection(*(set(e.benchmarks) for e in evaluations)):
        problems: dict[str, dict] = {}
        for reading in READINGS:
            each = [e.accuracies(benchmark, reading) for e in evaluations]
            # in the first evaluation's order: the bootstrap resamples a list, and a set's order changes per process
            for key in [k for k in each[0] if all(k in a for a in each[1:])]:
                problems.setdefault(key, {"id": key})[reading] = sum(a[key] for a in each) / len(each)
        benchmarks[benchmark] = {"per_problem": list(problems.values())}
        for name in ("mean_length", "boxed_rate"):
            values = [e.benchmarks[benchmark].get(name) for e in evaluations]
            if None not in values:
                benchmarks[benchmark][name] = sum(values) / len(values)
    return Evaluation(stage, benchmarks, members=list(evaluations), runs=tuple(runs))


def _signed(change: tuple[float, float, float] | None) -> str:
    return "" if change is None else "{:+.1f} ({:+.1f} to {:+.1f})".format(*(100 * v for v in change))


def pooled_cell(evaluation: Evaluation, benchmark: str) -> str:
    """A pooled evaluation's table cell, in %: the mean over its runs and problems with a 95% interval from resampling
    both (:func:`~eval.metrics.hierarchical_bootstrap`), the answers' style (as a run's cell has it), the boxed
    answers' accuracy alone where every draw counted them, and the best trivial baseline, marked unless the headline's
    interval clears it (as :func:`~eval.report.baseline_cell` marks a run's)."""
    levels = {reading: mean_interval(evaluation, benchmark, reading) for reading in ("boxed_accuracy", "accuracy")}
    cells = [percent_ci(level) for level in levels.values() if level is not None]
    style = answer_style(evaluation.benchmarks[benchmark])
    cell = f"{cells[0]} boxed{style} ({cells[1]} lenient)" if len(cells) == 2 else (cells[0] if cells else "") + style
    member = next((e.benchmarks[benchmark] for e in evaluation.members if "baselines" in e.benchmarks[benchmark]),
                  None)
    if member is None:  # summaries from before baselines were counted
        return cell
    level = levels["boxed_accuracy" if boxed_headline(member) else "accuracy"]
    beaten = level is not None and level[1] > member["baselines"][member["baselines"]["best"]]["accuracy"]
    return cell + f"; baseline {baseline_cell({**member, 'beats_baseline': beaten})}"


def mean_interval(evaluation: Evaluation, benchmark: str, reading: str) -> tuple[float, float, float] | None:
    """An evaluation's mean accuracy with its 95% interval: over its runs and problems for a pool, over the problems
    for one run (:func:`~eval.metrics.hierarchical_bootstrap` either way)."""
    draws = evaluation.draws(benchmark, reading)
    if not all(draws):
        return None
    samples = hierarchical_bootstrap([draws])
    return (pooled_mean(draws), *percentile_interval([m for (m,) in samples])) if samples else None


def level_table(rows: list[tuple[str, Evaluation]], benchmarks: list[str], sizes: dict, stratum: str) -> list[str]:
    """Each model's headline accuracy on the problems of one answer-size stratum, beside that stratum's share for
    the benchmark's best trivial baseline and the multiple of it the model reaches: where a goal asks for a multiple
    of what a guess scores, on the answers a guess rarely finds."""
    body = []
    for name, e in rows:
        cells = []
        for b in benchmarks:
            # a pool has a level where every member scored the benchmark (its own benchmarks, :func:`pooled`)
            summaries = [m.benchmarks[b] for m in (e.members or [e])] if b in e.benchmarks else []
            if not summaries or not sizes.get(b):
                cells.append("")
                continue
            reading = "boxed_accuracy" if boxed_headline(summaries[0]) else "accuracy"
            level = mean_interval(within(e, b, sizes, stratum), b, reading)
            base = next((m["by_answer_size"][stratum]["best_baseline"] for m in summaries
                         if stratum in m.get("by_answer_size", {})), None)
            cell = "" if level is None else percent_ci(level)
            if cell and base:
                cell += f"; {level[0] / base:.1f}x the baseline's {100 * base:.1f}"
            cells.append(cell)
        if any(cells):
            body.append(f"| {name} | " + " | ".join(cells) + " |")
    if not body:
        return []
    return [f"| headline accuracy, answers {stratum} | " + " | ".join(f"{b} (95% CI)" for b in benchmarks) + " |",
            "|---|" + "---|" * len(benchmarks), *body, "",
            f"Accuracy in % on the problems whose answer is a number {stratum} alone (boxed answers where the prompt "
            "asks for a box); the baseline: the benchmark's best trivial baseline on these problems.", ""]


def answer_sizes(runs: list[Run], benchmarks: list[str]) -> dict[str, dict[str, str]]:
    """Each benchmark's problems' answer strata (:func:`eval.baselines.answer_size`), by problem id: from the
    summaries where they recorded them, else from the benchmark's file."""
    from eval.baselines import answer_size
    from eval.benchmarks import load_problems

    sizes: dict[str, dict[str, str]] = {}
    for b in benchmarks:
        recorded = {p["id"]: p["answer_size"] for run in runs for e in run.evaluations if b in e.benchmarks
                    for p in e.benchmarks[b].get("per_problem", []) if "answer_size" in p}
        if not recorded:
            try:
                recorded = {p.id: answer_size(p.answer) for p in load_problems(b)}
            except ValueError:  # a benchmark this machine cannot read: no strata
                recorded = {}
        sizes[b] = recorded
    return sizes


def within(evaluation: Evaluation, benchmark: str, sizes: dict, stratum: str | None) -> Evaluation:
    """``evaluation`` restricted to the problems of ``benchmark`` in an answer-size stratum (None: all of them)."""
    if stratum is None:
        return evaluation
    keep = {k for k, v in sizes.get(benchmark, {}).items() if v == stratum}

    def cut(e: Evaluation) -> Evaluation:
        m = dict(e.benchmarks[benchmark])
        m["per_problem"] = [p for p in m.get("per_problem", []) if p["id"] in keep]
        return Evaluation(e.stage, {**e.benchmarks, benchmark: m}, e.model)

    return Evaluation(evaluation.stage, cut(evaluation).benchmarks, evaluation.model,
                      [cut(m) for m in evaluation.members])


def baseline_table(runs: list[Run], benchmarks: list[str]) -> list[str]:
    """The benchmarks' trivial baselines beside the models (from a summary that recorded them, else scored here on
    the benchmark's problems): the accuracy of the commonest answer and of the question's last and first numbers."""
    from eval.baselines import score_baselines
    from eval.benchmarks import load_problems

    rows = []
    for b in benchmarks:
        found = next((e.benchmarks[b]["baselines"] for run in runs for e in run.evaluations
                      if "baselines" in e.benchmarks.get(b, {})), None)
        if found is None:
            try:
                problems = load_problems(b)
            except ValueError:
                continue
            scored = {p["id"] for run in runs for e in run.evaluations if b in e.benchmarks
                      for p in e.benchmarks[b].get("per_problem", [])}
            problems = [p for p in problems if p.id in scored]
            if not problems:  # the runs scored other problems under this name: no baseline to set beside them
                continue
            from rewards.verify import MathVerifier, VerifierPool

            verifier = MathVerifier(pool=VerifierPool(num_workers=2, timeout=5))
            try:
                found = score_baselines(problems, verifier)
            finally:
                verifier.close()
        cells = [f"{100 * found[k]['accuracy']:.1f}" + (f" ({found[k]['answer']})" if "answer" in found[k] else "")
                 for k in ("commonest answer", "last number", "first number")]
        rows.append(f"| {b} | " + " | ".join(cells) + f" | {found['best']} |")
    if not rows:
        return []
    return ["| trivial baseline (% of problems) | commonest answer | last number in the question | first number | "
            "best |", "|---|---|---|---|---|", *rows,
            "", "What a benchmark gives away without reading (eval/baselines.py): a model that does not beat the best "
            "of these shows no reasoning on it.", ""]


def arm_draws(runs: list[Run]) -> dict[tuple[str, str], tuple[list[str], Evaluation]]:
    """(stage, lineage) -> the labels of the runs of one recipe (the seed aside; whole, or from one shared model)
    that scored that stage, and their pooled evaluation: draws of one arm, where one draw's distance from another arm
    is as noisy as the draws."""
    members: dict[tuple[str, str], list[tuple[Run, Evaluation]]] = {}
    for run in runs:
        for e in run.evaluations:
            if e.stage in run.lineage:
                members.setdefault((e.stage, run.lineage[e.stage]), []).append((run, e))
    members = {key: independent(m) for key, m in members.items()}
    return {key: ([run.label for run, _ in m], pooled(key[0], [e for _, e in m], runs=tuple(r.label for r, _ in m)))
            for key, m in members.items() if len(m) > 1}


def arm_changes(runs: list[Run], draws_of_arms: dict) -> list[tuple[str, Evaluation, Evaluation]]:
    """Each pool of one arm's whole runs against the same runs' evaluations one stage earlier (each its own model:
    GRPO's gain over the distillation it started from, over the arm's draws), paired run by run."""
    by_label = {run.label: run for run in runs}
    pairs = []
    for (stage, _), (labels, after) in draws_of_arms.items():
        earlier = []
        for label in labels:
            evaluations = by_label[label].evaluations
            at = next(i for i, e in enumerate(evaluations) if e.stage == stage)
            earlier.append(evaluations[at - 1] if at else None)
        if None in earlier or len({e.stage for e in earlier}) > 1 or len({e.model for e in earlier}) == 1:
            continue  # the runs' earlier stages differ, or one shared model: paired as a start elsewhere
        before = pooled(earlier[0].stage, earlier, runs=tuple(labels))
        pairs.append((f"mean of {', '.join(labels)}: {before.stage} -> {stage}", before, after))
    return pairs


def first_arm_pool(first: Run, stage: str, key: str, draws_of_arms: dict) -> str | None:
    """The lineage of the first run's arm's draws that a pool of draws (``key``) is measured against: for the first
    arm's own other pools, the first run's; for another arm, the first arm's pool with the fewest settings unlike its
    own (so GRPO of 160 steps meets the other arm's GRPO of 160 steps, not of 80), the first run's on a tie."""
    own = first.lineage.get(stage)
    model = json.loads(own)["model"] if own else None
    pools = [k for s, k in draws_of_arms if s == stage and json.loads(k)["model"] == model]
    pools.sort(key=lambda k: k != own)  # the first run's own pool first (a stable sort), so a tie picks it
    if not pools or json.loads(key)["model"] == model:
        return own if own in pools else None
    return min(pools, key=lambda k: _unlike(json.loads(k), json.loads(key)))


def _unlike(a: dict, b: dict) -> int:
    """How many of the settings both lineages name they differ in, nested settings counted one by one: a lineage
    from a borrowed start names no settings of the stages before it, which say nothing about the stages after."""
    a, b = _leaves(a), _leaves(b)
    return sum(a[n] != b[n] for n in a.keys() & b.keys())


def _leaves(settings: dict, prefix: str = "") -> dict:
    """Nested settings as one level of dotted keys."""
    out = {}
    for name, value in settings.items():
        out.update(_leaves(value, f"{prefix}{name}.") if isinstance(value, dict) else {f"{prefix}{name}": value})
    return out


def markdown(runs: list[Run]) -> str:
    benchmarks = list(dict.fromkeys(b for run in runs for e in run.evaluations for b in e.benchmarks))
    lines = ["| model | " + " | ".join(f"{b} (avg@n, 95% CI)" for b in benchmarks) + " |",
             "|---|" + "---|" * len(benchmarks)]
    for run in runs:
        for e in run.evaluations:
            cells = [accuracy_cell(e.benchmarks[b]) if b in e.benchmarks else "" for b in benchmarks]
            lines.append(f"| {run.label}, {e.stage} | " + " | ".join(cells) + " |")
    draws_of_arms = arm_draws(runs)
    for (stage, _), (labels, e) in draws_of_arms.items():
        cells = [pooled_cell(e, b) if b in e.benchmarks else "" for b in benchmarks]
        lines.append(f"| mean of {', '.join(labels)}, {stage} | " + " | ".join(cells) + " |")
    lines += ["", "Accuracies in %; boxed: counting only the answers given in a \\boxed{}, as the prompt asks (the "
              "headline), lenient: an unboxed answer read from the last stated one counts too"
              + ("; a mean of runs: each problem's accuracy averaged over runs of one recipe (the seed aside; whole, "
                 "or from one shared model; runs alike in every seed count once), its interval from resampling the "
                 "runs and the problems" if draws_of_arms else "") + ".", ""]
    pairs = [(f"{run.label}: {earlier.stage} -> {later.stage}", earlier, later)
             for run in runs for earlier, later in zip(run.evaluations, run.evaluations[1:])]
    pairs += [(f"{run.label} - {runs[0].label}, {e.stage}", first, e) for run in runs[1:] for e in run.evaluations
              for first in runs[0].evaluations if first.stage == e.stage]
    # a run started from another run's model (--checkpoint): its stage against that model's evaluation
    pairs += [(f"{run.label}: {other.label}, {start.stage} -> {e.stage}", start, e) for run in runs
              for e in run.evaluations if e.stage in run.starts for other in runs if other is not run
              for start in other.evaluations if start.model and start.model == run.starts[e.stage]]
    # one model (its fingerprint) scored by two runs whose evaluations differ (``eval.engine.backend=vllm`` on
    # another run's checkpoint): what the evaluation changes; against the first run at its own stage it is above
    pairs += [(f"{run.label} - {other.label}, {e.stage}, the same model", f, e) for i, other in enumerate(runs)
              for run in runs[i + 1:] for e in run.evaluations for f in other.evaluations
              if fingerprint(e.model) and fingerprint(e.model) == fingerprint(f.model)
              and None not in (run.evaluated_with, other.evaluated_with) and run.evaluated_with != other.evaluated_with
              and not (i == 0 and f.stage == e.stage)]
    # runs that differ in the seed alone, started from one model: the mean of their problems' accuracies against it
    draws: dict[tuple[str, str, str], list[tuple[Run, Evaluation]]] = {}
    for run in runs:
        for e in run.evaluations:
            if e.stage in run.variants:
                draws.setdefault((run.starts[e.stage], e.stage, run.variants[e.stage]), []).append((run, e))
    for (model, stage, _), members in draws.items():
        members = independent(members)
        start = next(((other, s) for other in runs for s in other.evaluations if s.model and s.model == model), None)
        if len(members) > 1 and start is not None:
            labels = ", ".join(run.label for run, _ in members)
            pairs.append((f"mean of {labels}: {start[0].label}, {start[1].stage} -> {stage}", start[1],
                          pooled(stage, [e for _, e in members])))
    pairs += arm_changes(runs, draws_of_arms)
    # draws of one arm against the draws of the first run's arm, at the same stage (and as a ratio)
    ratios = []
    for (stage, key), (labels, e) in draws_of_arms.items():
        base = first_arm_pool(runs[0], stage, key, draws_of_arms)
        if base is not None and base != key:
            names = (f"mean of {', '.join(labels)}", f"mean of {', '.join(draws_of_arms[(stage, base)][0])}")
            pairs.append((f"{names[0]} - {names[1]}, {stage}", draws_of_arms[(stage, base)][1], e))
            ratios.append((f"{names[0]} / {names[1]}, {stage}", draws_of_arms[(stage, base)][1], e))
    lines += baseline_table(runs, benchmarks)
    tables = 0
    sizes = answer_sizes(runs, benchmarks)
    lines += level_table([(f"{run.label}, {e.stage}", e) for run in runs for e in run.evaluations]
                         + [(f"mean of {', '.join(labels)}, {stage}", e)
                            for (stage, _), (labels, e) in draws_of_arms.items()], benchmarks, sizes, "> 10")
    for reading, title, only in (("boxed_accuracy", "change, boxed (headline)", None),
                                 ("boxed_accuracy", "change, boxed, answers > 10", "> 10"),
                                 ("accuracy", "change, lenient", None),
                                 ("accuracy", "change, lenient, answers > 10", "> 10"),
                                 ("right_by_every_step", "change, right by every step", None)):
        changes = []
        for name, before, after in pairs:
            cells = [difference(within(before, b, sizes, only), within(after, b, sizes, only), b, reading)
                     if b in before.benchmarks and b in after.benchmarks else None for b in benchmarks]
            if any(cells):
                changes.append(f"| {name} | " + " | ".join(_signed(c) for c in cells) + " |")
        if changes:
            lines += [f"| {title} | " + " | ".join(f"{b} (95% CI)" for b in benchmarks) + " |",
                      "|---|" + "---|" * len(benchmarks), *changes, ""]
            tables += 1
    for reading, title in (("boxed_accuracy", "ratio, boxed (headline)"), ("accuracy", "ratio, lenient")):
        rows = []
        for name, before, after in ratios:
            cells = [ratio(before, after, b, reading) if b in before.benchmarks and b in after.benchmarks else None
                     for b in benchmarks]
            if any(cells):
                rows.append(f"| {name} | " + " | ".join("" if c is None else "{:.0f}% ({:.0f}-{:.0f}%)".format(
                    *(100 * v for v in c)) for c in cells) + " |")
        if rows:
            lines += [f"| {title} | " + " | ".join(f"{b} (95% CI)" for b in benchmarks) + " |",
                      "|---|" + "---|" * len(benchmarks), *rows,
                      "", "One arm's mean accuracy over the other's, its interval from resampling both arms' runs "
                      "and the problems (a claim that an arm reaches a fraction of the other reads the lower bound).",
                      ""]
    if tables:
        lines += ["Each stage's model against the one before it, each run against the first at the same stage, "
                  "a run started from another run's model against that model, one model evaluated with other "
                  "settings against itself, the mean of runs that differ in "
                  "the seed alone against the model they started from, the mean of runs of one recipe against "
                  "the same runs one stage earlier, and against the first run's arm's draws of the most alike "
                  "settings, on the same problems: the mean change of a problem's accuracy, in points, with a paired "
                  "bootstrap interval (runs and problems resampled where a side pools runs, a run with itself where "
                  "both sides pool the same runs); boxed where both evaluations kept each problem's boxed "
                  "answers' accuracy; answers > 10: only the problems whose answer is a number above 10, where a "
                  "constant small answer or a number copied from the question rarely scores; right by every step: "
                  "answered right having reached every step of the worked solution by a right equation, which no "
                  "guess earns (eval/worked_steps.py; the word problems).", ""]
    lines += ["| run | GRPO steps | reward first -> last | generated tok/s (rollout) | recurrent state per sequence |",
              "|---|---|---|---|---|"]
    for run in runs:
        reward = run.curves.get("reward", [])
        change = ""
        if reward:
            first, last, k = first_last_means([v for _, v in reward])
            change = f"{first:.3f} -> {last:.3f} (mean of {k})"
        rate = f"{run.tokens_per_s:,.0f}" if run.tokens_per_s else ""
        state = f"{run.state_bytes / 2**20:.2f} MiB" if run.state_bytes is not None else ""
        lines.append(f"| {run.label} | {reward[-1][0] if reward else ''} | {change} | {rate} | {state} |")
    return "\n".join(lines) + "\n"


def smoothed(run: Run, name: str = "reward", per_sample: bool = True) -> dict[int, float]:
    """A run's GRPO curve as the figure draws it (a trailing mean over a tenth of its points), by rollouts trained
    on so far (by step where its recipe does not say how many a step trains on, or not ``per_sample``)."""
    points = run.curves.get(name, [])
    values = moving_average([v for _, v in points], max(1, len(points) // 10))
    per_step = (run.rollouts_per_step or 1) if per_sample else 1
    return {step * per_step: value for (step, _), value in zip(points, values)}


def reward_band(reference: list[Run], runs: list[Run]) -> list[str]:
    """Each run's GRPO reward against the spread of the ``reference`` runs (independent draws of one setting, e.g.
    synchronous GRPO over seeds), rollout for rollout: the share of its points inside the references' 95% prediction
    interval there (where a new draw of their setting lands 95% of the time), and its last fifth's mean against
    the same interval of theirs. A run that learned as they did stays inside about 95% of the time."""
    if len(reference) < 2:
        raise ValueError("--reference: a spread needs two or more runs, got "
                         + (", ".join(r.label for r in reference) or "none"))
    curves = {r.label: smoothed(r) for r in [*reference, *runs]}
    for label, curve in curves.items():
        if not curve:
            raise ValueError(f"{label}: no GRPO reward curve (grpo/metrics.jsonl) to set against the reference")
    band = reference_band(reference)
    low, high = prediction_interval([first_last_means(list(curves[r.label].values()))[1] for r in reference])
    names = ", ".join(r.label for r in reference)
    lines = [f"GRPO's reward (trailing mean) against a new draw's 95% prediction interval from {names}, at the same "
             "rollouts trained on:", "",
             "| run | rollouts compared | inside the interval | last fifth's mean | the interval of it |",
             "|---|---|---|---|---|"]
    for run in runs:
        at = sorted(set(band) & set(curves[run.label]))
        inside = [band[x][0] <= curves[run.label][x] <= band[x][1] for x in at]
        end = first_last_means(list(curves[run.label].values()))[1]
        share = f"{100 * sum(inside) / len(inside):.0f}% of {len(inside)} points" if inside else "none shared"
        lines.append(f"| {run.label} | {at[-1] if at else 0:,} | {share} | {end:.3f} | {low:.3f} to {high:.3f} |")
    return lines


def reference_band(reference: list[Run], per_sample: bool = True) -> dict[int, tuple[float, float]]:
    """The references' 95% prediction interval of the reward's trailing mean, at every point all of them have."""
    curves = [smoothed(r, per_sample=per_sample) for r in reference]
    return {x: prediction_interval([c[x] for c in curves]) for x in sorted(set.intersection(*(set(c) for c in curves)))}


def palette(n: int) -> list:
    """``n`` distinct colours: matplotlib's ten, twenty, or as many as asked from a continuous map (the default
    cycle repeats after ten, and a comparison of a few runs' every stage has more bars than that)."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["turbo"](i / (n - 1)) for i in range(n)]


def plot(runs: list[Run], path: Path, reference: list[Run] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{run.label}, {e.stage}", e) for run in runs for e in run.evaluations]
    benchmarks = list(dict.fromkeys(b for _, e in rows for b in e.benchmarks))
    legend_rows = (max(len(rows), 2 * len(runs)) + 1) // 2  # legends below the axes, two columns each
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5 + 0.16 * legend_rows))
    width = 0.8 / max(len(rows), 1)
    for i, ((name, e), colour) in enumerate(zip(rows, palette(len(rows)))):
        xs, ys, lo, hi = [], [], [], []
        for j, b in enumerate(benchmarks):
            if b in e.benchmarks:
                avg, low, high = accuracy(e.benchmarks[b])
                xs.append(j + (i - (len(rows) - 1) / 2) * width)
                ys.append(100 * avg)
                lo.append(100 * (avg - low))
                hi.append(100 * (high - avg))
        left.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=name, color=colour)
    left.set_xticks(range(len(benchmarks)), benchmarks)
    left.set_ylabel("avg@n accuracy (%)")
    left.set_title("Accuracy (95% CI)")
    left.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    per_sample = bool(reference) and all(run.rollouts_per_step for run in runs)
    if reference:  # the reference runs' interval (reward_band's)
        band = reference_band(reference, per_sample)
        right.fill_between(list(band), [lo for lo, _ in band.values()], [hi for _, hi in band.values()],
                           color="0.85", label="reference runs' reward, 95% prediction interval")
    for run, colour in zip(runs, palette(len(runs))):  # one colour a run: solid reward, dashed accuracy
        for name, style in (("reward", "-"), ("accuracy", "--")):
            points = smoothed(run, name, per_sample)
            if points:
                right.plot(list(points), list(points.values()), style, color=colour, label=f"{run.label}: {name}")
    right.set_xlabel("rollouts trained on" if per_sample else "GRPO step")
    right.set_title("GRPO reward and accuracy (moving average)")
    if right.lines:
        right.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def compare(entries: list[str], out: Path, reference: list[str] | None = None) -> Path:
    """``entries``: run folders, each optionally ``LABEL=FOLDER``; writes ``out/compare.md`` and ``out/compare.png``
    and returns the markdown file. ``reference``: labels of runs whose GRPO reward curves make a band that every
    other run is read against (:func:`reward_band`)."""
    runs, seen, named = [], {}, {}
    for entry in entries:
        label, _, folder = entry.partition("=") if "=" in entry else ("", "", entry)
        label = label or Path(folder).name
        where = Path(folder).resolve()
        if where in seen:  # one run given twice would be pooled as two independent draws
            raise ValueError(f"{folder}: given twice (as {seen[where]} and {entry}); each run once")
        if label in named:  # every row and change names its run by the label: two alike could not be told apart
            raise ValueError(f"{entry}: the label {label!r} is {named[label]}'s too; give each run its own (runs of "
                             f"one recipe are pooled by their recipes, not their labels)")
        seen[where], named[label] = entry, entry
        runs.append(read_run(label, Path(folder)))
    band = []
    if reference:
        labels = [run.label for run in runs]
        for label in reference:
            if label not in labels:
                raise ValueError(f"--reference {label}: no run of that label (the runs: {', '.join(labels)})")
        band = reward_band([r for r in runs if r.label in reference], [r for r in runs if r.label not in reference])
    out = Path(out)
    plot(runs, out / "compare.png", [r for r in runs if r.label in (reference or [])])
    text = markdown(runs) + ("\n" + "\n".join(band) + "\n" if band else "") + "\n![comparison](compare.png)\n"
    atomic_write(out / "compare.md", text)
    return out / "compare.md"
