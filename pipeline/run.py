"""Running recipes: the stages in order, each as a Ray task on the resources it needs, resumable.

``ray.init()`` with no address starts a local cluster (the default); an address joins an existing one.
Placement: on one GPU the rollout engines share the trainer's GPU and free their memory between rollouts;
with more GPUs the trainer takes one and each engine one of the others. On CPU everything shares the cores.
A stage whose ``final/`` model exists is skipped; an unfinished stage resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import ray
import yaml
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .checkpoints import DONE, is_done, latest_complete_checkpoint, save_final
from .distributed import is_main_process, run_data_parallel, world
from .lock import RunLock
from .metrics import first_last_means, read_metrics
from .models import engine_options, load_model, precision_name, resolve_device
from .placement import GRPOPlacement, Plan, cluster_plan, reserve
from .recipe import Recipe, RecipeError, recipe_to_dict, stage_settings
from .storage import is_stored, materialize, set_aside, upload

logger = logging.getLogger(__name__)
STAGES = ("align", "distill", "grpo", "eval")


def stage_runs(recipe: Recipe, stage: str) -> bool:
    """Whether ``recipe`` runs ``stage``: enabled, and for ``align`` a model converted into some SSE layers (a model
    built otherwise, or converted with every layer kept as attention, has nothing to align)."""
    return getattr(recipe, stage).enabled and (stage != "align" or recipe.model.converts_layers())


class StageSettingsChanged(RecipeError):
    pass


def changed_settings(stage: str, before: dict, now: dict) -> list[str]:
    """``key: old -> new`` for every setting of ``stage`` that differs between two resolved recipes."""
    old, new = stage_settings(before, stage), stage_settings(now, stage)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def eval_dir(stage_dir: Path, name: str) -> Path:
    """Where the evaluation stage writes the evaluation of ``eval.models`` entry ``name``: the last model's in the
    stage's folder, each other model's in a folder of its name."""
    return stage_dir if name == "last" else stage_dir / name


def prepare_stage(recipe: Recipe, stage: str, stage_dir: Path, redo: bool) -> bool:
    """Says what a re-run does with ``stage`` (starting, resuming, done) and keeps the recipe it runs with in
    ``stage_dir/recipe.yaml``; if settings of a stage that already ran changed, refuses with the list, or with
    ``redo`` moves the old outputs aside (never deletes them) and starts afresh. True if it did."""
    saved = stage_dir / "recipe.yaml"
    now = recipe_to_dict(recipe)
    fresh = False
    if saved.exists():
        changes = changed_settings(stage, yaml.safe_load(saved.read_text()) or {}, now)
        if changes and not redo:
            raise StageSettingsChanged(
                f"{stage}: settings changed since this stage ran in {stage_dir}: " + "; ".join(changes)
                + f". Use another output_dir, or --redo {stage} to run it again (its outputs are moved aside)")
        if changes or redo:
            suffix = f".replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            aside = stage_dir.with_name(stage_dir.name + suffix)
            stage_dir.rename(aside)
            if recipe.storage is not None:  # its stored checkpoints must not be resumed from either
                set_aside(recipe.stored_at(stage), suffix)
            fresh = True
            logger.warning("%s: running again; the previous outputs are in %s", stage, aside)
    scored = stage == "eval" and all((eval_dir(stage_dir, name) / "summary.json").exists()
                                     for name in recipe.eval.models)
    if is_done(stage_dir / "final") or scored:
        logger.info("%s: done, skipping", stage)
    else:
        resume = latest_complete_checkpoint(stage_dir / "checkpoints")
        logger.info("%s: %s", stage, f"resuming from {resume.name}" if resume else "starting")
    stage_dir.mkdir(parents=True, exist_ok=True)
    saved.write_text(yaml.safe_dump(now, sort_keys=False))
    return fresh


PROJECT_PACKAGES = ("common", "sse_model", "kernels", "pipeline", "rewards", "eval")


def runtime_env(recipe: Recipe) -> dict:
    """What the workers of an existing cluster run with: the recipe's ``ray.runtime_env`` plus, with
    ``ray.ship_project``, this checkout's packages as Ray ``py_modules`` (uploaded once per content)."""
    import importlib

    env = dict(recipe.ray.runtime_env)
    if recipe.ray.ship_project:
        env["py_modules"] = [*env.get("py_modules", []), *(importlib.import_module(p) for p in PROJECT_PACKAGES)]
    return env


