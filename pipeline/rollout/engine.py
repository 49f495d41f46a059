"""The SSE-aware rollout engine: continuous batching over a pool of state slots.

A request (prompt, :class:`SamplingParams` with ``n`` samples) waits until ``n`` slots and the KV blocks of its
prompt are free, is prefilled once in chunks into its first slot (chunks interleave with the decode steps of
running sequences), and its state is then forked into the other ``n - 1`` slots: a copy of every linear layer's
fixed-size state, while the softmax layers' full KV blocks are shared. Each decode step advances every running
sequence by one token in one forward pass over their slots; SSE layers read and write only the partitions each
token selects. A finished sequence frees its slot and blocks at once and the next waiting request is admitted.

Memory: a slot holds the linear states (fixed size); full-attention KV lives in blocks of ``block_size`` tokens
taken as sequences grow (:class:`~pipeline.rollout.cache.SlotCache`), so short sequences leave room for more. When a
decode step needs blocks that are not free, the most recently started sequences are preempted: their blocks are
returned and they are later recomputed (prompt + tokens so far prefilled again) and continue exactly where they
stopped (sampling is counter-based: a token depends on the seed and its position only). On CUDA, decode steps
replay CUDA graphs captured per batch-size bucket (powers of two): attention layers read their KV blocks in place
through the block tables (:mod:`kernels.paged_attention`), so one graph serves every length (without the paged
kernel, graphs are also per KV-blocks bucket, powers of two). Without top-p / top-k, a token is sampled in one pass
over the logits (:mod:`kernels.sampling`).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.generation import end_of_sequence_ids

from . import cache as cache_module
from .cache import SlotCache, kv_dtype_of, plan_slots, state_dtype_of
from .model_runner import LaunchedStep, ModelRunner
from .options import DEFAULTS
from .request import CompletionOutput, Request, RequestOutput, Sequence
from .sampling import SamplingParams, sample
from .scheduler import Scheduler

logger = logging.getLogger(__name__)
__all__ = ["CompletionOutput", "Engine", "EngineStats", "RequestOutput"]


@dataclass
class EngineStats:
    generated_tokens: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefill_forwards: int = 0
    occupied_slot_steps: int = 0
    finished_requests: int = 0
    preemptions: int = 0

    def as_dict(self, max_slots: int) -> dict:
        busy = self.decode_seconds + self.prefill_seconds
        return {
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.prefill_tokens,
            "decode_steps": self.decode_steps,
            "decode_tokens_per_s": self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0,
            "tokens_per_s": self.generated_tokens / busy if busy else 0.0,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0,
            "prefill_forwards": self.prefill_forwards,
            "mean_slot_occupancy": self.occupied_slot_steps / (self.decode_steps * max_slots) if self.decode_steps else 0.0,
            "finished_requests": self.finished_requests,
            "preemptions": self.preemptions,
        }


def _progress_bar(requests: int):
    from tqdm.auto import tqdm

    return tqdm(total=requests, desc="generate", unit="req", dynamic_ncols=True)


def _load(path, tokenizer, dtype, device):
    """``(model, tokenizer, device)`` of a checkpoint directory: a checkpoint loads on the CPU, and is served from
    the GPU when there is one and no device was asked."""
    from transformers import AutoTokenizer

    from sse_model.checkpoint import load_pretrained

    model = load_pretrained(path, dtype or torch.float32, require_sse=True)
    device = device if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
    return model, tokenizer or AutoTokenizer.from_pretrained(path), device


class Engine:
    """``Engine(model or path, ...)``; ``generate(prompts, SamplingParams(...))`` like vLLM's ``LLM``: the loop and
    the API over a :class:`~pipeline.rollout.scheduler.Scheduler`, a :class:`~pipeline.rollout.model_runner.ModelRunner`
    and a :class:`~pipeline.rollout.cache.SlotCache`.

    ``memory_budget`` (bytes; default: 90% of the GPU memory free when the engine starts, and again at each wake
    after :meth:`sleep`) holds ``max_slots`` slots and KV blocks of ``block_size`` tokens
    (:func:`~pipeline.rollout.cache.plan_slots`; ``num_blocks`` overrides the blocks). ``prefill_chunk_size``:
    prompt tokens prefilled per engine step. ``overlap`` (default: on CUDA) queues each decode step before the host
    has read the previous one's tokens (``_decode``); outputs are the same either way. ``residual_dtype`` (float32)
    keeps the skip connections wider than bf16 weights, as training does (:attr:`SSEModel.residual_dtype`);
    ``kv_cache_dtype="fp8"`` the softmax layers' keys and values in float8 (:func:`.cache.kv_dtype_of`),
    ``state_cache_dtype="bfloat16"`` the recurrent states in bf16; ``refill_fraction``: the scheduler's policy."""

    def __init__(self, model, tokenizer=None, *, max_slots: int | None = None, max_model_len: int = 4096,
                 memory_budget: int | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, prefill_chunk_size: int = DEFAULTS.prefill_chunk_size,
                 block_size: int = DEFAULTS.block_size, num_blocks: int | None = None, use_cuda_graphs=None,
                 overlap=None, residual_dtype=None, refill_fraction: float = DEFAULTS.refill_fraction, seed: int = 0,
                 kv_cache_dtype: str = DEFAULTS.kv_cache_dtype, state_cache_dtype: str = DEFAULTS.state_cache_dtype):
        if isinstance(model, (str, Path)):
            model, tokenizer, device = _load(model, tokenizer, dtype, device)
        device = torch.device(device) if device is not None else next(model.parameters()).device
        self.runner = ModelRunner(model, device, dtype, residual_dtype, use_cuda_graphs)
        self.scheduler = Scheduler(refill_fraction)
        self.tokenizer, self.config, self.device = tokenizer, model.config, device
        self.dtype, self.kv_dtype = self.runner.dtype, kv_dtype_of(kv_cache_dtype, self.runner.dtype)
        self.state_dtype = state_dtype_of(state_cache_dtype)
        self.max_model_len, self.prefill_chunk_size, self.block_size = max_model_len, prefill_chunk_size, block_size
        self.per_slot_bytes = SlotCache.bytes_per_slot(self.config, max_model_len, self.dtype, self.state_dtype,
                                                       self.kv_dtype)
        self._asked = (memory_budget, max_slots, num_blocks)
        self.cache: SlotCache | None = None
        self._plan()
        self.wake_up()
        self.stats = EngineStats()
        self.weights_version, self._next_id, self._rng = 0, 0, random.Random(seed)
        self.eos_ids = end_of_sequence_ids(model, tokenizer)
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self._launched: LaunchedStep | None = None  # the next decode step, queued before the host read this one
        self._joined = False  # sequences joined the running ones since the last step launched over all of them

    @property
    def model(self):
        return self.runner.model

    def _plan(self) -> None:
        """Sizes the slots and KV blocks (:func:`~pipeline.rollout.cache.plan_slots`); without a ``memory_budget``,
        from 90% of the memory free now: a colocated engine plans at each wake from what the trainer leaves."""
        memory_budget, max_slots, num_blocks = self._asked
        self.memory_budget = memory_budget if memory_budget is not None else \
            cache_module.default_memory_budget(self.device)
        self.max_slots, self.num_blocks = plan_slots(self.config, self.memory_budget, self.max_model_len,
                                                     self.block_size, self.dtype, max_slots, num_blocks,
                                                     self.kv_dtype, self.state_dtype)

    # -- requests ------------------------------------------------------------------------------------
    def capacity(self, seq_len: int | None = None) -> int:
        """How many sequences of ``seq_len`` tokens (default: max_model_len) can run at once."""
        blocks = self.scheduler.blocks_for(seq_len or self.max_model_len)
        return min(self.max_slots, self.num_blocks // blocks) if blocks else self.max_slots

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        """Queues one request; bad requests raise ``ValueError`` here and leave everything else untouched."""
        auto = request_id is None
        request_id = str(self._next_id) if auto else request_id
        request = Request.of(request_id, prompt, params, self.tokenizer, self.config.vocab_size, self.max_model_len)
        if params.n > self.max_slots:
            raise ValueError(f"n={params.n} exceeds the engine's {self.max_slots} slots")
        need = self.scheduler.blocks_to_admit(len(request.prompt_ids), params.n)
        if need > self.num_blocks:
            raise ValueError(f"the prompt ({len(request.prompt_ids)} tokens, n={params.n}) needs {need} KV blocks "
                             f"of {self.block_size} tokens; the engine has {self.num_blocks} (raise memory_budget or "
                             "lower n)")
        self._next_id += auto
        self.scheduler.waiting.append(request)
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Frees the state pools and CUDA graphs (e.g. while a colocated trainer updates the weights)."""
        if self.has_unfinished():
            raise RuntimeError("sleep while requests are in flight")
        self.runner.use(None)
        self.cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.cache is None:
            if self._asked[0] is None and self.scheduler.cache is not None:  # the default budget follows the
                self._plan()  # memory free now (the first plan is the constructor's)
            self.cache = SlotCache(self.config, self.max_slots + 1, self.max_model_len, self.device, self.dtype,
                                   self.state_dtype, self.num_blocks, self.block_size, kv_dtype=self.kv_dtype)
            self.runner.use(self.cache)
            self.scheduler.use(self.cache, self.max_slots, self.num_blocks, self.block_size)

    def warm_up(self, sequences: int | None = None) -> int:
        """A one-token request per batch bucket up to ``sequences`` at once (default: every slot), to its first
        decode step (vLLM's dummy batches): graphs captured before any timed request, each after a prefill (one
        captured before its cache's first prefill decoded differently). Counts, ids, seeds stay. Returns the graphs."""
        if self.has_unfinished():
            raise RuntimeError("warm_up while requests are in flight: before the first request")
        captured, stats, next_id = self.runner.num_graphs, copy.copy(self.stats), self._next_id
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, seed=0)
        for size in self.runner.graph_buckets(min(sequences or self.max_slots, self.max_slots)):
            self.generate([[0]] * size, params)
        self.stats, self._next_id = stats, next_id
        return self.runner.num_graphs - captured

    def step(self) -> list[RequestOutput]:
        """One decode step for running sequences, then admission and one prefill forward (up to
        ``prefill_chunk_size`` prompt tokens). Returns the requests that finished."""
        self.wake_up()
        finished: list[RequestOutput] = []
        if self.scheduler.running:
            finished += self._decode()
        self.scheduler.admit()
        stuck = None if finished else self.scheduler.stuck()
        if stuck:
            raise RuntimeError(stuck)
        if self.scheduler.prefilling:
            finished += self._prefill()
        return finished

    def _prefill(self) -> list[RequestOutput]:
        """One prefill forward: the new requests at the head of the queue whose whole prompts fit
        ``prefill_chunk_size`` tokens together, packed in one row, or else the next chunk of the first job (a long
        prompt, a preempted sequence, a lone new prompt, or any prompt where the cache takes no packed prefill).
        Returns the requests that finished."""
        start = time.perf_counter()
        queue = self.scheduler.prefilling
        pack = self.scheduler.packable(self.prefill_chunk_size)
        finished = []
        if len(pack) > 1:
            logits = self.runner.prefill_packed([r.prompt_ids for r in pack], [r.slots[0] for r in pack])
            for _ in pack:
                queue.popleft()
            self.stats.prefill_tokens += sum(len(r.prompt_ids) for r in pack)
            finished = self._start(pack, logits)
        else:
            job = queue[0]
            resumed = isinstance(job, Sequence)
            tokens, slot = (job.cached, job.slot) if resumed else (job.prompt_ids, job.slots[0])
            chunk = tokens[job.prefilled:job.prefilled + self.prefill_chunk_size]
            logits = self.runner.prefill(chunk, slot, self.scheduler.blocks_for(job.prefilled + len(chunk)))
            job.prefilled += len(chunk)
            self.stats.prefill_tokens += len(chunk)
            if job.prefilled == len(tokens):
                queue.popleft()
                if resumed:  # it continues from its last sampled token at the next decode step
                    self.scheduler.running.append(job)
                    self._joined = True
                else:
                    finished = self._start([job], logits)
        self.stats.prefill_forwards += 1
        self.stats.prefill_seconds += time.perf_counter() - start
        return finished

    def _start(self, requests: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        """Requests whose prompts are prefilled: each forks its first slot into its others and draws its samples'
        first tokens from its row of ``logits [len(requests), vocab]``, in one sampler call."""
        seqs = []
        for request in requests:
            self.scheduler.started(request)
            if len(request.slots) > 1:
                self.cache.fork(request.slots[0], torch.tensor(request.slots[1:], device=self.device))
            base = request.params.seed if request.params.seed is not None else self._rng.getrandbits(62)
            request.seqs = [Sequence(request, i, slot, base + i, stamp=request.stamp)
                            for i, slot in enumerate(request.slots)]
            seqs += request.seqs
        _, _, sampling = self.runner.step_inputs(seqs, [0] * len(seqs), [s.slot for s in seqs])
        rows = torch.tensor([i for i, r in enumerate(requests) for _ in r.slots], device=self.device)
        tokens, logprobs = sample(logits[rows], **sampling)
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            self._append(seq, token, logprob)
        self.scheduler.running += [s for s in seqs if s.finish_reason is None]
        self._joined = True
        return self._collect(seqs)

    def _decode(self) -> list[RequestOutput]:
        """One decode step of the running sequences. With ``overlap``, while no sequence is about to join them
        (nothing to prefill, no admission due, none joined since the last step), the next step is queued from this
        step's tokens still on the GPU before the host reads them: the host's bookkeeping (stop checks, the next
        inputs) then runs while the GPU computes, not between steps. A row whose sequence turns out to have stopped
        (a stop token) is computed once more and dropped."""
        start = time.perf_counter()
        step = self._launched or self._launch()
        self._launched = None
        if step is None:
            return []
        s = self.scheduler
        if self.overlap and not (self._joined or s.resuming or s.prefilling or s.refill_due()):
            self._launched = self._launch_after(step)
        done = self._land(step)
        if self._launched is not None and all(q.finish_reason is not None for q in self._launched.seqs):
            self._launched = None  # every row stopped: nothing to read
        self.stats.decode_seconds += time.perf_counter() - start
        return done

    def _launch(self) -> LaunchedStep | None:
        """Queues a decode step of every running sequence from its last token (preempting where blocks lack)."""
        self.scheduler.grow_running()
        self._joined = False
        return self.runner.launch(list(self.scheduler.running)) if self.scheduler.running else None

    def _launch_after(self, step: LaunchedStep) -> LaunchedStep | None:
        """Queues the step after ``step`` (not yet read) for its rows that surely continue: not stopped so far,
        room for two more tokens (``max_tokens``, ``max_model_len``) and the KV blocks for them free. None when no
        row qualifies or blocks lack (the next step then runs unqueued)."""
        rows = [i for i, s in enumerate(step.seqs) if s.finish_reason is None and
                len(s.token_ids) + 2 <= s.request.params.max_tokens and s.cached_length + 2 < self.max_model_len]
        if not rows or not self.scheduler.grow_ahead([step.seqs[i] for i in rows]):
            return None
        return self.runner.launch_after(step, rows)

    def _land(self, step: LaunchedStep) -> list[RequestOutput]:
        """Reads a queued step's tokens (waiting for the GPU) into its sequences; rows of sequences that stopped
        since it was queued are dropped."""
        tokens, logprobs = step.read()
        for seq, token, logprob in zip(step.seqs, tokens, logprobs):
            if seq.finish_reason is None:
                self._append(seq, token, logprob)
        self.stats.decode_steps += 1
        self.stats.occupied_slot_steps += len(step.seqs)
        self.scheduler.running = [s for s in self.scheduler.running if s.finish_reason is None]
        return self._collect(step.seqs)

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        seq.append(token, logprob, self.eos_ids, self.max_model_len, self.tokenizer)
        self.stats.generated_tokens += 1

    def _collect(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Frees the slots of finished sequences; returns the requests whose samples are all done."""
        done, seen = [], set()
        for seq in seqs:
            if seq.finish_reason is not None and seq.slot >= 0:
                self.scheduler.release(seq.slot)
                seq.slot = -1
                request = seq.request
                if request.id not in seen and request.finished:
                    seen.add(request.id)
                    done.append(request.output(self.tokenizer))
        self.stats.finished_requests += len(done)
        return done

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generates for every prompt (text or token ids); returns outputs in the order of ``prompts``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        if not self.has_unfinished():
            self.wake_up()  # a sleeping engine plans its memory before the requests are checked against it
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        start, tokens0 = time.perf_counter(), self.stats.generated_tokens
        while len(results) < len(ids):
            for out in self.step():
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
                    rate = (self.stats.generated_tokens - tokens0) / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix(tok_s=f"{rate:.0f}", running=len(self.scheduler.running))
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def update_weights(self, weights, version: int | None = None, in_flight: bool = False) -> None:
        """Loads new weights in place, between steps: a state dict, a checkpoint directory, or ``(name, tensor)``
        pairs as they arrive (:func:`pipeline.rollout.weight_sync.receive`). ``version`` sets the weights' version
        (a replacement joins its fleet at the fleet's). Refused while requests run unless ``in_flight``: they then
        continue under the new weights from the states and KV they hold (partial rollouts)."""
        if self.has_unfinished() and not in_flight:
            raise RuntimeError("update_weights while requests are in flight: between batches, or in_flight=True")
        if isinstance(weights, (str, Path)):
            from sse_model.checkpoint import load_pretrained

            weights = load_pretrained(weights, require_sse=True).state_dict()
        self.runner.load_weights(weights)
        self.weights_version = self.weights_version + 1 if version is None else version

    def get_stats(self) -> dict:
        self.stats.preemptions = self.scheduler.preemptions
        s = self.scheduler
        stats = self.stats.as_dict(self.max_slots)
        stats.update(device=str(self.device), dtype=str(self.dtype).removeprefix("torch."), max_slots=self.max_slots,
                     per_slot_bytes=self.per_slot_bytes, weights_version=self.weights_version,
                     running=len(s.running), waiting=len(s.waiting) + len(s.prefilling) + len(s.resuming),
                     block_size=self.block_size, num_blocks=self.num_blocks,
                     free_blocks=self.cache.blocks.num_free if self.cache is not None else self.num_blocks)
        return stats
