"""The engine's forward passes, as vLLM's model runner does them: prefill forwards (a chunk of one prompt, or several
whole prompts packed in one row), decode steps (eager, or replaying a CUDA graph captured per batch-size bucket),
the sampling inputs of a step, and a step queued on the GPU before the host reads the one before it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .cache import SlotCache
from .request import Sequence
from .sampling import sample
from .scheduler import _power_of_two


@dataclass(eq=False)
class LaunchedStep:
    """A decode step queued on the GPU: its rows and their sampled tokens (on the device, the next step's input),
    not yet read by the host. On CUDA the tokens and log-probabilities are also copied to pinned host memory right
    behind the sampler, and ``ready`` marks when they are there: reading them waits for this step alone, not for
    the step queued after it (a plain ``.tolist()`` would be ordered behind that one on the stream)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor] | None = None
    ready: torch.cuda.Event | None = None

    @classmethod
    def queue(cls, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor) -> "LaunchedStep":
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


class ModelRunner:
    """The model on its device and the cache its forwards read and write (:meth:`use`)."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype | None, residual_dtype=None,
                 use_cuda_graphs: bool | None = None):
        self.model = model.to(device=device, dtype=dtype or next(model.parameters()).dtype).eval()
        self.model.pack_projections()  # one product per group of maps that read one input (a decode step's GEMMs)
        self.model.model.residual_dtype = residual_dtype  # float32: skip connections added as the trainer adds them
        self.device, self.dtype = device, next(self.model.parameters()).dtype
        self.use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.cache: SlotCache | None = None
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._graph_pool = None  # one memory pool for every captured graph: the largest bucket's, not their sum

    def use(self, cache: SlotCache | None) -> None:
        """The cache the forwards use (None: asleep: the graphs, captured over the old one, are dropped)."""
        if cache is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # a dropped queued step may still read the cache and graphs
            self._graphs.clear()
            self._graph_pool = None
        self.cache = cache
        self.scratch_slot = cache.max_slots - 1 if cache is not None else None  # padding rows of graph buckets

    # -- prefill -------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens: list[int], slot: int, view_blocks: int) -> torch.Tensor:
        """One chunk of one prompt into ``slot``; the last position's logits ``[1, vocab]``."""
        self.cache.slots = torch.tensor([slot], device=self.device)
        self.cache.view_blocks = view_blocks
        ids = torch.tensor([tokens], device=self.device)
        return self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    @torch.no_grad()
    def prefill_packed(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Whole prompts packed in one row, each into its slot; each prompt's last logits ``[len(prompts), vocab]``."""
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([[t for p in prompts for t in p]], device=self.device)
        cu_seqlens = torch.tensor(list(itertools.accumulate(lengths, initial=0)), device=self.device)
        self.cache.slots = torch.tensor(slots, device=self.device)
        return self.model(input_ids=ids, cu_seqlens=cu_seqlens, past_key_values=self.cache, use_cache=True,
                          logits_to_keep=cu_seqlens[1:] - 1).logits[0]

    # -- decode --------------------------------------------------------------------------------------
    @torch.no_grad()
    def launch(self, seqs: list[Sequence]) -> LaunchedStep:
        """Queues a decode step of ``seqs`` from their last tokens."""
        ids, slots, sampling = self.step_inputs(seqs, [s.token_ids[-1] for s in seqs], [s.slot for s in seqs])
        return LaunchedStep.queue(seqs, *sample(self.forward_decode(ids, slots), **sampling))

    @torch.no_grad()
    def launch_after(self, step: LaunchedStep, rows: list[int]) -> LaunchedStep:
        """Queues the step after ``step`` (not yet read by the host) for its ``rows``, from its tokens on the GPU."""
        seqs = [step.seqs[i] for i in rows]
        picked, slots, sampling = self.step_inputs(seqs, rows, [s.slot for s in seqs], ahead=1)
        ids = step.tokens if len(rows) == len(step.seqs) else step.tokens[picked]
        return LaunchedStep.queue(seqs, *sample(self.forward_decode(ids, slots), **sampling))

    def forward_decode(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if not self.use_cuda_graphs:
            self.cache.slots = slots
            out = self.model(input_ids=ids[:, None], past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]
        return self._graph_decode(ids, slots)

    def step_inputs(self, seqs: list[Sequence], ids: list[int], slots: list[int], ahead: int = 0):
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

    # -- CUDA graphs: one per batch-size bucket; padding rows decode into the scratch slot ----------------
    def _graph_decode(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        B = ids.shape[0]
        # KV read in place through the block tables: one graph per batch bucket serves every length
        key = (min(_power_of_two(B), self.scratch_slot), 0 if self.cache.decode_in_place else self.cache.view_blocks)
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

    def graph_buckets(self, batch: int) -> list[int]:
        """The batch buckets of decode graphs up to ``batch`` sequences at once: none without CUDA graphs, or
        where a step's graph depends on the sequences' lengths (KV gathered, not read in place)."""
        if not self.use_cuda_graphs or self.cache is None or not self.cache.decode_in_place or batch < 1:
            return []
        return sorted({min(2 ** i, self.scratch_slot) for i in range(_power_of_two(batch).bit_length())})

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

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

    # -- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Copies new weights in place: a state dict, or ``(name, tensor)`` pairs as they arrive; an unknown name is
        refused (a state dict's before anything is copied)."""
        own = self.model.state_dict()
        if isinstance(weights, dict):
            unknown = sorted(set(weights) - set(own))
            if unknown:
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
