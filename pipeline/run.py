"""Running recipes: the stages in order (:mod:`pipeline.stages`), each as Ray tasks on the resources the plan gives
it (:mod:`pipeline.placement`), resumable.

``ray.init()`` with no address starts a local cluster of the run's own (the default); an address joins an existing
one. A stage whose ``final/`` model exists is skipped; an unfinished stage resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import ray
import yaml

from .checkpoints import is_done, latest_complete_checkpoint
from .lock import RunLock
from .placement import cluster_plan
from .recipe import Recipe, RecipeError, recipe_to_dict, stage_settings
from .report import write_report
from .stages import STAGES as STAGE_OBJECTS
from .stages import stage_runs
from .stages.base import finished
from .storage import set_aside

logger = logging.getLogger(__name__)
STAGES = tuple(STAGE_OBJECTS)  # ("align", "distill", "grpo", "eval")


class StageSettingsChanged(RecipeError):
    pass


def changed_settings(stage: str, before: dict, now: dict) -> list[str]:
    """``key: old -> new`` for every setting of ``stage`` that differs between two resolved recipes."""
    old, new = stage_settings(before, stage), stage_settings(now, stage)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


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
    scored = stage == "eval" and STAGE_OBJECTS["eval"].scored(recipe, stage_dir)
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


def quiet_token_notice(record: logging.LogRecord) -> bool:
    """Ray's notice, on every run, that a new local cluster has token authentication on (its default) is dropped;
    the warning that it is off is kept."""
    return not record.getMessage().startswith("Token authentication is enabled")


def init_ray(recipe: Recipe, address: str | None = None) -> None:
    if ray.is_initialized():
        return
    address = address or recipe.ray.address
    if address:
        ray.init(address=address, runtime_env=runtime_env(recipe), ignore_reinit_error=True)
    else:
        # address "local": a cluster of this run's own, even where another run's is up on this machine (ray.init
        # would join that one, refusing this run's num_cpus / num_gpus)
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(quiet_token_notice)
        ray.init(address="local", num_cpus=recipe.ray.num_cpus, num_gpus=recipe.ray.num_gpus,
                 include_dashboard=False, ignore_reinit_error=True, logging_level=logging.WARNING)


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
    after training): each enabled stage's own checks, and a writable storage."""
    from .storage import check_writable

    for stage in stages:
        if stage_runs(recipe, stage):
            STAGE_OBJECTS[stage].preflight(recipe)
    if recipe.storage is not None:
        check_writable(recipe.storage)


def check_checkpoint(recipe: Recipe, out: Path, stages: tuple[str, ...], checkpoint: str | None,
                     redo: tuple[str, ...]) -> None:
    """A ``--checkpoint`` that exists (checked before Ray starts; a missing one left a record of the bad path), and
    that a finished first stage started from: another one on a finished stage was skipped without a word."""
    from .storage import is_stored

    if checkpoint is None:
        return
    if not is_stored(checkpoint) and not (Path(checkpoint) / "config.json").exists():
        raise RecipeError(f"--checkpoint {checkpoint}: no model there (no config.json)")
    first = next((s for s in stages if stage_runs(recipe, s)), None)
    record = out / str(first) / "started_from.json"
    if first in (None, "eval") or first in redo or not is_done(out / first / "final") or not record.exists():
        return
    from .stages.base import model_id

    if json.loads(record.read_text())["model"] != model_id(str(checkpoint)):
        raise RecipeError(f"--checkpoint {checkpoint}: {first} already finished in {out} from another model "
                          f"({json.loads(record.read_text())['model']}); --redo {first} to run it from this one, or "
                          "another output_dir")


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
    check_checkpoint(recipe, out, stages, checkpoint, redo)
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
    running = tuple(s for s in stages if stage_runs(recipe, s))
    plan = cluster_plan(recipe, running)
    logger.info("%s", plan.describe())
    for stage in running:  # refused before any stage runs
        STAGE_OBJECTS[stage].check_plan(recipe, plan)
    # a local path or a stored URI (never a Path: "s3://")
    current = str(checkpoint) if checkpoint else starting_model(recipe, out, stages)
    started, timings, redone = time.time(), {}, False
    for stage in running:
        stage_start = time.time()
        stage_dir = out / stage
        redone = prepare_stage(recipe, stage, stage_dir, redo=redone or stage in redo) or redone
        current = finished(recipe, stage, stage_dir) or STAGE_OBJECTS[stage].run(recipe, stage_dir, current, plan)
        timings[stage] = time.time() - stage_start
    return write_report(recipe, out, timings, time.time() - started)
