"""Chunked SSE over the GLA transition in Triton: training forward/backward and prefill, varlen, no fla.

The kernels run Algorithm 2 of the SSE paper (varlen) without materialising it. A *row* is one (token,
partition) pair: rows ``[0, L)`` are the shared partition (row = token), rows ``[L, L + P)`` are the
sparse pairs of :class:`~sse_model.ops.sse.VarlenPlan` (``tok[r - L]`` their token). Rows are grouped into
*segments*, one per (sequence, partition), and every kernel loads q / k / v / g straight from the token
tensors through ``tok`` and applies the router's gates on the fly, so no gathered, gated or concatenated
copy is ever written. Per row, with ``a, b, m`` the read weight, write weight and write mask of the pair
(all 1 for shared rows):

    q_r = a * q[tok],  k_r = b * k[tok],  v_r = m * v[tok],  g_r = m * g[tok]

and each segment is an ordinary GLA recurrence ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``,
``o_t = scale * q_t S_t``; a token's output is the sum over its rows.

Each segment is cut into chunks of ``C`` rows. Per chunk, with ``G`` the in-chunk cumulative log-decay:

    o     = scale * [(q * e^G) h  +  A v],        A_ij = sum_d q_id k_jd e^(G_id - G_jd)  (j <= i)
    h'    = e^G_last * h  +  (k * e^(G_last - G))^T v

The intra-chunk matrix ``A`` is one matrix product of ``q e^G`` and ``k e^-G`` whenever ``|G| <= SAFE_LOG2``
(in log2 units) over the chunk, which keeps both factors inside float32 range; a chunk that decays harder
than that takes an exact elementwise path (slower, never inexact). Decays must be log-decays (``g <= 0``).

Kernels (grid axis 2 is the head):
    ``_fwd_h``:    per (segment, K-block x V-block), walks the chunks: stores each chunk's initial state (kept
                   for the backward, or made again there a group of heads at a time: ``_Call.head_groups``);
    ``_fwd_o``:    per chunk: the output, added into the token's output;
    ``_bwd_dh``:   per segment, walks the chunks backwards: the gradient of each chunk's final state;
    ``_bwd_dv``:   per chunk: dv;
    ``_bwd_dqkg``: per chunk: dq, dk, dg, and the gradients of the router's read and write weights;
    ``_carry``:    where a call's walks go in pieces (few long sequences, ``_piece_chunks``): each piece was
                   walked from zero, this adds what enters it to its chunks' states.
Each runs as one launch for the shared segments and one for the sparse ones; the sparse launches go to a
second stream while the shared partition's walk runs (:class:`_Overlap`), and at K = 1 the sparse output
launches write each token's output / dv and the shared ones add to it.
The pairs and chunk tables are built on the device by ``kernels/plan.py`` without a host synchronisation
(grids are upper bounds; programs past the end return at once); lengths are not specialised on, so packed
batches of any length reuse one compilation. The PyTorch ops of ``sse_model/ops`` are the reference the tests
hold these to.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.fused import (_features_backward, _features_forward, _low_rank_backward, _low_rank_products, _maps_in,
                           low_rank_features_decline)
from kernels.plan import CHUNK, ChunkPlan, build_plans
from sse_model.ops.checkpointing import kept_outputs
from sse_model.ops.fused import ACTIVATIONS
from sse_model.ops.sse import Branch, Routing, SSEOptions, VarlenPlan
from sse_model.ops.varlen import check_cu_seqlens, dense_cu_seqlens

LOG2E = tl.constexpr(1.4426950408889634)
SAFE_LOG2 = 86.0  # 2^86 ~ 1e26: e^G and e^-G, and their products with any sane gradient, stay finite


# ----------------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _rows(start, end, L, tok, rw, ww, wm, C: tl.constexpr, SPARSE: tl.constexpr):
    """Token index, validity and (read weight, write weight, write mask) of rows ``start .. start + C``, which
    are sparse pairs or shared rows as ``SPARSE`` says (a compile-time choice: no branch inside the loops that
    walk a segment, so their loads can be pipelined)."""
    rows = start + tl.arange(0, C)
    valid = rows < end
    if SPARSE:
        idx = rows - L
        t = tl.load(tok + idx, mask=valid, other=0).to(tl.int64)
        a = tl.load(rw + idx, mask=valid, other=0.0).to(tl.float32)
        b = tl.load(ww + idx, mask=valid, other=0.0).to(tl.float32)
        m = tl.load(wm + idx, mask=valid, other=0.0).to(tl.float32)
    else:
        t = rows.to(tl.int64)
        a = valid.to(tl.float32)
        b = a
        m = a
    return t, valid, a, b, m


@triton.jit
def _load(ptr, t, valid, i_h, H: tl.constexpr, D: tl.constexpr, offs, dmask):
    """Rows ``t`` of head ``i_h`` of a ``[tokens, H, D]`` tensor, columns ``offs``, as float32."""
    p = ptr + (t[:, None] * H + i_h) * D + offs[None, :]
    return tl.load(p, mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, x, t, valid, i_h, H: tl.constexpr, D: tl.constexpr, offs, dmask, ACCUM: tl.constexpr):
    p = ptr + (t[:, None] * H + i_h) * D + offs[None, :]
    mask = valid[:, None] & dmask[None, :]
    if ACCUM:
        x += tl.load(p, mask=mask, other=0.0).to(tl.float32)
    tl.store(p, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, DT: tl.constexpr, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _chunk(gid, chunk_seg, chunk_start, cu_seg, L, tok, rw, ww, wm, C: tl.constexpr, SPARSE: tl.constexpr):
    """First row and rows (see :func:`_rows`) of chunk ``gid``."""
    start = tl.load(chunk_start + gid).to(tl.int64)
    end = tl.load(cu_seg + tl.load(chunk_seg + gid) + 1).to(tl.int64)
    t, valid, a, b, m = _rows(start, end, L, tok, rw, ww, wm, C, SPARSE)
    return start, t, valid, a, b, m


@triton.jit
def _qkg(q, k, g, t, valid, a, b, m, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, mk):
    """One K-block of a chunk's gated q and k and its log2-decay ``g * m * log2(e)`` (not yet summed)."""
    qq = _load(q, t, valid, i_h, H, K, offs_k, mk) * a[:, None]
    kk = _load(k, t, valid, i_h, H, K, offs_k, mk) * b[:, None]
    gg = _load(g, t, valid, i_h, H, K, offs_k, mk) * (m * LOG2E)[:, None]
    return qq, kk, gg


@triton.jit
def _segment(cu_seg, chunk_off, seg, S, NP):
    """Row range, first chunk id and state row of a segment."""
    bos = tl.load(cu_seg + seg).to(tl.int64)
    eos = tl.load(cu_seg + seg + 1).to(tl.int64)
    c0 = tl.load(chunk_off + seg).to(tl.int64)
    return bos, eos, c0, _state_row(seg, S, NP).to(tl.int64)


@triton.jit
def _piece(cu_seg, chunk_off, seg0, S, NP, H0, M, MAXP, C: tl.constexpr):
    """A walk program's place (grid axis 1: segment x piece of ``M`` chunks, ``MAXP`` a segment; axis 2: the head
    of a group from ``H0``): segment, piece, head, the segment's rows, first chunk and state row, its chunks and
    pieces (at least one)."""
    pid, i_s = tl.program_id(1), tl.program_id(2)
    seg, p = seg0 + pid // MAXP, pid % MAXP
    bos, eos, c0, srow = _segment(cu_seg, chunk_off, seg, S, NP)
    n = tl.cdiv(eos - bos, C)
    return seg, p, H0 + i_s, bos, eos, c0, srow, n, tl.maximum(tl.cdiv(n, M), 1)


