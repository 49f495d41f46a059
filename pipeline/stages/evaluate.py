"""Stage 3, eval: the benchmark harness (``eval/``), generation sharded over Ray workers, then scoring."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import ray

from eval.generation import HFGenerateBackend, SamplingConfig
from eval.runner import generate, same_model, score

from ..models import engine_options, load_model, resolve_device
from ..recipe import Recipe, RecipeError
from ..storage import get_files, materialize, put_files
from .base import (Stage, check_engine_installed, check_source, initial_checkpoint, model_id, stage_model, stored,
                   task_setup)

logger = logging.getLogger(__name__)


def _progress():
    """Inside a Ray worker, Ray's tqdm (bars that refresh in place on the driver); else a plain bar."""
    if ray.is_initialized():
        from ray.experimental.tqdm_ray import tqdm

        return tqdm
    return True


def sampling_of(recipe: Recipe) -> SamplingConfig:
    cfg = recipe.eval
    return SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                          seed=recipe.seed)


def _shard_store(recipe: Recipe, workers: int, scored: str) -> str | None:
    """Where sharded generations meet when the recipe has a storage location (workers on other nodes): per model
    evaluated, so that an evaluation of another model never takes these."""
    if recipe.storage is None or workers <= 1:
        return None
    return recipe.stored_at("eval", "generations", hashlib.sha1(scored.encode()).hexdigest()[:12])


def generate_shard(recipe: Recipe, location: str, out_dir: str, shard: tuple[int, int]) -> dict:
    """Generation for one shard of every benchmark, with the rollout engine or ``model.generate``. ``location``:
    the checkpoint, a local path or a stored URI (fetched on this node). With storage, the shard's generations
    are fetched before (resuming) and stored after, so workers on any node need no common output folder. Returns
    the tokens it generated, the seconds that took (model loading and engine start apart) and, with this package's
    engine, its slots and the sequences it ran at once on average (what decides its rate)."""
    cfg = recipe.eval
    device = resolve_device(recipe.device)
    scored = model_id(location)
    store = _shard_store(recipe, shard[1], scored)
    generations = Path(out_dir) / "generations"
    mine = f"*.shard{shard[0]}of{shard[1]}.jsonl"
    if store is not None:  # with the settings they were made with, which generate() holds them to
        get_files(store, generations, mine)
        get_files(store, generations, "*.settings.json")
    started = time.perf_counter()
    checkpoint = str(materialize(location))
    model, tokenizer = load_model(recipe.model, checkpoint)
    loaded = time.perf_counter()
    served_by_vllm = cfg.backend == "engine" and cfg.engine.backend == "vllm"
    model = model.eval() if served_by_vllm else model.to(device).eval()  # vLLM loads the checkpoint itself
    if cfg.backend == "engine":
        from ..rollout import create_engine
        from ..rollout.backend import EngineBackend

        options = engine_options(recipe, cfg.engine, cfg.max_prompt_length + cfg.max_new_tokens)
        engine = create_engine(checkpoint if served_by_vllm else model, tokenizer, **options)
        backend = EngineBackend(engine)
    else:
        backend = HFGenerateBackend(model, tokenizer)
    ours = cfg.backend == "engine" and not served_by_vllm
    # our engine's decode graphs for every batch size it will run, before the timed generation (vLLM captures
    # its own when it starts)
    graphs = backend.engine.warm_up() if ours else 0
    # what a model costs before its first token (the per-model overhead of evaluating several), in the run's log
    ready = time.perf_counter() - loaded
    print(f"eval: {checkpoint}: loaded in {loaded - started:.1f} s, engine ready in {ready:.1f} s"
          + (f" ({graphs} decode graphs captured)" if graphs else ""), flush=True)
    began = time.perf_counter()
    tokens = generate(model, tokenizer, cfg.benchmarks, cfg.repeats, sampling_of(recipe), out_dir, backend,
                      cfg.limit, instruction=recipe.prompt_instruction, shard=shard, model_id=scored,
                      max_prompt_tokens=cfg.max_prompt_length, long_prompts=cfg.long_prompts, progress=_progress())
    rate = {"tokens": tokens, "seconds": time.perf_counter() - began}
    if ours and backend.engine.stats.decode_steps:  # (vLLM's engine keeps no such count)
        stats = backend.engine.stats
        rate.update(slots=backend.engine.max_slots, in_flight=stats.occupied_slot_steps / stats.decode_steps)
    if store is not None:
        put_files(sorted(generations.glob(mine)) + sorted(generations.glob("*.settings.json")), store)
    return rate


