"""The SSE-aware rollout engine: continuous batching over state slots, prefix forking, seeded sampling.

The engine's names load on first use (PEP 562): a recipe reads :mod:`.options` alone, and a Ray worker that
unpickles one does not pay for the engine's torch, Triton and kernels."""

from importlib import import_module

from .options import ENGINE_BACKENDS

_WHERE = {"CompletionOutput": ".engine", "Engine": ".engine", "RequestOutput": ".engine",
          "SamplingParams": ".sampling", "sample": ".sampling"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_engine(model, tokenizer=None, backend: str = "sse", **options):
    """The rollout engine a recipe's ``engine.backend`` names: ``sse`` (this package's :class:`Engine`) or ``vllm``
    (:class:`~pipeline.rollout.vllm.engine.VllmEngine`, which serves a checkpoint folder)."""
    if backend == "vllm":
        from .vllm.engine import VllmEngine

        return VllmEngine(model, tokenizer, **options)
    if backend != "sse":
        raise ValueError(f"engine.backend: {backend!r}; expected one of {ENGINE_BACKENDS}")
    from .engine import Engine

    return Engine(model, tokenizer, **options)


__all__ = ["CompletionOutput", "ENGINE_BACKENDS", "Engine", "RequestOutput", "SamplingParams", "create_engine",
           "sample"]
