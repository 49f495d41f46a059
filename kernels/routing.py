"""Fused SSE routing: router logits -> partition probabilities and the ranked top-k, one launch.

A program takes ``BLOCK_T`` tokens; each row is soft-maxed in float32 and its top-k found by k rounds of
argmax with masking (k is at most N <= 64: cheaper than a sort). The backward is the softmax Jacobian
product, a few elementwise ops left to PyTorch. The varlen reorder that consumes the ranking is
:class:`sse_model.ops.sse.VarlenPlan` (a counting sort: one-hot, cumulative sum, scatter; no sort, no
Python loop over partitions or sequences).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sse_model.ops.sse import Routing

MAX_PARTITIONS = 256


@triton.jit(do_not_specialize=["L"])
def _route_kernel(logits, probs, topk, L, N: tl.constexpr, KMAX: tl.constexpr, BN: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BN)
    row_ok = rows < L
    mask = row_ok[:, None] & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(logits + offs, mask=mask, other=-1e30).to(tl.float32)
    x = x - tl.max(x, axis=1)[:, None]
    e = tl.where(mask, tl.exp(x), 0.0)
    p = e / tl.sum(e, axis=1)[:, None]
    tl.store(probs + offs, p, mask=mask)
    work = tl.where(mask, p, -1.0)
    for r in tl.static_range(KMAX):
        best = tl.argmax(work, axis=1)
        tl.store(topk + rows.to(tl.int64) * KMAX + r, best.to(tl.int64), mask=row_ok)
        work = tl.where(cols[None, :] == best[:, None], -2.0, work)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, kmax: int):
        shape = logits.shape
        N = shape[-1]
        flat = logits.reshape(-1, N).contiguous()
        L = flat.shape[0]
        probs = torch.empty(L, N, device=logits.device, dtype=torch.float32)
        topk = torch.empty(L, kmax, device=logits.device, dtype=torch.long)
        if L:
            block_t = 64 if N <= 64 else 16
            _route_kernel[(triton.cdiv(L, block_t),)](flat, probs, topk, L, N=N, KMAX=kmax,
                                                      BN=triton.next_power_of_2(N), BLOCK_T=block_t)
        ctx.save_for_backward(probs)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(topk)
        return probs.view(shape), topk.view(*shape[:-1], kmax)

    @staticmethod
    def backward(ctx, grad_probs, _grad_topk):
        (probs,) = ctx.saved_tensors
        g = grad_probs.reshape(probs.shape).float()
        grad = probs * (g - (g * probs).sum(-1, keepdim=True))
        return grad.view(grad_probs.shape).to(ctx.logits_dtype), None


def route_triton(router_logits: torch.Tensor, num_writers: int, num_readers: int) -> Routing:
    """Drop-in for :func:`sse_model.ops.sse.route` (float32 probabilities; float64 logits go to PyTorch)."""
    N = router_logits.shape[-1]
    if not 1 <= num_writers <= N or not 1 <= num_readers <= N:
        raise ValueError(f"num_writers ({num_writers}) and num_readers ({num_readers}) must be in [1, {N}]")
    if N > MAX_PARTITIONS:
        raise ValueError(f"route_triton supports up to {MAX_PARTITIONS} partitions, got {N}")
    probs, topk = _Route.apply(router_logits, max(num_writers, num_readers))
    return Routing(probs, topk, num_writers, num_readers)