def _log_shards(rates: list[dict]) -> None:
    """A line per shard, printed by the one process that waited for them all: Ray folds lines that differ only in
    their numbers when several workers print them (``[repeated 3x across cluster]``), which lost shards' rates."""
    for k, r in enumerate(rates):
        flight = f", {r['in_flight']:.0f} sequences at once of {r['slots']} slots" if "slots" in r else ""
        print(f"eval: shard {k + 1} of {len(rates)}: {r['tokens']} tokens generated in {r['seconds']:.1f} s "
              f"({r['tokens'] / max(r['seconds'], 1e-9):.0f} tok/s{flight})", flush=True)


def generate_all(recipe: Recipe, out_dir: Path, checkpoint: str | Path, workers: int = 1,
                 num_gpus_per_worker: float = 0) -> None:
    """Every benchmark's generations of ``checkpoint`` (a local path or a stored URI) in ``out_dir``: here, or
    sharded over ``workers`` Ray workers (:mod:`pipeline.placement`) of ``num_gpus_per_worker`` GPUs each."""
    out_dir = Path(out_dir)
    if workers <= 1:
        _log_shards([generate_shard(recipe, str(checkpoint), str(out_dir), (0, 1))])
        return
    task = ray.remote(num_cpus=1, num_gpus=num_gpus_per_worker)(generate_shard)
    _log_shards(ray.get([task.remote(recipe, str(checkpoint), str(out_dir), (k, workers)) for k in range(workers)]))
    store = _shard_store(recipe, workers, model_id(str(checkpoint)))
    if store is not None:  # every worker's shards, wherever it ran
        get_files(store, out_dir / "generations")