@triton.jit
def _state_tile(i_kv, NV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Key / value offsets of program ``i_kv``'s ``[BK, BV]`` tile of a ``[K, V]`` state, its offsets and mask."""
    offs_k = (i_kv // NV) * BK + tl.arange(0, BK)
    offs_v = (i_kv % NV) * BV + tl.arange(0, BV)
    mk, mv = offs_k < K, offs_v < V
    return offs_k, offs_v, mk, mv, offs_k[:, None] * V + offs_v[None, :], mk[:, None] & mv[None, :]


@triton.jit
def _state_row(seg, S, NP):
    """Row of ``[num_seqs * (1 + NP), H, K, V]`` states for a segment (shared ones first, then sparse)."""
    if seg >= S:
        s = seg - S
        r = (s // NP) * (1 + NP) + 1 + s % NP
    else:
        r = seg * (1 + NP)
    return r


@triton.jit
def _intra_A(q, k, gc, qg, C: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, SAFE: tl.constexpr):
    """``sum_d q_id k_jd 2^(gc_id - gc_jd)`` for one K-block (unmasked above the diagonal only in the fast path)."""
    if tl.max(tl.max(tl.abs(gc), axis=1), axis=0) <= SAFE:
        A = _dot(qg, tl.trans(k * tl.exp2(-gc)), DT, IEEE)
    else:
        rows = tl.arange(0, C)
        A = tl.zeros([C, C], dtype=tl.float32)
        for j in range(C):
            sel = (rows == j)[:, None]
            kj = tl.sum(tl.where(sel, k, 0.0), axis=0)
            gj = tl.sum(tl.where(sel, gc, 0.0), axis=0)
            col = tl.sum(q * kj[None, :] * tl.exp2(tl.minimum(gc - gj[None, :], 0.0)), axis=1)
            A += tl.where(rows[None, :] == j, col[:, None], 0.0)
    return A


@triton.jit
def _intra_grads(dA, q, k, gc, C: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, SAFE: tl.constexpr):
    """``dq_i = sum_j dA_ij k_j 2^(gc_i - gc_j)``, ``dk_j = sum_i dA_ij q_i 2^(gc_i - gc_j)``; ``dA`` is causal."""
    if tl.max(tl.max(tl.abs(gc), axis=1), axis=0) <= SAFE:
        eg = tl.exp2(gc)
        ieg = tl.exp2(-gc)
        dq = eg * _dot(dA, k * ieg, DT, IEEE)
        dk = ieg * _dot(tl.trans(dA), q * eg, DT, IEEE)
    else:
        rows = tl.arange(0, C)
        dq = tl.zeros_like(q)
        dk = tl.zeros_like(k)
        for j in range(C):
            sel = (rows == j)[:, None]
            kj = tl.sum(tl.where(sel, k, 0.0), axis=0)
            gj = tl.sum(tl.where(sel, gc, 0.0), axis=0)
            col = tl.sum(tl.where(rows[None, :] == j, dA, 0.0), axis=1)  # dA[:, j]
            decay = tl.exp2(tl.minimum(gc - gj[None, :], 0.0))
            dq += col[:, None] * kj[None, :] * decay
            dk += tl.where(sel, tl.sum(col[:, None] * q * decay, axis=0)[None, :], 0.0)
    return dq, dk


# ----------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _walk_h(k, g, v, tok, ww, wm, h_tile, b_h, j0, j1, bos, eos, L, i_h, offs_k, offs_v, mk, mv, tmask, decay_before,
            H: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
            DT: tl.constexpr, IEEE: tl.constexpr, SPARSE: tl.constexpr, PIECES: tl.constexpr):
    """The state pass over chunks ``j0 .. j1`` of one segment from state ``b_h``: stores each chunk's initial
    state at ``h_tile`` (chunk after chunk, in states of ``HS`` heads); returns the final one and, with
    ``PIECES``, the log2-decay summed over the chunks, each chunk's sum before it stored at ``decay_before``."""
    acc = offs_k.to(tl.float32) * 0.0
    for j in range(j0, j1):
        tl.store(h_tile + j * HS * K * V, b_h.to(h_tile.dtype.element_ty), mask=tmask)
        if PIECES:
            tl.store(decay_before + j * HS * K, acc, mask=mk)
        t, valid, a, b, m = _rows(bos + j * C, eos, L, tok, ww, ww, wm, C, SPARSE)
        kk = _load(k, t, valid, i_h, H, K, offs_k, mk) * b[:, None]
        gg = _load(g, t, valid, i_h, H, K, offs_k, mk) * (m * LOG2E)[:, None]
        vv = _load(v, t, valid, i_h, H, V, offs_v, mv) * m[:, None]
        gc = tl.cumsum(gg, axis=0)
        gl = tl.sum(gg, axis=0)
        b_h = b_h * tl.exp2(gl)[:, None] + _dot(tl.trans(kk * tl.exp2(gl[None, :] - gc)), vv, DT, IEEE)
        if PIECES:
            acc += gl
    return b_h, acc


@triton.jit(do_not_specialize=["L", "S", "NP", "seg0", "H0", "M", "MAXP"])
def _fwd_h(
    k_sh, k_sp, g_sh, g_sp, v, tok, ww, wm, h, h0, ht, cu_seg, chunk_off, piece_end, piece_decay, decay_before,
    L, S, NP, seg0, H0, M, MAXP,
    H: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DT: tl.constexpr,
    IEEE: tl.constexpr, PIECES: tl.constexpr,
):
    # heads H0 .. H0 + HS of H (a group of them in the backward, see _backward); h holds HS heads; without PIECES
    # one piece of every chunk a segment
    i_kv, i_s = tl.program_id(0), tl.program_id(2)
    seg, p, i_h, bos, eos, c0, srow, n, pieces = _piece(cu_seg, chunk_off, seg0, S, NP, H0, M, MAXP, C)
    if p >= pieces:
        return
    offs_k, offs_v, mk, mv, tile, tmask = _state_tile(i_kv, NV, K, V, BK, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:  # the first piece starts from the initial state, the others from zero (see _carry)
        if p == 0:
            b_h += tl.load(h0 + (srow * H + i_h) * K * V + tile, mask=tmask, other=0.0).to(tl.float32)
    h_tile = h + (c0 * HS + i_s) * K * V + tile
    before = decay_before + (c0 * HS + i_s) * K + offs_k
    j0, j1 = p * M, tl.minimum(p * M + M, n)
    if seg >= S:
        b_h, acc = _walk_h(k_sp, g_sp, v, tok, ww, wm, h_tile, b_h, j0, j1, bos, eos, L, i_h, offs_k, offs_v, mk, mv,
                           tmask, before, H, HS, K, V, C, DT, IEEE, True, PIECES)
    else:
        b_h, acc = _walk_h(k_sh, g_sh, v, tok, ww, wm, h_tile, b_h, j0, j1, bos, eos, L, i_h, offs_k, offs_v, mk, mv,
                           tmask, before, H, HS, K, V, C, DT, IEEE, False, PIECES)
    if PIECES:
        piece = (seg * MAXP + p) * HS + i_s
        tl.store(piece_end + piece * K * V + tile, b_h, mask=tmask)
        tl.store(piece_decay + piece * K + offs_k, acc, mask=mk)
    elif STORE_HT:
        tl.store(ht + (srow * H + i_h) * K * V + tile, b_h, mask=tmask)


@triton.jit(do_not_specialize=["L", "scale"])
def _fwd_o(
    q, k, g, v, h, o, tok, rw, ww, wm, ids, chunk_seg, chunk_start, cu_seg, scale,
    L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NK: tl.constexpr, OUT_BY_TOKEN: tl.constexpr, ACCUM: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
    SAFE: tl.constexpr, SPARSE: tl.constexpr,
):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    gid = tl.load(ids + i_c).to(tl.int64)
    if gid < 0:
        return
    start, t, valid, a, b, m = _chunk(gid, chunk_seg, chunk_start, cu_seg, L, tok, rw, ww, wm, C, SPARSE)
    offs_v = i_v * BV + tl.arange(0, BV)
    mv = offs_v < V
    b_o = tl.zeros([C, BV], dtype=tl.float32)
    b_A = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(NK):
        offs_k = i_k * BK + tl.arange(0, BK)
        mk = offs_k < K
        qq, kk, gg = _qkg(q, k, g, t, valid, a, b, m, i_h, H, K, offs_k, mk)
        gc = tl.cumsum(gg, axis=0)
        qg = qq * tl.exp2(gc)
        hh = tl.load(h + (gid * H + i_h) * K * V + offs_k[:, None] * V + offs_v[None, :],
                     mask=mk[:, None] & mv[None, :], other=0.0)
        b_o += _dot(qg, hh, DT, IEEE)
        b_A += _intra_A(qq, kk, gc, qg, C, DT, IEEE, SAFE)
    rows = tl.arange(0, C)
    b_A = tl.where(rows[:, None] >= rows[None, :], b_A, 0.0)
    vv = _load(v, t, valid, i_h, H, V, offs_v, mv) * m[:, None]
    b_o = (b_o + _dot(b_A, vv, DT, IEEE)) * scale
    if OUT_BY_TOKEN:
        _store(o, b_o, t, valid, i_h, H, V, offs_v, mv, ACCUM)
    else:
        _store(o, b_o, start - L + rows, valid, i_h, H, V, offs_v, mv, False)


@triton.jit
def _walk_dh(q, g, do, tok, rw, wm, dh_tile, b_dh, j0, j1, bos, eos, scale, L, i_h, offs_k, offs_v, mk, mv, tmask,
             decay_before, H: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
             DT: tl.constexpr, IEEE: tl.constexpr, SPARSE: tl.constexpr, PIECES: tl.constexpr):
    """The state-gradient pass over chunks ``j0 .. j1`` of one segment, last to first, from ``b_dh``: stores the
    gradient of each chunk's final state at ``dh_tile`` (chunk after chunk), returns that of the first chunk's
    initial state and, with ``PIECES``, the log2-decay summed as :func:`_walk_h` does."""
    acc = offs_k.to(tl.float32) * 0.0
    for jj in range(0, j1 - j0):
        j = j1 - 1 - jj
        tl.store(dh_tile + j * HS * K * V, b_dh.to(dh_tile.dtype.element_ty), mask=tmask)
        if PIECES:
            tl.store(decay_before + j * HS * K, acc, mask=mk)
        t, valid, a, b, m = _rows(bos + j * C, eos, L, tok, rw, rw, wm, C, SPARSE)
        qq = _load(q, t, valid, i_h, H, K, offs_k, mk) * a[:, None]
        gg = _load(g, t, valid, i_h, H, K, offs_k, mk) * (m * LOG2E)[:, None]
        dd = _load(do, t, valid, i_h, H, V, offs_v, mv)
        gc = tl.cumsum(gg, axis=0)
        gl = tl.sum(gg, axis=0)
        b_dh = b_dh * tl.exp2(gl)[:, None] + _dot(tl.trans(qq * tl.exp2(gc) * scale), dd, DT, IEEE)
        if PIECES:
            acc += gl
    return b_dh, acc


@triton.jit(do_not_specialize=["L", "S", "NP", "seg0", "H0", "scale", "M", "MAXP"])
def _bwd_dh(
    q_sh, q_sp, g_sh, g_sp, do, tok, rw, wm, dh, dht, dh0, cu_seg, chunk_off, piece_end, piece_decay, decay_before,
    scale, L, S, NP, seg0, H0, M, MAXP,
    H: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DT: tl.constexpr,
    IEEE: tl.constexpr, PIECES: tl.constexpr,
):
    i_kv, i_s = tl.program_id(0), tl.program_id(2)
    seg, p, i_h, bos, eos, c0, srow, n, pieces = _piece(cu_seg, chunk_off, seg0, S, NP, H0, M, MAXP, C)
    if p >= pieces:
        return
    offs_k, offs_v, mk, mv, tile, tmask = _state_tile(i_kv, NV, K, V, BK, BV)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:  # the last piece starts from the final state's gradient, the others from zero (see _carry)
        if p == pieces - 1:
            b_dh += tl.load(dht + (srow * H + i_h) * K * V + tile, mask=tmask, other=0.0).to(tl.float32)
    dh_tile = dh + (c0 * HS + i_s) * K * V + tile
    before = decay_before + (c0 * HS + i_s) * K + offs_k
    j0, j1 = p * M, tl.minimum(p * M + M, n)
    if seg >= S:
        b_dh, acc = _walk_dh(q_sp, g_sp, do, tok, rw, wm, dh_tile, b_dh, j0, j1, bos, eos, scale, L, i_h, offs_k,
                             offs_v, mk, mv, tmask, before, H, HS, K, V, C, DT, IEEE, True, PIECES)
    else:
        b_dh, acc = _walk_dh(q_sh, g_sh, do, tok, rw, wm, dh_tile, b_dh, j0, j1, bos, eos, scale, L, i_h, offs_k,
                             offs_v, mk, mv, tmask, before, H, HS, K, V, C, DT, IEEE, False, PIECES)
    if PIECES:
        piece = (seg * MAXP + p) * HS + i_s
        tl.store(piece_end + piece * K * V + tile, b_dh, mask=tmask)
        tl.store(piece_decay + piece * K + offs_k, acc, mask=mk)
    elif STORE_DH0:
        tl.store(dh0 + (srow * H + i_h) * K * V + tile, b_dh, mask=tmask)


@triton.jit(do_not_specialize=["S", "NP", "seg0", "H0", "M", "MAXP"])
def _carry(
    h, piece_end, piece_decay, decay_before, final, cu_seg, chunk_off,
    S, NP, seg0, H0, M, MAXP,
    H: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, STORE_FINAL: tl.constexpr, REVERSE: tl.constexpr,
):
    """The second half of a walk split into pieces (``_fwd_h``, or ``_bwd_dh`` with ``REVERSE``): each piece
    walked from zero, its chunks' states are completed with the state that enters it, the pieces walked before
    it folded in walk order (each one's end, ``piece_end``, after the entering state decayed over it,
    ``piece_decay``), decayed to each chunk (``decay_before``); the segment's last piece in walk order stores
    its final state (the final state, or the initial state's gradient)."""
    i_kv, i_s = tl.program_id(0), tl.program_id(2)
    seg, p, i_h, bos, eos, c0, srow, n, pieces = _piece(cu_seg, chunk_off, seg0, S, NP, H0, M, MAXP, C)
    if p >= pieces:
        return
    offs_k, offs_v, mk, mv, tile, tmask = _state_tile(i_kv, NV, K, V, BK, BV)
    if REVERSE:
        walked = pieces - 1 - p
    else:
        walked = p
    b = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, walked):
        if REVERSE:
            q = pieces - 1 - i
        else:
            q = i
        piece = (seg * MAXP + q) * HS + i_s
        d = tl.load(piece_decay + piece * K + offs_k, mask=mk, other=0.0)
        b = b * tl.exp2(d)[:, None] + tl.load(piece_end + piece * K * V + tile, mask=tmask, other=0.0)
    if walked > 0:
        for j in range(p * M, tl.minimum(p * M + M, n)):
            at = (c0 + j) * HS + i_s
            d = tl.load(decay_before + at * K + offs_k, mask=mk, other=0.0)
            x = tl.load(h + at * K * V + tile, mask=tmask, other=0.0).to(tl.float32) + tl.exp2(d)[:, None] * b
            tl.store(h + at * K * V + tile, x.to(h.dtype.element_ty), mask=tmask)
    if STORE_FINAL:
        if walked == pieces - 1:
            piece = (seg * MAXP + p) * HS + i_s
            d = tl.load(piece_decay + piece * K + offs_k, mask=mk, other=0.0)
            end = b * tl.exp2(d)[:, None] + tl.load(piece_end + piece * K * V + tile, mask=tmask, other=0.0)
            tl.store(final + (srow * H + i_h) * K * V + tile, end, mask=tmask)


@triton.jit(do_not_specialize=["L", "H0", "scale"])
def _bwd_dv(
    q, k, g, do, dh, dv, tok, rw, ww, wm, ids, chunk_seg, chunk_start, cu_seg, scale,
    L, H0,
    H: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NK: tl.constexpr, OUT_BY_TOKEN: tl.constexpr, ACCUM: tl.constexpr, DT: tl.constexpr,
    IEEE: tl.constexpr, SAFE: tl.constexpr, SPARSE: tl.constexpr,
):
    i_v, i_c, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = H0 + i_s
    gid = tl.load(ids + i_c).to(tl.int64)
    if gid < 0:
        return
    start, t, valid, a, b, m = _chunk(gid, chunk_seg, chunk_start, cu_seg, L, tok, rw, ww, wm, C, SPARSE)
    offs_v = i_v * BV + tl.arange(0, BV)
    mv = offs_v < V
    b_dv = tl.zeros([C, BV], dtype=tl.float32)
    b_A = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(NK):
        offs_k = i_k * BK + tl.arange(0, BK)
        mk = offs_k < K
        qq, kk, gg = _qkg(q, k, g, t, valid, a, b, m, i_h, H, K, offs_k, mk)
        gc = tl.cumsum(gg, axis=0)
        gl = tl.sum(gg, axis=0)
        b_A += _intra_A(qq, kk, gc, qq * tl.exp2(gc), C, DT, IEEE, SAFE)
        dhh = tl.load(dh + (gid * HS + i_s) * K * V + offs_k[:, None] * V + offs_v[None, :],
                      mask=mk[:, None] & mv[None, :], other=0.0)
        b_dv += _dot(kk * tl.exp2(gl[None, :] - gc), dhh, DT, IEEE)
    rows = tl.arange(0, C)
    b_A = tl.where(rows[:, None] >= rows[None, :], b_A * scale, 0.0)
    dd = _load(do, t, valid, i_h, H, V, offs_v, mv)
    b_dv = (b_dv + _dot(tl.trans(b_A), dd, DT, IEEE)) * m[:, None]
    if OUT_BY_TOKEN:
        _store(dv, b_dv, t, valid, i_h, H, V, offs_v, mv, ACCUM)
    else:
        _store(dv, b_dv, start - L + rows, valid, i_h, H, V, offs_v, mv, False)


@triton.jit(do_not_specialize=["L", "H0", "scale"])
def _bwd_dqkg(
    q, k, g, v, do, h, dh, dq, dk, dg, dab, tok, rw, ww, wm, ids, chunk_seg, chunk_start, cu_seg, scale,
    L, H0,
    H: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, OUT_BY_TOKEN: tl.constexpr, GATE_GRADS: tl.constexpr,
    DT: tl.constexpr, IEEE: tl.constexpr, SAFE: tl.constexpr, SPARSE: tl.constexpr,
):
    i_k, i_c, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = H0 + i_s
    gid = tl.load(ids + i_c).to(tl.int64)
    if gid < 0:
        return
    start, t, valid, a, b, m = _chunk(gid, chunk_seg, chunk_start, cu_seg, L, tok, rw, ww, wm, C, SPARSE)
    rows = tl.arange(0, C)
    offs_k = i_k * BK + tl.arange(0, BK)
    mk = offs_k < K
    q_raw = _load(q, t, valid, i_h, H, K, offs_k, mk)
    k_raw = _load(k, t, valid, i_h, H, K, offs_k, mk)
    qq, kk = q_raw * a[:, None], k_raw * b[:, None]
    gc = tl.cumsum(_load(g, t, valid, i_h, H, K, offs_k, mk) * (m * LOG2E)[:, None], axis=0)
    gl = tl.sum(tl.where(rows[:, None] == C - 1, gc, 0.0), axis=0)
    b_dq = tl.zeros([C, BK], dtype=tl.float32)
    b_dki = tl.zeros([C, BK], dtype=tl.float32)
    b_dA = tl.zeros([C, C], dtype=tl.float32)
    hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(NV):
        offs_v = i_v * BV + tl.arange(0, BV)
        mv = offs_v < V
        dd = _load(do, t, valid, i_h, H, V, offs_v, mv)
        vv = _load(v, t, valid, i_h, H, V, offs_v, mv) * m[:, None]
        tile = (gid * HS + i_s) * K * V + offs_k[:, None] * V + offs_v[None, :]
        tmask = mk[:, None] & mv[None, :]
        hh = tl.load(h + tile, mask=tmask, other=0.0)
        dhh = tl.load(dh + tile, mask=tmask, other=0.0)
        b_dq += _dot(dd, tl.trans(hh), DT, IEEE)
        b_dki += _dot(vv, tl.trans(dhh), DT, IEEE)
        b_dA += _dot(dd, tl.trans(vv), DT, IEEE)
        hdh += tl.sum(hh.to(tl.float32) * dhh.to(tl.float32), axis=1)
    b_dq = b_dq * tl.exp2(gc) * scale
    b_dki = b_dki * tl.exp2(gl[None, :] - gc)
    b_dA = tl.where(rows[:, None] >= rows[None, :], b_dA * scale, 0.0)
    dq_intra, dk_intra = _intra_grads(b_dA, qq, kk, gc, C, DT, IEEE, SAFE)
    b_dq += dq_intra
    b_dk = b_dki + dk_intra
    # d/dG_i = q_i dq_i - k_i dk_i, plus the chunk's final state h' = e^G_last (...) at the last row;
    # the log-decay g_t enters every G_i with i >= t: a reverse cumulative sum inside the chunk
    dG = qq * b_dq - kk * b_dk
    last = tl.exp2(gl) * hdh + tl.sum(kk * b_dki, axis=0)
    b_dg = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG + last[None, :]
    if OUT_BY_TOKEN:
        out = t
    else:
        out = start - L + rows
    _store(dq, b_dq * a[:, None], out, valid, i_h, H, K, offs_k, mk, False)
    _store(dk, b_dk * b[:, None], out, valid, i_h, H, K, offs_k, mk, False)
    _store(dg, b_dg * m[:, None], out, valid, i_h, H, K, offs_k, mk, False)
    if GATE_GRADS:  # partial sums over this K-block of d/da and d/db, [P, 2, H, NK]
        base = ((start - L + rows).to(tl.int64) * 2 * H + i_h) * NK + i_k
        tl.store(dab + base, tl.sum(q_raw * b_dq, axis=1), mask=valid)
        tl.store(dab + base + H * NK, tl.sum(k_raw * b_dk, axis=1), mask=valid)


# ----------------------------------------------------------------------------------------------------------
# host side


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes along the key and value dims, and launch options, of one kernel."""

    block_k: int
    block_v: int
    num_warps: int = 8
    num_stages: int = 2
    min_blocks_v: int = 1  # value blocks at least: narrower ones where the head dim is small (down to 16)

    def blocks(self, K: int, V: int) -> dict:
        """``BK, BV, NK, NV`` for head dims ``K, V`` (tiles of at least 16: the smallest ``tl.dot``)."""
        bk = min(self.block_k, max(16, triton.next_power_of_2(K)))
        bv = min(self.block_v, max(16, triton.next_power_of_2(V)))
        while bv > 16 and triton.cdiv(V, bv) < self.min_blocks_v:
            bv //= 2
        return dict(BK=bk, BV=bv, NK=triton.cdiv(K, bk), NV=triton.cdiv(V, bv))

    def launch(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


# Chosen on an H100 with ``benchmarks/kernels/tune_chunk.py`` at head dims K = V = 128, at the model benchmark's
# layer shapes (8 x 4k and 2 x 16k tokens, 8 heads; the per-chunk kernels also at 32 x 4k, 18 heads): fixed
# configs instead of autotuning keep the first step's compilation short. 128-wide value blocks read q / k / g
# once per chunk in the output and dv kernels.
#
# ``_bwd_dqkg`` walks the value blocks in a loop. With one block (BV >= V: V = 64 at BV = 64, or BV = 128 at
# V = 128) or an unpipelined loop (num_stages = 1), Triton 3.6 miscompiles its bf16 products at 4 warps on
# Hopper: compute-sanitizer reports an out-of-range shared-memory address and the launch dies with an illegal
# memory access, or (V = 80 / 96 at one stage) the gradients come out wrong. Two value blocks or more are
# clean at every head dim from 64 to 256 (``docs/real_shapes.md``) and, at V = 64, also the fastest choice.
CONFIGS = {
    "fwd_h": KernelConfig(64, 64, 4),
    "fwd_o": KernelConfig(32, 128, 4),
    "bwd_dh": KernelConfig(64, 128, 4),
    "bwd_dv": KernelConfig(32, 128, 4),
    "bwd_dqkg": KernelConfig(32, 64, 4, min_blocks_v=2),
}


def _cfg(name: str, K: int, V: int, *keys: str) -> dict:
    c = CONFIGS[name]
    blocks = c.blocks(K, V)
    return {**{k: blocks[k] for k in keys}, **c.launch()}


@dataclass
class _Call:
    """What one SSE / GLA call needs besides the differentiable tensors."""

    plan: ChunkPlan
    tok: torch.Tensor | None  # [P] token of each sparse pair
    position: torch.Tensor | None  # [L, Kmax] pair index of each token's ranked partitions
    scale: float
    output_final_state: bool
    safe: float = SAFE_LOG2
    # > 1: the backward makes the chunk states again, this many groups of heads one after another, instead of
    # keeping the forward's (SSEOptions.backward_head_groups)
    head_groups: int = 1
    # > 0: the state walks go in pieces of this many chunks (see _piece_chunks), the same for every walk of the
    # call, so that a backward by head groups makes exactly the forward's states
    piece_chunks: int = 0


# A state walk (``_fwd_h``, ``_bwd_dh``) runs one program per state tile, segment and head, chunk after chunk,
# so its time is one program's walk over the longest segment. Where a call has few long sequences (one 32k
# training row: 72 programs of 512 chunks at sse-h-2b's 18 heads, fewer in a group of heads) that leaves most of
# the GPU idle: the walks then go in pieces of PIECE_CHUNKS chunks, all walked at once from zero, and ``_carry``
# completes each piece's states with what enters it. A call splits where its shared walk would have fewer than
# SPLIT_BELOW_PROGRAMS_PER_SM programs a multiprocessor (PIECE_CHUNKS = 0: never); what it gains at the 2B step on
# 32k rows: docs/paper_scale.md.
PIECE_CHUNKS = 64
SPLIT_BELOW_PROGRAMS_PER_SM = 4


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors (0 off CUDA: Triton's interpreter walks whole segments unless tests say)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _piece_chunks(num_seqs: int, L: int, H: int, K: int, V: int, chunk: int, device: torch.device) -> int:
    """Chunks a piece of the call's state walks (0: whole segments), from the shared walk's programs at every
    head: a backward by head groups walks as its forward did."""
    blocks = CONFIGS["fwd_h"].blocks(K, V)
    programs = blocks["NK"] * blocks["NV"] * num_seqs * H
    if not PIECE_CHUNKS or triton.cdiv(L, chunk) <= PIECE_CHUNKS:
        return 0
    return PIECE_CHUNKS if programs < SPLIT_BELOW_PROGRAMS_PER_SM * _multiprocessors(device) else 0


def _pieces(call: _Call, L: int, heads: int, K: int, V: int, device: torch.device):
    """``(M, MAXP, piece_end, piece_decay, decay_before)`` of a walk over ``heads`` heads: chunks a piece, pieces
    a segment at most, and :func:`_carry`'s buffers; for whole segments, one piece of every chunk and no buffers."""
    plan, M = call.plan, call.piece_chunks
    if not M:
        return 1 << 30, 1, plan.cu_seg, plan.cu_seg, plan.cu_seg
    maxp = triton.cdiv(triton.cdiv(L, plan.chunk), M)  # no segment has more rows than the call has tokens
    n = plan.num_segments * maxp * heads
    return (M, maxp, torch.empty(n, K, V, device=device, dtype=torch.float32),
            torch.empty(n, K, device=device, dtype=torch.float32),
            torch.empty(plan.max_chunks, heads, K, device=device, dtype=torch.float32))


def _dot_type(v: torch.Tensor):
    return (tl.float32, True) if v.dtype == torch.float32 else (getattr(tl, str(v.dtype).split(".")[-1]), False)


OVERLAP = True  # run the sparse partitions' work beside the shared walk (see _Overlap); False: one stream
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class _Overlap:
    """The sparse partitions' work on a second CUDA stream while the shared partition's state walk runs.

    The shared walk is one sequential pass over a whole sequence; the sparse segments are ``NP`` times shorter
    at K = 1, so after them the GPU would run only the shared walk's few programs (64 at 2 x 16k tokens and 8
    heads). On the side stream the sparse walk and the sparse per-chunk launches fill those SMs. Creating it
    forks (the side stream waits for what the current stream has queued so far), launches inside ``with`` go to
    the side stream, and ``join`` makes the current stream wait for the side stream. Tensors used on the side
    stream are allocated before the fork and the current stream joins before anything frees them, so the
    caching allocator never reuses their memory early. On the CPU (the interpreter) all of it is a no-op and
    the order of launches is the same.
    """

    def __init__(self, device: torch.device):
        self.side = None
        if device.type == "cuda" and OVERLAP:
            if device not in _SIDE_STREAMS:
                _SIDE_STREAMS[device] = torch.cuda.Stream(device)
            self.side = _SIDE_STREAMS[device]
            self.main = torch.cuda.current_stream(device)
            self.side.wait_stream(self.main)

    def __enter__(self):
        if self.side is not None:
            self._ctx = torch.cuda.stream(self.side)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.side is not None:
            self._ctx.__exit__(*exc)

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)


def _forward(call: _Call, q_sh, k_sh, g_sh, q_sp, k_sp, g_sp, v, rw, ww, wm, h0):
    """Output, final states (or None) and every chunk's initial state ``h`` (the state pass's product)."""
    plan = call.plan
    L, H, K = q_sh.shape
    V = v.shape[-1]
    C = plan.chunk
    S, NP = plan.num_seqs, plan.num_sparse_partitions
    DT, IEEE = _dot_type(v)
    sparse = call.tok is not None
    dummy = plan.cu_seg
    tok, rw_, ww_, wm_ = (call.tok, rw, ww, wm) if sparse else (dummy,) * 4
    h = torch.empty(plan.max_chunks, H, K, V, device=v.device, dtype=v.dtype)
    ht = torch.empty(S * (1 + NP), H, K, V, device=v.device, dtype=torch.float32) if call.output_final_state else None
    o = torch.empty(L, H, V, device=v.device, dtype=v.dtype)
    cfg = _cfg("fwd_o", K, V, "BK", "BV", "NK")
    NV = triton.cdiv(V, cfg["BV"])
    common = dict(H=H, K=K, V=V, C=C, DT=DT, IEEE=IEEE, SAFE=call.safe, **cfg)
    tables = (plan.chunk_seg, plan.chunk_start, plan.cu_seg, call.scale, L)
    walk = _state_pass(call, k_sh, g_sh, k_sp, g_sp, v, ww, wm, h, h0, ht)
    # the shared outputs are added to the sparse ones where each token has exactly one pair (K = 1)
    by_token = sparse and call.position.shape[1] == 1
    if sparse:
        out = o if by_token else torch.empty(call.tok.numel(), H, V, device=v.device, dtype=torch.float32)
    overlap = _Overlap(v.device) if sparse else None  # after every allocation, before the shared walk
    walk(sparse_segments=False)
    if sparse:
        with overlap:
            walk(sparse_segments=True)
            _fwd_o[(NV, plan.launch_sparse.numel(), H)](
                q_sp, k_sp, g_sp, v, h, out, tok, rw_, ww_, wm_, plan.launch_sparse, *tables,
                OUT_BY_TOKEN=by_token, ACCUM=False, SPARSE=True, **common,
            )
        overlap.join()
    _fwd_o[(NV, plan.launch_shared.numel(), H)](
        q_sh, k_sh, g_sh, v, h, o, dummy, dummy, dummy, dummy, plan.launch_shared, *tables,
        OUT_BY_TOKEN=True, ACCUM=by_token, SPARSE=False, **common,
    )
    if sparse and not by_token:
        o = (o.float() + out[call.position].sum(1)).to(v.dtype)
    return o, ht, h


def _state_pass(call: _Call, k_sh, g_sh, k_sp, g_sp, v, ww, wm, h, h0, ht, first: int = 0):
    """The state pass for heads ``first .. first + h.shape[1]``: each chunk's initial state into ``h`` (and, with
    ``ht``, each segment's final one). Returns ``walk(sparse_segments)``, the launch over the shared or the sparse
    segments, so that the forward can put the sparse one on its side stream."""
    plan = call.plan
    L, H, K = k_sh.shape
    V, heads = v.shape[-1], h.shape[1]
    S, NP = plan.num_seqs, plan.num_sparse_partitions
    DT, IEEE = _dot_type(v)
    sparse = call.tok is not None
    dummy = plan.cu_seg
    tok, ww_, wm_ = (call.tok, ww, wm) if sparse else (dummy,) * 3
    seq = _cfg("fwd_h", K, V, "BK", "BV", "NV")
    tiles = triton.cdiv(K, seq["BK"]) * seq["NV"]
    M, maxp, ends, decays, before = _pieces(call, L, heads, K, V, v.device)
    final = dummy if ht is None else ht
    args = (k_sh, k_sp if sparse else k_sh, g_sh, g_sp if sparse else g_sh, v, tok, ww_, wm_, h,
            dummy if h0 is None else h0, final, plan.cu_seg, plan.chunk_off, ends, decays, before, L, S, NP)
    shape = dict(H=H, HS=heads, K=K, V=V, C=plan.chunk, **seq)
    opts = dict(H0=first, M=M, MAXP=maxp, USE_H0=h0 is not None, STORE_HT=ht is not None, DT=DT, IEEE=IEEE,
                PIECES=bool(call.piece_chunks), **shape)

    def walk(sparse_segments: bool) -> None:
        seg0 = S if sparse_segments else 0
        grid = (tiles, (S * NP if sparse_segments else S) * maxp, heads)
        _fwd_h[grid](*args, seg0, **opts)
        if call.piece_chunks:
            _carry[grid](h, ends, decays, before, final, plan.cu_seg, plan.chunk_off, S, NP, seg0, first, M, maxp,
                         STORE_FINAL=ht is not None, REVERSE=False, **shape)

    return walk


def _states(call: _Call, k_sh, g_sh, k_sp, g_sp, v, ww, wm, h0, first: int, heads: int) -> torch.Tensor:
    """Every chunk's initial state for heads ``first .. first + heads`` (``[chunks, heads, K, V]``): the forward's
    state pass again, for a backward that does not keep the forward's states (``_Call.head_groups``)."""
    K, V = k_sh.shape[-1], v.shape[-1]
    h = torch.empty(call.plan.max_chunks, heads, K, V, device=v.device, dtype=v.dtype)
    walk = _state_pass(call, k_sh, g_sh, k_sp, g_sp, v, ww, wm, h, h0, None, first)
    walk(sparse_segments=False)
    if call.tok is not None:
        walk(sparse_segments=True)
    return h


def _backward(call: _Call, do, dht, q_sh, k_sh, g_sh, q_sp, k_sp, g_sp, v, rw, ww, wm, h0, h):
    """Every gradient, from the forward's chunk states ``h``, or (``h`` None) a group of heads at a time with
    each group's states made again and its state gradients freed before the next group's: the states and their
    gradients of all heads are then never alive at once."""
    plan = call.plan
    L, H, K = q_sh.shape
    V = v.shape[-1]
    C = plan.chunk
    S, NP = plan.num_seqs, plan.num_sparse_partitions
    DT, IEEE = _dot_type(v)
    sparse = call.tok is not None
    dummy = plan.cu_seg
    tok, rw_, ww_, wm_ = (call.tok, rw, ww, wm) if sparse else (dummy,) * 4
    do = do.contiguous()
    dht = None if dht is None else dht.contiguous()
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    heads = H if h is not None else H // call.head_groups
    seq = _cfg("bwd_dh", K, V, "BK", "BV", "NV")
    tiles = triton.cdiv(K, seq["BK"]) * seq["NV"]
    base = dict(H=H, HS=heads, K=K, V=V, C=C, DT=DT, IEEE=IEEE, SAFE=call.safe)
    dv_cfg = {**base, **_cfg("bwd_dv", K, V, "BK", "BV", "NK")}
    dq_cfg = {**base, **_cfg("bwd_dqkg", K, V, "BK", "BV", "NK", "NV")}
    NV, NK = triton.cdiv(V, dv_cfg["BV"]), dq_cfg["NK"]
    tables = (plan.chunk_seg, plan.chunk_start, plan.cu_seg, call.scale, L)
    dv = torch.empty_like(v)
    grads = [torch.empty_like(x) for x in (q_sh, k_sh, g_sh)]
    by_token = sparse and call.position.shape[1] == 1
    sparse_grads = [None] * 5
    if sparse:
        P = call.tok.numel()
        dv_out = dv if by_token else torch.empty(P, H, V, device=v.device, dtype=torch.float32)
        if by_token:
            outs = [torch.empty_like(x) for x in (q_sp, k_sp, g_sp)]
        else:
            outs = [torch.empty(P, H, K, device=v.device, dtype=torch.float32) for _ in range(3)]
        dab = torch.empty(P, 2, H, NK, device=v.device, dtype=torch.float32)
    for first in range(0, H, heads):
        hs = h if h is not None else _states(call, k_sh, g_sh, k_sp, g_sp, v, ww, wm, h0, first, heads)
        dh = torch.empty(plan.max_chunks, heads, K, V, device=v.device, dtype=v.dtype)
        M, maxp, ends, decays, before = _pieces(call, L, heads, K, V, v.device)
        final = dummy if dh0 is None else dh0
        walk = (q_sh, q_sp if sparse else q_sh, g_sh, g_sp if sparse else g_sh, do, tok, rw_, wm_, dh,
                dummy if dht is None else dht, final, plan.cu_seg, plan.chunk_off, ends, decays, before,
                call.scale, L, S, NP)
        shape = dict(H=H, HS=heads, K=K, V=V, C=C, **seq)
        walk_opts = dict(H0=first, M=M, MAXP=maxp, USE_DHT=dht is not None, STORE_DH0=dh0 is not None, DT=DT,
                         IEEE=IEEE, PIECES=bool(call.piece_chunks), **shape)

        def walk_dh(seg0: int, segments: int) -> None:
            grid = (tiles, segments * maxp, heads)
            _bwd_dh[grid](*walk, seg0, **walk_opts)
            if call.piece_chunks:
                _carry[grid](dh, ends, decays, before, final, plan.cu_seg, plan.chunk_off, S, NP, seg0, first, M,
                             maxp, STORE_FINAL=dh0 is not None, REVERSE=True, **shape)

        overlap = _Overlap(v.device) if sparse else None  # after every allocation, before the shared walk
        walk_dh(0, S)
        if sparse:  # on the side stream: the sparse state-gradient walk, dv and dq / dk / dg (see _Overlap)
            with overlap:
                walk_dh(S, S * NP)
                _bwd_dv[(NV, plan.launch_sparse.numel(), heads)](
                    q_sp, k_sp, g_sp, do, dh, dv_out, tok, rw_, ww_, wm_, plan.launch_sparse, *tables, first,
                    OUT_BY_TOKEN=by_token, ACCUM=False, SPARSE=True, **dv_cfg,
                )
                dv_done = torch.cuda.Event() if overlap.side is not None else None
                if dv_done is not None:
                    dv_done.record(overlap.side)
                _bwd_dqkg[(NK, plan.launch_sparse.numel(), heads)](
                    q_sp, k_sp, g_sp, v, do, hs, dh, *outs, dab, tok, rw_, ww_, wm_, plan.launch_sparse, *tables,
                    first, OUT_BY_TOKEN=by_token, GATE_GRADS=True, SPARSE=True, **dq_cfg,
                )
            if dv_done is not None:  # the shared dv adds into the sparse one
                overlap.main.wait_event(dv_done)
        _bwd_dv[(NV, plan.launch_shared.numel(), heads)](
            q_sh, k_sh, g_sh, do, dh, dv, dummy, dummy, dummy, dummy, plan.launch_shared, *tables, first,
            OUT_BY_TOKEN=True, ACCUM=by_token, SPARSE=False, **dv_cfg,
        )
        _bwd_dqkg[(NK, plan.launch_shared.numel(), heads)](
            q_sh, k_sh, g_sh, v, do, hs, dh, *grads, dummy, dummy, dummy, dummy, dummy, plan.launch_shared, *tables,
            first, OUT_BY_TOKEN=True, GATE_GRADS=False, SPARSE=False, **dq_cfg,
        )
        if sparse:
            overlap.join()  # before this group's states and their gradients are freed
        del hs, dh, walk, walk_dh  # now (``walk`` holds ``dh`` too), before the next group's: one group's alive
    if sparse:
        if not by_token:
            dv = (dv.float() + dv_out[call.position].sum(1)).to(v.dtype)
            outs = [x[call.position].sum(1).to(ref.dtype) for x, ref in zip(outs, (q_sp, k_sp, g_sp))]
        dab = dab.sum((2, 3))
        sparse_grads = [*outs, dab[:, 0], dab[:, 1]]
    return (*grads, *sparse_grads[:3], dv, *sparse_grads[3:], dh0)


class _ChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, q_sh, k_sh, g_sh, q_sp, k_sp, g_sp, v, rw, ww, wm, h0):
        # under gradient checkpointing the block's recomputation takes these from its forward (see
        # sse_model/ops/checkpointing.py) rather than running the kernels again
        def forward_states():
            o, ht, h = _forward(call, q_sh, k_sh, g_sh, q_sp, k_sp, g_sp, v, rw, ww, wm, h0)
            return o, ht, (h if call.head_groups == 1 else None)

        o, ht, h = kept_outputs(forward_states, large=True)
        ctx.call = call
        # the chunk states are kept rather than recomputed by the backward (one state pass less per step:
        # ~9% of an SSE layer's kernel time); they are [chunks, H, K, V], about K / C times the size of k;
        # under checkpointing only the block being rebuilt holds them, unless the forward's are kept too
        # (checkpointing_keeps_linear_attention). With head groups the backward makes them again instead, a
        # group at a time (less memory at the backward's peak, docs/paper_scale.md)
        ctx.save_for_backward(q_sh, k_sh, g_sh, q_sp, k_sp, g_sp, v, rw, ww, wm, h0, h)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.saved_tensors
        dq_sh, dk_sh, dg_sh, dq_sp, dk_sp, dg_sp, dv, drw, dww, dh0 = _backward(ctx.call, do, dht, *saved)
        h0 = saved[-2]
        return (None, dq_sh, dk_sh, dg_sh, dq_sp, dk_sp, dg_sp, dv, drw, dww, None,
                None if h0 is None else dh0.to(h0.dtype))


