"""Sparse decode: one launch advances a batch of sequences by one token through an SSE (or GLA/GDN) layer.

Each sequence owns a row ``slots[b]`` of a state pool ``[rows, 1 + N, H, K, V]`` (partition 0 is the
shared one). A program handles one (sequence, head, block of V columns): it updates the shared partition,
then walks the token's ranked partitions (``topk[b, r]``, r < max(writers, readers)), writing the first
``num_writers`` and reading the first ``num_readers``. Unselected partitions are never loaded, so the
bytes moved per token are ``(1 + max(Kw, Kr)) * H * K * V * 2 * sizeof(state)``, independent of N.

No host synchronisation and shapes fixed by the batch size: the launch can be captured in a CUDA graph.
The PyTorch definition is :func:`sse_model.ops.sse.sse_decode_step`; tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sse_model.ops.delta_rule import L2NORM_EPS
from sse_model.ops.sse import Branch, Routing, SSEOptions


@triton.jit
def _l2norm(x, eps):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps))


@triton.jit
def _advance(S, q, k, v, g, beta, mask_k, GDN: tl.constexpr):
    """One transition of a [BK, BV] state tile; ``g`` is [BK] (GLA) or a scalar (GDN)."""
    if GDN:
        S = S * tl.exp(g)
        delta = v - tl.sum(k[:, None] * S, axis=0)
        S = S + beta * k[:, None] * delta[None, :]
    else:
        S = tl.exp(g)[:, None] * S + k[:, None] * v[None, :]
    return tl.where(mask_k[:, None], S, 0.0)


@triton.jit
def _sse_decode_kernel(
    pool, slots, o,
    q0, k0, g0, b0,  # shared branch [B, H, K]; g0 [B, H, K] (GLA) or [B, H] (GDN); b0 [B, H] (GDN)
    qs, ks, gs, bs,  # sparse branch, same layout
    v, topk, probs,  # v [B, H, V]; topk [B, KMAX]; probs [B, N] (float32)
    scale, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N: tl.constexpr, KMAX: tl.constexpr,
    NUM_WRITERS: tl.constexpr, NUM_READERS: tl.constexpr,
    WRITE_GATE: tl.constexpr, READ_GATE: tl.constexpr,
    GDN: tl.constexpr, GATE_VALUE: tl.constexpr, L2NORM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = iv * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    tile_mask = mask_k[:, None] & mask_v[None, :]
    bh = b * H + h
    row = tl.load(slots + b).to(tl.int64)
    part_stride = H * K * V
    tile = (h * K + offs_k[:, None]).to(tl.int64) * V + offs_v[None, :]
    base = pool + row * (1 + N) * part_stride

    val = tl.load(v + bh * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)

    # the shared partition: always written and read
    q = tl.load(q0 + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k0 + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if GDN:
        g = tl.load(g0 + bh).to(tl.float32)
        beta = tl.load(b0 + bh).to(tl.float32)
    else:
        g = tl.load(g0 + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        beta = 0.0
    if L2NORM:
        q = _l2norm(q, eps)
        k = _l2norm(k, eps)
    S = tl.load(base + tile, mask=tile_mask, other=0.0).to(tl.float32)
    S = _advance(S, q, k, val, g, beta, mask_k, GDN)
    tl.store(base + tile, S.to(pool.dtype.element_ty), mask=tile_mask)
    out = tl.sum((q * scale)[:, None] * S, axis=0)

    if KMAX > 0:
        q_sp = tl.load(qs + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k_sp = tl.load(ks + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if GDN:
            g_sp = tl.load(gs + bh).to(tl.float32)
            beta_sp = tl.load(bs + bh).to(tl.float32)
        else:
            g_sp = tl.load(gs + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            beta_sp = 0.0
        for r in tl.static_range(KMAX):
            part = tl.load(topk + b * KMAX + r).to(tl.int64)
            p = tl.load(probs + b * N + part).to(tl.float32)
            ptrs = base + (1 + part) * part_stride + tile
            S = tl.load(ptrs, mask=tile_mask, other=0.0).to(tl.float32)
            if r < NUM_WRITERS:
                w = p if WRITE_GATE else 1.0
                # gated inputs are rounded to the input dtype, as in the chunked (prefill) path
                if GDN and GATE_VALUE:
                    k_w = k_sp
                    v_w = (val * w).to(v.dtype.element_ty).to(tl.float32)
                else:
                    k_w = (k_sp * w).to(ks.dtype.element_ty).to(tl.float32)
                    v_w = val
                if L2NORM:
                    k_w = _l2norm(k_w, eps)
                S = _advance(S, q_sp, k_w, v_w, g_sp, beta_sp, mask_k, GDN)
                tl.store(ptrs, S.to(pool.dtype.element_ty), mask=tile_mask)
            if r < NUM_READERS:
                q_r = (q_sp * p).to(qs.dtype.element_ty).to(tl.float32) if READ_GATE else q_sp
                if L2NORM:
                    q_r = _l2norm(q_r, eps)
                out += tl.sum((q_r * scale)[:, None] * S, axis=0)
    tl.store(o + bh * V + offs_v, out.to(o.dtype.element_ty), mask=mask_v)


def _check(name, x, shape, device):
    if x is None:
        raise ValueError(f"sse decode: {name} is required")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"sse decode: {name} must have shape {list(shape)}, got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"sse decode: {name} is on {x.device}, the state pool on {device}")


def _block_v(V: int) -> int:
    return min(64, triton.next_power_of_2(V))


def _launch(pool, slots, shared: Branch, sparse: Branch | None, v, topk, probs, num_writers, num_readers,
            opts: SSEOptions, scale: float, num_sparse_partitions: int, out_dtype: torch.dtype | None = None):
    B, H, V = v.shape
    K = shared.q.shape[-1]
    device = pool.device
    if not pool.is_contiguous():
        raise ValueError("sse decode: the state pool must be contiguous")
    if pool.shape[-4:] != (1 + num_sparse_partitions, H, K, V) and not (num_sparse_partitions == 0 and pool.shape[-3:] == (H, K, V)):
        raise ValueError(f"sse decode: state pool {list(pool.shape)} does not match H={H}, K={K}, V={V}, "
                         f"N={num_sparse_partitions}")
    _check("slots", slots, (B,), device)
    gdn = opts.transition == "gdn"
    g_shape = (B, H) if gdn else (B, H, K)
    branches = [shared] + ([sparse] if sparse is not None else [])
    for prefix, br in zip(("shared", "sparse"), branches):
        _check(f"{prefix}.q", br.q, (B, H, K), device)
        _check(f"{prefix}.k", br.k, (B, H, K), device)
        _check(f"{prefix}.g", br.g, g_shape, device)
        if gdn:
            _check(f"{prefix}.beta", br.beta, (B, H), device)
    contiguous = [x.contiguous() if x is not None else None for x in
                  (shared.q, shared.k, shared.g, shared.beta)]
    sparse_args = [x.contiguous() if x is not None else None for x in
                   ((sparse.q, sparse.k, sparse.g, sparse.beta) if sparse is not None else (None,) * 4)]
    # unused pointers still need a tensor; the kernel never reads them (constexpr branches)
    dummy = v
    contiguous = [dummy if x is None else x for x in contiguous]
    sparse_args = [dummy if x is None else x for x in sparse_args]
    o = torch.empty(B, H, V, device=device, dtype=out_dtype or torch.float32)
    BV = _block_v(V)
    kmax = 0 if topk is None else topk.shape[1]
    grid = (B, H, triton.cdiv(V, BV))
    _sse_decode_kernel[grid](
        pool, slots.contiguous(), o, *contiguous, *sparse_args, v.contiguous(),
        dummy if topk is None else topk.contiguous(), dummy if probs is None else probs.contiguous(),
        scale, L2NORM_EPS,
        H=H, K=K, V=V, N=num_sparse_partitions, KMAX=kmax, NUM_WRITERS=num_writers, NUM_READERS=num_readers,
        WRITE_GATE=opts.write_gate, READ_GATE=opts.read_gate, GDN=gdn,
        GATE_VALUE=opts.gate_target == "value", L2NORM=gdn and opts.qk_l2norm,
        BK=triton.next_power_of_2(K), BV=BV, num_warps=4,
    )
    return o


def sse_decode_triton(pool, slots, shared: Branch, sparse: Branch, v, routing: Routing,
                      opts: SSEOptions, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Drop-in for :func:`sse_model.ops.sse.sse_decode_step` (same arguments, same in-place update); the output in
    ``out_dtype`` (default float32)."""
    B, H, K = shared.q.shape
    N = routing.num_sparse_partitions
    kmax = max(routing.num_writers, routing.num_readers)
    _check("routing.topk", routing.topk[:, :kmax], (B, kmax), pool.device)
    _check("routing.probs", routing.probs, (B, N), pool.device)
    scale = K**-0.5 if opts.scale is None else opts.scale
    return _launch(pool, slots, shared, sparse, v, routing.topk[:, :kmax],  # any integer type: no cast to launch
                   routing.probs.float(), routing.num_writers, routing.num_readers, opts, scale, N, out_dtype)


def linear_decode_triton(transition, pool, slots, q, k, v, g, beta=None, *, scale=None,
                         use_qk_l2norm=False) -> torch.Tensor:
    """Drop-in for the GLA / gated-delta-rule decode step: ``pool`` is ``[rows, H, K, V]``."""
    opts = SSEOptions(transition=transition, qk_l2norm=use_qk_l2norm)
    if use_qk_l2norm and transition != "gdn":
        raise ValueError("use_qk_l2norm is only defined for the gated delta rule")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _launch(pool, slots, Branch(q, k, g, beta), None, v, None, None, 0, 0, opts, scale, 0)
