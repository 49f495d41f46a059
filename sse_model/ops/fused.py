"""Reference definitions of the elementwise stages that the Triton backend fuses (see ``kernels/fused.py``).

Each is a chain of small PyTorch ops whose memory traffic, not arithmetic, costs the time at training shapes;
the dispatch point (:mod:`sse_model.ops.dispatch`) runs one fused kernel per stage where a backend offers it
and these definitions everywhere else. Tests hold the two equal, gradients included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("identity", "silu", "softmax")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, times ``silu(gate)`` when a gate is given (GLA's output
    norm); computed in float32 (float64 for float64 inputs), returned in ``out_dtype`` (default ``x``'s)."""
    dtype = x.dtype if out_dtype is None else out_dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    x32 = x.to(wide)
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * weight.to(wide)
    if gate is not None:
        y = y * F.silu(gate.to(wide))
    return y.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the SwiGLU MLP's activation."""
    return F.silu(gate) * up


def feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """q/k/v feature maps over the last (head) dim; softmax runs in float32."""
    if name == "identity":
        return x
    if name == "silu":
        return F.silu(x)
    if name == "softmax":
        return torch.softmax(x.float() if x.dtype != torch.float64 else x, dim=-1).to(x.dtype)
    raise ValueError(f"unknown feature map {name!r}")


def sse_features(q, q_lora, k, k_lora, gk_shared, gk_sparse, *, lora_side: str, q_activation: str,
                 k_activation: str, normalizer: float):
    """The SSE (GLA transition) layer's inputs of both sides from its projections, all ``[..., H, K]``:
    ``q`` and ``k`` plus their LoRA difference on ``lora_side``, feature-mapped; log-decays
    ``logsigmoid(gk) / normalizer``. Returns ``(q, k, g)`` of the shared side, then of the sparse side."""
    if lora_side == "sparse":
        q_sh, k_sh, q_sp, k_sp = q, k, q + q_lora, k + k_lora
    else:
        q_sh, k_sh, q_sp, k_sp = q + q_lora, k + k_lora, q, k
    q_sh, q_sp = feature_map(q_sh, q_activation), feature_map(q_sp, q_activation)
    k_sh, k_sp = feature_map(k_sh, k_activation), feature_map(k_sp, k_activation)
    g_sh, g_sp = F.logsigmoid(gk_shared) / normalizer, F.logsigmoid(gk_sparse) / normalizer
    return q_sh, k_sh, g_sh, q_sp, k_sp, g_sp


def sse_low_rank_features(q, k, low, up, *, lora_side: str, q_activation: str, k_activation: str,
                          normalizer: float):
    """:func:`sse_features` from the layer's first product: the second halves of its low-rank maps applied
    first (``low``: the rank-r inputs of the LoRA q, LoRA k and both gates, ``[..., r]``; ``up``: their
    ``(weight, bias)``). ``q, k: [..., H, K]``. Where a backend fuses it, training keeps the rank-r inputs for
    the backward instead of four full-width products."""
    H, K = q.shape[-2:]
    lora_q, lora_k, gk_shared, gk_sparse = (F.linear(x, w, b).unflatten(-1, (H, K)) for x, (w, b) in zip(low, up))
    return sse_features(q, lora_q, k, lora_k, gk_shared, gk_sparse, lora_side=lora_side, q_activation=q_activation,
                        k_activation=k_activation, normalizer=normalizer)


def sse_decode_features(q, k, v, low, up, *, lora_side: str, q_activation: str, k_activation: str,
                        v_activation: str, normalizer: float):
    """A decode step's SSE (GLA transition) inputs from the layer's first product: :func:`sse_low_rank_features`
    and the value's feature map. ``v: [..., H, V]``. Returns ``(q, k, g)`` of the shared side, of the sparse side,
    then ``v``. One fused pass replaces four narrow products and two elementwise kernels per layer and step."""
    features = sse_low_rank_features(q, k, low, up, lora_side=lora_side, q_activation=q_activation,
                                     k_activation=k_activation, normalizer=normalizer)
    return (*features, feature_map(v, v_activation))