class _LowRankChunkFunction(torch.autograd.Function):
    """The low-rank feature map (``kernels/fused.py::_LowRankFeatures``) and the chunk walk in one function, for a
    backward by head groups: it keeps the feature map's inputs (the q / k projections and the rank-r inputs, which
    the map keeps anyway) instead of the six feature-mapped tensors, and its backward makes each group's features,
    then its states, again and frees them before the next group's. At the sse-h-2b layer the six are 0.84 GiB at
    the block's start under checkpointing (docs/paper_scale.md). Each group runs as an SSE call of its own heads:
    heads do not mix in SSE, and the routing is per token."""

    @staticmethod
    def forward(ctx, call, options, q, k, lq, lk, lg0, lg1, wq, wk, wg0, wg1, bq, bk, bg0, bg1, v, rw, ww, wm, h0):
        low = (lq, lk, lg0, lg1)
        weights, biases, ctx.dtypes = _maps_in(lq.dtype, (wq, wk, wg0, wg1), (bq, bk, bg0, bg1))

        def forward_states():  # under checkpointing the block's recomputation takes these from its forward
            features = _features(q, k, low, weights, biases, options)[0]
            o, ht, _ = _forward(call, *_token_major(features), v, rw, ww, wm, h0)
            return o, ht, None

        o, ht, _ = kept_outputs(forward_states, large=True)
        ctx.call, ctx.options = call, options
        ctx.save_for_backward(q, k, *low, *weights, *biases, v, rw, ww, wm, h0)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, *rest = ctx.saved_tensors  # q, k: [..., H, K] as the layer gave them (the features' shape)
        low, weights, biases, (v, rw, ww, wm, h0) = rest[:4], rest[4:8], rest[8:12], rest[12:]
        H, K = q.shape[-2:]
        n = H // ctx.call.head_groups
        one_group = replace(ctx.call, head_groups=1)  # each group an SSE call of its own, its states made again
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_ups = [torch.empty(q.shape, device=q.device, dtype=low[0].dtype) for _ in range(4)]
        dh0 = None if h0 is None else torch.empty(h0.shape, device=h0.device, dtype=torch.float32)
        drw = dww = None
        for first in range(0, H, n):
            heads = slice(first, first + n)
            rows = slice(first * K, (first + n) * K)  # the group's outputs of the low-rank maps

            def part(x, axis=1):  # the group's heads: axis 1 of [L, H, V] and the states, -2 of q and k
                return None if x is None else x.narrow(axis, first, n).contiguous()

            features, ins, strides = _features(part(q, -2), part(k, -2), low, [w[rows] for w in weights],
                                               [None if b is None else b[rows] for b in biases], ctx.options)
            *feature_grads, dv_g, drw_g, dww_g, dh0_g = _backward(
                one_group, part(do), part(dht), *_token_major(features), part(v), rw, ww, wm, part(h0), None)
            del features
            grads = _features_backward(ins, strides, ctx.options, *feature_grads)
            del ins, feature_grads
            for full, g in zip((dq, d_ups[0], dk, d_ups[1], d_ups[2], d_ups[3]), grads):
                full[..., heads, :] = g
            dv[:, heads] = dv_g
            if dh0 is not None:
                dh0[:, heads] = dh0_g
            if drw_g is not None:  # the pairs' weights are shared by the heads: each group adds its part
                drw, dww = (drw_g, dww_g) if drw is None else (drw + drw_g, dww + dww_g)
        maps = _low_rank_backward(low, weights, biases, d_ups, ctx.needs_input_grad[4:16], ctx.dtypes)
        return (None, None, dq, dk, *maps, dv, drw, dww, None, None if h0 is None else dh0.to(h0.dtype))