def init_ray(recipe: Recipe, address: str | None = None) -> None:
    if ray.is_initialized():
        return
    address = address or recipe.ray.address
    if address:
        ray.init(address=address, runtime_env=runtime_env(recipe), ignore_reinit_error=True)
    else:
        # address "local": a cluster of this run's own, even where another run's is up on this machine (ray.init
        # would join that one, refusing this run's num_cpus / num_gpus)
        ray.init(address="local", num_cpus=recipe.ray.num_cpus, num_gpus=recipe.ray.num_gpus,
                 include_dashboard=False, ignore_reinit_error=True, logging_level=logging.WARNING)


def _task_setup():
    """Every stage task: torch threads for the CPUs Ray gave it, and none of the warnings we have dealt with
    (transformers' v6 renames of arguments TRL still passes by the old names; TRL's notice that
    ``rollout_func``, which the GRPO stage uses on purpose, is experimental)."""
    import os
    import warnings

    import torch

    assigned = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(assigned)))
    warnings.filterwarnings("ignore", message=r".*is deprecated and will be removed in v6", category=FutureWarning)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _stored(recipe: Recipe, location: str | Path, stage: str) -> str:
    """A model this process has locally (the initial model, a --checkpoint), stored as ``stage``'s starting model
    when the recipe has a storage location, so that stages on other nodes can read it; else unchanged."""
    if recipe.storage is None or is_stored(location):
        return str(location)
    return upload(Path(location), recipe.stored_at(stage, "start"))


def _hand_on(recipe: Recipe, stage: str, final: Path) -> str:
    """The location the next stage reads a stage's final model from: stored under ``recipe.storage`` when
    there is one (by the process that wrote it), else its local path."""
    if recipe.storage is None or not is_main_process():
        return str(final)
    return upload(final, recipe.stored_at(stage, "final"))


def _align_task(recipe: Recipe, out_dir: str, start_from: str | None) -> str:
    from .stages.align import run_align

    _task_setup()
    final = run_align(recipe, Path(out_dir), materialize(start_from) if start_from else None)
    return _hand_on(recipe, "align", final)


def _distill_task(recipe: Recipe, out_dir: str, start_from: str | None) -> str:
    from .stages.distill import run_distill

    _task_setup()
    final = run_distill(recipe, Path(out_dir), materialize(start_from) if start_from else None)
    return _hand_on(recipe, "distill", final)


def _grpo_task(recipe: Recipe, out_dir: str, start_from: str, plan: GRPOPlacement, group) -> str:
    from .rollout.actor import EngineFleet
    from .stages.grpo import run_grpo

    _task_setup()
    cfg = recipe.grpo
    engine_resources, colocated = plan.engine, plan.colocated
    sync = cfg.weight_sync
    if sync == "broadcast":  # (a colocated broadcast is refused before the stages start: check_weight_sync)
        sync = "nccl" if engine_resources.get("num_gpus", 0) >= 1 else "gloo"

    def fleet_factory(trainer_bytes: int):  # the engines read the model where it is kept: stored, on any node
        options = engine_options(recipe, cfg.engine, cfg.max_prompt_length + cfg.max_completion_length)
        if colocated and cfg.engine.backend == "vllm" and options["memory_budget"] is None:
            options["memory_budget"] = colocated_vllm_cache(trainer_bytes)
        return EngineFleet(start_from, None, num_engines=plan.engines, max_restarts=cfg.max_engine_restarts,
                           weight_sync=sync,
                           sleep_between_calls=colocated if cfg.engine.sleep is None else cfg.engine.sleep,
                           device=resolve_device(recipe.device).type, **options,
                           **engine_resources, resources=cfg.engine_resources, placement_group=group,
                           bundles=plan.engine_bundles[world()[0]] if group is not None else None)

    final = run_grpo(recipe, Path(out_dir), materialize(start_from), fleet_factory)
    return _hand_on(recipe, "grpo", final)


