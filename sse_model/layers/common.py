"""What every mixer receives besides its hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..cache import ModelCache
from ..ops.attention import Segments, segments_of


@dataclass
class ForwardContext:
    """Computed once per model forward and shared by all layers.

    ``token_mask`` ([B, T], False at padding) makes linear mixers skip padded tokens: their key, value,
    decay and write strength are zeroed, so states pass through them unchanged. ``key_mask`` ([B, past + T])
    is the validity of every position a softmax layer can attend to. ``cu_seqlens`` marks a packed batch.
    """

    position_ids: torch.Tensor
    query_index: torch.Tensor  # [B|1, T] cache coordinate of each token (causal masking)
    token_mask: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cache: ModelCache | None = None

    @property
    def use_cache(self) -> bool:
        return self.cache is not None

    @cached_property
    def segments(self) -> Segments | None:
        """The packed sequences as host ``(start, end)`` pairs (and their device bounds), read once per forward for
        every softmax layer."""
        return None if self.cu_seqlens is None else segments_of(self.cu_seqlens)


def zero_padding(x: torch.Tensor | None, token_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` with every padded token's entries set to 0 (``where``, so NaN or inf cannot leak through)."""
    if x is None or token_mask is None:
        return x
    mask = token_mask.reshape(*token_mask.shape, *([1] * (x.dim() - token_mask.dim())))
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
