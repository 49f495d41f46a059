"""The rollout engine's cache: per-slot state pools for the linear layers and paged KV blocks for the softmax layers
(:class:`SlotCache`, which keeps :class:`sse_model.cache.ModelCache`'s protocol for the model's layers), and the
blocks' allocator (:class:`BlockAllocator`). The engine sizes it (:mod:`pipeline.rollout.engine`); decode steps of
full-attention layers read the blocks in place with :mod:`kernels.paged_attention`."""

from __future__ import annotations

from collections import deque

import torch

from sse_model.cache import LinearLayerState, linear_state_shapes
from sse_model.configuration_sse import ATTENTION_MIXERS
from sse_model.ops.dispatch import note_declined

from .options import KV_CACHE_DTYPES, STATE_CACHE_DTYPES

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # casting beyond it gives NaN, so values are clamped first


def kv_dtype_of(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pools' dtype for an engine option ``kv_cache_dtype`` (``auto``: the engine's ``dtype``)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8" else dtype


def state_dtype_of(state_cache_dtype: str) -> torch.dtype:
    """The recurrent-state pools' dtype for an engine option ``state_cache_dtype``."""
    if state_cache_dtype not in STATE_CACHE_DTYPES:
        raise ValueError(f"state_cache_dtype must be one of {', '.join(STATE_CACHE_DTYPES)}, got {state_cache_dtype!r}")
    return getattr(torch, state_cache_dtype)