# what a colocated vLLM engine leaves beside its cache and the trainer's state: its weights, activations and graphs
VLLM_OVERHEAD = 4 * 2**30


def colocated_vllm_cache(trainer_bytes: int) -> int:
    """A colocated vLLM engine's cache bytes: vLLM sizes its cache once, when it starts, before the trainer holds its
    memory, and allocates that much again at every wake; so it plans from what the trainer keeps while it sleeps
    (``trainer_bytes``: weights, gradients, optimizer state of this worker), not from what is free at its start.
    (Our engine plans again at every wake from the memory then free.)"""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    budget = int(0.9 * total) - trainer_bytes - VLLM_OVERHEAD
    if budget <= 0:
        raise RecipeError(f"grpo.engine.backend: vllm colocated with a trainer that keeps {trainer_bytes / 2**30:.1f} "
                          f"GiB leaves no cache on a GPU of {total / 2**30:.0f} GiB: use grpo.placement: split")
    return budget


class _Generator:
    """The eval stage's generation, one model after another in one process: a Ray task a model (a GPU task's
    worker exits after one call) paid the process, imports, CUDA context and kernels' first launches again for
    every model, ~20 s each on an H200. Each model's memory is given back before the next is loaded."""

    def __init__(self):
        _task_setup()
        self.served = 0

    def generate(self, recipe: Recipe, out_dir: str, checkpoint: str, workers: int, eval_gpus: float) -> tuple[str, int]:
        """Generations of one model; returns the node that holds them (where they are scored) and how many models
        this process has generated for, this one included."""
        import gc

        import torch

        from .stages.evaluate import generate_all

        generate_all(recipe, Path(out_dir), checkpoint, workers, eval_gpus if workers > 1 else 0)
        gc.collect()  # the engine's cycles (its CUDA graphs and state pools) before the cache is emptied
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.served += 1
        return ray.get_runtime_context().get_node_id(), self.served


def _score_task(recipe: Recipe, out_dir: str) -> dict:
    from .stages.evaluate import score_all

    _task_setup()
    return score_all(recipe, Path(out_dir))


