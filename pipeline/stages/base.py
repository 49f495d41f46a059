"""What every stage shares: the interface the run loop calls (:class:`Stage`), the skeleton of a training stage
(:func:`done`, :func:`callbacks`, :func:`fit`, :func:`finish`), where a stage's models come from
(:func:`initial_checkpoint`, :func:`stage_model`) and how they reach the next stage on any node (:func:`stored`,
:func:`hand_on`)."""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path

from transformers import TrainerState
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_utils import TrainOutput

from common.files import atomic_write

from ..checkpoints import DONE, CheckpointMarker, is_done, resume_point, save_final, writing
from ..distributed import is_main_process
from ..metrics import MetricsLogger, plot_curves
from ..recipe import Recipe, RecipeError, recipe_to_dict
from ..storage import identity, is_stored, materialize, upload

logger = logging.getLogger(__name__)


class Stage:
    """One stage of a recipe: ``name`` is its recipe section and its output folder. The run loop asks whether the
    recipe runs it, lets it refuse what this machine or this cluster cannot serve before anything starts, runs it
    on the plan's resources and puts its line in the report."""

    name: str

    def enabled(self, recipe: Recipe) -> bool:
        return getattr(recipe, self.name).enabled

    def preflight(self, recipe: Recipe) -> None:
        """What this machine must offer, checked before Ray starts (packages, files)."""

    def check_plan(self, recipe: Recipe, plan) -> None:
        """What the cluster's plan (:class:`pipeline.placement.Plan`) must allow, checked before any stage runs."""

    def run(self, recipe: Recipe, stage_dir: Path, start: str | None, plan) -> str | None:
        """Runs the stage as Ray tasks from the model ``start`` (a path or stored URI; None: the recipe's initial
        model); returns where the next stage finds its model (None: it hands none on)."""
        raise NotImplementedError

    def highlight(self, recipe: Recipe, stage_dir: Path) -> str:
        """The report's words on a finished run of the stage."""
        return ""


def task_setup() -> None:
    """Every stage task: torch threads for the CPUs Ray gave it, and none of the warnings we have dealt with
    (transformers' v6 renames of arguments TRL still passes by the old names; TRL's notice that
    ``rollout_func``, which the GRPO stage uses on purpose, is experimental)."""
    import ray
    import torch

    assigned = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(assigned)))
    warnings.filterwarnings("ignore", message=r".*is deprecated and will be removed in v6", category=FutureWarning)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


# -- models in and out ---------------------------------------------------------------------------------------
def stored(recipe: Recipe, location: str | Path, stage: str) -> str:
    """A model this process has locally (the initial model, a --checkpoint), stored as ``stage``'s starting model
    when the recipe has a storage location, so that stages on other nodes can read it; else unchanged."""
    if recipe.storage is None or is_stored(location):
        return str(location)
    return upload(Path(location), recipe.stored_at(stage, "start"))


def hand_on(recipe: Recipe, stage: str, final: Path) -> str:
    """The location the next stage reads a stage's final model from: stored under ``recipe.storage`` when
    there is one (by the process that wrote it), else its local path."""
    if recipe.storage is None or not is_main_process():
        return str(final)
    return upload(final, recipe.stored_at(stage, "final"))


def record_start(stage_dir: Path, start: str | None) -> None:
    """``<stage>/started_from.json``: the model a training stage starts from, named as evaluations name the model
    they scored (:func:`model_id`), so that ``sse-pipeline compare`` pairs a run started
    from another run's model (``--checkpoint``) with that model's evaluation. None: a fresh model (nothing to pair)."""
    if start is None:
        return
    atomic_write(stage_dir / "started_from.json", json.dumps({"model": model_id(str(start))}) + "\n")


def model_id(location: str) -> str:
    """What a model location names, the same on every node: a stored model's URI and upload, else the checkpoint's
    fingerprint. Evaluations record it as the model they scored, training stages as the model they started from."""
    from eval.runner import model_identity

    return identity(location) if is_stored(location) else model_identity(str(materialize(location)))


def initial_settings(recipe: Recipe) -> dict:
    """What a recipe's starting model is built from: a built one with other settings is built again."""
    return {"model": recipe_to_dict(recipe)["model"], "seed": recipe.seed}


def initial_checkpoint(recipe: Recipe, out: Path) -> Path:
    """The recipe's starting model as a directory (built from a preset or converted), built again when the model
    settings or the seed it was built with changed (the old one moved aside)."""
    from ..models import load_model

    if recipe.model.path is not None:
        return Path(recipe.model.path)
    path = out / "initial"
    settings = initial_settings(recipe)
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


def stage_model(recipe: Recipe, out: Path, name: str) -> Path:
    """The model ``eval.models`` names: the initial one, or a training stage's final model in ``out``."""
    if name == "initial":
        return initial_checkpoint(recipe, out)
    final = out / name / "final"
    if not is_done(final):
        raise RecipeError(f"eval.models: {name!r}: {final} holds no finished model (run the {name} stage first)")
    return final


# -- the training stages' skeleton ---------------------------------------------------------------------------
def done(stage: str, out_dir: Path) -> Path | None:
    """The stage's final model if it is already written (a re-run skips the stage)."""
    final = Path(out_dir) / "final"
    if is_done(final):
        logger.info("%s: already done (%s)", stage, final)
        return final
    return None


