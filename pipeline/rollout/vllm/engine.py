"""vLLM behind the rollout engine's interface: a recipe's ``engine.backend: vllm``.

:class:`VllmEngine` has the methods GRPO's fleet and evaluation call on :class:`~pipeline.rollout.engine.Engine`
(``add_request``/``step``/``has_unfinished``, ``generate``, ``sleep``/``wake_up``, ``update_weights``,
``capacity``, ``get_stats``) over ``vllm.LLM``, which serves the checkpoint through this package's plugin
(:mod:`pipeline.rollout.vllm.plugin`). vLLM runs in the calling process and samples with its own sampler; each
token's log-probability is taken under the distribution sampled (vLLM's ``processed_logprobs``: after temperature
and top-p / top-k, renormalised over what they keep), as the engine's.
"""

from __future__ import annotations

from pathlib import Path

import os

import torch

from ..engine import CompletionOutput, RequestOutput
from ..options import DEFAULTS
from ..sampling import SamplingParams


def vllm_environment() -> None:
    """vLLM's settings for a site packed here (callers' own settings win): the FlashInfer sampler JIT-compiles
    from sources the pack drops, and vLLM's engine core never came up as a separate process on the GPU
    machine (sandboxed), while in the calling process it does."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # prompt + 32k new tokens past a 32k preset


def import_vllm():
    """vLLM, or an ``ImportError`` that says which recipe key asked for it and how to get it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "engine.backend: vllm needs vLLM 0.25.1, which is not importable here "
            f"({error}); pip install 'sse-pipeline[vllm]', or bring it to a machine without a package index "
            "with python -m scripts.vllm_site from a checkout; engine.backend: sse is this package's engine"
        ) from error
    return vllm


def to_vllm_kwargs(params: SamplingParams) -> dict:
    """Our sampling parameters in vLLM's names (``vllm.SamplingParams(**kwargs)``)."""
    params.validate()
    return dict(n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
                max_tokens=params.max_tokens, stop=params.stop_strings or None, stop_token_ids=params.stop_token_ids,
                ignore_eos=params.ignore_eos, seed=params.seed, logprobs=0 if params.logprobs else None,
                include_stop_str_in_output=params.include_stop_str_in_output)