def initial_checkpoint(recipe: Recipe, out: Path) -> Path:
    """The recipe's starting model as a directory (built from a preset or converted), built again when the model
    settings or the seed it was built with changed (the old one moved aside)."""
    if recipe.model.path is not None:
        return Path(recipe.model.path)
    path = out / "initial"
    settings = {"model": recipe_to_dict(recipe)["model"], "seed": recipe.seed}
    if is_done(path):
        built = json.loads((path / DONE).read_text()).get("settings")
        if built == settings:
            return path
        aside = path.with_name(f"initial.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(aside)
        logger.warning("initial: the model settings changed since %s was built; building it again (the old one is "
                       "in %s)", path, aside)
    model, tokenizer = load_model(recipe.model, None, seed=recipe.seed)
    save_final(model, tokenizer, path, {"stage": "initial", "from": recipe.model.preset or recipe.model.convert_from,
                                        "settings": settings})
    return path


def _stage_model(recipe: Recipe, out: Path, name: str) -> Path:
    """The model ``eval.models`` names: the initial one, or a training stage's final model in ``out``."""
    if name == "initial":
        return initial_checkpoint(recipe, out)
    final = out / name / "final"
    if not is_done(final):
        raise RecipeError(f"eval.models: {name!r}: {final} holds no finished model (run the {name} stage first)")
    return final


def starting_model(recipe: Recipe, out: Path, stages: tuple[str, ...]) -> str | None:
    """The model the first of ``stages`` starts from when no checkpoint is given: the final model of the last
    training stage before it that the recipe enables and that has finished in ``out`` (``sse-pipeline eval`` on a
    finished run scores its GRPO model, not a fresh initial one); None: the initial model."""
    first = next((s for s in STAGES if s in stages and stage_runs(recipe, s)), None)
    before = STAGES[:STAGES.index(first)] if first else ()
    for stage in reversed([s for s in before if s != "eval" and stage_runs(recipe, s)]):
        final = out / stage / "final"
        if is_done(final):
            logger.info("%s: starting from %s, the last finished stage's model", first, final)
            return str(final)
    return None


def preflight(recipe: Recipe, stages: tuple[str, ...]) -> None:
    """What this machine must offer the recipe, checked before Ray or any stage starts (each used to fail only
    after training): vLLM where an engine backend names it, evaluation files that exist, a writable storage."""
    import importlib.util

    from .storage import check_writable

    enabled = [s for s in stages if stage_runs(recipe, s)]
    engines = {"grpo": recipe.grpo.engine, **({"eval": recipe.eval.engine} if recipe.eval.backend == "engine" else {})}
    for stage in enabled:
        if stage in engines and engines[stage].backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise RecipeError(f"{stage}.engine.backend: vllm needs vLLM 0.25.1, which is not installed "
                              "(pip install 'sse-pipeline[vllm]', or python -m scripts.vllm_site from a checkout); "
                              "engine.backend: sse is this package's engine")
    if "eval" in enabled:
        from eval.benchmarks import BENCHMARKS

        for name in recipe.eval.benchmarks:
            looks_like_file = name.startswith((".", "/", "~")) or name.endswith((".jsonl", ".json", ".parquet"))
            if name not in BENCHMARKS and looks_like_file and not Path(name).expanduser().exists():
                raise RecipeError(f"eval.benchmarks: {name!r} is no file (from {Path.cwd()}) and no registered "
                                  f"benchmark ({sorted(BENCHMARKS)})")
    if recipe.storage is not None:
        check_writable(recipe.storage)


def run_recipe(recipe: Recipe, stages: tuple[str, ...] = STAGES, address: str | None = None,
               checkpoint: str | None = None, redo: tuple[str, ...] = ()) -> Path:
    """Runs ``stages`` of ``recipe`` (each consuming the previous one's final model); returns the report.
    One run at a time per output folder (:class:`~pipeline.lock.RunLock`); each stage keeps the recipe it
    ran with, and a re-run with changed settings of a stage refuses unless the stage is in ``redo``."""
    extra = [s for s in redo if s not in stages]
    if extra:
        raise RecipeError(f"--redo {' '.join(extra)}: this command runs {', '.join(stages)} only; run the stages to "
                          f"redo with it (sse-pipeline run ... --redo {extra[0]})")
    preflight(recipe, stages)
    out = Path(recipe.output_dir)
    with RunLock(out):
        redone = False  # a stage run again makes every later stage stale: they run again too
        for stage in stages:  # every refusal before anything starts
            if not stage_runs(recipe, stage):
                continue
            redone = redone or stage in redo
            saved = out / stage / "recipe.yaml"
            if saved.exists() and not redone:
                if changed_settings(stage, yaml.safe_load(saved.read_text()) or {}, recipe_to_dict(recipe)):
                    prepare_stage(recipe, stage, out / stage, redo=False)  # raises, naming the changes
        return _run_stages(recipe, out, stages, address, checkpoint, redo)


def _run_stages(recipe: Recipe, out: Path, stages: tuple[str, ...], address: str | None,
                checkpoint: str | None, redo: tuple[str, ...]) -> Path:
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    init_ray(recipe, address)
    where = cluster_plan(recipe, tuple(s for s in stages if stage_runs(recipe, s)))
    logger.info("%s", where.describe())
    if "grpo" in stages and stage_runs(recipe, "grpo"):  # refused before any stage runs
        check_weight_sync(recipe, where)
    # a local path or a stored URI (never a Path: "s3://")
    current = str(checkpoint) if checkpoint else starting_model(recipe, out, stages)
    started = time.time()
    timings = {}
    redone = False
    for stage in stages:
        if not stage_runs(recipe, stage):
            continue
        stage_start = time.time()
        stage_dir = out / stage
        redone = prepare_stage(recipe, stage, stage_dir, redo=redone or stage in redo) or redone
        if stage == "align":
            start = _stored(recipe, current, "align") if current else None
            _record_start(stage_dir, start)
            current = ray.get(ray.remote(**where.whole)(_align_task).remote(recipe, str(stage_dir), start))
        elif stage == "distill":
            start = _stored(recipe, current, "distill") if current else None
            _record_start(stage_dir, start)
            if where.distill.workers > 1:
                current = run_data_parallel(_distill_task, (recipe, str(stage_dir), start),
                                            [where.train_worker] * where.distill.workers, "distill")
            else:
                task = ray.remote(**where.whole)(_distill_task)
                current = ray.get(task.remote(recipe, str(stage_dir), start))
        elif stage == "grpo":
            start_from = _stored(recipe, current or initial_checkpoint(recipe, out), "grpo")
            _record_start(stage_dir, start_from)
            plan = where.grpo
            group = reserve(plan)
            try:
                args = (recipe, str(stage_dir), str(start_from), plan, group)
                if plan.workers > 1:
                    options = [plan.trainer_options(group, r) for r in range(plan.workers)]
                    current = run_data_parallel(_grpo_task, args, options, "grpo")
                else:
                    current = ray.get(ray.remote(**plan.trainer_options(group, 0))(_grpo_task).remote(*args))
            finally:
                if group is not None:
                    ray.util.remove_placement_group(group)
        elif stage == "eval":
            from .stages.evaluate import generated_already

            generator = ray.remote(**(where.whole if where.eval_workers <= 1 else {"num_cpus": 1}))(_Generator)
            one_model_each = recipe.eval.backend == "engine" and recipe.eval.engine.backend == "vllm"  # one engine a process
            score = ray.remote(num_cpus=1)(_score_task)
            scoring, worker = [], None  # each model is scored (CPU) while the GPU generates for the next
            try:
                for name in recipe.eval.models:
                    model = (current or initial_checkpoint(recipe, out)) if name == "last" else _stage_model(recipe, out, name)
                    model_dir = str(eval_dir(stage_dir, name))
                    location = str(_stored(recipe, model, "eval"))
                    if generated_already(Path(model_dir), location):  # a re-run: scored again, nothing generated
                        logger.info("eval: %s: every generation of this model is in %s, scoring them again", name,
                                    model_dir)
                        node = ray.get_runtime_context().get_node_id()  # where this driver read them
                    else:
                        began = time.time()
                        if worker is None or one_model_each:
                            if worker is not None:
                                ray.kill(worker)
                            worker = generator.remote()
                        node, served = ray.get(worker.generate.remote(recipe, model_dir, location, where.eval_workers,
                                                                      where.eval_gpus))
                        logger.info("eval: %s: generations in %.0f s (loading and engine included; the worker's model "
                                    "%d)", name, time.time() - began, served)
                    on_node = NodeAffinitySchedulingStrategy(node, soft=False)  # the output folder is that node's
                    scoring.append(score.options(scheduling_strategy=on_node).remote(recipe, model_dir))
            finally:
                if worker is not None:
                    ray.kill(worker)
            ray.get(scoring)
        timings[stage] = time.time() - stage_start
    report = write_report(recipe, out, timings, time.time() - started)
    return report


def check_weight_sync(recipe: Recipe, where: Plan) -> None:
    """Refuses a ``grpo.weight_sync`` the run's placement cannot serve, before any stage runs."""
    sync, mode = recipe.grpo.weight_sync, where.grpo.mode
    if sync == "cuda_ipc" and mode != "colocated":
        raise RecipeError(f"grpo.weight_sync: cuda_ipc opens the trainer's GPU memory in engines on the same GPU "
                          f"(grpo.placement colocated); this run places them {mode}: use broadcast for engines on "
                          "GPUs of their own, object_store on CPU")
    if sync == "broadcast" and mode == "colocated":
        raise RecipeError("grpo.weight_sync: broadcast needs engines on GPUs of their own (NCCL pairs one process per "
                          "GPU); with the engines on the trainer's GPU use cuda_ipc or object_store")


def _record_start(stage_dir: Path, start: str | None) -> None:
    """``<stage>/started_from.json``: the model a training stage starts from, named as evaluations name the model
    they scored (:func:`~pipeline.stages.evaluate.model_id`), so that ``sse-pipeline compare`` pairs a run started
    from another run's model (``--checkpoint``) with that model's evaluation. None: a fresh model (nothing to pair)."""
    if start is None:
        return
    from common.files import atomic_write

    from .stages.evaluate import model_id

    atomic_write(stage_dir / "started_from.json", json.dumps({"model": model_id(str(start))}) + "\n")


def time_split(rows: list[dict]) -> list[str]:
    """Mean seconds per GRPO step in rollout / reward / weight sync / train, as a markdown table."""
    parts = ("rollout", "reward", "weight_sync", "train")
    rows = [r for r in rows if "time/step_s" in r and "time/rollout_s" in r]
    if not rows:
        return []
    mean = {p: sum(r.get(f"time/{p}_s", 0.0) for r in rows) / len(rows) for p in ("step", *parts)}
    rate = [r["tokens/generated_per_s"] for r in rows if "tokens/generated_per_s" in r]
    header = "| steps | s/step | " + " | ".join(parts) + " | generated tok/s (rollout) |"
    cells = " | ".join(f"{mean[p]:.2f} s ({100 * mean[p] / max(mean['step'], 1e-9):.0f}%)" for p in parts)
    rate_text = f"{sum(rate) / len(rate):,.0f}" if rate else ""
    return ["Time per step (mean over logged steps):", "", header, "|" + " --- |" * (len(parts) + 3),
            f"| {len(rows)} | {mean['step']:.2f} | {cells} | {rate_text} |", ""]


def _scores(benchmarks: dict) -> str:
    """``gsm8k avg@4 12.3%; ...`` from an evaluation's ``summary.json`` benchmarks."""
    return "; ".join(f"{name} avg@{m['repeats']} {100 * m['avg@' + str(m['repeats'])]:.1f}%"
                     for name, m in benchmarks.items())


def write_report(recipe: Recipe, out: Path, timings: dict, total: float) -> Path:
    """``report.md``: what ran, where its outputs are, and the headline numbers."""
    lines = [f"# {recipe.name}", "", f"Output directory: `{out}`",
             f"Training precision: {precision_name(recipe, resolve_device(recipe.device))}.", ""]
    lines += ["| stage | seconds this run | final model | highlights |", "| --- | --- | --- | --- |"]
    for stage in STAGES:
        stage_dir = out / stage
        if not stage_dir.exists():
            continue
        rows = read_metrics(stage_dir / "metrics.jsonl")
        highlight = ""
        if stage in ("align", "distill") and rows:
            losses = [r["loss"] for r in rows if "loss" in r]
            highlight = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""
        if stage == "grpo" and rows:
            rewards = [r["reward"] for r in rows if "reward" in r]
            if rewards:
                first, last, k = first_last_means(rewards)
                highlight = (f"reward (mean of first/last {k} logs) {first:.3f} -> {last:.3f}; "
                             "curve: `grpo/reward_curve.png`")
        if stage == "eval":
            parts = []
            for name in recipe.eval.models:  # the last model's scores, then those of the other models scored
                summary_file = eval_dir(stage_dir, name) / "summary.json"
                if summary_file.exists():
                    text = _scores(json.loads(summary_file.read_text())["benchmarks"])
                    parts.append(text if name == "last" else f"{name}: {text}")
            highlight = " / ".join(parts)
        final = stage_dir / "final"
        lines.append(f"| {stage} | {timings.get(stage, 0.0):.0f} | {'`' + str(final) + '`' if final.exists() else ''} | "
                     f"{highlight} |")
    if (out / "eval" / "results.md").exists():
        lines += ["", "## Evaluation", "", (out / "eval" / "results.md").read_text(), "![eval](eval/results.png)"]
    if (out / "grpo" / "reward_curve.png").exists():
        lines += ["", "## GRPO", "", *time_split(read_metrics(out / "grpo" / "metrics.jsonl")),
                  "![reward curve](grpo/reward_curve.png)"]
    lines += ["", f"Total wall time of this run: {total:.0f} s.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
