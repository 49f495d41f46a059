"""The Sparse State Expansion mixer (SSE over a GLA or gated delta-rule transition).

Parameter names and the default computation follow the public reference, fla's ``SSEGLA``/``SSEGDN``,
so its checkpoints load unchanged (see ``sse_model/fla_compat.py``):

    q_proj, k_proj, v_proj          shared by all partitions
    lora_q_proj, lora_k_proj        low-rank difference between the shared and the sparse partitions' Q/K
    gk_proj[0], gk_proj[1]          GLA: low-rank decay gates of the shared and the sparse partitions
    a_proj, b_proj, A_log, dt_bias  GDN: decay and write strength, first half shared, second half sparse
    e_proj                          router over the N sparse partitions
    q_conv1d_shared, k_conv1d_shared  optional short convolutions of the shared partition's Q/K
    g_proj, o_norm, o_proj          low-rank output gate, per-head gated RMSNorm, output projection
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import LinearLayerState
from ..modules import GatedRMSNorm, Linear, RMSNorm, ShortConvolution, project, row_topk_softmax
from ..ops.delta_rule import l2norm
from ..ops.fused import feature_map
from ..ops.dispatch import (route_tokens, sse_attention, sse_decode, sse_decode_features, sse_low_rank_attention,
                            sse_low_rank_features)
from ..ops.sse import Branch, Routing, SSEOptions
from .common import ForwardContext, zero_padding
from .linear import gdn_gates, init_gdn_decay, output_projection


def balance_loss(routing: Routing, token_mask: torch.Tensor | None) -> torch.Tensor:
    """``N / K * sum_i f_i * P_i``: ``f_i`` the fraction of tokens writing partition i, ``P_i`` its mean
    router probability, both over real (non-padding) tokens. 1 when balanced, up to N / K when collapsed."""
    probs = routing.probs.float()
    chosen = routing.write_mask.float()
    if token_mask is not None:
        weight = token_mask.to(probs.dtype)[..., None]
        count = weight.sum().clamp(min=1)
        mean_prob = (probs * weight).sum(dim=(0, 1)) / count
        frac = (chosen * weight).sum(dim=(0, 1)) / count
    else:
        mean_prob = probs.mean(dim=(0, 1))
        frac = chosen.mean(dim=(0, 1))
    return routing.num_sparse_partitions / routing.num_writers * (mean_prob * frac).sum()


def _first(branch: Branch) -> Branch:
    return Branch(*(None if t is None else t[:, 0] for t in (branch.q, branch.k, branch.g, branch.beta)))


class SSEAttention(nn.Module):
    """One SSE layer; see :class:`~sse_model.SSEConfig` for the choices and ``ops/sse.py`` for the math."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        H, K, V = config.num_heads, config.head_dim, config.head_v_dim
        self.num_heads, self.head_k_dim, self.head_v_dim = H, K, V
        self.num_sparse_partitions = config.num_sparse_partitions
        self.transition = config.sse_transition
        hidden = config.hidden_size
        rank = config.resolved_lora_rank()

        bias = config.linear_qkv_bias
        self.q_proj = Linear(hidden, H * K, bias=bias)
        self.k_proj = Linear(hidden, H * K, bias=bias)
        self.v_proj = Linear(hidden, H * V, bias=bias)
        self.lora_q_proj = nn.Sequential(Linear(hidden, rank, bias=False), Linear(rank, H * K, bias=False))
        self.lora_k_proj = nn.Sequential(Linear(hidden, rank, bias=False), Linear(rank, H * K, bias=False))
        if self.transition == "gla":
            r = config.gate_low_rank_dim
            self.gk_proj = nn.ModuleList(
                nn.Sequential(Linear(hidden, r, bias=False), Linear(r, H * K, bias=True)) for _ in range(2)
            )
        else:
            self.a_proj = Linear(hidden, 2 * H, bias=False)
            self.b_proj = Linear(hidden, 2 * H, bias=False)
            self.A_log = nn.Parameter(torch.zeros(2 * H))
            self.dt_bias = nn.Parameter(torch.zeros(2 * H))
            init_gdn_decay(self.A_log, self.dt_bias)
        self.e_proj = Linear(hidden, self.num_sparse_partitions, bias=False)
        # a list to append each call's partition choice to (``[B, T, max(Kw, Kr)]``): where an engine and a trainer
        # route a token differently (benchmarks/rollout/bench_numerics.py); eager calls only (a CUDA graph's replay
        # runs no Python)
        self.routing_record: list | None = None
        if config.use_short_conv:
            self.q_conv1d_shared = ShortConvolution(H * K, config.conv_size)
            self.k_conv1d_shared = ShortConvolution(H * K, config.conv_size)
        if config.use_output_gate:
            self.g_proj = nn.Sequential(Linear(hidden, V, bias=False), Linear(V, H * V, bias=False))
            self.o_norm = GatedRMSNorm(V, eps=config.rms_norm_eps)
        else:
            self.o_norm = RMSNorm(V, eps=config.rms_norm_eps)
        self.o_proj = Linear(H * V, hidden, bias=config.output_bias)

        # the fused feature prologue covers the reference layer's computation (GLA, all rows, no convolution)
        self.fused_features = (self.transition == "gla" and not config.use_short_conv
                               and (config.row_topk is None or config.row_topk >= K))
        gating = config.sse_gating
        self.options = SSEOptions(
            transition=self.transition,
            write_gate=gating in ("write_read", "write"),
            read_gate=gating in ("write_read", "read"),
            gate_target=config.gdn_gate_target,
            qk_l2norm=self.transition == "gdn" and config.gdn_gate_target == "key",
            backward_head_groups=config.sse_backward_head_groups,
        )
        if H % config.sse_backward_head_groups:
            raise ValueError(f"sse_backward_head_groups ({config.sse_backward_head_groups}) must divide num_heads ({H})")

    def input_projections(self) -> tuple[nn.Linear, ...]:
        """What reads the layer's input in one product: q, k, v, the narrow first halves of the low-rank maps, the
        output gate's, and last the router. The router joins only in decode steps (training and prefill call
        ``e_proj``, so that its hooks see the logits there). The gate reads the input with padding zeroed, which
        changes only padded tokens' outputs."""
        narrow = [self.lora_q_proj[0], self.lora_k_proj[0]]
        if self.transition == "gla":
            narrow += [self.gk_proj[0][0], self.gk_proj[1][0]]
        if hasattr(self, "g_proj"):
            narrow.append(self.g_proj[0])
        return self.q_proj, self.k_proj, self.v_proj, *narrow, self.e_proj

    def low_rank_outputs(self) -> tuple[nn.Linear, ...]:
        """The second halves of the LoRA q, LoRA k and (GLA) both decay gates, in ``input_projections`` order."""
        gates = (self.gk_proj[0][1], self.gk_proj[1][1]) if self.transition == "gla" else ()
        return self.lora_q_proj[1], self.lora_k_proj[1], *gates

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(residual + output, balance loss)``; ``residual`` (the block's skip connection) is optional."""
        cfg = self.config
        B, T, _ = hidden_states.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        mask = ctx.token_mask
        x = zero_padding(hidden_states, mask)
        pool = ctx.cache.linear_pool(self.layer_idx) if ctx.cache is not None and T == 1 else None
        state = ctx.cache.read_linear(self.layer_idx, recurrent=pool is None) if ctx.cache is not None else None

        maps = self.input_projections()  # the router last: a decode step reads it in the same product
        q, k, v, *low = project(x, *(maps if pool is not None else maps[:-1]))
        router_logits = low.pop() if pool is not None else self.e_proj(x)
        gate = self.g_proj[1](low.pop()) if hasattr(self, "g_proj") else None
        q, k = zero_padding(q, mask), zero_padding(k, mask)

        def heads(t, d):
            return t.view(B, T, H, d)

        conv_out = None
        feature_inputs = None  # unpadded tokens: the feature map's inputs, which SSE takes itself
        if self.fused_features:
            options = dict(lora_side=cfg.lora_side, q_activation=cfg.q_activation,
                           k_activation=cfg.key_activation("gla"), normalizer=cfg.gate_logit_normalizer)
            ups = [(m.weight, m.bias) for m in self.low_rank_outputs()]  # the low-rank maps' second halves
            if pool is not None:  # a decode step: with the value's feature map in the same pass
                *features, v = sse_decode_features(heads(q, K), heads(k, K), heads(v, V), low, ups,
                                                   v_activation=cfg.v_activation, **options)
            else:
                v = feature_map(heads(v, V), cfg.v_activation)
                if mask is None:  # the feature map in SSE's own call (sse_low_rank_attention)
                    feature_inputs = (heads(q, K), heads(k, K), low, ups)
                else:  # the LoRA add, both feature maps, both log-decays; the backward keeps the rank-r inputs
                    features = sse_low_rank_features(heads(q, K), heads(k, K), low, ups, **options)
            if feature_inputs is None:
                q_shared, k_shared, g_shared, q_sparse, k_sparse, g_sparse = features
            beta_shared = beta_sparse = None
        else:
            lora_q, lora_k = self.lora_q_proj[1](low[0]), self.lora_k_proj[1](low[1])
            v = feature_map(heads(v, V), cfg.v_activation)
            if cfg.lora_side == "sparse":
                q_shared, k_shared, q_sparse, k_sparse = q, k, q + lora_q, k + lora_k
            else:
                q_shared, k_shared, q_sparse, k_sparse = q + lora_q, k + lora_k, q, k
            if cfg.use_short_conv:
                conv_in = state.conv if state is not None and state.conv is not None else (None, None)
                q_shared, conv_q = self.q_conv1d_shared(q_shared, conv_in[0], ctx.use_cache, ctx.cu_seqlens)
                k_shared, conv_k = self.k_conv1d_shared(k_shared, conv_in[1], ctx.use_cache, ctx.cu_seqlens)
                conv_out = (conv_q, conv_k)
            (q_shared, k_shared, rows_shared), (q_sparse, k_sparse, rows_sparse) = (
                self._features(heads(q_shared, K), heads(k_shared, K)),
                self._features(heads(q_sparse, K), heads(k_sparse, K)),
            )
            if self.transition == "gla":
                norm = cfg.gate_logit_normalizer
                g_shared = F.logsigmoid(heads(self.gk_proj[0][1](low[2]), K)) / norm
                g_sparse = F.logsigmoid(heads(self.gk_proj[1][1](low[3]), K)) / norm
                if rows_shared is not None:  # row top-k: rows that are not written are not decayed either
                    g_shared, g_sparse = g_shared * rows_shared, g_sparse * rows_sparse
                beta_shared = beta_sparse = None
            else:
                g, beta = gdn_gates(self.a_proj(x), self.b_proj(x), self.A_log, self.dt_bias, cfg.allow_neg_eigval)
                (g_shared, g_sparse), (beta_shared, beta_sparse) = g.chunk(2, dim=-1), beta.chunk(2, dim=-1)
                if cfg.gdn_gate_target == "value":
                    q_shared, k_shared, q_sparse, k_sparse = map(l2norm, (q_shared, k_shared, q_sparse, k_sparse))
        if feature_inputs is None:
            shared = Branch(q_shared, *(zero_padding(t, mask) for t in (k_shared, g_shared, beta_shared)))
            sparse = Branch(q_sparse, *(zero_padding(t, mask) for t in (k_sparse, g_sparse, beta_sparse)))
        v = zero_padding(v, mask)

        routing = route_tokens(router_logits, cfg.num_writers, cfg.num_readers)
        if self.routing_record is not None:
            self.routing_record.append(routing.topk.detach())
        if pool is not None:  # one token per sequence, partitions updated in place
            token = Routing(routing.probs[:, 0], routing.topk[:, 0], routing.num_writers, routing.num_readers)
            o = sse_decode(*pool, _first(shared), _first(sparse), v[:, 0], token, self.options,
                           out_dtype=hidden_states.dtype)[:, None]
            ctx.cache.write_linear(self.layer_idx, LinearLayerState(None, conv_out))
            # no balance loss: it is a training objective, and a decode step would spend a dozen launches on it
            return output_projection(self, o, gate, residual), None
        call = dict(implementation=cfg.sse_implementation, mode=cfg.linear_mode, chunk_size=cfg.chunk_size,
                    initial_state=None if state is None else state.recurrent, output_final_state=ctx.use_cache,
                    cu_seqlens=ctx.cu_seqlens)
        if feature_inputs is not None:
            o, recurrent = sse_low_rank_attention(*feature_inputs, v, routing, self.options, feature_options=options,
                                                  **call)
        else:
            o, recurrent = sse_attention(shared, sparse, v, routing, self.options, **call)
        if state is not None:
            ctx.cache.write_linear(self.layer_idx, LinearLayerState(recurrent, conv_out))
        out = output_projection(self, o.to(hidden_states.dtype), gate, residual)
        return out, balance_loss(routing, mask)

    def _features(self, q_raw: torch.Tensor, k_raw: torch.Tensor):
        """Feature maps of one side: ``(q, k, rows)``. With ``row_topk`` the key is ``softmax(top-k(.))``
        over its rows and ``rows`` the mask of the rows it writes; otherwise ``rows`` is None."""
        cfg = self.config
        q = feature_map(q_raw, cfg.q_activation)
        if cfg.row_topk is not None and cfg.row_topk < self.head_k_dim:
            k, rows = row_topk_softmax(k_raw, cfg.row_topk)
            return q, k, rows.to(k.dtype)
        return q, feature_map(k_raw, cfg.key_activation(self.transition)), None
