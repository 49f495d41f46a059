"""Fused elementwise stages of the model, forward and backward, one pass over memory each.

At training shapes these stages cost more than their matrix products: the PyTorch definitions
(:mod:`sse_model.ops.fused`) run as a dozen separate kernels, several through float32 copies. Here:

- ``rms_norm_triton``: RMSNorm over the last dim with an optional ``silu(gate)`` factor (the block norms,
  and the gated per-head output norm of GLA and SSE layers); float32 statistics, the weight gradient
  reduced per program and summed once;
- ``sse_features_triton``: the SSE layer's two sides from its projections: the LoRA add, the q and k feature
  maps (identity, silu, softmax over the head dim) and the log-sigmoid decays, six outputs in one pass;
  ``sse_low_rank_features_triton`` the same from the LoRA and gate maps' rank-r inputs (training: autograd keeps
  those instead of the four full-width products);

Both treat their inputs as rows of the last dim; rows must fit one tile (up to 16k elements).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import interpreting
from sse_model.ops.dispatch import note_declined
from sse_model.ops.fused import ACTIVATIONS

MAX_ROW = 16384
MIN_PROGRAMS = 256


def _rows_per_program(block: int, rows: int | None = None) -> int:
    """Rows of ``block`` elements per program: up to 4096 elements, but, given the number of ``rows``, fewer
    where that leaves under ``MIN_PROGRAMS`` programs (a decode step's few hundred rows would otherwise run on
    a handful of SMs)."""
    per = max(1, min(64, 4096 // block))
    while rows is not None and per > 1 and triton.cdiv(rows, per) < MIN_PROGRAMS:
        per //= 2
    return per


# ----------------------------------------------------------------------------------------------------------
# RMSNorm (optionally gated)


@triton.jit(do_not_specialize=["M", "eps"])
def _rms_fwd(x, w, gate, y, rstd, M, D, eps, HAS_GATE: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BD)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    xx = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xx * xx, axis=1) / D + eps)
    out = xx * r[:, None] * tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:
        gg = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
        out = out * gg * tl.sigmoid(gg)
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, r, mask=rows < M)


@triton.jit(do_not_specialize=["M", "ROWS_PER_PROG"])
def _rms_bwd(x, w, gate, dy, rstd, dx, dgate, dw, M, D, ROWS_PER_PROG, HAS_GATE: tl.constexpr, BD: tl.constexpr,
             BM: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    ww = tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BD], dtype=tl.float32)
    for start in range(pid * ROWS_PER_PROG, tl.minimum(pid * ROWS_PER_PROG + ROWS_PER_PROG, M), BM):
        rows = start + tl.arange(0, BM)
        mask = (rows < M)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        xx = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd + rows, mask=rows < M, other=0.0)
        xn = xx * r[:, None]
        if HAS_GATE:
            gg = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
            sg = tl.sigmoid(gg)
            tl.store(dgate + offs, (d * xn * ww[None, :] * sg * (1.0 + gg * (1.0 - sg))).to(dgate.dtype.element_ty),
                     mask=mask)
            d = d * gg * sg
        acc += tl.sum(d * xn, axis=0)
        dn = d * ww[None, :]
        out = r[:, None] * (dn - xn * (tl.sum(dn * xn, axis=1) / D)[:, None])
        tl.store(dx + offs, out.to(dx.dtype.element_ty), mask=mask)
    tl.store(dw + pid * D + cols, acc, mask=cmask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps, out_dtype):
        shape = x.shape
        D = shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        g2 = None if gate is None else gate.reshape(-1, D).contiguous()
        M = x2.shape[0]
        y = torch.empty_like(x2, dtype=out_dtype)
        rstd = torch.empty(M, device=x.device, dtype=torch.float32)
        BD = triton.next_power_of_2(D)
        BM = _rows_per_program(BD, M)
        _rms_fwd[(triton.cdiv(M, BM),)](x2, weight, x2 if g2 is None else g2, y, rstd, M, D, eps,
                                        HAS_GATE=g2 is not None, BD=BD, BM=BM, num_warps=4 if BD <= 1024 else 8)
        ctx.save_for_backward(x2, weight, g2, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, g2, rstd = ctx.saved_tensors
        M, D = x2.shape
        dy2 = dy.reshape(M, D).contiguous()
        BD = triton.next_power_of_2(D)
        BM = _rows_per_program(BD)
        programs = max(1, min(triton.cdiv(M, BM), 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count
                               if x2.is_cuda else 8))
        rows_per_prog = triton.cdiv(triton.cdiv(M, programs), BM) * BM
        programs = triton.cdiv(M, rows_per_prog)
        dx = torch.empty_like(x2)
        dgate = None if g2 is None else torch.empty_like(g2)
        dw = torch.empty(programs, D, device=x2.device, dtype=torch.float32)
        _rms_bwd[(programs,)](x2, weight, x2 if g2 is None else g2, dy2, rstd, dx, x2 if dgate is None else dgate, dw,
                              M, D, rows_per_prog, HAS_GATE=g2 is not None, BD=BD, BM=BM,
                              num_warps=4 if BD <= 1024 else 8)
        shape = ctx.shape
        return (dx.view(shape), dw.sum(0).to(weight.dtype), None if dgate is None else dgate.view(shape), None, None)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None):
    """Drop-in for :func:`sse_model.ops.fused.rms_norm`; None declines (rows too long, float64)."""
    if x.dtype == torch.float64 or (gate is not None and gate.shape != x.shape):
        return None
    if x.shape[-1] > MAX_ROW:
        note_declined("fused rms_norm", f"rows of {x.shape[-1]} > {MAX_ROW}")
        return None
    return _RMSNorm.apply(x, weight, gate, eps, x.dtype if out_dtype is None else out_dtype)


# ----------------------------------------------------------------------------------------------------------
# SwiGLU activation (generation)


@triton.jit(do_not_specialize=["M", "SG", "SU"])
def _silu_mul_fwd(gate, up, y, M, D, SG, SU, BD: tl.constexpr, BM: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    g = tl.load(gate + rows[:, None] * SG + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + rows[:, None] * SU + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y + rows[:, None] * D + cols[None, :], (g * tl.sigmoid(g) * u).to(y.dtype.element_ty), mask=mask)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """Drop-in for :func:`sse_model.ops.fused.silu_mul` without autograd (generation; training keeps PyTorch's):
    one pass over ``gate`` and ``up``, read in place as column slices of one product. None declines."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return None
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype == torch.float64:
        return None
    (gate, sg), (up, su) = _token_rows(gate, 1), _token_rows(up, 1)
    D = gate.shape[-1]
    M = gate.numel() // D
    y = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    BD = min(1024, triton.next_power_of_2(D))
    BM = _rows_per_program(BD, M * triton.cdiv(D, BD))
    _silu_mul_fwd[(triton.cdiv(M, BM), triton.cdiv(D, BD))](gate, up, y, M, D, sg, su, BD=BD, BM=BM, num_warps=4)
    return y


# ----------------------------------------------------------------------------------------------------------
# SSE feature prologue


@triton.jit
def _act(x, mask, KIND: tl.constexpr):
    if KIND == 1:
        x = x * tl.sigmoid(x)
    elif KIND == 2:
        x = tl.where(mask, x, -1e30)
        e = tl.where(mask, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
        x = e / tl.maximum(tl.sum(e, axis=1), 1e-30)[:, None]  # rows past the end are all masked
    return x


@triton.jit
def _act_bwd(x, dy, mask, KIND: tl.constexpr):
    if KIND == 1:
        s = tl.sigmoid(x)
        dy = dy * s * (1.0 + x * (1.0 - s))
    elif KIND == 2:
        y = _act(x, mask, 2)
        dy = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    return dy


@triton.jit
def _sides(x, lora, offs_x, offs, mask, LORA_SHARED: tl.constexpr):
    """Pre-activations ``(x, x + lora)`` as (shared, sparse), or swapped when the LoRA is on the shared side."""
    a = tl.load(x + offs_x, mask=mask, other=0.0).to(tl.float32)
    b = a + tl.load(lora + offs, mask=mask, other=0.0).to(tl.float32)
    if LORA_SHARED:
        a, b = b, a
    return a, b


@triton.jit
def _side_grads(x, lora, dy0, dy1, dx, dlora, offs_x, offs, mask, LORA_SHARED: tl.constexpr, ACT: tl.constexpr):
    """Gradients of ``x`` and ``lora`` from those of ``act(shared)`` and ``act(sparse)``."""
    a, b = _sides(x, lora, offs_x, offs, mask, LORA_SHARED)
    da = _act_bwd(a, tl.load(dy0 + offs, mask=mask, other=0.0).to(tl.float32), mask, ACT)
    db = _act_bwd(b, tl.load(dy1 + offs, mask=mask, other=0.0).to(tl.float32), mask, ACT)
    tl.store(dx + offs, (da + db).to(dx.dtype.element_ty), mask=mask)
    if LORA_SHARED:
        db = da
    tl.store(dlora + offs, db.to(dlora.dtype.element_ty), mask=mask)


@triton.jit
def _logsigmoid(x):
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _row_offsets(rows, cols, K, H, SQ, SK):
    """Offsets of rows (token, head) in contiguous ``[..., H, K]`` tensors, and in ``q`` / ``k``, whose tokens
    are ``SQ`` / ``SK`` elements apart (column slices of a wider projection)."""
    r = rows.to(tl.int64)
    head = (r % H)[:, None] * K + cols[None, :]
    return r[:, None] * K + cols[None, :], (r // H)[:, None] * SQ + head, (r // H)[:, None] * SK + head


@triton.jit(do_not_specialize=["M", "H", "SQ", "SK", "inv_norm"])
def _features_fwd(q, ql, k, kl, g0, g1, q0, q1, k0, k1, o0, o1, M, K, H, SQ, SK, inv_norm,
                  LORA_SHARED: tl.constexpr, QACT: tl.constexpr, KACT: tl.constexpr, BK: tl.constexpr,
                  BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    offs, offs_q, offs_k = _row_offsets(rows, cols, K, H, SQ, SK)
    a, b = _sides(q, ql, offs_q, offs, mask, LORA_SHARED)
    tl.store(q0 + offs, _act(a, mask, QACT).to(q0.dtype.element_ty), mask=mask)
    tl.store(q1 + offs, _act(b, mask, QACT).to(q1.dtype.element_ty), mask=mask)
    a, b = _sides(k, kl, offs_k, offs, mask, LORA_SHARED)
    tl.store(k0 + offs, _act(a, mask, KACT).to(k0.dtype.element_ty), mask=mask)
    tl.store(k1 + offs, _act(b, mask, KACT).to(k1.dtype.element_ty), mask=mask)
    x = tl.load(g0 + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o0 + offs, (_logsigmoid(x) * inv_norm).to(o0.dtype.element_ty), mask=mask)
    x = tl.load(g1 + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o1 + offs, (_logsigmoid(x) * inv_norm).to(o1.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "H", "SQ", "SK", "inv_norm"])
def _features_bwd(q, ql, k, kl, g0, g1, dq0, dq1, dk0, dk1, do0, do1, dq, dql, dk, dkl, dg0, dg1, M, K, H, SQ, SK,
                  inv_norm, LORA_SHARED: tl.constexpr, QACT: tl.constexpr, KACT: tl.constexpr, BK: tl.constexpr,
                  BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    offs, offs_q, offs_k = _row_offsets(rows, cols, K, H, SQ, SK)
    _side_grads(q, ql, dq0, dq1, dq, dql, offs_q, offs, mask, LORA_SHARED, QACT)
    _side_grads(k, kl, dk0, dk1, dk, dkl, offs_k, offs, mask, LORA_SHARED, KACT)
    x = tl.load(g0 + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(do0 + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dg0 + offs, (d * inv_norm * tl.sigmoid(-x)).to(dg0.dtype.element_ty), mask=mask)
    x = tl.load(g1 + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(do1 + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dg1 + offs, (d * inv_norm * tl.sigmoid(-x)).to(dg1.dtype.element_ty), mask=mask)


def _token_rows(x: torch.Tensor, dims: int = 2) -> tuple[torch.Tensor, int]:
    """``x`` (``[..., H, K]``, or ``[..., r]`` with ``dims=1``) and the distance between its tokens, without a
    copy where each token's entries are contiguous and its tokens evenly spaced (a column slice of a wider
    projection's output)."""
    inner = x.shape[-dims:]
    width = math.prod(inner)
    expected = [math.prod(inner[i + 1:]) for i in range(dims)]
    dense = all(s == e or n == 1 for s, e, n in zip(x.stride()[-dims:], expected, inner))
    # token dimensions of size 1 have no meaningful stride (a view gives them any): leave them out
    lead = [(n, s) for n, s in zip(x.shape[:-dims], x.stride()[:-dims]) if n > 1]
    even = all(s == s_next * n_next for (_, s), (n_next, s_next) in zip(lead, lead[1:]))
    if dense and even:
        return x, (lead[-1][1] if lead else width)
    return x.contiguous(), width


def _features_forward(q, q_lora, k, k_lora, gk0, gk1, options):
    """The six outputs of ``_features_fwd``, and what its backward reads (``ins``, the token strides)."""
    lora_shared, qact, kact, normalizer = options
    H, K = q.shape[-2:]
    (q, sq), (k, sk) = _token_rows(q), _token_rows(k)
    ins = [q, q_lora.contiguous(), k, k_lora.contiguous(), gk0.contiguous(), gk1.contiguous()]
    M = q.numel() // K
    outs = [torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in (q, q, k, k, ins[4], ins[5])]
    BK = max(16, triton.next_power_of_2(K))
    BM = _rows_per_program(BK, M)
    _features_fwd[(triton.cdiv(M, BM),)](*ins, *outs, M, K, H, sq, sk, 1.0 / normalizer,
                                         LORA_SHARED=lora_shared, QACT=qact, KACT=kact, BK=BK, BM=BM, num_warps=4)
    q0, q1, k0, k1, g0, g1 = outs
    return (q0, k0, g0, q1, k1, g1), ins, (sq, sk)


def _features_backward(ins, strides, options, dq0, dk0, dg0, dq1, dk1, dg1):
    """The gradients of ``_features_forward``'s six inputs from those of its outputs (None: zero)."""
    lora_shared, qact, kact, normalizer = options
    H, K = ins[0].shape[-2:]
    M = ins[0].numel() // K
    grads_in = [torch.zeros(ins[i].shape, device=ins[i].device, dtype=ins[i].dtype) if d is None else d.contiguous()
                for d, i in ((dq0, 0), (dq1, 0), (dk0, 2), (dk1, 2), (dg0, 4), (dg1, 5))]
    grads = [torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in ins]
    BK = max(16, triton.next_power_of_2(K))
    BM = _rows_per_program(BK)
    _features_bwd[(triton.cdiv(M, BM),)](*ins, *grads_in, *grads, M, K, H, *strides, 1.0 / normalizer,
                                         LORA_SHARED=lora_shared, QACT=qact, KACT=kact, BK=BK, BM=BM, num_warps=4)
    return grads


class _Features(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, q_lora, k, k_lora, gk0, gk1, lora_shared, qact, kact, normalizer):
        ctx.options = (lora_shared, qact, kact, normalizer)
        outs, ins, ctx.strides = _features_forward(q, q_lora, k, k_lora, gk0, gk1, ctx.options)
        ctx.save_for_backward(*ins)
        return outs

    @staticmethod
    def backward(ctx, *douts):
        return (*_features_backward(ctx.saved_tensors, ctx.strides, ctx.options, *douts), None, None, None, None)


class _LowRankFeatures(torch.autograd.Function):
    """:class:`_Features` from the rank-r inputs of the LoRA and gate maps' second halves: the four full-width
    products are made in the forward and again in the backward, so autograd keeps ``[..., r]`` inputs instead
    of four ``[..., H, K]`` outputs (at 32k tokens of the 2B shape, 0.56 GiB less in an SSE layer's backward).
    The products run in the inputs' dtype (autocast's: the weights cast as autocast would)."""

    @staticmethod
    def forward(ctx, q, k, lq, lk, lg0, lg1, wq, wk, wg0, wg1, bq, bk, bg0, bg1, lora_shared, qact, kact, normalizer):
        ctx.options = (lora_shared, qact, kact, normalizer)
        low = (lq, lk, lg0, lg1)
        weights, biases, ctx.dtypes = _maps_in(lq.dtype, (wq, wk, wg0, wg1), (bq, bk, bg0, bg1))
        ups = _low_rank_products(q.shape[-2:], low, weights, biases)
        outs, _, ctx.strides = _features_forward(q, ups[0], k, ups[1], ups[2], ups[3], ctx.options)
        ctx.save_for_backward(q, k, *low, *weights, *biases)
        return outs

    @staticmethod
    def backward(ctx, *douts):
        q, k, *rest = ctx.saved_tensors
        low, weights, biases = rest[:4], rest[4:8], rest[8:]
        ups = _low_rank_products(q.shape[-2:], low, weights, biases)
        ins = [_token_rows(q)[0], ups[0], _token_rows(k)[0], ups[1], ups[2], ups[3]]
        dq, dq_lora, dk, dk_lora, dg0, dg1 = _features_backward(ins, ctx.strides, ctx.options, *douts)
        del ins, ups
        grads = _low_rank_backward(low, weights, biases, (dq_lora, dk_lora, dg0, dg1), ctx.needs_input_grad[2:14],
                                   ctx.dtypes)
        return (dq, dk, *grads, None, None, None, None)


def _maps_in(dtype, weights, biases):
    """The low-rank maps' weights and biases in the inputs' dtype once (autocast's cast), kept for the backward's
    two products, and their own dtypes (the gradients')."""
    cast = ([None if t is None else t.to(dtype) for t in ts] for ts in (weights, biases))
    return *cast, [None if t is None else t.dtype for t in (*weights, *biases)]


def _low_rank_backward(low, weights, biases, d_ups, wanted, dtypes) -> list[torch.Tensor | None]:
    """The gradients of the rank-r inputs, the weights and the biases (in that order, four each) from those of
    the four full-width products ``d_ups``; ``wanted``: which of the twelve to make (frozen maps, e.g. alignment
    of the new parts only, skip their weights' products)."""
    dlow, dweights, dbiases = [], [], []
    for i, (x, w, b, dy) in enumerate(zip(low, weights, biases, d_ups)):
        dy = dy.reshape(-1, dy.shape[-2] * dy.shape[-1])
        dlow.append((dy @ w).view(x.shape) if wanted[i] else None)
        dweights.append((dy.t() @ x.reshape(-1, x.shape[-1])).to(dtypes[i]) if wanted[4 + i] else None)
        dbiases.append(dy.sum(0, dtype=dtypes[4 + i]) if b is not None and wanted[8 + i] else None)
    return [*dlow, *dweights, *dbiases]


def _low_rank_products(head_shape, low, weights, biases) -> list[torch.Tensor]:
    """``x @ w^T + b`` for each rank-r input (weights already in its dtype), as ``[..., H, K]``; autocast off, so
    that the backward's products are the forward's."""
    with torch.autocast(low[0].device.type, enabled=False):
        return [F.linear(x, w, b).unflatten(-1, tuple(head_shape)) for x, w, b in zip(low, weights, biases)]


def sse_features_triton(q, q_lora, k, k_lora, gk_shared, gk_sparse, *, lora_side: str, q_activation: str,
                        k_activation: str, normalizer: float):
    """Drop-in for :func:`sse_model.ops.fused.sse_features`; None declines (float64, shapes that differ)."""
    ins = (q, q_lora, k, k_lora, gk_shared, gk_sparse)
    if q.dtype == torch.float64 or any(x.shape != q.shape for x in ins):
        return None
    if q.shape[-1] > MAX_ROW:
        note_declined("fused sse_features", f"head size {q.shape[-1]} > {MAX_ROW}")
        return None
    return _Features.apply(q, q_lora, k, k_lora, gk_shared, gk_sparse, lora_side == "shared",
                           ACTIVATIONS.index(q_activation), ACTIVATIONS.index(k_activation), normalizer)


def low_rank_features_decline(q, k, low, weights) -> bool:
    """Whether the low-rank feature map's kernel cannot take these inputs: float64, inputs of several dtypes,
    shapes that differ, a head size above one row of the kernel (said once)."""
    if q.dtype == torch.float64 or q.shape != k.shape or len({x.dtype for x in (q, k, *low)}) != 1:
        return True
    if any(w.shape[0] != q.shape[-2] * q.shape[-1] for w in weights):
        return True
    if q.shape[-1] > MAX_ROW:
        note_declined("fused sse_low_rank_features", f"head size {q.shape[-1]} > {MAX_ROW}")
        return True
    return False


def sse_low_rank_features_triton(q, k, low, up, *, lora_side: str, q_activation: str, k_activation: str,
                                 normalizer: float):
    """Drop-in for :func:`sse_model.ops.fused.sse_low_rank_features` (:class:`_LowRankFeatures`); None
    declines (float64, inputs of several dtypes, shapes that differ)."""
    (wq, bq), (wk, bk), (wg0, bg0), (wg1, bg1) = up
    if low_rank_features_decline(q, k, low, (wq, wk, wg0, wg1)):
        return None
    return _LowRankFeatures.apply(q, k, *low, wq, wk, wg0, wg1, bq, bk, bg0, bg1, lora_side == "shared",
                                  ACTIVATIONS.index(q_activation), ACTIVATIONS.index(k_activation), normalizer)


# ----------------------------------------------------------------------------------------------------------
# The SSE prologue of a decode step, from the low-rank inputs


@triton.jit
def _low_rank_up(low, w, t, tm, S, R, rows, rmask, BR: tl.constexpr, F32: tl.constexpr):
    """``low[t] @ w[rows]^T`` accumulated in float32 (``[BT, BR] x [BR, BK]``); ``low``'s tokens are ``S``
    apart."""
    r = tl.arange(0, BR)
    a = tl.load(low + t[:, None] * S + r[None, :], mask=tm[:, None] & (r < R)[None, :], other=0.0)
    b = tl.load(w + rows[:, None].to(tl.int64) * R + r[None, :], mask=rmask[:, None] & (r < R)[None, :], other=0.0)
    if F32:  # float32 products in full precision (float32 inputs, and Triton's interpreter)
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b))


@triton.jit
def _side_features(x, low, w, out0, out1, t, tm, offs, S, SL, R, rows, mask, cm, LORA_SHARED: tl.constexpr,
                   ACT: tl.constexpr, BR: tl.constexpr, F32: tl.constexpr):
    """``act(x)`` and ``act(x + low @ w^T)`` as (shared, sparse), swapped when the LoRA is on the shared side."""
    a = tl.load(x + t[:, None] * S + rows[None, :], mask=mask, other=0.0).to(tl.float32)
    b = a + _low_rank_up(low, w, t, tm, SL, R, rows, cm, BR, F32)
    if LORA_SHARED:
        a, b = b, a
    tl.store(out0 + offs, _act(a, mask, ACT).to(out0.dtype.element_ty), mask=mask)
    tl.store(out1 + offs, _act(b, mask, ACT).to(out1.dtype.element_ty), mask=mask)


@triton.jit
def _gate_features(low, w, bias, out, t, tm, offs, SL, R, rows, mask, cm, inv_norm, BR: tl.constexpr,
                   F32: tl.constexpr):
    """``logsigmoid(low @ w^T + bias) / normalizer``."""
    x = _low_rank_up(low, w, t, tm, SL, R, rows, cm, BR, F32) + tl.load(bias + rows, mask=cm)[None, :].to(tl.float32)
    tl.store(out + offs, (_logsigmoid(x) * inv_norm).to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "SQ", "SK", "SV", "SLQ", "SLK", "SG0", "SG1", "inv_norm"])
def _decode_features_fwd(q, k, v, lq, lk, lg0, lg1, wq, wk, wg0, bg0, wg1, bg1, q0, q1, k0, k1, o0, o1, vo,
                         M, H, K, V, RQ, RG, SQ, SK, SV, SLQ, SLK, SG0, SG1, inv_norm,
                         LORA_SHARED: tl.constexpr, QACT: tl.constexpr, KACT: tl.constexpr, VACT: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BRQ: tl.constexpr,
                         BRG: tl.constexpr, F32: tl.constexpr):
    """One head of ``BT`` tokens, one of four parts per program (a decode step has few tokens: the parts
    spread it over more SMs): q, k, the shared gate and the value, the sparse gate."""
    h, part = tl.program_id(1), tl.program_id(2)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < M
    t = t.to(tl.int64)
    cols = tl.arange(0, BK)
    cm = cols < K
    mask = tm[:, None] & cm[None, :]
    rows = h * K + cols  # this head's rows of the up-projections
    offs = (t * H + h)[:, None] * K + cols[None, :]
    if part == 0:
        _side_features(q, lq, wq, q0, q1, t, tm, offs, SQ, SLQ, RQ, rows, mask, cm, LORA_SHARED, QACT, BRQ, F32)
    elif part == 1:
        _side_features(k, lk, wk, k0, k1, t, tm, offs, SK, SLK, RQ, rows, mask, cm, LORA_SHARED, KACT, BRQ, F32)
    elif part == 2:
        _gate_features(lg0, wg0, bg0, o0, t, tm, offs, SG0, RG, rows, mask, cm, inv_norm, BRG, F32)
        vcols = tl.arange(0, BV)
        vmask = tm[:, None] & (vcols < V)[None, :]
        x = tl.load(v + t[:, None] * SV + (h * V + vcols)[None, :], mask=vmask, other=0.0).to(tl.float32)
        tl.store(vo + (t * H + h)[:, None] * V + vcols[None, :], _act(x, vmask, VACT).to(vo.dtype.element_ty),
                 mask=vmask)
    else:
        _gate_features(lg1, wg1, bg1, o1, t, tm, offs, SG1, RG, rows, mask, cm, inv_norm, BRG, F32)


DECODE_TOKENS_PER_PROGRAM = 16  # the smallest tile of tl.dot


def sse_decode_features_triton(q, k, v, low, up, *, lora_side: str, q_activation: str, k_activation: str,
                               v_activation: str, normalizer: float):
    """Drop-in for :func:`sse_model.ops.fused.sse_decode_features`, without autograd (it serves generation);
    None declines: gradients wanted, float64, mixed dtypes, biases other than the gates', shapes that differ."""
    (wq, bq), (wk, bk), (wg0, bg0), (wg1, bg1) = up
    tensors = (q, k, v, *low, wq, wk, wg0, wg1, bg0, bg1)
    if any(t is None for t in tensors) or bq is not None or bk is not None:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if q.dtype == torch.float64 or len({t.dtype for t in tensors}) != 1 or q.shape != k.shape:
        return None
    H, K = q.shape[-2:]
    V = v.shape[-1]
    RQ, RG = low[0].shape[-1], low[2].shape[-1]
    if (low[1].shape[-1], low[3].shape[-1]) != (RQ, RG):
        return None
    if max(K, V) > MAX_ROW or max(RQ, RG) > 256:
        note_declined("fused sse_decode_features", f"head sizes {K}/{V} (at most {MAX_ROW}), low-rank widths "
                                                   f"{RQ}/{RG} (at most 256)")
        return None
    (q, sq), (k, sk), (v, sv) = _token_rows(q), _token_rows(k), _token_rows(v)
    (lq, slq), (lk, slk), (lg0, sg0), (lg1, sg1) = (_token_rows(x, 1) for x in low)
    M = q.numel() // (H * K)
    outs = [torch.empty(q.shape, device=q.device, dtype=q.dtype) for _ in range(6)]
    v_out = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    BT = DECODE_TOKENS_PER_PROGRAM
    _decode_features_fwd[(triton.cdiv(M, BT), H, 4)](
        q, k, v, lq, lk, lg0, lg1, wq, wk, wg0, bg0, wg1, bg1, *outs, v_out,
        M, H, K, V, RQ, RG, sq, sk, sv, slq, slk, sg0, sg1, 1.0 / normalizer,
        LORA_SHARED=lora_side == "shared", QACT=ACTIVATIONS.index(q_activation),
        KACT=ACTIVATIONS.index(k_activation), VACT=ACTIVATIONS.index(v_activation), BT=BT,
        BK=max(16, triton.next_power_of_2(K)), BV=max(16, triton.next_power_of_2(V)),
        BRQ=max(16, triton.next_power_of_2(RQ)), BRG=max(16, triton.next_power_of_2(RG)),
        F32=q.dtype == torch.float32 or interpreting(), num_warps=4)
    q0, q1, k0, k1, g0, g1 = outs
    return q0, k0, g0, q1, k1, g1, v_out
