"""Decode attention over the rollout engine's paged KV cache, keys and values read where they are.

The engine's attention layers decode by gathering each sequence's KV blocks into one contiguous tensor and then
running SDPA (``SlotCache.attend``): every step copies the whole cache once more. Here a program handles one
(sequence, KV head): it walks the sequence's blocks through its block table, ``BT`` tokens at a time, for all
query heads of the group at once (GQA), with an online softmax in float32 (flash-decoding without the split).

Layout, as :class:`sse_model.cache.SlotCache` keeps it: ``pool_k``/``pool_v`` ``[num_blocks + 1, H_kv, block_size,
D]``; ``tables`` ``[B, max_blocks]``, each sequence's blocks in order; ``lengths`` ``[B]``, its tokens, the new
one included. Lengths are read on the device: no host synchronisation, the launch can be captured in a CUDA graph.
Tiles are multiplied in float32 (TF32 on the tensor cores: exact for bf16 keys and values, which fit its
mantissa; the kernel is bound by reading the cache, not by the products).

Not yet the engine's path: ``python -m kernels.bench.bench_paged`` measures it against the gather path first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q, pool_k, pool_v, tables, lengths, o, scale,
    sq_b, sq_h, sk_blk, sk_h, sk_t, st_b, so_b, so_h,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    n = tl.load(lengths + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = hk * GROUP + g
    group_mask = g < GROUP
    q_tile = tl.load(q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=group_mask[:, None], other=0.0)
    q_tile = q_tile.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(0, n, BT):
        t = start + tl.arange(0, BT)
        valid = t < n
        block = tl.load(tables + b * st_b + t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = block[:, None] * sk_blk + hk * sk_h + (t % BLOCK_SIZE)[:, None] * sk_t + d[None, :]
        k = tl.load(pool_k + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q_tile, tl.trans(k)) * scale  # [GP, BT]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(pool_v + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    out = acc / l[:, None]
    tl.store(o + b * so_b + heads[:, None] * so_h + d[None, :], out.to(o.dtype.element_ty), mask=group_mask[:, None])


def paged_decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float | None = None,
                           tokens_per_step: int = 64) -> torch.Tensor:
    """``q`` ``[B, H, D]`` (one token per sequence) -> ``[B, H, D]``: softmax attention over each sequence's first
    ``lengths[b]`` cached tokens. ``H`` a multiple of the pools' ``H_kv``; ``D`` a power of two from 16."""
    B, H, D = q.shape
    H_kv, block_size = pool_k.shape[1], pool_k.shape[2]
    if H % H_kv or D < 16 or D & (D - 1):
        raise ValueError(f"paged_decode_attention: {H} query heads over {H_kv} KV heads of size {D}")
    if pool_k.stride(-1) != 1 or q.stride(-1) != 1 or pool_k.stride() != pool_v.stride():
        raise ValueError("paged_decode_attention: the head dimension must be contiguous, keys and values alike")
    group = H // H_kv
    o = torch.empty_like(q)
    _paged_decode_kernel[(B, H_kv)](
        q, pool_k, pool_v, tables, lengths, o, D ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), tables.stride(0),
        o.stride(0), o.stride(1),
        GROUP=group, GP=max(16, triton.next_power_of_2(group)), D=D, BLOCK_SIZE=block_size, BT=tokens_per_step,
    )
    return o
