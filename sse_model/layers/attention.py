"""Causal softmax attention with RoPE and GQA (``attn``), optionally within a sliding window (``swa``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..modules import Linear, RotaryEmbedding, project
from ..ops.attention import packed_causal_attention
from .common import ForwardContext


class SoftmaxAttention(nn.Module):
    """Llama/Qwen2-style attention; parameter names match those models and fla's ``Attention``.

    A query at absolute position ``i`` sees keys at ``j <= i`` (and ``j > i - window`` for ``swa``) that
    are valid in the key mask and, in a packed batch, belong to the same sequence. A packed batch attends
    sequence by sequence (:mod:`sse_model.ops.attention`), never through a dense mask; padding and caches
    build a boolean mask from the cache coordinates.
    """

    def __init__(self, config, layer_idx: int, window: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.attn_head_dim
        self.window = window
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=config.output_bias)
        self.rotary = RotaryEmbedding(self.head_dim, base=config.rope_theta, parameters=config.rope_parameters,
                                      max_position_embeddings=config.max_position_embeddings)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        """q, k and v: they read the layer's input in one product."""
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        """``(residual + output, None)``; ``residual`` (the block's skip connection) is optional."""
        B, T, _ = hidden_states.shape
        q, k, v = project(hidden_states, *self.input_projections())
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        o = None
        if ctx.cache is not None and T == 1 and ctx.key_mask is None:  # a decode step: the cache may attend itself
            o = ctx.cache.decode_attention(self.layer_idx, q[:, 0], k[:, 0], v[:, 0], self.rotary,
                                           ctx.position_ids[:, 0].expand(B))
        if o is None:
            q, k = self.rotary(q, k, ctx.position_ids)
            o = self._attend(*(x.transpose(1, 2) for x in (q, k, v)), ctx).transpose(1, 2)
        o = o.reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(o, residual), None

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``q [B, H, T, D]``, the new ``k, v [B, H_kv, T, D]`` -> ``[B, H, T, D]`` through SDPA."""
        if ctx.cu_seqlens is not None and ctx.key_mask is None:
            if ctx.cache is not None:  # a packed prefill of empty slots: each prompt sees only itself
                ctx.cache.store_packed(self.layer_idx, k, v, ctx.cu_seqlens)
            return packed_causal_attention(q, k, v, ctx.segments, self.window)
        if ctx.cache is not None:
            k, v, key_index, key_valid = ctx.cache.attend(self.layer_idx, k, v)
        else:
            key_index, key_valid = ctx.query_index, None
        mask = self._mask(ctx, key_index, key_valid)
        return F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            is_causal=mask is None and q.shape[2] > 1,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )

    def _mask(self, ctx: ForwardContext, key_index: torch.Tensor, key_valid: torch.Tensor | None):
        """Boolean ``[B|1, 1, T, S]`` mask from the cache coordinates of queries and keys, or None where
        plain causal attention (or, for one query, attending to every key) is exact."""
        q_index = ctx.query_index
        T, S = q_index.shape[1], key_index.shape[1]
        plain = ctx.key_mask is None and ctx.cu_seqlens is None and key_valid is None
        if plain and (self.window is None or S <= self.window) and (S == T or T == 1):
            return None
        q = q_index[:, :, None]
        k = key_index[:, None, :]
        allowed = k <= q
        if self.window is not None:
            allowed = allowed & (k > q - self.window)
        if ctx.cu_seqlens is not None:
            seq = torch.searchsorted(ctx.cu_seqlens.long()[1:], torch.arange(T, device=q.device), right=True)
            allowed = allowed & (seq[None, None, :] == seq[None, :, None])
        if key_valid is not None:
            allowed = allowed & key_valid[:, None, :]
        if ctx.key_mask is not None:
            allowed = allowed & ctx.key_mask.gather(1, key_index.expand(ctx.key_mask.shape[0], -1))[:, None, :]
        # A padded query has no valid key; let it see itself so its (ignored) output stays finite.
        allowed = allowed | (k == q)
        return allowed[:, None]
