"""The hybrid generation cache: a fixed-size state per linear layer, a KV cache per softmax layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new keys and values; returns everything the current queries may attend to."""
        if self.keys is not None:
            keys = torch.cat([self.keys, keys], dim=2)
            values = torch.cat([self.values, values], dim=2)
        keep = keys.shape[2] if self.window is None else min(keys.shape[2], self.window - 1)
        self.keys, self.values = keys[:, :, keys.shape[2] - keep:], values[:, :, values.shape[2] - keep:]
        return keys, values

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


@dataclass
class SSEHybridCache:
    """Generation cache of :class:`~sse_model.SSEForCausalLM`.

    ``seen_tokens`` counts every position processed so far (left padding included); attention masks and
    RoPE positions are expressed in that coordinate. The memory of a linear layer does not grow with it.
    """

    layers: list[LinearLayerState | AttentionLayerCache] = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def for_config(cls, config) -> "SSEHybridCache":
        layers = []
        for kind in config.mixer_types:
            if kind in ("attn", "swa"):
                layers.append(AttentionLayerCache(window=config.sliding_window if kind == "swa" else None))
            else:
                layers.append(LinearLayerState())
        return cls(layers)

    # transformers' cache protocol, as far as ``generate`` uses it
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
