"""Gated delta rule (Gated DeltaNet) in PyTorch: the recurrent definition and the chunked (WY) form.

    S'_t = exp(g_t) S_{t-1}
    S_t  = S'_t + beta_t k_t^T (v_t - k_t S'_t),        o_t = scale * q_t S_t

``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g, beta: [B, T, H]`` (one log-decay and one write strength per
head and token). ``use_qk_l2norm`` L2-normalises q and k first (``x / sqrt(|x|^2 + 1e-6)``), as
``fla.ops.gated_delta_rule`` does with ``use_qk_l2norm_in_kernel=True``. Other conventions as in ``gla.py``.
"""

from __future__ import annotations

import torch

from .varlen import ChunkLayout, PaddedLayout, check_cu_seqlens, compute_dtype, dense_cu_seqlens, scan_chunks

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    dt = compute_dtype(x)
    y = x.to(dt)
    return (y * torch.rsqrt(y.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3] or g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(
            f"expected v [B, T, H, V], g and beta [B, T, H] matching q {tuple(q.shape)}, "
            f"got v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    B, T, H, K = q.shape
    num_seqs = B
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T)
        num_seqs = cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (num_seqs, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [{num_seqs}, {H}, {K}, {v.shape[-1]}], got {tuple(initial_state.shape)}"
        )


def _packed(fn, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, multiple, **kw):
    layout = PaddedLayout.from_cu_seqlens(cu_seqlens, multiple)
    q, k, v, g, beta = (layout.pad(x) for x in (q, k, v, g, beta))
    o, state = fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state, **kw)
    return layout.unpad(o), state


def gated_delta_step(state, q, k, v, g, beta, scale, use_qk_l2norm=False):
    """One token of the gated delta rule; any leading dims, computed in ``state``'s dtype."""
    dt = state.dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    state = g.to(dt).exp()[..., None, None] * state
    delta = v - torch.einsum("...k,...kv->...v", k, state)
    state = state + beta.to(dt)[..., None, None] * k[..., None] * delta[..., None, :]
    return state, torch.einsum("...k,...kv->...v", q * scale, state)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule: the definition."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if cu_seqlens is not None:
        return _packed(
            recurrent_gated_delta_rule, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, 1,
            scale=scale,
        )
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q)
    state = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    outputs = []
    for t in range(T):
        state, o = gated_delta_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale)
        outputs.append(o)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V, dtype=dt)
    return o.to(v.dtype), (state if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk-parallel gated delta rule through the WY representation.

    Within a chunk the written values solve ``(I + tril_strict(beta K K^T * D)) U = beta V - (beta Γ K) S``
    (``D_ij = exp(G_i - G_j)``, ``Γ_i = exp(G_i)``); a unit lower-triangular solve gives them exactly.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q)
    out_dtype = v.dtype
    if cu_seqlens is None:
        cu_seqlens = dense_cu_seqlens(B, T, q.device)
        q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    layout = ChunkLayout(cu_seqlens, chunk_size)

    def chunks(x):  # [1, T, H, *D] -> [NC, H, C, *D]
        return layout.to_chunks(x.to(dt)).transpose(1, 2)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    gc = g.cumsum(dim=-1)  # [NC, H, C]
    C = chunk_size
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    log_decay = gc.unsqueeze(-1) - gc.unsqueeze(-2)  # [NC, H, C_i, C_j]
    neg_inf = torch.full_like(log_decay, float("-inf"))
    decay_causal = torch.where(causal, log_decay, neg_inf).exp()
    decay_strict = torch.where(strict, log_decay, neg_inf).exp()

    k_beta = k * beta[..., None]
    system = torch.eye(C, dtype=dt, device=q.device) + (k_beta @ k.transpose(-1, -2)) * decay_strict
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)

    attn = (q @ k.transpose(-1, -2)) * decay_causal
    q_from_start = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()  # [NC, H]

    def step(ids, state):
        new_v = u[ids] - w[ids] @ state
        out = q_from_start[ids] @ state + attn[ids] @ new_v
        state = chunk_decay[ids][..., None, None] * state + k_to_end[ids].transpose(-1, -2) @ new_v
        return out, state

    num_seqs = cu_seqlens.numel() - 1
    state = q.new_zeros(num_seqs, H, K, V) if initial_state is None else initial_state.to(dt)
    o, state = scan_chunks(layout, state, step)
    if not o.numel():
        o = v.new_zeros(layout.num_chunks, H, C, V)
    o = layout.from_chunks((o * scale).transpose(1, 2))
    return o.reshape(B, T, H, V).to(out_dtype), (state if output_final_state else None)
