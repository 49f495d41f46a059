"""How a rollout engine holds and schedules its sequences: one set of options and their defaults, which the
engine takes and the recipe's ``engine`` sections extend (:class:`pipeline.recipe.EngineConfig`). Each field's
``rules`` are the values it accepts, checked when a recipe loads."""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINE_BACKENDS = ("sse", "vllm")  # this package's rollout engine, or vLLM serving the model through our plugin
# the softmax layers' KV cache: in the engine's dtype ("auto"), or float8 e4m3 ("fp8": half the bytes a decode step
# reads, as vLLM's kv_cache_dtype=fp8 with unit scales, values clamped to e4m3's range)
KV_CACHE_DTYPES = ("auto", "fp8")
# the SSE and linear layers' recurrent states: float32, or bfloat16 (half the bytes a slot holds and a decode step reads
# and writes, rounded at every step; vLLM's mamba_ssm_cache_dtype)
STATE_CACHE_DTYPES = ("float32", "bfloat16")


def _rules(default, **rules):
    return field(default=default, metadata={"rules": rules})


@dataclass
class EngineOptions:
    max_slots: int | None = _rules(None, ge=1)  # sequences at once; None: as many as the memory holds (<= 256)
    memory_budget_gb: float | None = _rules(None, gt=0)  # None: 90% of the GPU memory free when it starts or wakes
    prefill_chunk_size: int = _rules(2048, ge=1)  # prompt tokens prefilled per engine step
    block_size: int = _rules(256, ge=1)  # tokens per KV block of the full-attention layers
    kv_cache_dtype: str = _rules("auto", choices=KV_CACHE_DTYPES)
    state_cache_dtype: str = _rules("float32", choices=STATE_CACHE_DTYPES)
    use_cuda_graphs: bool | None = None  # None: on CUDA
    overlap: bool | None = None  # queue each decode step before the host reads the last one's tokens; None: on CUDA
    # while sequences run, admit waiting requests once this fraction of the slots is free, to prefill them together:
    # a small model's prefill forward costs its launches; 0 admits at once (long generations of a large model leave
    # up to about half this fraction of the slots idle while requests wait)
    refill_fraction: float = _rules(0.25, ge=0, le=1)


DEFAULTS = EngineOptions()
