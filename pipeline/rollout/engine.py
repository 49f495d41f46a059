"""The SSE-aware rollout engine: continuous batching over a pool of state slots.

A request (prompt, :class:`SamplingParams` with ``n`` samples) waits until ``n`` slots and the KV blocks of its
prompt are free, is prefilled once in chunks into its first slot (chunks interleave with the decode steps of
running sequences), and its state is then forked into the other ``n - 1`` slots: a copy of every linear layer's
fixed-size state, while the softmax layers' full KV blocks are shared. Each decode step advances every running
sequence by one token in one forward pass over their slots; SSE layers read and write only the partitions each
token selects. A finished sequence frees its slot and blocks at once and the next waiting request is admitted.

Memory: a slot holds the linear states (fixed size); full-attention KV lives in blocks of ``block_size`` tokens
taken as sequences grow (:class:`~sse_model.cache.SlotCache`), so short sequences leave room for more. When a
decode step needs blocks that are not free, the most recently started sequences are preempted: their blocks are
returned and they are later recomputed (prompt + tokens so far prefilled again) and continue exactly where they
stopped (sampling is counter-based: a token depends on the seed and its position only). On CUDA, decode steps
replay CUDA graphs captured per batch-size bucket (powers of two): attention layers read their KV blocks in place
through the block tables (:mod:`kernels.paged_attention`), so one graph serves every length (without the paged
kernel, graphs are also per KV-blocks bucket, powers of two). Without top-p / top-k, a token is sampled in one pass
over the logits (:mod:`kernels.sampling`).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eval.generation import end_of_sequence_ids
from sse_model.cache import SlotCache

from .sampling import SamplingParams, sample

logger = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # "stop" | "length"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass(eq=False)  # identity: the queues find and remove this very sequence
class _Sequence:
    request: "_Request"
    index: int
    slot: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prefilled: int = 0  # tokens recomputed so far after a preemption
    stamp: int = 0  # admission order: the newest is preempted first

    @property
    def cached(self) -> list[int]:
        """What the slot holds before the next decode step: the prompt and every token but the last sampled."""
        return self.request.prompt_ids + self.token_ids[:-1]

    @property
    def cached_length(self) -> int:
        return len(self.request.prompt_ids) + len(self.token_ids) - 1


@dataclass(eq=False)
class _Request:
    id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    slots: list[int] = field(default_factory=list)
    prefilled: int = 0
    seqs: list[_Sequence] = field(default_factory=list)
    stamp: int = 0  # admission order
    promised: int = 0  # free blocks promised to its forks


@dataclass(eq=False)
class _Launched:
    """A decode step queued on the GPU: its rows and their sampled tokens (on the device, the next step's input),
    not yet read by the host. On CUDA the tokens and log-probabilities are also copied to pinned host memory right
    behind the sampler, and ``ready`` marks when they are there: reading them waits for this step alone, not for
    the step queued after it (a plain ``.tolist()`` would be ordered behind that one on the stream)."""

    seqs: list[_Sequence]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor] | None = None
    ready: torch.cuda.Event | None = None

    @classmethod
    def queue(cls, seqs: list[_Sequence], tokens: torch.Tensor, logprobs: torch.Tensor) -> "_Launched":
        if not tokens.is_cuda:
            return cls(seqs, tokens, logprobs)
        host = (torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True),
                torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True))
        host[0].copy_(tokens, non_blocking=True)
        host[1].copy_(logprobs, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, tokens, logprobs, host, ready)

    def read(self) -> tuple[list[int], list[float]]:
        """The sampled tokens and log-probabilities on the host (waits for this step's sampler)."""
        if self.host is None:
            return self.tokens.tolist(), self.logprobs.tolist()
        self.ready.synchronize()
        return self.host[0].tolist(), self.host[1].tolist()


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


DEFAULT_MAX_SLOTS = 256  # GRPO's 32 prompts x 8 samples in one batch


def default_memory_budget(device: torch.device) -> int:
    """90% of the free GPU memory after the weights on CUDA; 2 GiB on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return 2 * 1024**3


class Engine:
    """``Engine(model or path, ...)``; ``generate(prompts, SamplingParams(...))`` like vLLM's ``LLM``.

    ``memory_budget`` (bytes; default: 90% of the GPU memory free when the engine starts, and again at each wake
    after :meth:`sleep`) holds ``max_slots`` slots (default: up to 256, as many as the budget holds for
    sequences a quarter of ``max_model_len`` long, besides one of full length) and, in the rest, the KV blocks
    of ``block_size`` tokens.
    ``num_blocks`` overrides what the budget holds. ``prefill_chunk_size`` is the number of prompt tokens
    prefilled per engine step. ``overlap`` (default: on CUDA) queues each decode step before the host has read
    the previous one's tokens (see ``_decode``); outputs are the same either way. ``residual_dtype`` (float32)
    keeps the skip connections wider than bf16 weights, as training does (:attr:`SSEModel.residual_dtype`).
    ``refill_fraction``: while sequences run, waiting requests are admitted once that fraction of the slots is free
    (or all that waits fits), so that their prompts are prefilled together: a prefill forward of a small model
    costs ~100 ms of host time whatever its tokens (SmolLM2-135M on an H100), some thirty decode steps."""

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_slots: int | None = None,
        max_model_len: int = 4096,
        memory_budget: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        prefill_chunk_size: int = 512,
        block_size: int = 256,
        num_blocks: int | None = None,
        use_cuda_graphs: bool | None = None,
        overlap: bool | None = None,
        residual_dtype: torch.dtype | None = None,
        refill_fraction: float = 0.25,
        seed: int = 0,
    ):
        if isinstance(model, (str, Path)):
            from transformers import AutoTokenizer

            from sse_model.checkpoint import load_pretrained

            path = model
            model = load_pretrained(path, dtype or torch.float32, require_sse=True)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
            if device is None:  # a checkpoint loads on the CPU: serve it from the GPU when there is one
                device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(device=device, dtype=dtype or next(model.parameters()).dtype).eval()
        self.model.pack_projections()  # one product per group of maps that read one input (a decode step's GEMMs)
        self.model.model.residual_dtype = residual_dtype  # float32: skip connections added as the trainer adds them
        self.tokenizer = tokenizer
        self.config = model.config
        self.device, self.dtype = device, next(self.model.parameters()).dtype
        self.max_model_len = max_model_len
        self.prefill_chunk_size = prefill_chunk_size
        self.block_size = block_size
        self.per_slot_bytes = SlotCache.bytes_per_slot(self.config, max_model_len, self.dtype)
        if not 0 <= refill_fraction <= 1:
            raise ValueError(f"refill_fraction must be in [0, 1], got {refill_fraction}")
        self.refill_fraction = refill_fraction
        self._asked = (memory_budget, max_slots, num_blocks)
        self._plan()
        self.cache = self._new_cache()
        self.waiting: deque[_Request] = deque()
        self.resuming: deque[_Sequence] = deque()  # preempted sequences, recomputed before new requests start
        self.prefilling: deque[_Request | _Sequence] = deque()
        self.running: list[_Sequence] = []
        self.promised_blocks = 0  # free blocks promised to the forks of requests being prefilled
        self._admissions = 0
        self.stats = EngineStats()
        self.weights_version = 0
        self._rng = random.Random(seed)
        self._next_id = 0
        self.eos_ids = end_of_sequence_ids(model, tokenizer)
        self.use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self._launched: _Launched | None = None  # the next decode step, queued before the host read this one
        self._joined = False  # sequences joined the running ones since the last step launched over all of them
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._graph_pool = None  # one memory pool for every captured graph: the largest bucket's, not their sum

    def _plan(self) -> None:
        """Sizes the slots and KV blocks. Without a ``memory_budget`` the budget is 90% of the memory free at this
        moment, so an engine that sleeps beside a trainer plans again at each wake from what the trainer leaves
        (its weights and optimizer states, which it does not hold when the engine starts)."""
        memory_budget, max_slots, num_blocks = self._asked
        self.memory_budget = memory_budget if memory_budget is not None else default_memory_budget(self.device)
        self.max_slots, self.num_blocks = self._plan_memory(max_slots, num_blocks)
        self.scratch_slot = self.max_slots  # padding rows of graph buckets write here
        self.free_slots: deque[int] = deque(range(self.max_slots))

    def _plan_memory(self, max_slots: int | None, num_blocks: int | None) -> tuple[int, int]:
        """``(max_slots, num_blocks)`` within the memory budget (``num_blocks`` given: as given); one sequence of
        ``max_model_len`` always fits."""
        state = SlotCache.state_bytes(self.config, self.max_model_len, self.dtype)
        per_block = SlotCache.kv_bytes_per_token(self.config, self.dtype) * self.block_size
        one_sequence = per_block * -(-self.max_model_len // self.block_size)
        if max_slots is None:  # planned for sequences a quarter of max_model_len long on average
            planned = state + per_block * -(-max(self.block_size, self.max_model_len // 4) // self.block_size)
            max_slots = min(DEFAULT_MAX_SLOTS, (self.memory_budget - one_sequence) // planned)
        if num_blocks is None:
            num_blocks = (self.memory_budget - (max_slots + 1) * state) // per_block if per_block else 0
            num_blocks = min(num_blocks, max_slots * -(-self.max_model_len // self.block_size))  # more never fill
        num_blocks = num_blocks if per_block else 0
        if max_slots < 1 or num_blocks * per_block < one_sequence:
            raise ValueError(f"memory_budget {self.memory_budget} B is below one sequence of max_model_len="
                             f"{self.max_model_len} tokens ({state + one_sequence} B; max_slots={max_slots} slots "
                             f"of {state} B each)")
        return int(max_slots), int(num_blocks)

    def _new_cache(self) -> SlotCache:
        return SlotCache(self.config, self.max_slots + 1, self.max_model_len, self.device, self.dtype,
                         num_blocks=self.num_blocks, block_size=self.block_size)

    # ---------------------------------------------------------------------------------------------
    # requests
    def capacity(self, seq_len: int | None = None) -> int:
        """How many sequences of ``seq_len`` tokens (default: max_model_len) can run at once."""
        blocks = self._blocks_for(seq_len or self.max_model_len)
        return min(self.max_slots, self.num_blocks // blocks) if blocks else self.max_slots

    def _blocks_for(self, length: int) -> int:
        return -(-length // self.block_size) if self.num_blocks else 0

    def _blocks_to_admit(self, prompt_len: int, n: int) -> int:
        """The prompt's blocks plus a copy of its partly filled last block for each other sample."""
        return self._blocks_for(prompt_len) + (n - 1) * int(self.num_blocks > 0 and prompt_len % self.block_size > 0)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        """Queues one request; bad requests raise ``ValueError`` here and leave everything else untouched."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or give the engine a tokenizer")
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            text = prompt
        else:
            prompt_ids, text = [int(t) for t in prompt], None
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")
        vocab = self.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.n > self.max_slots:
            raise ValueError(f"n={params.n} exceeds the engine's {self.max_slots} slots")
        if self._blocks_to_admit(len(prompt_ids), params.n) > self.num_blocks:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens, n={params.n}) needs "
                             f"{self._blocks_to_admit(len(prompt_ids), params.n)} KV blocks of {self.block_size} "
                             f"tokens; the engine has {self.num_blocks} (raise memory_budget or lower n)")
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        self.waiting.append(_Request(request_id, text, prompt_ids, params, time.monotonic()))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.resuming or self.prefilling or self.running)

    # ---------------------------------------------------------------------------------------------
    # the loop
    def sleep(self) -> None:
        """Frees the state pools and CUDA graphs (e.g. while a colocated trainer updates the weights)."""
        if self.has_unfinished():
            raise RuntimeError("sleep while requests are in flight")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a dropped queued step may still read the cache and graphs
        self.cache = None
        self._graphs.clear()
        self._graph_pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.cache is None:
            if self._asked[0] is None:  # the default budget follows the memory free now
                self._plan()
            self.cache = self._new_cache()

    def step(self) -> list[RequestOutput]:
        """One decode step for running sequences, then admission and one prefill forward (up to
        ``prefill_chunk_size`` prompt tokens). Returns the requests that finished."""
        self.wake_up()
        finished: list[RequestOutput] = []
        if self.running:
            finished += self._decode()
        self._admit()
        if not (self.running or self.prefilling or finished) and (self.waiting or self.resuming):
            raise RuntimeError(f"the engine is idle but cannot admit what waits ({len(self.waiting)} requests, "
                               f"{len(self.resuming)} preempted sequences; {len(self.free_slots)} free slots, "
                               f"{self._free_blocks()} of {self.num_blocks} KV blocks free)")
        if self.prefilling:
            finished += self._prefill()
        return finished

    def _free_blocks(self) -> int:
        return self.cache.blocks.num_free - self.promised_blocks

    def _admit(self) -> None:
        """Preempted sequences first, then waiting requests in order, while slots and KV blocks are free (beside
        running sequences, a new request also leaves a block of room for each of its samples to grow into)."""
        while self.resuming and self.free_slots and \
                self._blocks_for(self.resuming[0].cached_length + 1) <= self._free_blocks():
            seq = self.resuming.popleft()
            seq.slot, seq.prefilled, seq.stamp = self.free_slots.popleft(), 0, self._stamp()
            self.cache.grow([seq.slot], [seq.cached_length])
            self.prefilling.append(seq)
        if self.running and not self._refill_due():
            return
        while not self.resuming and self.waiting and len(self.free_slots) >= self.waiting[0].params.n:
            request = self.waiting[0]
            prompt_len, n = len(request.prompt_ids), request.params.n
            need = self._blocks_to_admit(prompt_len, n)
            busy = bool(self.running or self.prefilling)  # an idle engine admits whatever fits
            if need + (n if self.num_blocks and busy else 0) > self._free_blocks():
                break
            self.waiting.popleft()
            request.slots = [self.free_slots.popleft() for _ in range(n)]
            request.stamp, request.prefilled = self._stamp(), 0
            self.cache.grow(request.slots[:1], [prompt_len])
            request.promised = need - self._blocks_for(prompt_len)
            self.promised_blocks += request.promised
            self.prefilling.append(request)

    def _refill_due(self) -> bool:
        """Whether waiting requests are admitted now: nothing runs, or ``refill_fraction`` of the slots (or as many
        as all waiting requests need) are free."""
        if not self.waiting:
            return False
        if not self.running:
            return True
        want, waiting = max(1, int(self.refill_fraction * self.max_slots)), 0
        for request in self.waiting:
            waiting += request.params.n
            if waiting >= want:
                break
        return len(self.free_slots) >= min(want, waiting)

    def _stamp(self) -> int:
        self._admissions += 1
        return self._admissions

    def _release(self, slot: int) -> None:
        self.cache.reset(torch.tensor([slot], device=self.device))
        self.free_slots.append(slot)

    def _preempt_newest(self) -> None:
        """Returns the slots and blocks of the most recently admitted sequence or prefill: it starts again when
        there is room. The oldest sequence is never the newest, so it always progresses."""
        job = max([*self.running, *self.prefilling], key=lambda j: j.stamp)
        if isinstance(job, _Request):
            self.prefilling.remove(job)
            for slot in job.slots:
                self._release(slot)
            job.slots = []
            self.promised_blocks -= job.promised
            self.waiting.appendleft(job)
        else:
            (self.running if job in self.running else self.prefilling).remove(job)
            self._release(job.slot)
            job.slot = -1
            self.resuming.appendleft(job)
        self.stats.preemptions += 1

    @torch.no_grad()
    def _prefill(self) -> list[RequestOutput]:
        """One prefill forward: the new requests at the head of the queue whose whole prompts fit
        ``prefill_chunk_size`` tokens together, packed in one row (:meth:`_prefill_packed`), or else the next chunk
        of the first job (a long prompt, a preempted sequence). Returns the requests that finished."""
        start = time.perf_counter()
        pack = self._packable(self.prefill_chunk_size)
        finished = self._prefill_packed(pack) if len(pack) > 1 else self._prefill_chunk()
        self.stats.prefill_forwards += 1
        self.stats.prefill_seconds += time.perf_counter() - start
        return finished

    def _prefill_chunk(self) -> list[RequestOutput]:
        """The next chunk of the first job alone: a prompt longer than the budget, a preempted sequence's tokens,
        a lone new prompt, or any prompt where the cache takes no packed prefill."""
        job = self.prefilling[0]
        resumed = isinstance(job, _Sequence)
        tokens, slot = (job.cached, job.slot) if resumed else (job.prompt_ids, job.slots[0])
        chunk = tokens[job.prefilled:job.prefilled + self.prefill_chunk_size]
        self.cache.slots = torch.tensor([slot], device=self.device)
        self.cache.view_blocks = self._blocks_for(job.prefilled + len(chunk))
        ids = torch.tensor([chunk], device=self.device)
        logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        job.prefilled += len(chunk)
        self.stats.prefill_tokens += len(chunk)
        if job.prefilled < len(tokens):
            return []
        self.prefilling.popleft()
        if resumed:  # it continues from its last sampled token at the next decode step
            self.running.append(job)
            self._joined = True
            return []
        return self._start([job], logits[:, -1])

    def _packable(self, budget: int) -> list[_Request]:
        """The new requests at the head of the prefill queue whose whole prompts fit in ``budget`` tokens
        together, when the cache takes packed prefills."""
        if not self.cache.packs_prefill:
            return []
        pack = []
        for job in self.prefilling:
            if isinstance(job, _Sequence) or job.prefilled or len(job.prompt_ids) > budget:
                break
            pack.append(job)
            budget -= len(job.prompt_ids)
        return pack

    def _prefill_packed(self, pack: list[_Request]) -> list[RequestOutput]:
        """One forward over the prompts of ``pack`` packed in one row, each into its request's first slot."""
        lengths = [len(r.prompt_ids) for r in pack]
        ids = torch.tensor([[t for r in pack for t in r.prompt_ids]], device=self.device)
        cu_seqlens = torch.tensor(list(itertools.accumulate(lengths, initial=0)), device=self.device)
        self.cache.slots = torch.tensor([r.slots[0] for r in pack], device=self.device)
        last = cu_seqlens[1:] - 1
        logits = self.model(input_ids=ids, cu_seqlens=cu_seqlens, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=last).logits[0]
        for _ in pack:
            self.prefilling.popleft()
        self.stats.prefill_tokens += sum(lengths)
        return self._start(pack, logits)

    def _start(self, requests: list[_Request], logits: torch.Tensor) -> list[RequestOutput]:
        """Requests whose prompts are prefilled: each forks its first slot into its others and draws its samples'
        first tokens from its row of ``logits [len(requests), vocab]``, in one sampler call."""
        seqs = []
        for request in requests:
            self.promised_blocks -= request.promised
            if len(request.slots) > 1:
                self.cache.fork(request.slots[0], torch.tensor(request.slots[1:], device=self.device))
            base = request.params.seed if request.params.seed is not None else self._rng.getrandbits(62)
            request.seqs = [_Sequence(request, i, slot, base + i, stamp=request.stamp)
                            for i, slot in enumerate(request.slots)]
            seqs += request.seqs
        _, _, sampling = self._step_inputs(seqs, [0] * len(seqs), [s.slot for s in seqs])
        rows = torch.tensor([i for i, r in enumerate(requests) for _ in r.slots], device=self.device)
        tokens, logprobs = sample(logits[rows], **sampling)
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            self._append(seq, token, logprob)
        self.running += [s for s in seqs if s.finish_reason is None]
        self._joined = True
        return self._collect(seqs)

    def _grow_running(self) -> None:
        """Every running sequence gets the blocks its next token needs; while they are short, the newest sequence
        or prefill is preempted."""
        while self.running:
            lengths = [s.cached_length + 1 for s in self.running]
            try:
                self.cache.grow([s.slot for s in self.running], lengths, keep_free=self.promised_blocks)
            except MemoryError:
                self._preempt_newest()
                continue
            self._view(max(lengths))
            return

    def _view(self, longest: int) -> None:
        """KV blocks the attention of a step reads per row (the gather path; the paged kernel reads lengths)."""
        self.cache.view_blocks = min(_power_of_two(self._blocks_for(longest)), self.cache.max_blocks_per_slot)

    @torch.no_grad()
    def _decode(self) -> list[RequestOutput]:
        """One decode step of the running sequences. With ``overlap``, while no sequence is about to join them
        (nothing to prefill, no admission due, none joined since the last step), the next step is queued from this
        step's tokens still on the GPU before the host reads them: the host's bookkeeping (stop checks, the next
        inputs) then runs while the GPU computes, not between steps. A row whose sequence turns out to have stopped (a stop token) is computed once more and dropped."""
        start = time.perf_counter()
        step = self._launched or self._launch()
        self._launched = None
        if step is None:
            return []
        if self.overlap and not (self._joined or self.resuming or self.prefilling or self._refill_due()):
            self._launched = self._launch_after(step)
        done = self._land(step)
        if self._launched is not None and all(s.finish_reason is not None for s in self._launched.seqs):
            self._launched = None  # every row stopped: nothing to read
        self.stats.decode_seconds += time.perf_counter() - start
        return done

    def _launch(self) -> _Launched | None:
        """Queues a decode step of every running sequence from its last token (preempting where blocks lack)."""
        self._grow_running()
        seqs = list(self.running)
        self._joined = False
        if not seqs:
            return None
        ids, slots, sampling = self._step_inputs(seqs, [s.token_ids[-1] for s in seqs], [s.slot for s in seqs])
        return _Launched.queue(seqs, *sample(self._forward_decode(ids, slots), **sampling))

    def _launch_after(self, step: _Launched) -> _Launched | None:
        """Queues the step after ``step`` (not yet read) from its tokens on the GPU, for its rows that surely
        continue: not stopped so far, room for two more tokens (``max_tokens``, ``max_model_len``) and the KV
        blocks for them free. None when no row qualifies or blocks lack (the next step then runs unqueued)."""
        rows = [i for i, s in enumerate(step.seqs) if s.finish_reason is None and
                len(s.token_ids) + 2 <= s.request.params.max_tokens and s.cached_length + 2 < self.max_model_len]
        if not rows:
            return None
        seqs = [step.seqs[i] for i in rows]
        try:
            self.cache.grow([s.slot for s in seqs], [s.cached_length + 2 for s in seqs], keep_free=self.promised_blocks)
        except MemoryError:
            return None
        self._view(max(s.cached_length + 2 for s in seqs))
        picked, slots, sampling = self._step_inputs(seqs, rows, [s.slot for s in seqs], ahead=1)
        ids = step.tokens if len(rows) == len(step.seqs) else step.tokens[picked]
        return _Launched.queue(seqs, *sample(self._forward_decode(ids, slots), **sampling))

    def _land(self, step: _Launched) -> list[RequestOutput]:
        """Reads a queued step's tokens (waiting for the GPU) into its sequences; rows of sequences that stopped
        since it was queued are dropped."""
        tokens, logprobs = step.read()
        for seq, token, logprob in zip(step.seqs, tokens, logprobs):
            if seq.finish_reason is None:
                self._append(seq, token, logprob)
        self.stats.decode_steps += 1
        self.stats.occupied_slot_steps += len(step.seqs)
        self.running = [s for s in self.running if s.finish_reason is None]
        return self._collect(step.seqs)

    def _forward_decode(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if not self.use_cuda_graphs:
            self.cache.slots = slots
            out = self.model(input_ids=ids[:, None], past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]
        return self._graph_decode(ids, slots)

    def _step_inputs(self, seqs: list[_Sequence], ids: list[int], slots: list[int], ahead: int = 0):
        """``(ids, slots, sampling)`` of the rows of a step on the device, ``sampling`` the keyword arguments of
        :func:`sample` (``ahead``: tokens sampled but not yet read): two copies (one per dtype) from pinned
        memory, which the host issues without waiting for the GPU (a copy from pageable memory would first wait
        for every kernel already queued)."""
        p = [s.request.params for s in seqs]
        steps = [len(s.token_ids) + ahead for s in seqs]
        ints = torch.tensor([ids, slots, [x.top_k for x in p], [s.seed for s in seqs], steps], dtype=torch.long)
        floats = torch.tensor([[x.temperature for x in p], [x.top_p for x in p]], dtype=torch.float32)
        if self.device.type == "cuda":
            ints, floats = ints.pin_memory(), floats.pin_memory()
        ints, floats = ints.to(self.device, non_blocking=True), floats.to(self.device, non_blocking=True)
        need_top_k = any(x.top_k > 0 for x in p)
        sampling = dict(temperature=floats[0], top_p=floats[1], top_k=ints[2], seeds=ints[3], steps=ints[4],
                        need_filter=need_top_k or any(x.top_p < 1 for x in p), need_top_k=need_top_k)
        return ints[0], ints[1], sampling

    def _append(self, seq: _Sequence, token: int, logprob: float) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        if params.logprobs:
            seq.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos_ids)
        if token in stop_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop_strings and self.tokenizer is not None:
            window = max(8, 2 * max(len(s) for s in params.stop_strings))
            tail = self.tokenizer.decode(seq.token_ids[-window:], skip_special_tokens=True)
            hit = next((s for s in params.stop_strings if s in tail), None)
            if hit is not None:
                seq.finish_reason, seq.stop_reason = "stop", hit
        if seq.finish_reason is None and (len(seq.token_ids) >= params.max_tokens or
                                          len(seq.request.prompt_ids) + len(seq.token_ids) >= self.max_model_len):
            seq.finish_reason = "length"

    def _collect(self, seqs: list[_Sequence]) -> list[RequestOutput]:
        """Frees the slots of finished sequences; returns the requests whose samples are all done."""
        done, seen = [], set()
        for seq in seqs:
            if seq.finish_reason is not None and seq.slot >= 0:
                self._release(seq.slot)
                seq.slot = -1
                request = seq.request
                if request.id not in seen and all(s.finish_reason is not None for s in request.seqs):
                    seen.add(request.id)
                    done.append(self._output(request))
        self.stats.finished_requests += len(done)
        return done

    def _output(self, request: _Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
                if isinstance(seq.stop_reason, str):
                    cut = text.find(seq.stop_reason)
                    if cut >= 0:
                        text = text[:cut + (len(seq.stop_reason) if request.params.include_stop_str_in_output else 0)]
            outputs.append(CompletionOutput(seq.index, text, seq.token_ids,
                                            seq.logprobs if request.params.logprobs else None,
                                            seq.finish_reason, seq.stop_reason))
        return RequestOutput(request.id, request.prompt, request.prompt_ids, outputs)

    # ---------------------------------------------------------------------------------------------
    # CUDA graphs: one per batch-size bucket; padding rows decode into the scratch slot
    def _graph_decode(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        B = ids.shape[0]
        # KV read in place through the block tables: one graph per batch bucket serves every length
        key = (min(_power_of_two(B), self.max_slots), 0 if self.cache.decode_in_place else self.cache.view_blocks)
        if key not in self._graphs:
            self._capture(*key)
        graph, static_ids, static_slots, static_logits = self._graphs[key]
        static_ids.fill_(0)
        static_ids[:B] = ids
        static_slots.fill_(self.scratch_slot)
        static_slots[:B] = slots
        self.cache.lengths[self.scratch_slot:self.scratch_slot + 1].zero_()  # on the device: no wait for the GPU
        graph.replay()
        return static_logits[:B]

    def _capture(self, size: int, view_blocks: int) -> None:
        static_ids = torch.zeros(size, dtype=torch.long, device=self.device)
        static_slots = torch.full((size,), self.scratch_slot, dtype=torch.long, device=self.device)
        lengths = self.cache.lengths.clone()

        def run():
            self.cache.slots = static_slots
            out = self.model(input_ids=static_ids[:, None], past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (Triton autotuning, allocator)
                self.cache.lengths[self.scratch_slot] = 0
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.cache.lengths[self.scratch_slot] = 0
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        # Sharing the pool is safe: graphs replay one at a time and each step reads its logits before the next.
        with torch.cuda.graph(graph, pool=self._graph_pool):
            static_logits = run()
        self.cache.lengths.copy_(lengths)
        self._graphs[(size, view_blocks)] = (graph, static_ids, static_slots, static_logits)

    # ---------------------------------------------------------------------------------------------
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
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        start, tokens0 = time.perf_counter(), self.stats.generated_tokens
        while len(results) < len(ids):
            for out in self.step():
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
                    rate = (self.stats.generated_tokens - tokens0) / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix(tok_s=f"{rate:.0f}", running=len(self.running))
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def update_weights(self, weights, version: int | None = None) -> None:
        """Loads new weights in place, between batches: a state dict, a checkpoint directory, or an iterable of
        ``(name, tensor)`` pairs as they arrive (:func:`pipeline.rollout.weight_sync.receive`). ``version``
        sets the weights' version instead of counting this load (an engine that replaces a dead one joins
        its fleet at the fleet's version)."""
        if self.has_unfinished():
            raise RuntimeError("update_weights while requests are in flight; call it between batches")
        if isinstance(weights, (str, Path)):
            from sse_model.checkpoint import load_pretrained

            weights = load_pretrained(weights, require_sse=True).state_dict()
        own = self.model.state_dict()
        if isinstance(weights, dict):
            unknown = sorted(set(weights) - set(own))
            if unknown:  # refused before anything is copied
                raise KeyError(f"update_weights: unknown parameters {unknown[:5]}")
            weights = weights.items()
        unknown = []
        with torch.no_grad():
            for name, value in weights:
                if name not in own:
                    unknown.append(name)
                    continue
                own[name].copy_(value.to(device=own[name].device, dtype=own[name].dtype))
        if unknown:
            raise KeyError(f"update_weights: unknown parameters {unknown[:5]}")
        self.weights_version = self.weights_version + 1 if version is None else version

    def get_stats(self) -> dict:
        stats = self.stats.as_dict(self.max_slots)
        stats.update(device=str(self.device), dtype=str(self.dtype).removeprefix("torch."), max_slots=self.max_slots,
                     per_slot_bytes=self.per_slot_bytes, weights_version=self.weights_version,
                     running=len(self.running), waiting=len(self.waiting) + len(self.prefilling) + len(self.resuming),
                     block_size=self.block_size, num_blocks=self.num_blocks,
                     free_blocks=self.cache.blocks.num_free if self.cache is not None else self.num_blocks)
        return stats


def _power_of_two(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size
