"""The chunk kernels' plan in five launches instead of ~60 PyTorch operators.

An SSE layer's training step is close to bound by the host (``docs/benchmarks.md``), and its plan was the
largest part of the host's extra work over GLA: the counting sort of :class:`~sse_model.ops.sse.VarlenPlan`
and the chunk tables of :class:`ChunkPlan`, each a chain of small operators. Here:

- ``_block_counts``, then ``_count_before`` (per token block, with the running sum of the blocks' counts
  between them): ``before[t, p]``, the pairs of partition ``p`` among tokens ``< t``;
- ``_segments`` (one program): the segments' row offsets (the sequences, then one per (sequence,
  partition)), the pair offsets, each segment's first chunk id and the chunk totals;
- ``_pairs`` (per token block): each token's sequence (binary search), its pairs' places in the reorder,
  and per pair its token, partition, source index in the ``[L, Kmax]`` choices and write / read masks;
- ``_chunks`` (per chunk-id block): each chunk id's segment (binary search) and first row, and the two
  per-chunk launches' chunk ids.

Nothing waits for the GPU: sizes are the same upper bounds as the PyTorch builders'. The PyTorch builders stay
the definition; the tests hold these kernels to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sse_model.ops.sse import VarlenPlan

BLOCK = 1024
CHUNK = 64  # rows per chunk of the chunk kernels (kernels/sse_chunk.py)


@dataclass
class ChunkPlan:
    """Segments and chunks of one call. Segments ``[0, S)`` are the sequences (the shared partition), then
    ``S * NP`` sparse segments, sequence-major, partition-minor (the order of ``VarlenPlan``). Chunk ids
    number every segment's chunks in segment order; ``launch_shared`` / ``launch_sparse`` give each program
    of the two per-chunk launches its chunk id (-1: nothing to do). Host-side sizes are upper bounds, so
    building the plan never waits for the GPU. :meth:`build` is the PyTorch definition; :func:`build_plans`
    builds the same tables with the kernels below.
    """

    cu_seg: torch.Tensor  # [num_seg + 1] row offsets
    chunk_off: torch.Tensor  # [num_seg] first chunk id of each segment
    chunk_seg: torch.Tensor  # [max_chunks] segment of each chunk id (-1 past the end)
    chunk_start: torch.Tensor  # [max_chunks] first row of each chunk id
    launch_shared: torch.Tensor
    launch_sparse: torch.Tensor | None
    num_seqs: int
    num_sparse_partitions: int  # NP sparse partitions; 0 for plain GLA
    chunk: int

    @property
    def num_segments(self) -> int:
        return self.cu_seg.numel() - 1

    @property
    def max_chunks(self) -> int:
        return self.chunk_seg.numel()

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, num_tokens: int, sparse_cu: torch.Tensor | None = None,
              num_pairs: int = 0, num_sparse_partitions: int = 0, chunk: int = CHUNK) -> "ChunkPlan":
        """``cu_seqlens``: token offsets of the ``S`` sequences; ``sparse_cu``: offsets of the sparse segments
        in the pair list (``VarlenPlan.cu_seqlens``, ``[S * NP + 1]``), None for plain GLA."""
        device = cu_seqlens.device
        S = cu_seqlens.numel() - 1
        cu = cu_seqlens.long()
        if sparse_cu is not None:
            cu = torch.cat([cu, num_tokens + sparse_cu[1:].long()])
        n_chunks = (cu[1:] - cu[:-1] + chunk - 1) // chunk
        incl = n_chunks.cumsum(0)
        excl = incl - n_chunks
        max_sh = -(-num_tokens // chunk) + S
        max_sp = 0 if sparse_cu is None else -(-num_pairs // chunk) + S * num_sparse_partitions
        total = max_sh + max_sp
        ids = torch.arange(total, device=device)
        seg = torch.searchsorted(incl, ids, right=True)
        inside = seg < n_chunks.numel()
        seg_c = seg.clamp(max=n_chunks.numel() - 1)
        chunk_start = cu[seg_c] + (ids - excl[seg_c]) * chunk
        chunk_seg = torch.where(inside, seg, -1)
        launch_sh = torch.where(inside[:max_sh] & (seg[:max_sh] < S), ids[:max_sh], -1)
        launch_sp = None
        if sparse_cu is not None:
            sp_ids = excl[S] + torch.arange(max_sp, device=device)  # sparse chunks follow the shared ones
            launch_sp = torch.where(sp_ids < incl[-1], sp_ids, -1)
        i32 = torch.int32
        return cls(cu.to(i32), excl.to(i32), chunk_seg.to(i32), chunk_start,
                   launch_sh.to(i32), None if launch_sp is None else launch_sp.to(i32), S, num_sparse_partitions, chunk)


@triton.jit
def _one_hot(topk, t, tm, parts, KM: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr):
    """``[BT, NB]``: how many of token ``t``'s ``KM`` choices are partition ``parts``."""
    hot = tl.zeros([BT, NB], dtype=tl.int32)
    for j in tl.static_range(KM):
        p = tl.load(topk + t.to(tl.int64) * KM + j, mask=tm, other=-1).to(tl.int32)
        hot += (p[:, None] == parts[None, :]).to(tl.int32)
    return hot


