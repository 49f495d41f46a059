"""Gated linear attention (GLA) in PyTorch: the recurrent definition and the chunked form.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,        o_t = scale * q_t S_t

``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g`` is a log-decay (<= 0), states are ``[B, H, K, V]``.
Conventions follow flash-linear-attention (``fla.ops.gla``): ``scale`` defaults to ``K ** -0.5``; with
``cu_seqlens`` the batch is packed (``B == 1``) and states are per sequence. A RetNet-style fixed decay is a
GLA whose ``g`` is constant over time. Both functions are differentiable by autograd; states accumulate in
float32 (float64 for float64 inputs), outputs come back in the input dtype.
"""

from __future__ import annotations

import torch

from .varlen import ChunkLayout, PaddedLayout, check_cu_seqlens, compute_dtype, dense_cu_seqlens, scan_chunks


def _check(q, k, v, g, initial_state, cu_seqlens):
    if q.shape != k.shape or g.shape != k.shape:
        raise ValueError(f"q, k and g must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] matching q {tuple(q.shape)}, got {tuple(v.shape)}")
    B, T, H, K = q.shape
    num_seqs = B
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T)
        num_seqs = cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (num_seqs, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [{num_seqs}, {H}, {K}, {v.shape[-1]}], got {tuple(initial_state.shape)}"
        )


def _packed(fn, q, k, v, g, initial_state, output_final_state, cu_seqlens, multiple, **kw):
    layout = PaddedLayout.from_cu_seqlens(cu_seqlens, multiple)
    q, k, v, g = (layout.pad(x) for x in (q, k, v, g))
    o, state = fn(q, k, v, g, initial_state=initial_state, output_final_state=output_final_state, **kw)
    return layout.unpad(o), state


def gla_step(state, q, k, v, g, scale):
    """One token: ``S = diag(exp(g)) S + k^T v``, ``o = scale * q S``; any leading dims, in ``state``'s dtype."""
    dt = state.dtype
    state = g.to(dt).exp()[..., None] * state + k.to(dt)[..., None] * v.to(dt)[..., None, :]
    return state, torch.einsum("...k,...kv->...v", q.to(dt) * scale, state)


def recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GLA: the definition every faster path is checked against."""
    _check(q, k, v, g, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is not None:
        return _packed(recurrent_gla, q, k, v, g, initial_state, output_final_state, cu_seqlens, 1, scale=scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q)
    state = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    outputs = []
    for t in range(T):
        state, o = gla_step(state, q[:, t], k[:, t], v[:, t], g[:, t], scale)
        outputs.append(o)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V, dtype=dt)
    return o.to(v.dtype), (state if output_final_state else None)


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk-parallel GLA: exact intra-chunk attention plus a recurrence over chunk states.

    Inside a chunk, ``A_ij = sum_d q_id k_jd exp(G_id - G_jd)`` is formed from the exact pairwise
    log-decay differences (``G`` the in-chunk cumulative sum), which never overflows; across chunks both
    factors ``exp(G_i)`` and ``exp(G_last - G_j)`` are <= 1. Memory is ``O(T * chunk_size * K)`` per head.
    """
    _check(q, k, v, g, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q)
    out_dtype = v.dtype
    if cu_seqlens is None:
        cu_seqlens = dense_cu_seqlens(B, T, q.device)
        q, k, v, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
    layout = ChunkLayout(cu_seqlens, chunk_size)

    def chunks(x):  # [1, T, H, D] -> [NC, H, C, D]
        return layout.to_chunks(x.to(dt)).transpose(1, 2)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    gc = g.cumsum(dim=-2)
    C = chunk_size
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    log_decay = gc.unsqueeze(-2) - gc.unsqueeze(-3)  # [NC, H, C_i, C_j, K]
    decay = torch.where(causal[..., None], log_decay, torch.full_like(log_decay, float("-inf"))).exp()
    intra = torch.einsum("nhik,nhijk,nhjk->nhij", q, decay, k) @ v

    q_from_start = q * gc.exp()
    k_to_end = k * (gc[..., -1:, :] - gc).exp()
    chunk_decay = gc[..., -1, :].exp()  # [NC, H, K]

    def step(ids, state):
        out = q_from_start[ids] @ state
        state = chunk_decay[ids][..., None] * state + k_to_end[ids].transpose(-1, -2) @ v[ids]
        return out, state

    num_seqs = cu_seqlens.numel() - 1
    state = q.new_zeros(num_seqs, H, K, V) if initial_state is None else initial_state.to(dt)
    inter, state = scan_chunks(layout, state, step)
    o = (intra + inter) * scale if inter.numel() else intra * scale
    o = layout.from_chunks(o.transpose(1, 2))
    return o.reshape(B, T, H, V).to(out_dtype), (state if output_final_state else None)