def _features(q, k, low, weights, biases, options):
    """``kernels/fused.py``'s feature map from the rank-r inputs: the six feature-mapped tensors (shared q, k, g,
    then sparse), what its backward reads, and the token strides. The inputs in the layer's shapes, so that the
    products (``F.linear``) round as :class:`~kernels.fused._LowRankFeatures`' do."""
    ups = _low_rank_products(q.shape[-2:], low, weights, biases)
    return _features_forward(q, ups[0], k, ups[1], ups[2], ups[3], options)


def _token_major(features):
    """The feature-mapped tensors (new, contiguous) as the chunk kernels' ``[L, H, K]``."""
    return [x.reshape(-1, *x.shape[-2:]) for x in features]


# ----------------------------------------------------------------------------------------------------------
# entry points (the dispatch point's conventions)


def _tokens(x: torch.Tensor | None, L: int) -> torch.Tensor | None:
    """``[B, T, H, D]`` -> contiguous ``[B * T, H, D]``."""
    return None if x is None else x.reshape(L, *x.shape[2:]).contiguous()


def _sequences(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    if cu_seqlens is None:
        return dense_cu_seqlens(B, T, device)
    check_cu_seqlens(cu_seqlens, B, T)
    return cu_seqlens


def chunk_gla_triton(q, k, v, g, beta=None, *, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, use_qk_l2norm=False, chunk_size: int = CHUNK):
    """GLA with the dispatch point's signature (``q, k, g: [B, T, H, K]``, states ``[S, H, K, V]`` float32)."""
    if use_qk_l2norm:
        raise ValueError("use_qk_l2norm is only defined for the gated delta rule")
    B, T, H, K = q.shape
    L = B * T
    cu = _sequences(B, T, cu_seqlens, q.device)
    plan = kept_outputs(lambda: ChunkPlan(**build_plans(cu, L, chunk=chunk_size)[0], num_seqs=cu.numel() - 1,
                                          num_sparse_partitions=0, chunk=chunk_size))  # once per checkpointed step
    call = _Call(plan, None, None, K**-0.5 if scale is None else scale, output_final_state,
                 piece_chunks=_piece_chunks(cu.numel() - 1, L, H, K, v.shape[-1], chunk_size, q.device))
    h0 = None if initial_state is None else initial_state.contiguous()
    o, ht = _ChunkFunction.apply(call, _tokens(q, L), _tokens(k, L), _tokens(g, L), None, None, None,
                                 _tokens(v, L), None, None, None, h0)
    return o.view(B, T, H, v.shape[-1]), ht


@dataclass
class _SSEPlan:
    """What an SSE call derives from the routing's choices alone (so checkpointing keeps it, see
    ``sse_model/ops/checkpointing.py``): the pairs, their chunk plan, their tokens as int32, each pair's index
    in the flattened ``[L, Kmax]`` choices, and its write and read masks (1 within the top ``num_writers`` /
    ``num_readers`` of its token, else 0; in the router probabilities' dtype)."""

    pairs: VarlenPlan
    chunks: ChunkPlan
    tok: torch.Tensor
    source: torch.Tensor
    write: torch.Tensor
    read: torch.Tensor

    @classmethod
    def build(cls, routing: Routing, cu: torch.Tensor, chunk: int) -> "_SSEPlan":
        """With the plan kernels (``kernels/plan.py``): what ``VarlenPlan.build`` and ``ChunkPlan.build``
        define, in five launches."""
        N = routing.num_sparse_partitions
        topk = routing.topk.reshape(-1, routing.topk.shape[-1])
        tables, (pairs, tok, source, write, read) = build_plans(cu, topk.shape[0], topk, N, routing.num_writers,
                                                                 routing.num_readers, chunk)
        chunks = ChunkPlan(**tables, num_seqs=cu.numel() - 1, num_sparse_partitions=N, chunk=chunk)
        dtype = routing.probs.dtype
        return cls(pairs, chunks, tok, source, write.to(dtype), read.to(dtype))

    def weights(self, routing: Routing, opts: SSEOptions):
        """Each pair's (read weight, write weight, write mask): the router probability of its partition where
        the gate is on, times the masks (:meth:`Routing.weights` at the pairs, without the ``[L, N]`` masks)."""
        probs, topk = (x.reshape(-1, x.shape[-1]) for x in (routing.probs, routing.topk))
        p = probs.gather(1, topk).reshape(-1)[self.source]
        all_choices = topk.shape[1]
        ww = (p if routing.num_writers == all_choices else self.write * p) if opts.write_gate else self.write
        rw = (p if routing.num_readers == all_choices else self.read * p) if opts.read_gate else self.read
        return rw, ww, self.write


def sse_chunk_triton(shared: Branch, sparse: Branch, v: torch.Tensor, routing: Routing, opts: SSEOptions, *,
                     implementation: str = "auto", initial_state=None, output_final_state=False, cu_seqlens=None,
                     chunk_size: int = CHUNK, safe: float = SAFE_LOG2):
    """SSE (GLA transition) with :func:`~sse_model.ops.dispatch.sse_attention`'s signature; None declines
    (the gated delta rule, or the masking algorithm asked for explicitly)."""
    if opts.transition != "gla" or implementation == "mask":
        return None
    B, T, H, K = shared.q.shape
    call, (rw, ww, wm), h0, finish = _prologue(B, T, H, K, v, routing, opts, initial_state, output_final_state,
                                               cu_seqlens, chunk_size, safe)
    L = B * T
    q_sh, k_sh, g_sh = (_tokens(x, L) for x in (shared.q, shared.k, shared.g))
    # the fused launches select the shared or sparse tensor per segment: one dtype per role
    q_sp, k_sp, g_sp = (_tokens(x.to(ref.dtype), L)
                        for x, ref in zip((sparse.q, sparse.k, sparse.g), (q_sh, k_sh, g_sh)))
    return finish(*_ChunkFunction.apply(call, q_sh, k_sh, g_sh, q_sp, k_sp, g_sp, _tokens(v, L), rw, ww, wm, h0))


def sse_low_rank_chunk_triton(q, k, low, up, v, routing: Routing, opts: SSEOptions, *, feature_options: dict,
                              implementation: str = "auto", initial_state=None, output_final_state=False,
                              cu_seqlens=None, chunk_size: int = CHUNK, safe: float = SAFE_LOG2):
    """:func:`~sse_model.ops.dispatch.sse_low_rank_attention`: the low-rank feature map and SSE in one function
    (:class:`_LowRankChunkFunction`) where the backward goes by head groups (``opts.backward_head_groups`` > 1) and
    the feature map's kernel takes the inputs; None declines (the two run one after the other)."""
    if opts.transition != "gla" or implementation == "mask" or opts.backward_head_groups == 1:
        return None
    (wq, bq), (wk, bk), (wg0, bg0), (wg1, bg1) = up
    if low_rank_features_decline(q, k, low, (wq, wk, wg0, wg1)):
        return None
    B, T, H, K = q.shape
    call, (rw, ww, wm), h0, finish = _prologue(B, T, H, K, v, routing, opts, initial_state, output_final_state,
                                               cu_seqlens, chunk_size, safe)
    options = (feature_options["lora_side"] == "shared", ACTIVATIONS.index(feature_options["q_activation"]),
               ACTIVATIONS.index(feature_options["k_activation"]), feature_options["normalizer"])
    return finish(*_LowRankChunkFunction.apply(call, options, q, k, *low, wq, wk, wg0, wg1, bq, bk, bg0, bg1,
                                               _tokens(v, B * T), rw, ww, wm, h0))


def _prologue(B, T, H, K, v, routing, opts, initial_state, output_final_state, cu_seqlens, chunk_size, safe):
    """What both SSE entry points derive before their function: the call (with the routing's plan, kept under
    checkpointing), the pairs' read / write weights and write mask, the initial states as ``[S * (1 + N), H, K,
    V]``, and ``finish``, which gives the output and final states the dispatch point's shapes."""
    V = v.shape[-1]
    N = routing.num_sparse_partitions
    cu = _sequences(B, T, cu_seqlens, v.device)
    S = cu.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (S, 1 + N, H, K, V):
        raise ValueError(f"SSE state must be {[S, 1 + N, H, K, V]}, got {list(initial_state.shape)}")
    plan = kept_outputs(lambda: _SSEPlan.build(routing, cu, chunk_size))  # once per checkpointed step
    if H % opts.backward_head_groups:
        raise ValueError(f"backward_head_groups ({opts.backward_head_groups}) must divide the {H} heads")
    call = _Call(plan.chunks, plan.tok, plan.pairs.position, K**-0.5 if opts.scale is None else opts.scale,
                 output_final_state, safe, opts.backward_head_groups,
                 _piece_chunks(S, B * T, H, K, V, chunk_size, v.device))
    h0 = None if initial_state is None else initial_state.reshape(S * (1 + N), H, K, V).contiguous()

    def finish(o, ht):
        return o.view(B, T, H, V), None if ht is None else ht.view(S, 1 + N, H, K, V)

    return call, plan.weights(routing, opts), h0, finish
