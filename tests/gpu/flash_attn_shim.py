"""A stand-in for the ``flash_attn`` package built on PyTorch SDPA, so that fla's ``Attention`` layer (which
imports flash-attn, absent from the GPU image) can run as a peer in parity tests. Same call signatures."""

import sys
import types

import torch
import torch.nn.functional as F


def _attend(q, k, v, causal, window_size):
    """``q: [T, H, D]``, ``k, v: [S, H_kv, D]`` of one sequence."""
    T, S = q.shape[0], k.shape[0]
    qi = torch.arange(S - T, S, device=q.device)[:, None]
    kj = torch.arange(S, device=q.device)[None, :]
    allowed = kj <= qi if causal else torch.ones(T, S, dtype=torch.bool, device=q.device)
    if window_size is not None and window_size[0] >= 0:
        allowed &= kj >= qi - window_size[0]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=allowed, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), **_):
    return torch.stack([_attend(q[b], k[b], v[b], causal, window_size) for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, window_size=(-1, -1), **_):
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        c, d = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        out[a:b] = _attend(q[a:b], k[c:d], v[c:d], causal, window_size)
    return out


def install():
    module = types.ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.__version__ = "0.0-sdpa-shim"
    sys.modules["flash_attn"] = module