def finished(recipe: Recipe, stage: str, stage_dir: Path) -> str | None:
    """A training stage's final model where this machine has it whole and nothing is stored elsewhere: the run
    hands it on without starting a worker only to find it done (with ``storage``, the stage's task hands on the
    stored copy)."""
    final = done(stage, stage_dir) if recipe.storage is None else None  # an evaluation writes no final model
    return None if final is None else str(final)


def callbacks(recipe: Recipe, stage: str, out_dir: Path, timer=None) -> list:
    """Every worker marks (and stores) complete checkpoints; the first also logs the metrics."""
    marker = CheckpointMarker(recipe.stored_at(stage, "checkpoints"))
    return [marker, *([MetricsLogger(Path(out_dir) / "metrics.jsonl", timer)] if is_main_process() else [])]


def fit(stage: str, recipe: Recipe, out_dir: Path, trainer):
    """Trains from the newest complete checkpoint (a stored one fetched first); returns the trainer's result and the
    final weights, gathered on every worker (under FSDP a collective: every worker must call it)."""
    if trainer.args.disable_tqdm:  # in a Ray worker: MetricsLogger's one line a step, not the trainer's dict of logs
        trainer.remove_callback(PrinterCallback)
    resume = resume_point(recipe.stored_at(stage, "checkpoints"), out_dir)
    if resume is not None:
        logger.info("%s: resuming from %s", stage, resume)
        state = TrainerState.load_from_json(str(resume / "trainer_state.json"))
        if 0 < trainer.args.max_steps <= state.global_step:  # transformers would train one step past the end
            trainer._load_from_checkpoint(str(resume))  # the weights (under FSDP: the shards) as train() loads them
            trainer.state = state
            result = TrainOutput(state.global_step, None, {})  # its mean loss went unrecorded when it was killed
            return result, trainer.accelerator.get_state_dict(trainer.model)
    with writing(Path(out_dir) / "checkpoints"):  # a checkpoint that could not be written: where, and the room left
        result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if trainer.state.global_step == 0:  # a finished stage that trained nothing would hand the next its input
        raise RuntimeError(f"{stage}: trained no optimizer step: its data holds fewer rows than one step takes")
    return result, trainer.accelerator.get_state_dict(trainer.model)


def finish(stage: str, out_dir: Path, trainer, tokenizer, weights: dict, curves: list[str], info: dict) -> Path:
    """The first worker plots the stage's ``curves`` (metric names) into its figure (:data:`CURVES`) and writes the
    final model atomically, ``info`` in its done marker; the others return its path."""
    final = Path(out_dir) / "final"
    if not is_main_process():
        return final
    plot_curves(Path(out_dir) / "metrics.jsonl", Path(out_dir) / CURVES[stage], curves, stage)
    return save_final(trainer.accelerator.unwrap_model(trainer.model), tokenizer, final,
                      {"stage": stage, "global_step": trainer.state.global_step, **info}, weights)


CURVES = {"align": "loss.png", "distill": "loss.png", "grpo": "reward_curve.png"}  # each stage's figure


def loss_highlight(stage_dir: Path) -> str:
    """``loss a -> b``: the first and last logged training loss."""
    from ..metrics import read_metrics

    losses = [r["loss"] for r in read_metrics(Path(stage_dir) / "metrics.jsonl") if "loss" in r]
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""


def check_engine_installed(stage: str, engine) -> None:
    """vLLM where a stage's engine backend names it, refused before Ray starts."""
    import importlib.util

    if engine.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise RecipeError(f"{stage}.engine.backend: vllm needs vLLM 0.25.1, which is not installed "
                          "(pip install 'sse-pipeline[vllm]', or python -m scripts.vllm_site from a checkout); "
                          "engine.backend: sse is this package's engine")


def check_data_source(key: str, spec) -> None:
    """Every source of a data spec (its mix's too) as :func:`check_source` reads it; builtins and the packaged sets
    are always there."""
    from ..data import PACKAGED, check_split

    for i, part in enumerate([spec, *spec.mix]):
        where = key if i == 0 else f"{key}.mix[{i - 1}]"
        if not (part.source.startswith("builtin:") or part.source in PACKAGED):
            check_source(f"{where}.source", part.source)
        try:
            check_split(part)
        except ValueError as err:
            raise RecipeError(f"{where}.split: {err}") from None


def check_source(key: str, name: str, instead: str = "") -> Path | None:
    """A data set's name as its loaders read it, before anything starts (it failed once the stage had loaded its
    model): a local file (returned); a file's name (a path, or a JSONL / JSON / parquet name) that is not there,
    refused (``instead``: what else the name could have been); else a hub dataset, whose hub must be in reach."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name.startswith((".", "/", "~")) or name.endswith((".jsonl", ".json", ".parquet")):
        raise RecipeError(f"{key}: {name!r} is no file (from {Path.cwd()}){instead}")
    check_hub(key, name)
    return None


def _hub_address() -> tuple[str, int]:
    """The host and port of the hub the ``datasets`` library reads (``HF_ENDPOINT`` where a mirror is set)."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


HUB = _hub_address()


def check_hub(key: str, name: str, timeout_s: float = 5.0) -> None:
    """A hub dataset's name, refused at once where the hub cannot be reached (``datasets`` waited a minute before it
    failed, after the stages before had run)."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return  # offline mode: the datasets cache serves it, or says it cannot
    try:
        socket.create_connection(HUB, timeout=timeout_s).close()
    except OSError as error:
        raise RecipeError(f"{key}: {name!r} names a hub dataset, and the hub is out of reach from here ({error}); "
                          "give a local file (JSONL / JSON / parquet), or set HF_HUB_OFFLINE=1 to read the cache")
