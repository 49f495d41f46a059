"""Generation caches: a fixed-size state per linear layer, a KV cache per softmax layer.

Two implementations of one protocol, which the layers use and nothing else:

- :class:`SSEHybridCache`: batch-major, grows with the batch (``model.generate``);
- :class:`SlotCache`: preallocated pools of ``max_slots`` rows that a rollout engine fills, forks and frees;
  each forward works on the rows named by ``slots``, and linear layers update their rows in place.

Protocol (``cache`` below is either):
    ``cache.query_index(T)``            [B|1, T] cache coordinate of each new token (for causal masking)
    ``cache.read_linear(i, recurrent)`` the :class:`LinearLayerState` of the current rows (None entries:
                                        zeros); ``recurrent=False`` skips the state (in-place decoding)
    ``cache.write_linear(i, state)``    store its non-None parts back
    ``cache.linear_pool(i)``            ``(pool, slots)`` for in-place decode kernels, or None
    ``cache.attend(i, k, v)``           append keys/values; returns ``(keys, values, key_index, key_valid)``
    ``cache.advance(T)``                after the forward: T more tokens seen
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .configuration_sse import ATTENTION_MIXERS


@dataclass
class LinearLayerState:
    """Recurrent state of a linear mixer. SSE: ``[B, 1 + N, H, K, V]``; GLA/GDN/RetNet: ``[B, H, K, V]``.
    ``conv`` holds the short-convolution caches (``[B, D, W]`` each) when the layer has them."""

    recurrent: torch.Tensor | None = None
    conv: tuple[torch.Tensor, ...] | None = None


@dataclass
class AttentionLayerCache:
    """Keys and values after RoPE, ``[B, H_kv, T_cached, D]``. Sliding-window layers keep only the last
    ``window - 1`` positions, all that a future query can see."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    window: int | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


@dataclass
class SSEHybridCache:
    """Batch-major cache for ``model.generate``. ``seen_tokens`` counts every position processed so far
    (left padding included): that is the cache coordinate. The linear layers' memory does not grow."""

    layers: list[LinearLayerState | AttentionLayerCache] = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def for_config(cls, config) -> "SSEHybridCache":
        layers = []
        for kind in config.mixer_types:
            if kind in ATTENTION_MIXERS:
                layers.append(AttentionLayerCache(window=config.sliding_window if kind == "swa" else None))
            else:
                layers.append(LinearLayerState())
        return cls(layers)

    # -- protocol ----------------------------------------------------------------------------------
    def query_index(self, T: int, device=None) -> torch.Tensor:
        return torch.arange(self.seen_tokens, self.seen_tokens + T, device=device)[None]

    def read_linear(self, layer_idx: int, recurrent: bool = True) -> LinearLayerState:
        return self.layers[layer_idx]

    def write_linear(self, layer_idx: int, state: LinearLayerState) -> None:
        layer = self.layers[layer_idx]
        layer.recurrent = state.recurrent if state.recurrent is not None else layer.recurrent
        layer.conv = state.conv if state.conv is not None else layer.conv

    def linear_pool(self, layer_idx: int):
        """The batch's state tensor itself, for in-place decoding (once a prefill has created it)."""
        state = self.layers[layer_idx].recurrent
        if state is None or state.requires_grad:
            return None
        return state, torch.arange(state.shape[0], device=state.device)

    def attend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        layer = self.layers[layer_idx]
        first = self.seen_tokens - layer.length
        if layer.keys is not None:
            keys = torch.cat([layer.keys, keys], dim=2)
            values = torch.cat([layer.values, values], dim=2)
        keep = keys.shape[2] if layer.window is None else min(keys.shape[2], layer.window - 1)
        layer.keys, layer.values = keys[:, :, keys.shape[2] - keep:], values[:, :, values.shape[2] - keep:]
        key_index = torch.arange(first, first + keys.shape[2], device=keys.device)[None]
        return keys, values, key_index, None

    def advance(self, T: int) -> None:
        self.seen_tokens += T

    # -- transformers' generate --------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int):
        return self.layers[layer_idx]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Selects batch rows (beam search, forking samples)."""
        for layer in self.layers:
            if isinstance(layer, AttentionLayerCache):
                if layer.keys is not None:
                    layer.keys = layer.keys.index_select(0, beam_idx.to(layer.keys.device))
                    layer.values = layer.values.index_select(0, beam_idx.to(layer.values.device))
            else:
                if layer.recurrent is not None:
                    layer.recurrent = layer.recurrent.index_select(0, beam_idx.to(layer.recurrent.device))
                if layer.conv is not None:
                    layer.conv = tuple(c.index_select(0, beam_idx.to(c.device)) for c in layer.conv)

    def memory_bytes(self) -> int:
        total = 0
        for layer in self.layers:
            tensors = [layer.keys, layer.values] if isinstance(layer, AttentionLayerCache) else \
                [layer.recurrent, *(layer.conv or ())]
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return total


def linear_state_shapes(config, kind: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Per-row shapes of a linear layer's recurrent state and of one short-convolution cache."""
    H, K, V = config.num_heads, config.head_dim, config.head_v_dim
    recurrent = (1 + config.num_sparse_partitions, H, K, V) if kind == "sse" else (H, K, V)
    conv = (H * K, config.conv_size) if config.use_short_conv else None
    return recurrent, conv