def to_kv(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the KV pools keep it (float8: clamped to its range, unit scale)."""
    if kv_dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(kv_dtype)
    return x.to(kv_dtype)


class BlockAllocator:
    """Fixed-size KV blocks for the full-attention layers of a :class:`SlotCache`: a free list and reference
    counts, so samples forked from one prompt share its full blocks instead of copying them."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise MemoryError(f"{count} KV blocks asked for, {len(self.free)} of {self.num_blocks} free")
        blocks = [self.free.popleft() for _ in range(count)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than it was taken")


class SlotCache:
    """State pools for a rollout engine: per-slot linear states, paged KV for the full-attention layers.

    Linear layers: ``[max_slots, ...state]`` in float32; window (``swa``) layers: a ``[max_slots, H_kv, window,
    D]`` round-robin buffer per slot. Full-attention layers keep their keys and values in ``num_blocks`` blocks of
    ``block_size`` tokens ``[num_blocks + 1, H_kv, block_size, D]`` (the last block is scratch: unused table
    entries and the padding rows of graph buckets point there); ``tables[s]`` lists slot ``s``'s blocks in order.
    Blocks are taken as a slot grows (:meth:`grow`), shared by forked samples (:meth:`fork`) and returned when the
    slot is emptied (:meth:`reset`), so memory follows what the sequences hold, not ``max_len``.

    ``kv_dtype`` (default ``dtype``): the keys' and values' storage; float8 (:func:`kv_dtype_of`) is read back in
    ``dtype`` by attention.

    Before each forward set ``slots`` (a LongTensor of rows) and ``view_blocks`` (how many table entries the
    attention reads: at least the longest row's blocks; a graph captures one value); ``lengths[s]`` is the
    number of tokens slot ``s`` holds. Decode steps of full layers read the blocks where they are
    (:meth:`decode_attention`, on CUDA; ``paged_decode=False`` gathers them and runs SDPA instead).
    """

    def __init__(self, config, max_slots: int, max_len: int, device, dtype, state_dtype=torch.float32,
                 num_blocks: int | None = None, block_size: int = 256, paged_decode: bool | None = None,
                 kv_dtype: torch.dtype | None = None):
        self.config, self.max_slots, self.max_len, self.block_size = config, max_slots, max_len, block_size
        self.kv_dtype = kv_dtype or dtype
        self.max_blocks_per_slot = -(-max_len // block_size)
        if num_blocks is None:  # every slot can reach max_len
            num_blocks = max_slots * self.max_blocks_per_slot
        self.linear: dict[int, torch.Tensor] = {}
        self.conv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.windows: dict[int, int | None] = {}
        H, D = config.num_key_value_heads, config.attn_head_dim
        for i, kind in enumerate(config.mixer_types):
            if kind in ATTENTION_MIXERS:
                window = config.sliding_window if kind == "swa" else None
                shape = (max_slots, H, min(max_len, window), D) if window else (num_blocks + 1, H, block_size, D)
                self.keys[i] = torch.zeros(shape, device=device, dtype=self.kv_dtype)
                self.values[i] = torch.zeros(shape, device=device, dtype=self.kv_dtype)
                self.windows[i] = window
            else:
                recurrent, conv = linear_state_shapes(config, kind)
                self.linear[i] = torch.zeros((max_slots, *recurrent), device=device, dtype=state_dtype)
                if conv is not None:
                    self.conv[i] = tuple(torch.zeros((max_slots, *conv), device=device, dtype=dtype) for _ in range(2))
        self.paged = any(w is None for w in self.windows.values())
        self.blocks = BlockAllocator(num_blocks if self.paged else 0)
        self.scratch_block = num_blocks
        self.slot_blocks: list[list[int]] = [[] for _ in range(max_slots)]
        self.tables = torch.full((max_slots, self.max_blocks_per_slot), num_blocks, dtype=torch.long, device=device)
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.slots = torch.zeros(1, dtype=torch.long, device=device)
        self.view_blocks = self.max_blocks_per_slot
        self._packed: tuple | None = None  # a packed prefill's cu_seqlens and each token's block and offset
        # decode steps of full layers read the blocks in place (kernels.paged_attention); off: gather + SDPA
        self.paged_decode = torch.device(device).type == "cuda" if paged_decode is None else paged_decode

    @staticmethod
    def bytes_per_slot(config, max_len: int, dtype=torch.bfloat16, state_dtype=torch.float32,
                       kv_dtype: torch.dtype | None = None) -> int:
        """Memory one sequence of ``max_len`` tokens needs: its linear states plus its KV."""
        return SlotCache.state_bytes(config, max_len, dtype, state_dtype, kv_dtype) + \
            SlotCache.kv_bytes_per_token(config, kv_dtype or dtype) * max_len

    @staticmethod
    def state_bytes(config, max_len: int, dtype=torch.bfloat16, state_dtype=torch.float32,
                    kv_dtype: torch.dtype | None = None) -> int:
        """What a slot holds whatever its length: linear states, short-convolution caches, window KV."""
        total = 0
        item = torch.tensor([], dtype=dtype).element_size()
        kv_item = torch.tensor([], dtype=kv_dtype or dtype).element_size()
        for kind in config.mixer_types:
            if kind == "swa":
                window = min(max_len, config.sliding_window)
                total += 2 * config.num_key_value_heads * window * config.attn_head_dim * kv_item
            elif kind not in ATTENTION_MIXERS:
                recurrent, conv = linear_state_shapes(config, kind)
                total += torch.Size(recurrent).numel() * torch.tensor([], dtype=state_dtype).element_size()
                if conv is not None:
                    total += 2 * torch.Size(conv).numel() * item
        return total

    @staticmethod
    def kv_bytes_per_token(config, dtype=torch.bfloat16) -> int:
        """Keys and values of one token in every full-attention layer."""
        item = torch.tensor([], dtype=dtype).element_size()
        layers = sum(kind in ATTENTION_MIXERS and kind != "swa" for kind in config.mixer_types)
        return 2 * layers * config.num_key_value_heads * config.attn_head_dim * item

    def blocks_for(self, length: int) -> int:
        """Blocks a slot of ``length`` tokens holds (0 without full-attention layers)."""
        return -(-length // self.block_size) if self.paged else 0

    # -- slot management ---------------------------------------------------------------------------
    def reset(self, slots: torch.Tensor) -> None:
        """Empties ``slots``: lengths and states to zero, KV blocks returned."""
        for pool in self.linear.values():
            pool[slots] = 0
        for pair in self.conv.values():
            for pool in pair:
                pool[slots] = 0
        for s in slots.tolist():
            self.blocks.release(self.slot_blocks[s])
            self.slot_blocks[s] = []
        self.tables[slots] = self.scratch_block
        self.lengths[slots] = 0

    def grow(self, slots: list[int], lengths: list[int], keep_free: int = 0) -> None:
        """Gives each slot the blocks to hold ``lengths`` tokens; ``MemoryError`` (and nothing taken) if that would
        leave fewer than ``keep_free`` blocks free."""
        need = [max(0, self.blocks_for(n) - len(self.slot_blocks[s])) for s, n in zip(slots, lengths)]
        if sum(need) > self.blocks.num_free - keep_free:
            raise MemoryError(f"{sum(need)} KV blocks needed, {self.blocks.num_free} free, {keep_free} kept free")
        if max(lengths, default=0) > self.max_len:
            raise ValueError(f"a slot cannot hold {max(lengths)} tokens; max_len is {self.max_len}")
        rows, cols, new = [], [], []
        for s, n in zip(slots, need):
            if n:
                taken = self.blocks.allocate(n)
                first = len(self.slot_blocks[s])
                self.slot_blocks[s] += taken
                rows += [s] * n
                cols += range(first, first + n)
                new += taken
        if new:
            device = self.tables.device
            self.tables[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = \
                torch.tensor(new, device=device)

    def fork(self, source: int, targets: torch.Tensor) -> None:
        """Copies slot ``source`` (states, length) into every slot of ``targets``; its full KV blocks are shared,
        a partly filled last block is copied (the samples write their own tokens into it)."""
        for pool in [*self.linear.values(), *(p for pair in self.conv.values() for p in pair)]:
            pool[targets] = pool[source].clone()
        length = int(self.lengths[source])
        for i, window in self.windows.items():
            if window is not None:
                for pool in (self.keys[i], self.values[i]):
                    n = min(length, pool.shape[2])
                    pool[targets, :, :n] = pool[source, :, :n].clone()
        blocks = self.slot_blocks[source]
        full = length // self.block_size if self.paged else 0
        for t in targets.tolist():
            if self.slot_blocks[t]:
                raise RuntimeError(f"fork into slot {t}, which still holds KV blocks; reset it first")
            self.blocks.share(blocks[:full])
            self.slot_blocks[t] = list(blocks[:full])
            self.grow([t], [length])
            self.tables[t, :full] = self.tables[source, :full]
            if len(blocks) > full:
                own = self.slot_blocks[t][full]
                for i, window in self.windows.items():
                    if window is None:
                        for pool in (self.keys[i], self.values[i]):
                            pool[own] = pool[blocks[full]]
        self.lengths[targets] = length

    # -- protocol ----------------------------------------------------------------------------------
    def query_index(self, T: int, device=None) -> torch.Tensor:
        return self.lengths[self.slots][:, None] + torch.arange(T, device=self.lengths.device)[None]

    def read_linear(self, layer_idx: int, recurrent: bool = True) -> LinearLayerState:
        conv = self.conv.get(layer_idx)
        # a prefill's initial states in float32 (the chunked kernels' states), whatever the pool keeps
        return LinearLayerState(self.linear[layer_idx][self.slots].float() if recurrent else None,
                                None if conv is None else tuple(c[self.slots] for c in conv))

    def write_linear(self, layer_idx: int, state: LinearLayerState) -> None:
        if state.recurrent is not None:
            self.linear[layer_idx][self.slots] = state.recurrent.to(self.linear[layer_idx].dtype)
        if state.conv is not None:
            for pool, value in zip(self.conv[layer_idx], state.conv):
                pool[self.slots] = value.to(pool.dtype)

    def linear_pool(self, layer_idx: int):
        return self.linear[layer_idx], self.slots

    def attend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """Stores the new keys/values of each row; returns what the new queries may attend to.

        Full layers write position ``p`` at offset ``p % block_size`` of block ``tables[slot, p // block_size]``
        and read their rows' first ``view_blocks`` blocks. Window layers keep a round-robin buffer of ``window``
        entries: the queries see the buffer as it was plus the new tokens, and only the last ``window`` new
        tokens are written back."""
        B, _, T, _ = keys.shape
        pool_k, pool_v = self.keys[layer_idx], self.values[layer_idx]
        start = self.lengths[self.slots][:, None]  # [B, 1]
        new_index = start + torch.arange(T, device=keys.device)[None]  # [B, T]
        new_k, new_v = to_kv(keys.transpose(1, 2), self.kv_dtype), to_kv(values.transpose(1, 2), self.kv_dtype)
        read = keys.dtype  # attention reads the stored keys and values (float8 too) in the layer's dtype
        if self.windows[layer_idx] is None:
            table = self._store_blocks(layer_idx, new_k, new_v, new_index)
            view = table[:, :self.view_blocks]  # [B, nb]
            H, D = pool_k.shape[1], pool_k.shape[3]
            k = pool_k[view].transpose(1, 2).reshape(B, H, -1, D).to(read)
            v = pool_v[view].transpose(1, 2).reshape(B, H, -1, D).to(read)
            key_index = torch.arange(k.shape[2], device=keys.device)[None].expand(B, -1)
            return k, v, key_index, key_index < start + T
        capacity = pool_k.shape[2]
        entries = torch.arange(capacity, device=keys.device)[None]
        old_index = start - 1 - ((start - 1 - entries) % capacity)  # latest position held by each entry
        keys_all = torch.cat([pool_k[self.slots], new_k.transpose(1, 2)], dim=2).to(read)
        values_all = torch.cat([pool_v[self.slots], new_v.transpose(1, 2)], dim=2).to(read)
        key_index = torch.cat([old_index, new_index], dim=1)
        valid = torch.cat([old_index >= 0, torch.ones_like(new_index, dtype=torch.bool)], dim=1)
        keep = min(T, capacity)
        rows = self.slots[:, None].expand(B, keep)
        pool_k[rows, :, new_index[:, T - keep:] % capacity] = new_k[:, T - keep:]
        pool_v[rows, :, new_index[:, T - keep:] % capacity] = new_v[:, T - keep:]
        return keys_all, values_all, key_index, valid

    @property
    def decode_in_place(self) -> bool:
        """Whether decode steps of full layers read the blocks in place (:meth:`decode_attention`; ``view_blocks``
        then matters to prefill only): ``paged_decode`` on and a head size the kernel takes."""
        D = self.config.attn_head_dim
        if not self.paged_decode:
            return False
        if D < 16 or D & (D - 1):
            note_declined("paged decode attention", f"head size {D} is not a power of two from 16; the blocks are "
                                                    "gathered for SDPA")
            return False
        return True

    def decode_attention(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         rotary, positions: torch.Tensor):
        """``queries [B, H, D]``, ``keys, values [B, H_kv, D]`` of a full layer's decode step, before RoPE
        (``rotary``: the layer's :class:`~sse_model.modules.RotaryEmbedding`, at ``positions [B]``): rotates them,
        stores the key and value and returns ``[B, H, D]``, each row's attention over its tokens (the new one
        included) read from its blocks in place: two launches, :func:`kernels.paged_attention.rotary_store_decode`
        and the paged attention. None where :meth:`attend` serves: window layers, not :attr:`decode_in_place`."""
        if not self.decode_in_place or self.windows[layer_idx] is not None:
            return None
        from kernels.paged_attention import paged_decode_attention, rotary_store_decode

        pool_k, pool_v = self.keys[layer_idx], self.values[layer_idx]
        q = rotary_store_decode(queries, keys, values, positions, rotary.inv_freq, rotary.attention_factor,
                                pool_k, pool_v, self.tables, self.lengths, self.slots)
        return paged_decode_attention(q, pool_k, pool_v, self.tables, self.lengths, slots=self.slots).to(queries.dtype)

    def _store_blocks(self, layer_idx: int, new_k: torch.Tensor, new_v: torch.Tensor, new_index: torch.Tensor):
        """Writes ``new_k/new_v [B, T, H_kv, D]`` at positions ``new_index [B, T]`` of the rows' blocks; returns
        the rows' block tables."""
        bs = self.block_size
        table = self.tables[self.slots]  # [B, max_blocks]
        block = table.gather(1, (new_index // bs).clamp(max=table.shape[1] - 1))
        self.keys[layer_idx][block, :, new_index % bs] = new_k
        self.values[layer_idx][block, :, new_index % bs] = new_v
        return table

    @property
    def packs_prefill(self) -> bool:
        """Whether a forward may prefill several empty slots from one packed row: not with short-convolution
        caches or window layers, whose packed forms keep no per-sequence cache."""
        return not self.conv and all(w is None for w in self.windows.values())

    def store_packed(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """A packed prefill's ``keys, values [1, H_kv, T, D]``: sequence ``i`` of ``cu_seqlens`` goes to slot
        ``slots[i]`` at positions ``0 .. len_i - 1`` (the slots start empty, their blocks taken by :meth:`grow`)."""
        if self._packed is None or self._packed[0] is not cu_seqlens:  # once per forward, for every layer
            T = keys.shape[2]
            token = torch.arange(T, device=keys.device)
            seq = torch.searchsorted(cu_seqlens.long()[1:], token, right=True)
            position = token - cu_seqlens.long()[seq]
            block = self.tables[self.slots[seq], position // self.block_size]
            self._packed = cu_seqlens, block, position % self.block_size
        _, block, offset = self._packed
        self.keys[layer_idx][block, :, offset] = to_kv(keys[0].transpose(0, 1), self.kv_dtype)
        self.values[layer_idx][block, :, offset] = to_kv(values[0].transpose(0, 1), self.kv_dtype)

    def advance(self, T: int | torch.Tensor) -> None:
        """``T`` more tokens in every current row, or ``T[i]`` in row ``i`` (a packed prefill)."""
        self.lengths[self.slots] += T


DEFAULT_MAX_SLOTS = 256  # GRPO's 32 prompts x 8 samples in one batch


def default_memory_budget(device: torch.device) -> int:
    """90% of the free GPU memory after the weights on CUDA; 2 GiB on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return 2 * 1024**3


def plan_slots(config, memory_budget: int, max_model_len: int, block_size: int, dtype: torch.dtype,
               max_slots: int | None = None, num_blocks: int | None = None,
               kv_dtype: torch.dtype | None = None, state_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """``(max_slots, num_blocks)`` within ``memory_budget`` bytes (either given: as given): slots planned for
    sequences a quarter of ``max_model_len`` long on average (up to :data:`DEFAULT_MAX_SLOTS`), KV blocks in the
    rest; one sequence of ``max_model_len`` always fits, or the budget is refused."""
    state = SlotCache.state_bytes(config, max_model_len, dtype, state_dtype, kv_dtype)
    per_block = SlotCache.kv_bytes_per_token(config, kv_dtype or dtype) * block_size
    one_sequence = per_block * -(-max_model_len // block_size)
    if max_slots is None:
        planned = state + per_block * -(-max(block_size, max_model_len // 4) // block_size)
        max_slots = min(DEFAULT_MAX_SLOTS, (memory_budget - one_sequence) // planned)
    blocks_given = num_blocks is not None
    if num_blocks is None:
        num_blocks = (memory_budget - (max_slots + 1) * state) // per_block if per_block else 0
        num_blocks = min(num_blocks, max_slots * -(-max_model_len // block_size))  # more never fill
    num_blocks = num_blocks if per_block else 0
    if max_slots < 1 or num_blocks * per_block < one_sequence:
        if not blocks_given and max_slots > 1 and 2 * state + one_sequence <= memory_budget:  # one would fit
            raise ValueError(f"max_slots={max_slots}: the slots' states ({max_slots} x {state} B) leave memory_budget "
                             f"{memory_budget} B no room for one sequence of max_model_len={max_model_len} tokens "
                             f"({one_sequence} B of KV): fewer slots (engine.max_slots) or a larger budget")
        raise ValueError(f"memory_budget {memory_budget} B is below one sequence of max_model_len={max_model_len} "
                         f"tokens ({state + one_sequence} B; max_slots={max_slots} slots of {state} B each)")
    return int(max_slots), int(num_blocks)