@triton.jit(do_not_specialize=["L"])
def _block_counts(topk, counts, L, N: tl.constexpr, KM: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr):
    b = tl.program_id(0)
    t = b * BT + tl.arange(0, BT)
    parts = tl.arange(0, NB)
    hot = _one_hot(topk, t, t < L, parts, KM, NB, BT)
    tl.store(counts + b * N + parts, tl.sum(hot, axis=0), mask=parts < N)


@triton.jit(do_not_specialize=["L"])
def _count_before(topk, upto, before, L, N: tl.constexpr, KM: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr):
    b = tl.program_id(0)
    t = b * BT + tl.arange(0, BT)
    tm = t < L
    parts = tl.arange(0, NB)
    pmask = parts < N
    carry = tl.load(upto + (b - 1) * N + parts, mask=pmask & (parts * 0 + b > 0), other=0)  # earlier blocks' pairs
    if b == 0:
        tl.store(before + parts, carry, mask=pmask)
    incl = tl.cumsum(_one_hot(topk, t, tm, parts, KM, NB, BT), axis=0) + carry[None, :]
    tl.store(before + (t.to(tl.int64)[:, None] + 1) * N + parts[None, :], incl, mask=tm[:, None] & pmask[None, :])


@triton.jit(do_not_specialize=["L", "S"])
def _segments(cu, before, sparse_cu, cu_seg, chunk_off, totals, L, S, N: tl.constexpr, C: tl.constexpr,
              SPARSE: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr):
    chunks = tl.zeros([], dtype=tl.int32)
    for s0 in range(0, S, BS):  # the shared segments: the sequences
        s = s0 + tl.arange(0, BS)
        sm = s < S
        a = tl.load(cu + s, mask=sm, other=0).to(tl.int32)
        b = tl.load(cu + s + 1, mask=sm, other=0).to(tl.int32)
        n = tl.where(sm, (b - a + C - 1) // C, 0)
        tl.store(chunk_off + s, tl.cumsum(n, axis=0) - n + chunks, mask=sm)
        tl.store(cu_seg + s, a, mask=sm)
        chunks += tl.sum(n, axis=0)
    tl.store(cu_seg + S, L)
    tl.store(totals, chunks)
    if SPARSE:  # then one segment per (sequence, partition), sequence-major
        pairs = tl.zeros([], dtype=tl.int32)
        parts = tl.arange(0, NB)
        for s0 in range(0, S, BS):
            s = s0 + tl.arange(0, BS)
            sm = s < S
            m2 = sm[:, None] & (parts < N)[None, :]
            a = tl.load(cu + s, mask=sm, other=0).to(tl.int64)
            b = tl.load(cu + s + 1, mask=sm, other=0).to(tl.int64)
            count = (tl.load(before + b[:, None] * N + parts[None, :], mask=m2, other=0)
                     - tl.load(before + a[:, None] * N + parts[None, :], mask=m2, other=0))
            count = tl.reshape(count, [BS * NB])
            n = (count + C - 1) // C
            q = tl.reshape(s[:, None] * N + parts[None, :], [BS * NB])
            qm = tl.reshape(m2, [BS * NB])
            offset = tl.cumsum(count, axis=0) - count + pairs
            tl.store(sparse_cu + q, offset.to(sparse_cu.dtype.element_ty), mask=qm)
            tl.store(cu_seg + S + q, L + offset, mask=qm)
            tl.store(chunk_off + S + q, tl.cumsum(n, axis=0) - n + chunks, mask=qm)
            pairs += tl.sum(count, axis=0)
            chunks += tl.sum(n, axis=0)
        tl.store(sparse_cu + S * N, pairs.to(sparse_cu.dtype.element_ty))
        tl.store(cu_seg + S + S * N, L + pairs)
    tl.store(totals + 1, chunks)


@triton.jit
def _last_at_most(keys, x, mask, n, STEPS):
    """Per element of ``x``: the last index ``i < n`` of the ascending ``keys`` with ``keys[i] <= x``
    (``keys[0] <= x`` for all ``x``), by ``STEPS`` rounds of binary search."""
    lo = tl.zeros(x.shape, dtype=tl.int32)
    hi = tl.zeros(x.shape, dtype=tl.int32) + n - 1
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(keys + mid, mask=mask, other=0) <= x
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["L", "S", "STEPS"])
def _pairs(topk, cu, before, sparse_cu, position, token, tok32, partition, source, write, read, L, S, STEPS,
           N: tl.constexpr, KM: tl.constexpr, KW: tl.constexpr, KR: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < L
    lo = _last_at_most(cu, t, tm, S, STEPS)  # each token's sequence
    first = tl.load(cu + lo, mask=tm, other=0).to(tl.int64)
    t64 = t.to(tl.int64)
    for j in tl.static_range(KM):
        p = tl.load(topk + t64 * KM + j, mask=tm, other=0).to(tl.int64)
        rank = tl.load(before + t64 * N + p, mask=tm, other=0) - tl.load(before + first * N + p, mask=tm, other=0)
        pos = tl.load(sparse_cu + lo.to(tl.int64) * N + p, mask=tm, other=0).to(tl.int64) + rank
        tl.store(position + t64 * KM + j, pos, mask=tm)
        tl.store(token + pos, t64, mask=tm)
        tl.store(tok32 + pos, t, mask=tm)
        tl.store(partition + pos, p, mask=tm)
        tl.store(source + pos, t64 * KM + j, mask=tm)
        rank_j = tl.zeros([BT], dtype=tl.int32) + j
        tl.store(write + pos, (rank_j < KW).to(tl.float32), mask=tm)
        tl.store(read + pos, (rank_j < KR).to(tl.float32), mask=tm)


@triton.jit(do_not_specialize=["NSEG", "MAX_SH", "MAX_SP", "STEPS"])
def _chunks(cu_seg, chunk_off, totals, chunk_seg, chunk_start, launch_sh, launch_sp, NSEG, MAX_SH, MAX_SP, STEPS,
            C: tl.constexpr, SPARSE: tl.constexpr, BC: tl.constexpr):
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    cm = c < MAX_SH + MAX_SP
    shared = tl.load(totals)
    total = tl.load(totals + 1)
    lo = _last_at_most(chunk_off, c, cm, NSEG, STEPS)  # each chunk id's segment
    start = (tl.load(cu_seg + lo, mask=cm, other=0).to(tl.int64)
             + (c - tl.load(chunk_off + lo, mask=cm, other=0)).to(tl.int64) * C)
    tl.store(chunk_seg + c, tl.where(c < total, lo, -1), mask=cm)
    tl.store(chunk_start + c, start, mask=cm)
    tl.store(launch_sh + c, tl.where(c < shared, c, -1), mask=c < MAX_SH)
    if SPARSE:
        tl.store(launch_sp + c, tl.where(shared + c < total, shared + c, -1), mask=c < MAX_SP)


def _steps(n: int) -> int:
    """Binary-search rounds that find an index among ``n``."""
    return max(1, math.ceil(math.log2(max(n, 1))) + 1)


def build_plans(cu: torch.Tensor, num_tokens: int, topk: torch.Tensor | None = None, num_sparse_partitions: int = 0,
                num_writers: int = 1, num_readers: int = 1, chunk: int = 64):
    """The plans of one call: ``(chunks, pairs)`` with ``pairs`` None for plain GLA (``topk`` None), else
    ``(VarlenPlan, tok32, source, write, read)`` (see ``kernels/sse_chunk.py::_SSEPlan``); ``chunks`` has
    :class:`ChunkPlan`'s fields as a dict."""
    device = cu.device
    S = cu.numel() - 1
    L = num_tokens
    N = num_sparse_partitions
    sparse = topk is not None
    i32, i64 = torch.int32, torch.int64
    nb = triton.next_power_of_2(max(N, 1))
    num_seg = S + S * N
    cu_seg = torch.empty(num_seg + 1, device=device, dtype=i32)
    chunk_off = torch.empty(num_seg, device=device, dtype=i32)
    totals = torch.empty(2, device=device, dtype=i32)
    before = sparse_cu = None
    if sparse:
        KM = topk.shape[1]
        before = torch.empty(L + 1, N, device=device, dtype=i32)
        sparse_cu = torch.empty(S * N + 1, device=device, dtype=i64)
        # per block of tokens: the counts, their running sum over blocks, then the counts before each token
        bt = max(16, 8 * BLOCK // nb)
        blocks = triton.cdiv(L, bt)
        counts = torch.empty(blocks, N, device=device, dtype=i32)
        _block_counts[(blocks,)](topk, counts, L, N=N, KM=KM, NB=nb, BT=bt, num_warps=8)
        _count_before[(blocks,)](topk, counts.cumsum(0, dtype=i32), before, L, N=N, KM=KM, NB=nb, BT=bt, num_warps=8)
    bs = max(16, min(BLOCK // nb, triton.next_power_of_2(max(S, 1))))
    _segments[(1,)](cu, cu if before is None else before, cu_seg if sparse_cu is None else sparse_cu, cu_seg,
                    chunk_off, totals, L, S, N=max(N, 1), C=chunk, SPARSE=sparse, NB=nb, BS=bs)
    max_sh = -(-L // chunk) + S
    max_sp = -(-L * topk.shape[1] // chunk) + S * N if sparse else 0
    chunk_seg = torch.empty(max_sh + max_sp, device=device, dtype=i32)
    chunk_start = torch.empty(max_sh + max_sp, device=device, dtype=i64)
    launch_sh = torch.empty(max_sh, device=device, dtype=i32)
    launch_sp = torch.empty(max_sp, device=device, dtype=i32) if sparse else None
    _chunks[(triton.cdiv(max_sh + max_sp, BLOCK),)](
        cu_seg, chunk_off, totals, chunk_seg, chunk_start, launch_sh, launch_sh if launch_sp is None else launch_sp,
        num_seg, max_sh, max_sp, _steps(num_seg), C=chunk, SPARSE=sparse, BC=BLOCK)
    chunks = dict(cu_seg=cu_seg, chunk_off=chunk_off, chunk_seg=chunk_seg, chunk_start=chunk_start,
                  launch_shared=launch_sh, launch_sparse=launch_sp)
    if not sparse:
        return chunks, None
    P = L * KM
    position = torch.empty(L, KM, device=device, dtype=i64)
    token, partition, source = (torch.empty(P, device=device, dtype=i64) for _ in range(3))
    tok32 = torch.empty(P, device=device, dtype=i32)
    write, read = torch.empty(P, device=device), torch.empty(P, device=device)
    _pairs[(triton.cdiv(L, BLOCK),)](topk, cu, before, sparse_cu, position, token, tok32, partition, source, write,
                                     read, L, S, _steps(S), N=N, KM=KM, KW=num_writers, KR=num_readers, BT=BLOCK)
    return chunks, (VarlenPlan(token, partition, sparse_cu, position), tok32, source, write, read)


def build_plans_reference(cu: torch.Tensor, num_tokens: int, topk: torch.Tensor | None = None,
                          num_sparse_partitions: int = 0, num_writers: int = 1, num_readers: int = 1, chunk: int = 64):
    """:func:`build_plans` by the PyTorch definitions (``VarlenPlan.build``, ``ChunkPlan.build``)."""
    names = ("cu_seg", "chunk_off", "chunk_seg", "chunk_start", "launch_shared", "launch_sparse")
    if topk is None:
        plan = ChunkPlan.build(cu, num_tokens, chunk=chunk)
        return {name: getattr(plan, name) for name in names}, None
    L, Kmax = topk.shape
    pairs = VarlenPlan.build(topk, cu, num_sparse_partitions)
    plan = ChunkPlan.build(cu, L, pairs.cu_seqlens, pairs.token.numel(), num_sparse_partitions, chunk=chunk)
    source = torch.empty_like(pairs.token)
    source[pairs.position.reshape(-1)] = torch.arange(L * Kmax, device=topk.device)
    rank = source % Kmax
    return ({name: getattr(plan, name) for name in names},
            (pairs, pairs.token.int(), source, (rank < num_writers).float(), (rank < num_readers).float()))
