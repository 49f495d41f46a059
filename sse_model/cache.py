"""Generation caches: a fixed-size state per linear layer, a KV cache per softmax layer.

The layers use a cache only through the protocol below (:class:`ModelCache`); two classes keep it:

- :class:`SSEHybridCache` (here): batch-major, grows with the batch (``model.generate``);
- ``SlotCache`` (the rollout engine's, :mod:`pipeline.rollout.cache`): pools of ``max_slots`` rows that an engine
  fills, forks and frees, with the full-attention KV in blocks taken as sequences grow; each forward works on the
  rows named by ``slots``, and linear layers update their rows in place.

Protocol (``cache`` below is either):
    ``cache.query_index(T)``            [B|1, T] cache coordinate of each new token (for causal masking)
    ``cache.read_linear(i, recurrent)`` the :class:`LinearLayerState` of the current rows (None entries:
                                        zeros); ``recurrent=False`` skips the state (in-place decoding)
    ``cache.write_linear(i, state)``    store its non-None parts back
    ``cache.linear_pool(i)``            ``(pool, slots)`` for in-place decode kernels, or None
    ``cache.attend(i, k, v)``           append keys/values; returns ``(keys, values, key_index, key_valid)``
    ``cache.decode_attention(i, q, k, v, rotary, positions)`` one new token per row, before RoPE: rotate q/k,
                                        append k/v and return the attention output read in place, or None where
                                        RoPE, ``attend`` and SDPA serve
    ``cache.advance(T)``                after the forward: T more tokens seen

A cache whose ``packs_prefill`` is true also takes a packed prefill: one row of several prompts (``cu_seqlens``),
each the start of an empty slot, so that one forward prefills many short prompts (a forward of a small model is
bound by its launches, not its tokens). Linear layers then read and write one state per prompt; softmax layers
attend within each prompt and store its keys with ``cache.store_packed(i, keys, values, cu_seqlens)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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

    def decode_attention(self, layer_idx: int, queries, keys, values, rotary, positions) -> None:
        return None  # the batch's KV is contiguous already: attend + SDPA

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


@runtime_checkable
class ModelCache(Protocol):
    """What a generation cache offers the layers (the module docstring says what each method does)."""

    def query_index(self, T: int, device=None) -> torch.Tensor: ...

    def read_linear(self, layer_idx: int, recurrent: bool = True) -> LinearLayerState: ...

    def write_linear(self, layer_idx: int, state: LinearLayerState) -> None: ...

    def linear_pool(self, layer_idx: int): ...

    def attend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor): ...

    def decode_attention(self, layer_idx: int, queries, keys, values, rotary, positions): ...

    def advance(self, T) -> None: ...
