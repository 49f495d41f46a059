"""The SSE-aware rollout engine: continuous batching over state slots, prefix forking, seeded sampling."""

from .engine import CompletionOutput, Engine, RequestOutput
from .options import ENGINE_BACKENDS
from .sampling import SamplingParams, sample


def create_engine(model, tokenizer=None, backend: str = "sse", **options):
    """The rollout engine a recipe's ``engine.backend`` names: ``sse`` (this package's :class:`Engine`) or ``vllm``
    (:class:`~pipeline.rollout.vllm.engine.VllmEngine`, which serves a checkpoint folder)."""
    if backend == "vllm":
        from .vllm.engine import VllmEngine

        return VllmEngine(model, tokenizer, **options)
    if backend != "sse":
        raise ValueError(f"engine.backend: {backend!r}; expected one of {ENGINE_BACKENDS}")
    return Engine(model, tokenizer, **options)


__all__ = ["CompletionOutput", "Engine", "RequestOutput", "SamplingParams", "create_engine", "sample"]