def scored_summary(out_dir: Path) -> dict:
    """The summary ``out_dir``'s evaluation wrote once every generation was scored; {} without one (or half a file
    from before atomic writes)."""
    try:
        return json.loads((Path(out_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def generated_already(out_dir: Path, location: str, benchmarks=()) -> bool:
    """Whether ``out_dir`` holds every generation of this very model on each of ``benchmarks``: its summary names
    the model (its location's identity, fingerprint included) and covers them. A re-run then scores them again (CPU
    only, so a grader's fix applies) without loading the model or starting an engine. Changed evaluation settings
    moved the folder aside before this is asked (:func:`pipeline.run.prepare_stage`); another model, or the same
    path retrained, has another identity; a benchmark added to ``eval.benchmarks`` is generated beside the ones
    done (each benchmark's generations are a file of their own, resumed where they stopped)."""
    summary = scored_summary(out_dir)
    covered = set(benchmarks) <= set(summary.get("benchmarks", {}))
    return covered and same_model(summary.get("model"), model_id(location))


def score_all(recipe: Recipe, out_dir: Path) -> dict:
    """Scores the generations in ``out_dir`` and writes its summary and reports: CPU only, so that a run can score
    one model while the GPU generates for the next."""
    summary = score(out_dir, recipe.eval.benchmarks, recipe.eval.repeats, sampling_of(recipe), recipe.eval.limit,
                    instruction=recipe.prompt_instruction)
    logger.info("eval: wrote %s", Path(out_dir) / "results.md")
    return summary


class _Generator:
    """The eval stage's generation, one model after another in one process: a Ray task a model (a GPU task's
    worker exits after one call) paid the process, imports, CUDA context and kernels' first launches again for
    every model. Each model's memory is given back before the next is loaded."""

    def __init__(self):
        task_setup()
        self.served = 0

    def generate(self, recipe: Recipe, out_dir: str, checkpoint: str, workers: int,
                 eval_gpus: float) -> tuple[str, int]:
        """Generations of one model; returns the node that holds them (where they are scored) and how many models
        this process has generated for, this one included."""
        import gc

        import torch

        generate_all(recipe, Path(out_dir), checkpoint, workers, eval_gpus if workers > 1 else 0)
        gc.collect()  # the engine's cycles (its CUDA graphs and state pools) before the cache is emptied
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.served += 1
        return ray.get_runtime_context().get_node_id(), self.served


def _score_task(recipe: Recipe, out_dir: str) -> dict:
    task_setup()
    return score_all(recipe, Path(out_dir))


def eval_dir(stage_dir: Path, name: str) -> Path:
    """Where the evaluation stage writes the evaluation of ``eval.models`` entry ``name``: the last model's in the
    stage's folder, each other model's in a folder of its name."""
    return stage_dir if name == "last" else stage_dir / name


def _scores(benchmarks: dict) -> str:
    """``gsm8k avg@4 12.3%; ...`` from an evaluation's ``summary.json`` benchmarks."""
    return "; ".join(f"{name} avg@{m['repeats']} {100 * m['avg@' + str(m['repeats'])]:.1f}%"
                     for name, m in benchmarks.items())


class EvalStage(Stage):
    """Every model ``eval.models`` names, generated one after another in one worker process (sharded over the
    plan's workers), each scored on the CPU while the next generates."""

    name = "eval"

    def preflight(self, recipe: Recipe) -> None:
        """Evaluation files that exist and vLLM where the engine backend names it."""
        from eval.benchmarks import BENCHMARKS

        if recipe.eval.backend == "engine":
            check_engine_installed("eval", recipe.eval.engine)
        from eval.benchmarks import load_problems

        stems = {}
        for name in recipe.eval.benchmarks:
            local = name if name in BENCHMARKS else check_source(
                "eval.benchmarks", name, f" and no registered benchmark ({sorted(BENCHMARKS)})")
            if local is not None:  # a bad file is named now, not after training
                try:
                    load_problems(str(local))
                except ValueError as error:
                    raise RecipeError(f"eval.benchmarks: {error}") from None
            stem = Path(name).stem  # generations are filed by it
            if stem in stems:
                raise RecipeError(f"eval.benchmarks: {stems[stem]!r} and {name!r} share the name {stem!r}, under which "
                                  "their generations would be filed; rename one file")
            stems[stem] = name

    def scored(self, recipe: Recipe, stage_dir: Path) -> bool:
        """Whether every model of ``eval.models`` has its summary, covering every benchmark of ``eval.benchmarks``
        (the stage is done)."""
        return all(set(recipe.eval.benchmarks) <= set(scored_summary(eval_dir(stage_dir, name)).get("benchmarks", {}))
                   for name in recipe.eval.models)

    def run(self, recipe: Recipe, stage_dir: Path, start: str | None, plan) -> str | None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        out = stage_dir.parent
        generator = ray.remote(**(plan.whole if plan.eval_workers <= 1 else {"num_cpus": 1}))(_Generator)
        one_model_each = recipe.eval.backend == "engine" and recipe.eval.engine.backend == "vllm"  # an engine a process
        score = ray.remote(num_cpus=1)(_score_task)
        scoring, worker = [], None  # each model is scored (CPU) while the GPU generates for the next
        try:
            for name in recipe.eval.models:
                model = (start or initial_checkpoint(recipe, out)) if name == "last" else stage_model(recipe, out, name)
                model_dir = str(eval_dir(stage_dir, name))
                location = str(stored(recipe, model, "eval"))
                # a re-run: scored again, nothing generated
                if generated_already(Path(model_dir), location, recipe.eval.benchmarks):
                    logger.info("eval: %s: every generation of this model is in %s, scoring them again", name,
                                model_dir)
                    node = ray.get_runtime_context().get_node_id()  # where this driver read them
                else:
                    began = time.time()
                    if worker is None or one_model_each:
                        if worker is not None:
                            ray.kill(worker)
                        worker = generator.remote()
                    node, served = ray.get(worker.generate.remote(recipe, model_dir, location, plan.eval_workers,
                                                                  plan.eval_gpus))
                    logger.info("eval: %s: generations in %.0f s (loading and engine included; the worker's model "
                                "%d)", name, time.time() - began, served)
                on_node = NodeAffinitySchedulingStrategy(node, soft=False)  # the output folder is that node's
                scoring.append(score.options(scheduling_strategy=on_node).remote(recipe, model_dir))
        finally:
            if worker is not None:
                ray.kill(worker)
        ray.get(scoring)
        return start

    def highlight(self, recipe: Recipe, stage_dir: Path) -> str:
        parts = []
        for name in recipe.eval.models:  # the last model's scores, then those of the other models scored
            summary_file = eval_dir(stage_dir, name) / "summary.json"
            if summary_file.exists():
                text = _scores(json.loads(summary_file.read_text())["benchmarks"])
                parts.append(text if name == "last" else f"{name}: {text}")
        return " / ".join(parts)
