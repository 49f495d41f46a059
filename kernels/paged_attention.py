"""Decode attention over the rollout engine's paged KV cache, keys and values read where they are.

The engine's attention layers decode by gathering each sequence's KV blocks into one contiguous tensor and then
running SDPA (``SlotCache.attend``): every step copies the whole cache once more. Here a program handles one
(sequence, KV head, split): it walks its share of the sequence's blocks through the block table, ``BT`` tokens at
a time, for all query heads of the group at once (GQA), with an online softmax in float32. With few sequences
(long rollouts: 8 sequences x 18 heads is about one program per SM) each sequence is split into ``splits`` ranges
whose partial softmax states a second kernel merges (flash-decoding), so the whole GPU reads the cache.

Layout, as :class:`pipeline.rollout.cache.SlotCache` keeps it: ``pool_k``/``pool_v`` ``[num_blocks + 1, H_kv, block_size,
D]``; ``tables`` ``[B, max_blocks]``, each sequence's blocks in order; ``lengths`` ``[B]``, its tokens, the new
one included. Lengths are read on the device: no host synchronisation, the launch can be captured in a CUDA graph.
Tiles of bf16 keys and values are multiplied in bf16 with float32 accumulation, the probabilities rounded to bf16
for the value product (as flash attention does): float32 operands doubled the registers a program holds and kept
the kernel further from its memory roofline; float32 caches (and Triton's interpreter, whose bf16 products
are wrong) multiply in float32; float8 caches (``kv_cache_dtype: fp8``) are widened to fp16 tile by tile and
multiplied with fp16 queries. Each program runs 8 warps (``python -m benchmarks.kernels.bench_paged``).

The engine's decode attention (:meth:`pipeline.rollout.cache.SlotCache.decode_attention`); ``python -m
benchmarks.kernels.bench_paged`` measures it against the gather path and the memory roofline.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import interpreting

@triton.jit
def _tile(tables, row, hk, start, hi, st_b, sk_blk, sk_h, sk_t, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
          BT: tl.constexpr):
    """Where tokens ``[start, start + BT)`` of one sequence's KV head lie in the pools, and which are below ``hi``."""
    t = start + tl.arange(0, BT)
    valid = t < hi
    block = tl.load(tables + row * st_b + t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offs = block[:, None] * sk_blk + hk * sk_h + (t % BLOCK_SIZE)[:, None] * sk_t + tl.arange(0, D)[None, :]
    return offs, valid


@triton.jit
def _paged_decode_kernel(
    q, pool_k, pool_v, tables, lengths, slots, o, part_m, part_l, scale, H,
    sq_b, sq_h, sk_blk, sk_h, sk_t, st_b, so_b, so_h, so_s,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BT: tl.constexpr,
    SPLITS: tl.constexpr, F32: tl.constexpr, HAS_SLOTS: tl.constexpr, FP8: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_SLOTS:  # the engine's rows: lengths before this step's token, which is stored already
        row = tl.load(slots + b).to(tl.int64)
        n = tl.load(lengths + row) + 1
    else:
        row = b
        n = tl.load(lengths + b)
    per = tl.cdiv(tl.cdiv(n, SPLITS), BT) * BT  # this split's tokens: [lo, hi), whole steps of BT
    lo = split * per
    hi = tl.minimum(lo + per, n)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = hk * GROUP + g
    group_mask = g < GROUP
    q_tile = tl.load(q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=group_mask[:, None], other=0.0)
    if F32:
        q_tile = q_tile.to(tl.float32)
    elif FP8:  # float8 keys and values are widened to fp16, a shorter conversion than to bf16
        q_tile = q_tile.to(tl.float16)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, BT):  # Triton's pipeliner stages the next tiles' loads ahead (num_stages)
        offs, valid = _tile(tables, row, hk, start, hi, st_b, sk_blk, sk_h, sk_t, D, BLOCK_SIZE, BT)
        k = tl.load(pool_k + offs, mask=valid[:, None], other=0.0)
        if F32:
            k = k.to(tl.float32)
        elif FP8:
            k = k.to(tl.float16)
        s = tl.dot(q_tile, tl.trans(k)) * scale  # [GP, BT], accumulated in float32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(pool_v + offs, mask=valid[:, None], other=0.0)
        if F32:
            v = v.to(tl.float32)
        elif FP8:
            v = v.to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if SPLITS == 1:
        out = acc / l[:, None]
        tl.store(o + b * so_b + heads[:, None] * so_h + d[None, :], out.to(o.dtype.element_ty),
                 mask=group_mask[:, None])
    else:  # unnormalised partial state; an empty split leaves m = -inf, l = 0, acc = 0
        row = (b * H + heads) * SPLITS + split  # partials [B, H, SPLITS] per query head
        tl.store(part_m + row, m, mask=group_mask)
        tl.store(part_l + row, l, mask=group_mask)
        tl.store(o + b * so_b + heads[:, None] * so_h + split * so_s + d[None, :], acc, mask=group_mask[:, None])


@triton.jit
def _merge_splits_kernel(part_m, part_l, part_o, o, D: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr):
    """One (sequence, query head): ``o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s``."""
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    inside = s < SPLITS
    m = tl.load(part_m + row * SPLITS + s, mask=inside, other=float("-inf"))
    l = tl.load(part_l + row * SPLITS + s, mask=inside, other=0.0)
    top = tl.max(m, 0)  # finite: a sequence holds at least one token, so split 0 is never empty
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    acc = tl.load(part_o + (row * SPLITS + s)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(o + row * D + d, out.to(o.dtype.element_ty))


WARPS = 8  # a program's warps
# The engine's launch: tiles of 128 tokens, two of them in flight (Triton's num_stages), the fastest of the launches
# ``python -m benchmarks.kernels.bench_paged --fp8`` times on bf16 and float8 caches (``docs/benchmarks.md``): a float8
# tile pays a fixed price a step of the loop to widen, which bigger tiles pay less often
TOKENS_PER_STEP = 128
STAGES = 2


def default_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Splits per sequence so that about eight programs per SM read the cache (1 when the batch alone does)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(16, -(-8 * sms // (batch * kv_heads))))


def paged_decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float | None = None,
                           tokens_per_step: int = TOKENS_PER_STEP, splits: int | None = None,
                           slots: torch.Tensor | None = None, stages: int = STAGES) -> torch.Tensor:
    """``q`` ``[B, H, D]`` (one token per sequence) -> ``[B, H, D]``: softmax attention over each sequence's first
    ``lengths[b]`` (>= 1) cached tokens (float8 pools widened to fp16 as they are read). ``H`` a multiple of the
    pools' ``H_kv``; ``D`` a power of two from 16.
    ``splits``: ranges per sequence read by separate programs (default :func:`default_splits`, fixed by the
    shapes, so a CUDA graph can capture it). With ``slots`` (the engine's rows), sequence ``b`` is row ``slots[b]``
    of ``tables`` and ``lengths``, and reads ``lengths[slots[b]] + 1`` tokens: the cache's lengths before this
    step, whose token :func:`rotary_store_decode` stored. ``tokens_per_step``: a tile's tokens; ``stages``: the
    pipeline's depth (``num_stages``)."""
    B, H, D = q.shape
    H_kv, block_size = pool_k.shape[1], pool_k.shape[2]
    if H % H_kv or D < 16 or D & (D - 1):
        raise ValueError(f"paged_decode_attention: {H} query heads over {H_kv} KV heads of size {D}")
    if stages < 1:
        raise ValueError(f"paged_decode_attention: stages {stages}: at least one tile in flight")
    if pool_k.stride(-1) != 1 or q.stride(-1) != 1 or pool_k.stride() != pool_v.stride():
        raise ValueError("paged_decode_attention: the head dimension must be contiguous, keys and values alike")
    splits = default_splits(B, H_kv, q.device) if splits is None else splits
    group = H // H_kv
    o = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    if splits == 1:
        target, part_m, part_l = o, o, o  # the partial buffers are not touched
    else:
        target = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
        part_m = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    _paged_decode_kernel[(B, H_kv, splits)](
        q, pool_k, pool_v, tables, lengths, lengths if slots is None else slots, target, part_m, part_l,
        D ** -0.5 if scale is None else scale, H,
        q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), tables.stride(0),
        target.stride(0), target.stride(1), target.stride(2) if splits > 1 else 0,
        GROUP=group, GP=max(16, triton.next_power_of_2(group)), D=D, BLOCK_SIZE=block_size,
        BT=tokens_per_step, SPLITS=splits, F32=pool_k.dtype == torch.float32 or interpreting(),
        HAS_SLOTS=slots is not None, FP8=pool_k.dtype == torch.float8_e4m3fn, num_warps=WARPS, num_stages=stages,
    )
    if splits > 1:
        _merge_splits_kernel[(B * H,)](part_m, part_l, target, o, D=D, SPLITS=splits,
                                       SP=triton.next_power_of_2(splits))
    return o


@triton.jit
def _rotary_store_kernel(q, k, v, positions, inv_freq, factor, pool_k, pool_v, tables, lengths, slots, q_out,
                         H, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sp_b, sk_blk, sk_hd, sk_t, st_b,
                         HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, LIMIT: tl.constexpr):
    """Program (b, j): query head j < H rotated into ``q_out``; else KV head j - H: its key rotated and its value
    stored at the row's next position in its block."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, HALF)
    angle = tl.load(positions + b * sp_b).to(tl.float32) * tl.load(inv_freq + d)
    cos, sin = tl.cos(angle) * factor, tl.sin(angle) * factor
    if j < H:
        x = q + b * sq_b + j * sq_h
        x1, x2 = tl.load(x + d).to(tl.float32), tl.load(x + HALF + d).to(tl.float32)
        out = q_out + (b * H + j) * 2 * HALF
        tl.store(out + d, (x1 * cos - x2 * sin).to(q_out.dtype.element_ty))
        tl.store(out + HALF + d, (x2 * cos + x1 * sin).to(q_out.dtype.element_ty))
    else:
        h = j - H
        row = tl.load(slots + b).to(tl.int64)
        index = tl.load(lengths + row)
        block = tl.load(tables + row * st_b + index // BLOCK_SIZE).to(tl.int64)
        dest = block * sk_blk + h * sk_hd + (index % BLOCK_SIZE) * sk_t
        x = k + b * sk_b + h * sk_h
        x1, x2 = tl.load(x + d).to(tl.float32), tl.load(x + HALF + d).to(tl.float32)
        k1, k2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        y = v + b * sv_b + h * sv_h
        v1, v2 = tl.load(y + d).to(tl.float32), tl.load(y + HALF + d).to(tl.float32)
        if LIMIT > 0:  # a float8 pool: clamped to its range (beyond it the cast gives NaN)
            k1, k2 = tl.clamp(k1, -LIMIT, LIMIT), tl.clamp(k2, -LIMIT, LIMIT)
            v1, v2 = tl.clamp(v1, -LIMIT, LIMIT), tl.clamp(v2, -LIMIT, LIMIT)
        tl.store(pool_k + dest + d, k1.to(pool_k.dtype.element_ty))
        tl.store(pool_k + dest + HALF + d, k2.to(pool_k.dtype.element_ty))
        tl.store(pool_v + dest + d, v1.to(pool_v.dtype.element_ty))
        tl.store(pool_v + dest + HALF + d, v2.to(pool_v.dtype.element_ty))


def rotary_store_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        inv_freq: torch.Tensor, factor: float, pool_k: torch.Tensor, pool_v: torch.Tensor,
                        tables: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A decode step's attention prologue in one launch: RoPE (rotate-half, as
    :class:`sse_model.modules.RotaryEmbedding`, in float32) on ``q [B, H, D]`` and ``k [B, H_kv, D]`` at
    ``positions [B]``, and the rotated key and ``v`` stored at position ``lengths[slots[b]]`` of row ``slots[b]``'s
    blocks (``tables``, pools ``[blocks, H_kv, block_size, D]``; float8 pools take the values clamped to e4m3's
    range). Returns the rotated queries ``[B, H, D]`` in the pool's dtype (a float8 pool's: ``q``'s). ``q, k, v`` may
    be column slices of one product (each head's ``D`` values contiguous)."""
    B, H, D = q.shape
    H_kv = k.shape[1]
    if D % 2 or (D // 2) & (D // 2 - 1) or tuple(k.shape) != (B, H_kv, D) or tuple(v.shape) != (B, H_kv, D):
        raise ValueError(f"rotary_store_decode: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         "(heads of one size, half of it a power of two)")
    if any(t.stride(-1) != 1 for t in (q, k, v, pool_k)) or pool_k.stride() != pool_v.stride():
        raise ValueError("rotary_store_decode: the head dimension must be contiguous")
    fp8 = pool_k.dtype == torch.float8_e4m3fn
    q_out = torch.empty(B, H, D, device=q.device, dtype=q.dtype if fp8 else pool_k.dtype)
    _rotary_store_kernel[(B, H + H_kv)](
        q, k, v, positions, inv_freq, float(factor), pool_k, pool_v, tables, lengths, slots, q_out,
        H, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), positions.stride(0),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), tables.stride(0),
        HALF=D // 2, BLOCK_SIZE=pool_k.shape[2], LIMIT=torch.finfo(pool_k.dtype).max if fp8 else 0.0, num_warps=1)
    return q_out
