"""Linear-attention mixers: GLA, Gated DeltaNet and RetNet, with optional SLA head gates."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import LinearLayerState
from ..modules import GatedRMSNorm, Linear, RMSNorm, ShortConvolution, project
from ..ops.delta_rule import l2norm
from ..ops.fused import feature_map
from ..ops.dispatch import linear_attention, linear_decode
from .common import ForwardContext, zero_padding


def init_gdn_decay(A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """Mamba-2 / Gated DeltaNet initialisation: A ~ U(0, 16), dt ~ logU(1e-3, 1e-1) through softplus."""
    with torch.no_grad():
        A_log.copy_(torch.empty_like(A_log, dtype=torch.float32).uniform_(0, 16).log())
        dt = torch.exp(torch.rand_like(dt_bias, dtype=torch.float32) * (math.log(0.1) - math.log(0.001))
                       + math.log(0.001)).clamp(min=1e-4)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log, dt_bias, allow_neg_eigval: bool):
    """Log-decay ``g = -exp(A) softplus(a + dt_bias)`` (float32) and write strength ``beta = sigmoid(b)``."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    beta = b.sigmoid()
    return g, beta * 2 if allow_neg_eigval else beta


class LinearAttention(nn.Module):
    """``gla`` (data-dependent per-row decay), ``gdn`` (gated delta rule) or ``retnet`` (fixed decay
    ``1 - 2^(-5-h)`` per head). With ``config.sla_gates`` the head-level softmax gates of Softmax Linear
    Attention scale the query (read) and the key, or for ``gdn`` the value (write), of every head."""

    def __init__(self, config, layer_idx: int, kind: str):
        super().__init__()
        self.layer_idx, self.kind = layer_idx, kind
        self.transition = "gdn" if kind == "gdn" else "gla"
        self.config = config
        H, K, V = config.num_heads, config.head_dim, config.head_v_dim
        self.num_heads, self.head_k_dim, self.head_v_dim = H, K, V
        hidden = config.hidden_size
        bias = config.linear_qkv_bias
        self.q_proj = Linear(hidden, H * K, bias=bias)
        self.k_proj = Linear(hidden, H * K, bias=bias)
        self.v_proj = Linear(hidden, H * V, bias=bias)
        if kind == "gla":
            r = config.gate_low_rank_dim
            self.gk_proj = nn.Sequential(Linear(hidden, r, bias=False), Linear(r, H * K, bias=True))
        elif kind == "gdn":
            self.a_proj = Linear(hidden, H, bias=False)
            self.b_proj = Linear(hidden, H, bias=False)
            self.A_log = nn.Parameter(torch.zeros(H))
            self.dt_bias = nn.Parameter(torch.zeros(H))
            init_gdn_decay(self.A_log, self.dt_bias)
        elif kind == "retnet":
            self.register_buffer("log_decay", self.compute_log_decay(), persistent=False)
        else:
            raise ValueError(f"unknown linear mixer {kind!r}")
        if config.sla_gates:
            self.sla_q_proj = Linear(H * K, H, bias=False)
            self.sla_k_proj = Linear(H * K, H, bias=False)
        if config.use_short_conv:
            self.q_conv1d = ShortConvolution(H * K, config.conv_size)
            self.k_conv1d = ShortConvolution(H * K, config.conv_size)
        if config.use_output_gate:
            self.g_proj = Linear(hidden, H * V, bias=False)
            self.o_norm = GatedRMSNorm(V, eps=config.rms_norm_eps)
        else:
            self.o_norm = RMSNorm(V, eps=config.rms_norm_eps)
        self.o_proj = Linear(H * V, hidden, bias=config.output_bias)

    def compute_log_decay(self) -> torch.Tensor:
        """RetNet's per-head decay ``gamma_h = 1 - 2^(-5-h)``, as a log."""
        return (1 - 2.0 ** (-5 - torch.arange(self.num_heads, dtype=torch.float32))).log()

    def input_projections(self) -> tuple[nn.Linear, ...]:
        """What reads the layer's input in one product: q, k, v, GLA's narrow low-rank decay and the output
        gate. (The gate reads the input with padding zeroed, which changes only padded tokens' outputs.)"""
        low_gate = [self.gk_proj[0]] if self.kind == "gla" else []
        return self.q_proj, self.k_proj, self.v_proj, *low_gate, *([self.g_proj] if hasattr(self, "g_proj") else [])

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext, residual: torch.Tensor | None = None):
        """``(residual + output, None)``; ``residual`` (the block's skip connection) is optional."""
        cfg = self.config
        B, T, _ = hidden_states.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        x = zero_padding(hidden_states, ctx.token_mask)
        pool = ctx.cache.linear_pool(self.layer_idx) if ctx.cache is not None and T == 1 else None
        state = ctx.cache.read_linear(self.layer_idx, recurrent=pool is None) if ctx.cache is not None else None

        q_raw, k_raw, v_raw, *low = project(x, *self.input_projections())
        gate = low.pop() if hasattr(self, "g_proj") else None
        q_raw, k_raw = zero_padding(q_raw, ctx.token_mask), zero_padding(k_raw, ctx.token_mask)
        conv_out = None
        if cfg.use_short_conv:
            conv_in = state.conv if state is not None and state.conv is not None else (None, None)
            q_raw, conv_q = self.q_conv1d(q_raw, conv_in[0], ctx.use_cache, ctx.cu_seqlens)
            k_raw, conv_k = self.k_conv1d(k_raw, conv_in[1], ctx.use_cache, ctx.cu_seqlens)
            conv_out = (conv_q, conv_k)
        q = feature_map(q_raw.view(B, T, H, K), cfg.q_activation)
        k = feature_map(k_raw.view(B, T, H, K), cfg.key_activation(self.transition))
        v = feature_map(v_raw.view(B, T, H, V), cfg.v_activation)

        beta = None
        if self.kind == "gla":
            g = F.logsigmoid(self.gk_proj[1](low[0]).view(B, T, H, K)) / cfg.gate_logit_normalizer
        elif self.kind == "retnet":
            g = self.log_decay.to(q.dtype).view(1, 1, H, 1).expand(B, T, H, K)
        else:
            g, beta = gdn_gates(self.a_proj(x), self.b_proj(x), self.A_log, self.dt_bias, cfg.allow_neg_eigval)
            q, k = l2norm(q), l2norm(k)
        if cfg.sla_gates:
            read = torch.softmax(self.sla_q_proj(q_raw).float(), dim=-1)[..., None].to(q.dtype)
            write = torch.softmax(self.sla_k_proj(k_raw).float(), dim=-1)[..., None].to(q.dtype)
            q = q * read
            if self.kind == "gdn":
                v = v * write
            else:
                k = k * write
        k, v, g, beta = (zero_padding(t, ctx.token_mask) for t in (k, v, g, beta))

        if pool is not None:  # one token per sequence, state updated in place
            o = linear_decode(self.transition, *pool, q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                              None if beta is None else beta[:, 0])[:, None]
            ctx.cache.write_linear(self.layer_idx, LinearLayerState(None, conv_out))
            return output_projection(self, o.to(hidden_states.dtype), gate, residual), None
        o, recurrent = linear_attention(
            self.transition, q, k, v, g, beta,
            mode=cfg.linear_mode, chunk_size=cfg.chunk_size,
            initial_state=None if state is None else state.recurrent,
            output_final_state=ctx.use_cache,
            cu_seqlens=ctx.cu_seqlens,
        )
        if state is not None:
            ctx.cache.write_linear(self.layer_idx, LinearLayerState(recurrent, conv_out))
        return output_projection(self, o.to(hidden_states.dtype), gate, residual), None


def output_projection(layer: nn.Module, o: torch.Tensor, gate: torch.Tensor | None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head output norm, gated by ``gate`` (``g_proj``'s output, ``[B, T, H * V]``) when the layer has an
    output gate, then ``o_proj`` (plus ``residual``, when given)."""
    B, T = o.shape[:2]
    o = layer.o_norm(o) if gate is None else layer.o_norm(o, gate.view(B, T, -1, o.shape[-1]))
    return layer.o_proj(o.reshape(B, T, -1), residual)