def from_vllm_output(out) -> RequestOutput:
    """A finished vLLM ``RequestOutput`` as ours: each sample's tokens and the log-probability of each."""
    completions = []
    for c in out.outputs:
        logprobs = None if c.logprobs is None else [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
        completions.append(CompletionOutput(c.index, c.text or "", list(c.token_ids), logprobs, c.finish_reason,
                                            c.stop_reason))
    return RequestOutput(str(out.request_id), out.prompt, list(out.prompt_token_ids), completions)


class WeightLoader:
    """vLLM worker extension (``worker_extension_cls``): new weights into the served model, by our names."""

    def load_named_weights(self, weights) -> int:
        return len(self.get_model().load_weights(weights))


class VllmEngine:
    """``VllmEngine(checkpoint, tokenizer, **engine_options)``: the options of :func:`pipeline.models.engine_options`
    (``max_slots`` -> vLLM's ``max_num_seqs``; ``memory_budget`` -> its KV/state cache bytes, by default 90% of the
    memory free when it starts, as the engine; ``prefill_chunk_size`` -> tokens per step; ``use_cuda_graphs=False``
    -> eager; otherwise decode batches of up to ``max_slots`` replay CUDA graphs). ``block_size`` is vLLM's to
    choose for SSE models (a state row must fit a KV page)."""

    def __init__(self, model, tokenizer=None, *, max_slots: int | None = None, memory_budget: int | None = None,
                 max_model_len: int = 4096, prefill_chunk_size: int = DEFAULTS.prefill_chunk_size,
                 block_size: int | None = None, use_cuda_graphs: bool | None = None, dtype=None, seed: int = 0,
                 kv_cache_dtype: str = "auto", **_):
        if not isinstance(model, (str, Path)):
            raise TypeError("engine.backend: vllm serves a checkpoint folder; got a model object")
        import_vllm()
        from .plugin import register

        vllm_environment()
        register()
        from vllm import LLM

        free, total = torch.cuda.mem_get_info()  # as the engine: 90% of what is free now (a trainer may share)
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.max_slots = max_slots or 256
        has_tokenizer = any(Path(model, f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        self.llm = LLM(model=str(model), skip_tokenizer_init=not has_tokenizer, seed=seed,
                       dtype=str(dtype).removeprefix("torch.") if dtype is not None else "auto",
                       max_model_len=max_model_len, max_num_seqs=self.max_slots,
                       max_num_batched_tokens=max(prefill_chunk_size, self.max_slots),
                       enforce_eager=use_cuda_graphs is False, enable_prefix_caching=False, enable_sleep_mode=True,
                       # decode graphs for every batch up to max_slots (vLLM's default stops at 512: larger decode
                       # batches ran eager; our model has no torch.compile form, so only whole-step graphs exist)
                       compilation_config={"max_cudagraph_capture_size": self.max_slots},
                       logprobs_mode="processed_logprobs", gpu_memory_utilization=0.9 * free / total,
                       kv_cache_memory_bytes=memory_budget, kv_cache_dtype=kv_cache_dtype,
                       worker_extension_cls=f"{__name__}.WeightLoader")
        self.weights_version, self._next_id, self._asleep = 0, 0, False
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        self.wake_up()
        if request_id is None:
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        inputs = prompt if isinstance(prompt, str) else {"prompt_token_ids": [int(t) for t in prompt]}
        # one output per request, with all n samples, once the last finishes: vLLM gathers a request's samples
        # only in this mode (LLM.generate sets it too); by default each sample came out alone
        params = VllmParams(**to_vllm_kwargs(params), output_kind=RequestOutputKind.FINAL_ONLY)
        self.llm.llm_engine.add_request(request_id, inputs, params)
        return request_id

    def has_unfinished(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return [from_vllm_output(out) for out in self.llm.llm_engine.step() if out.finished]

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of ``prompts`` (text or token ids), as :meth:`Engine.generate`."""
        from vllm import SamplingParams as VllmParams

        self.wake_up()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outs = self.llm.generate(inputs, [VllmParams(**to_vllm_kwargs(p)) for p in params], use_tqdm=use_tqdm)
        return [from_vllm_output(out) for out in outs]

    # -- memory and weights --------------------------------------------------------------------------
    def sleep(self) -> None:
        """Frees the KV and state cache and moves the weights to host memory (vLLM's sleep level 1)."""
        if self.has_unfinished():
            raise RuntimeError("sleep while requests are in flight")
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def update_weights(self, weights, version: int | None = None) -> None:
        """A state dict, a checkpoint folder, or ``(name, tensor)`` pairs, as :meth:`Engine.update_weights`."""
        if self.has_unfinished():
            raise RuntimeError("update_weights while requests are in flight; call it between batches")
        if isinstance(weights, (str, Path)):
            from sse_model.checkpoint import load_pretrained

            weights = load_pretrained(weights, require_sse=True).state_dict()
        items = list(weights.items() if isinstance(weights, dict) else weights)
        self.wake_up()
        self.llm.collective_rpc("load_named_weights", args=(items,))
        self.weights_version = self.weights_version + 1 if version is None else version

    def capacity(self, seq_len: int | None = None) -> int:
        """Sequences of ``seq_len`` tokens that fit at once: vLLM's cache pages over the pages one needs (its
        attention blocks plus its state row)."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        pages = -(-(seq_len or self.max_model_len) // cache.block_size) + 1
        return max(1, min(self.max_slots, (cache.num_gpu_blocks or 0) // pages))

    def get_stats(self) -> dict:
        return dict(backend="vllm", device="cuda", dtype=self.dtype, max_slots=self.max_slots,
                    weights_version=self.weights_version, capacity=self.capacity())
