"""Causal softmax attention over a packed batch without a ``[T, T]`` mask.

A packed row ``[1, H, T, D]`` holds several sequences back to back (``cu_seqlens``). A dense boolean mask over
the whole row costs ``T^2`` memory and turns SDPA's flash kernel off (one 2B attention layer at 33.8k tokens
needed 6.3 GiB for it); attending sequence by sequence with ``is_causal`` keeps the flash / memory-efficient
kernels and never materialises anything quadratic in the row. A sliding window builds a band mask per sequence,
and only when the sequence is longer than the window.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def segments_of(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the non-empty sequences of a packed row (one host sync)."""
    bounds = cu_seqlens.tolist()
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


# SDPA's backends for the sequences of a packed row, cuDNN left out: cuDNN builds an execution plan for every new
# shape, and packed rows of real data bring new sequence lengths at every step. Measured on an H100 at SmolLM2-135M's
# shape: distillation steps of 32k packed tokens took ~10 s on real data (new lengths every step) and 1.4 s on the same
# batches seen a second time (python -m pipeline.bench.distill_step); the packed-row benchmark
# (python -m kernels.bench.bench_packed --lengths 0 [--cudnn]) compares the two choices directly.
PACKED_SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def packed_backends(device: torch.device):
    """The context that restricts SDPA to :data:`PACKED_SDPA_BACKENDS` on CUDA (a no-op elsewhere)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in PACKED_SDPA_BACKENDS])


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[tuple[int, int]],
    window: int | None = None,
) -> torch.Tensor:
    """``q [1, Hq, T, D]``, ``k, v [1, Hkv, T, D]`` (GQA when ``Hkv < Hq``) -> ``[1, Hq, T, D]``: each query
    sees the keys of its own sequence at positions ``<= i`` (and ``> i - window``)."""
    if q.shape[0] != 1:
        raise ValueError(f"a packed batch has one row, got {q.shape[0]}")
    gqa = k.shape[1] != q.shape[1]
    outs = []
    with packed_backends(q.device):
        for start, end in segments:
            qs, ks, vs = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            L = end - start
            mask = None
            if window is not None and L > window:
                i = torch.arange(L, device=q.device)
                mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None and L > 1,
                                                       enable_gqa=gqa))
    covered = sum(e - s for s, e in segments)
    if covered != q.shape[2]:
        raise ValueError(f"the segments cover {covered} of the row's {q.shape[2]} tokens")
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