class SlotCache:
    """Preallocated state pools for a rollout engine.

    Linear layers: ``[max_slots, ...state]`` in float32. Softmax layers: ``[max_slots, H_kv, max_len, D]``
    keys and values in the model dtype (``max_len`` = the window for ``swa`` layers, which write
    round-robin). ``lengths[s]`` is the number of tokens slot ``s`` holds. Set ``slots`` (a LongTensor of
    rows) before each forward; padding rows may repeat a slot marked ``-1`` in ``lengths`` (graph buckets).
    """

    def __init__(self, config, max_slots: int, max_len: int, device, dtype, state_dtype=torch.float32):
        self.config, self.max_slots, self.max_len = config, max_slots, max_len
        self.linear: dict[int, torch.Tensor] = {}
        self.conv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.windows: dict[int, int | None] = {}
        for i, kind in enumerate(config.mixer_types):
            if kind in ATTENTION_MIXERS:
                window = config.sliding_window if kind == "swa" else None
                length = min(max_len, window) if window else max_len
                shape = (max_slots, config.num_key_value_heads, length, config.attn_head_dim)
                self.keys[i] = torch.zeros(shape, device=device, dtype=dtype)
                self.values[i] = torch.zeros(shape, device=device, dtype=dtype)
                self.windows[i] = window
            else:
                recurrent, conv = linear_state_shapes(config, kind)
                self.linear[i] = torch.zeros((max_slots, *recurrent), device=device, dtype=state_dtype)
                if conv is not None:
                    self.conv[i] = tuple(torch.zeros((max_slots, *conv), device=device, dtype=dtype) for _ in range(2))
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.slots = torch.zeros(1, dtype=torch.long, device=device)

    @staticmethod
    def bytes_per_slot(config, max_len: int, dtype=torch.bfloat16, state_dtype=torch.float32) -> int:
        """Memory one slot needs: its linear states plus KV for ``max_len`` tokens."""
        total = 0
        item = torch.tensor([], dtype=dtype).element_size()
        for kind in config.mixer_types:
            if kind in ATTENTION_MIXERS:
                length = min(max_len, config.sliding_window) if kind == "swa" else max_len
                total += 2 * config.num_key_value_heads * length * config.attn_head_dim * item
            else:
                recurrent, conv = linear_state_shapes(config, kind)
                total += torch.Size(recurrent).numel() * torch.tensor([], dtype=state_dtype).element_size()
                if conv is not None:
                    total += 2 * torch.Size(conv).numel() * item
        return total

    # -- slot management ---------------------------------------------------------------------------
    def reset(self, slots: torch.Tensor) -> None:
        """Empties ``slots`` (lengths to 0, states to zero)."""
        for pool in self.linear.values():
            pool[slots] = 0
        for pair in self.conv.values():
            for pool in pair:
                pool[slots] = 0
        self.lengths[slots] = 0

    def fork(self, source: int, targets: torch.Tensor) -> None:
        """Copies slot ``source`` (states, KV prefix, length) into every slot of ``targets``."""
        for pool in [*self.linear.values(), *(p for pair in self.conv.values() for p in pair)]:
            pool[targets] = pool[source].clone()
        length = int(self.lengths[source])
        for pool in [*self.keys.values(), *self.values.values()]:
            n = min(length, pool.shape[2])
            pool[targets, :, :n] = pool[source, :, :n].clone()
        self.lengths[targets] = length

    # -- protocol ----------------------------------------------------------------------------------
    def query_index(self, T: int, device=None) -> torch.Tensor:
        return self.lengths[self.slots][:, None] + torch.arange(T, device=self.lengths.device)[None]

    def read_linear(self, layer_idx: int, recurrent: bool = True) -> LinearLayerState:
        conv = self.conv.get(layer_idx)
        return LinearLayerState(self.linear[layer_idx][self.slots] if recurrent else None,
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

        Full layers write at positions ``lengths .. lengths + T`` and attend to their rows' whole buffers.
        Window layers keep a round-robin buffer of ``window`` entries: the queries see the buffer as it was
        plus the new tokens, and only the last ``window`` new tokens are written back."""
        B, _, T, _ = keys.shape
        pool_k, pool_v = self.keys[layer_idx], self.values[layer_idx]
        capacity = pool_k.shape[2]
        start = self.lengths[self.slots][:, None]  # [B, 1]
        new_index = start + torch.arange(T, device=keys.device)[None]  # [B, T]
        entries = torch.arange(capacity, device=keys.device)[None]
        new_k, new_v = keys.transpose(1, 2).to(pool_k.dtype), values.transpose(1, 2).to(pool_v.dtype)
        if self.windows[layer_idx] is None:
            rows = self.slots[:, None].expand(B, T)
            pool_k[rows, :, new_index] = new_k
            pool_v[rows, :, new_index] = new_v
            key_index = entries.expand(B, -1)
            return pool_k[self.slots], pool_v[self.slots], key_index, key_index < start + T
        old_index = start - 1 - ((start - 1 - entries) % capacity)  # latest position held by each entry
        keys_all = torch.cat([pool_k[self.slots], new_k.transpose(1, 2)], dim=2)
        values_all = torch.cat([pool_v[self.slots], new_v.transpose(1, 2)], dim=2)
        key_index = torch.cat([old_index, new_index], dim=1)
        valid = torch.cat([old_index >= 0, torch.ones_like(new_index, dtype=torch.bool)], dim=1)
        keep = min(T, capacity)
        rows = self.slots[:, None].expand(B, keep)
        pool_k[rows, :, new_index[:, T - keep:] % capacity] = new_k[:, T - keep:]
        pool_v[rows, :, new_index[:, T - keep:] % capacity] = new_v[:, T - keep:]
        return keys_all, values_all, key_index, valid

    def advance(self, T: int) -> None:
        self.lengths[self.slots] += T
