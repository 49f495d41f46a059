"""Stage 3, eval: the benchmark harness (``eval/``), generation sharded over Ray workers, then scoring."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import ray

from eval.generation import HFGenerateBackend, SamplingConfig
from eval.runner import generate, model_identity, score

from ..models import engine_options, load_model, resolve_device
from ..recipe import Recipe
from ..storage import get_files, identity, is_stored, materialize, put_files

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


def model_id(location: str) -> str:
    """What a model location names, the same on every node: a stored model's URI and upload, else the checkpoint's
    fingerprint. Evaluations record it as the model they scored, training stages as the model they started from."""
    return identity(location) if is_stored(location) else model_identity(str(materialize(location)))


def _shard_store(recipe: Recipe, workers: int, scored: str) -> str | None:
    """Where sharded generations meet when the recipe has a storage location (workers on other nodes): per model
    evaluated, so that an evaluation of another model never takes these."""
    if recipe.storage is None or workers <= 1:
        return None
    return recipe.stored_at("eval", "generations", hashlib.sha1(scored.encode()).hexdigest()[:12])


def generate_shard(recipe: Recipe, location: str, out_dir: str, shard: tuple[int, int]) -> None:
    """Generation for one shard of every benchmark, with the rollout engine or ``model.generate``. ``location``:
    the checkpoint, a local path or a stored URI (fetched on this node). With storage, the shard's generations
    are fetched before (resuming) and stored after, so workers on any node need no common output folder."""
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
    # what a model costs before its first token (the per-model overhead of evaluating several), in the run's log
    print(f"eval: {checkpoint}: loaded in {loaded - started:.1f} s, engine ready in {time.perf_counter() - loaded:.1f} s",
          flush=True)
    generate(model, tokenizer, cfg.benchmarks, cfg.repeats, sampling_of(recipe), out_dir, backend, cfg.limit,
             instruction=recipe.prompt_instruction, shard=shard, model_id=scored,
             max_prompt_tokens=cfg.max_prompt_length, long_prompts=cfg.long_prompts, progress=_progress())
    if store is not None:
        put_files(sorted(generations.glob(mine)) + sorted(generations.glob("*.settings.json")), store)


def generate_all(recipe: Recipe, out_dir: Path, checkpoint: str | Path, workers: int = 1,
                 num_gpus_per_worker: float = 0) -> None:
    """Every benchmark's generations of ``checkpoint`` (a local path or a stored URI) in ``out_dir``: here, or
    sharded over ``workers`` Ray workers (:mod:`pipeline.placement`) of ``num_gpus_per_worker`` GPUs each."""
    out_dir = Path(out_dir)
    if workers <= 1:
        generate_shard(recipe, str(checkpoint), str(out_dir), (0, 1))
        return
    task = ray.remote(num_cpus=1, num_gpus=num_gpus_per_worker)(generate_shard)
    ray.get([task.remote(recipe, str(checkpoint), str(out_dir), (k, workers)) for k in range(workers)])
    store = _shard_store(recipe, workers, model_id(str(checkpoint)))
    if store is not None:  # every worker's shards, wherever it ran
        get_files(store, out_dir / "generations")


def generated_already(out_dir: Path, location: str) -> bool:
    """Whether ``out_dir`` holds every generation of this very model: its summary, written once they were all
    scored, names the model (its location's identity, fingerprint included). A re-run then scores them again (CPU
    only, so a grader's fix applies) without loading the model or starting an engine. Changed evaluation settings
    moved the folder aside before this is asked (:func:`pipeline.run.prepare_stage`); another model, or the same
    path retrained, has another identity."""
    summary = Path(out_dir) / "summary.json"
    try:
        return json.loads(summary.read_text()).get("model") == model_id(location)
    except (OSError, ValueError):  # none yet, or half a file from before atomic writes
        return False


def score_all(recipe: Recipe, out_dir: Path) -> dict:
    """Scores the generations in ``out_dir`` and writes its summary and reports: CPU only, so that a run can score
    one model while the GPU generates for the next."""
    summary = score(out_dir, recipe.eval.benchmarks, recipe.eval.repeats, sampling_of(recipe), recipe.eval.limit,
                    instruction=recipe.prompt_instruction)
    logger.info("eval: wrote %s", Path(out_dir) / "results.md")
    return summary
