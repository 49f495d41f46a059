"""Stage 3, eval: the benchmark harness (``eval/``), generation sharded over Ray workers, then scoring."""

from __future__ import annotations

import logging
from pathlib import Path

import ray

from eval.generation import HFGenerateBackend, SamplingConfig
from eval.runner import generate, model_identity, score

from ..models import engine_options, load_model, resolve_device
from ..recipe import Recipe

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


def generate_shard(recipe: Recipe, checkpoint: str, out_dir: str, shard: tuple[int, int]) -> None:
    """Generation for one shard of every benchmark, with the rollout engine or ``model.generate``."""
    cfg = recipe.eval
    device = resolve_device(recipe.device)
    model, tokenizer = load_model(recipe.model, checkpoint)
    model = model.to(device).eval()
    if cfg.backend == "engine":
        from ..rollout import Engine
        from ..rollout.backend import EngineBackend

        options = engine_options(recipe, cfg.engine, cfg.max_prompt_length + cfg.max_new_tokens)
        engine = Engine(model, tokenizer, **options)
        backend = EngineBackend(engine)
    else:
        backend = HFGenerateBackend(model, tokenizer)
    generate(model, tokenizer, cfg.benchmarks, cfg.repeats, sampling_of(recipe), out_dir, backend, cfg.limit,
             instruction=recipe.prompt_instruction, shard=shard, model_id=model_identity(checkpoint),
             max_prompt_tokens=cfg.max_prompt_length, long_prompts=cfg.long_prompts, progress=_progress())


def run_eval(recipe: Recipe, out_dir: Path, checkpoint: Path, num_gpus_per_worker: float = 0) -> dict:
    out_dir = Path(out_dir)
    workers = recipe.eval.num_workers
    if workers <= 1:
        generate_shard(recipe, str(checkpoint), str(out_dir), (0, 1))
    else:
        task = ray.remote(num_cpus=1, num_gpus=num_gpus_per_worker)(generate_shard)
        ray.get([task.remote(recipe, str(checkpoint), str(out_dir), (k, workers)) for k in range(workers)])
    summary = score(out_dir, recipe.eval.benchmarks, recipe.eval.repeats, sampling_of(recipe), recipe.eval.limit,
                    instruction=recipe.prompt_instruction)
    logger.info("eval: wrote %s", out_dir / "results.md")
    return summary
