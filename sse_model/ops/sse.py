"""Sparse State Expansion (SSE) core: routing and the three implementations that must agree.

An SSE layer keeps ``1 + N`` state partitions per head: partition 0 is always selected ("shared"); the
other N are sparse. Every token routes with ``p_t = softmax(e_t)`` over the N sparse partitions and takes
its top-``num_writers`` partitions for writing and top-``num_readers`` for reading (the two sets are
prefixes of one ranking, so one contains the other). Selected partition ``i`` receives the shared sparse
projections gated by its router weight (write-read gating of the SSE paper):

    GLA transition:  S^i_t = diag(exp(g_t)) S^i_{t-1} + (w^i_t k_t)^T v_t           for i written at t
    GDN transition:  the gated delta rule with k (gate_target="key") or v (gate_target="value") scaled by w^i_t
    output:          o_t = scale * q0_t S^0_t + sum_{i read at t} scale * (r^i_t q_t) S^i_t

with ``w^i = p^i`` (write gate on) or 1, ``r^i = p^i`` (read gate on) or 1. A partition that is not written
at step t is neither written nor decayed: its state is bit-for-bit unchanged.

Implementations:
    ``sse_recurrent``: token by token over explicit partition states (the definition);
    ``sse_masked``:   Algorithm 1 of the paper: replicate over partitions, mask, fold partitions into heads,
                      one call of a linear-attention op (good for short sequences);
    ``sse_varlen``:   Algorithm 2: reorder (token, partition) pairs by partition, one varlen segment per
                      (sequence, partition), shared partition fused as extra segments, one call.
States are ``[num_seqs, 1 + N, H, K, V]`` with partition 0 the shared one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .delta_rule import gated_delta_step, l2norm
from .gla import gla_step
from .varlen import PaddedLayout, check_cu_seqlens, compute_dtype, dense_cu_seqlens

LinearOp = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class Routing:
    """Top-k partition choice of each token. ``probs`` is ``[..., N]``, ``topk`` is ``[..., max(Kw, Kr)]``."""

    probs: torch.Tensor
    topk: torch.Tensor
    num_writers: int
    num_readers: int

    @property
    def num_sparse_partitions(self) -> int:
        return self.probs.shape[-1]

    def _mask(self, count: int) -> torch.Tensor:
        mask = torch.zeros_like(self.probs, dtype=torch.bool)
        return mask.scatter(-1, self.topk[..., :count], True)

    @property
    def write_mask(self) -> torch.Tensor:
        return self._mask(self.num_writers)

    @property
    def read_mask(self) -> torch.Tensor:
        return self._mask(self.num_readers)

    def weights(self, write_gate: bool, read_gate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-partition (write weight, read weight, write mask), zero where a partition is not selected."""
        write = self.write_mask.to(self.probs.dtype)
        read = self.read_mask.to(self.probs.dtype)
        write_w = write * self.probs if write_gate else write
        read_w = read * self.probs if read_gate else read
        return write_w, read_w, write


def route(router_logits: torch.Tensor, num_writers: int, num_readers: int) -> Routing:
    """Softmax over partitions (in float32, float64 for float64 logits) and the top-k ranking."""
    num_sparse_partitions = router_logits.shape[-1]
    if not 1 <= num_writers <= num_sparse_partitions or not 1 <= num_readers <= num_sparse_partitions:
        raise ValueError(
            f"num_writers ({num_writers}) and num_readers ({num_readers}) must be in [1, {num_sparse_partitions}]"
        )
    probs = torch.softmax(router_logits.to(compute_dtype(router_logits)), dim=-1)
    topk = torch.topk(probs.detach(), max(num_writers, num_readers), dim=-1, sorted=True).indices
    return Routing(probs, topk, num_writers, num_readers)


@dataclass
class Branch:
    """Feature-mapped inputs of one side of an SSE layer (the shared partition or the sparse ones).

    ``q, k: [B, T, H, K]``; GLA: ``g: [B, T, H, K]``; GDN: ``g, beta: [B, T, H]``.
    """

    q: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor | None = None


@dataclass(frozen=True)
class SSEOptions:
    transition: str = "gla"  # "gla" | "gdn"
    write_gate: bool = True
    read_gate: bool = True
    gate_target: str = "key"  # GDN only: what the write gate scales, "key" (fla reference) or "value" (SLA)
    qk_l2norm: bool = False  # GDN: L2-normalise q and k after gating, inside the op (fla reference)
    scale: float | None = None
    # the chunk kernels' backward: > 1 makes the chunk states again a group of heads at a time instead of keeping
    # the forward's (less memory at the backward's peak, one more state pass); must divide the heads
    backward_head_groups: int = 1


def gate_partition(sparse: Branch, v: torch.Tensor, read_w, write_w, write_mask, opts: SSEOptions):
    """Inputs that one sparse partition sees: the shared sparse projections gated by its router weights.

    The weights have the leading shape of the inputs (without head and feature dims). Unwritten partitions
    get zero key, value, log-decay and beta, so the linear op leaves their state untouched.
    """
    r, w, m = (x[..., None, None] for x in (read_w, write_w, write_mask))
    # the gates are float32; gated inputs keep the inputs' dtype (bf16 stays bf16 for the chunk kernels)
    q = (sparse.q * r).to(sparse.q.dtype)
    if opts.transition == "gdn" and opts.gate_target == "value":
        k, v = (sparse.k * m).to(sparse.k.dtype), (v * w).to(v.dtype)
    else:
        k, v = (sparse.k * w).to(sparse.k.dtype), (v * m).to(v.dtype)
    if opts.transition == "gla":
        return q, k, v, sparse.g * m, None
    return q, k, v, sparse.g * m[..., 0], sparse.beta * m[..., 0]


def _check_state(initial_state, num_seqs, num_sparse_partitions, q, v):
    expected = (num_seqs, 1 + num_sparse_partitions, q.shape[2], q.shape[3], v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(f"SSE state must be {list(expected)}, got {list(initial_state.shape)}")


# ----------------------------------------------------------------------------------------------------------
# (a) the recurrent definition


def _step(opts, state, q, k, v, g, beta, scale):
    """One token of the chosen transition; leading dims of ``state`` are arbitrary."""
    if opts.transition == "gla":
        return gla_step(state, q, k, v, g, scale)
    return gated_delta_step(state, q, k, v, g, beta, scale, opts.qk_l2norm)


def sse_decode_step(
    pool: torch.Tensor,
    slots: torch.Tensor,
    shared: Branch,
    sparse: Branch,
    v: torch.Tensor,
    routing: Routing,
    opts: SSEOptions,
) -> torch.Tensor:
    """One token for each of ``B`` sequences whose states live in rows ``slots`` of ``pool``
    (``[rows, 1 + N, H, K, V]``), updated in place. Inputs are per token: ``q: [B, H, K]``, ``v: [B, H, V]``,
    routing ``[B, N]``. Only the shared partition and each token's selected partitions are read or
    written; every other partition is left bit-for-bit untouched. Returns ``o: [B, H, V]``."""
    K = shared.q.shape[-1]
    scale = K**-0.5 if opts.scale is None else opts.scale
    rows = slots[:, None]
    s0, o = _step(opts, pool[slots, 0], shared.q, shared.k, v, shared.g, shared.beta, scale)
    pool[slots, 0] = s0.to(pool.dtype)
    write_w, read_w, write_mask = routing.weights(opts.write_gate, opts.read_gate)

    def inputs_for(idx):  # the sparse inputs for partitions idx [B, n]
        weights = [x.gather(-1, idx) for x in (read_w, write_w, write_mask)]
        one = Branch(*(None if x is None else x[:, None].expand(-1, idx.shape[1], *x.shape[1:])
                       for x in (sparse.q, sparse.k, sparse.g, sparse.beta)))
        return gate_partition(one, v[:, None].expand(-1, idx.shape[1], -1, -1), *weights, opts)

    written = routing.topk[:, :routing.num_writers]
    q_w, k_w, v_w, g_w, beta_w = inputs_for(written)
    new, _ = _step(opts, pool[rows, 1 + written], q_w, k_w, v_w, g_w, beta_w, scale)
    pool[rows.expand_as(written), 1 + written] = new.to(pool.dtype)

    read = routing.topk[:, :routing.num_readers]
    q_r = inputs_for(read)[0].to(pool.dtype)
    if opts.transition == "gdn" and opts.qk_l2norm:
        q_r = l2norm(q_r)
    return o + torch.einsum("bnhk,bnhkv->bhv", q_r * scale, pool[rows, 1 + read].to(q_r.dtype))


def sse_recurrent(
    shared: Branch,
    sparse: Branch,
    v: torch.Tensor,
    routing: Routing,
    opts: SSEOptions,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The definition: :func:`sse_decode_step` applied token after token."""
    B, T, H, K = shared.q.shape
    V = v.shape[-1]
    N = routing.num_sparse_partitions
    num_seqs = B if cu_seqlens is None else cu_seqlens.numel() - 1
    _check_state(initial_state, num_seqs, N, shared.q, v)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T)
        layout = PaddedLayout.from_cu_seqlens(cu_seqlens)
        pad = layout.pad
        shared = Branch(*(None if x is None else pad(x) for x in (shared.q, shared.k, shared.g, shared.beta)))
        sparse = Branch(*(None if x is None else pad(x) for x in (sparse.q, sparse.k, sparse.g, sparse.beta)))
        # padding steps have zero inputs and leave every state unchanged, but they still index partitions: give
        # them distinct ones (0, 1, ..), since a repeated index would write one partition twice per step
        kmax = routing.topk.shape[-1]
        real = pad(torch.ones_like(routing.topk[..., :1], dtype=torch.bool))
        topk = torch.where(real, pad(routing.topk), torch.arange(kmax, device=v.device))
        routing = Routing(pad(routing.probs), topk, routing.num_writers, routing.num_readers)
        o, state = sse_recurrent(shared, sparse, pad(v), routing, opts, initial_state, output_final_state)
        return layout.unpad(o), state

    dt = compute_dtype(shared.q)
    state = shared.q.new_zeros(B, 1 + N, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt).clone()
    slots = torch.arange(B, device=v.device)
    outputs = []
    for t in range(T):
        def at(branch):
            return Branch(*(None if x is None else x[:, t] for x in (branch.q, branch.k, branch.g, branch.beta)))

        token_routing = Routing(routing.probs[:, t], routing.topk[:, t], routing.num_writers, routing.num_readers)
        outputs.append(sse_decode_step(state, slots, at(shared), at(sparse), v[:, t], token_routing, opts))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V, dtype=dt)
    return o.to(v.dtype), (state if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------
# (b1) Algorithm 1: masking


def sse_masked(
    shared: Branch,
    sparse: Branch,
    v: torch.Tensor,
    routing: Routing,
    opts: SSEOptions,
    linear_op: LinearOp,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Replicates the sparse inputs over the N partitions, masks them, folds ``(1 + N, H)`` into heads."""
    B, T, H, K = shared.q.shape
    V = v.shape[-1]
    N = routing.num_sparse_partitions
    num_seqs = B if cu_seqlens is None else cu_seqlens.numel() - 1
    _check_state(initial_state, num_seqs, N, shared.q, v)
    write_w, read_w, write_mask = routing.weights(opts.write_gate, opts.read_gate)

    def expand(x):  # [B, T, H, ...] -> [B, T, N, H, ...]
        return None if x is None else x.unsqueeze(2).expand(-1, -1, N, *x.shape[2:])

    sparse_n = Branch(expand(sparse.q), expand(sparse.k), expand(sparse.g), expand(sparse.beta))
    q_s, k_s, v_s, g_s, beta_s = gate_partition(sparse_n, expand(v), read_w, write_w, write_mask, opts)

    def fold(first, rest):  # shared [B, T, H, ...] + sparse [B, T, N, H, ...] -> [B, T, (1 + N) H, ...]
        if first is None:
            return None
        dtype = torch.promote_types(first.dtype, rest.dtype)
        both = torch.cat([first.unsqueeze(2).to(dtype), rest.to(dtype)], dim=2)
        return both.reshape(B, T, (1 + N) * H, *both.shape[4:])

    o, state = linear_op(
        fold(shared.q, q_s), fold(shared.k, k_s), fold(v, v_s), fold(shared.g, g_s), fold(shared.beta, beta_s),
        scale=opts.scale,
        initial_state=None if initial_state is None else initial_state.reshape(num_seqs, (1 + N) * H, K, V),
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=opts.qk_l2norm,
    )
    o = o.reshape(B, T, 1 + N, H, V).sum(dim=2)
    if state is not None:
        state = state.reshape(num_seqs, 1 + N, H, K, V)
    return o.to(v.dtype), state


# ----------------------------------------------------------------------------------------------------------
# (b2) Algorithm 2: varlen


@dataclass
class VarlenPlan:
    """The reorder of (token, partition) pairs into one varlen segment per (sequence, partition).

    Built by a counting sort: the rank of a pair inside its segment is the number of earlier tokens of the
    same sequence that chose the same partition, a cumulative sum over a one-hot ``[L, N]``; no sort and no
    Python loop over partitions or sequences. Within a segment, tokens keep their order.
    """

    token: torch.Tensor  # [P] source token of each reordered pair
    partition: torch.Tensor  # [P] its partition (0..N-1)
    cu_seqlens: torch.Tensor  # [S * N + 1] segment offsets, sequence-major then partition
    position: torch.Tensor  # [L, Kmax] where token t's j-th ranked partition went (inverse of the reorder)

    @classmethod
    def build(cls, topk: torch.Tensor, cu_seqlens: torch.Tensor, num_sparse_partitions: int) -> "VarlenPlan":
        """``topk``: ``[L, Kmax]`` distinct partitions of each packed token."""
        L, Kmax = topk.shape
        device = topk.device
        cu = cu_seqlens.long()
        num_seqs = cu.numel() - 1
        topk = topk.long()
        # partition-major [N, L + 1]: the scan runs along the contiguous dimension (a scan over dim 0 of
        # [L, N] parallelises over only N columns on CUDA and is ~100x slower)
        onehot = torch.zeros(num_sparse_partitions, L + 1, dtype=torch.int32, device=device)
        onehot[:, 1:].scatter_(0, topk.t(), 1)
        before = onehot.cumsum(1).t()  # [L + 1, N]: pairs of each partition among tokens < t
        counts = before[cu[1:]] - before[cu[:-1]]  # [S, N]
        offsets = torch.cat([counts.new_zeros(1), counts.reshape(-1).cumsum(0)])
        seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), cu[1:] - cu[:-1], output_size=L)
        rank = before[:-1].gather(1, topk) - before[cu[seq]].gather(1, topk)  # [L, Kmax]
        position = offsets[seq[:, None] * num_sparse_partitions + topk] + rank
        token = torch.empty(L * Kmax, dtype=torch.long, device=device)
        partition = torch.empty_like(token)
        token[position.reshape(-1)] = torch.arange(L, device=device).repeat_interleave(Kmax)
        partition[position.reshape(-1)] = topk.reshape(-1)
        return cls(token, partition, offsets, position)


def sse_varlen(
    shared: Branch,
    sparse: Branch,
    v: torch.Tensor,
    routing: Routing,
    opts: SSEOptions,
    linear_op: LinearOp,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gathers each token into the segments of its top-k partitions, appends the shared partition's
    segments (the original sequences), runs one varlen call, and sums the partition outputs per token."""
    B, T, H, K = shared.q.shape
    V = v.shape[-1]
    N = routing.num_sparse_partitions
    num_seqs = B if cu_seqlens is None else cu_seqlens.numel() - 1
    _check_state(initial_state, num_seqs, N, shared.q, v)
    if cu_seqlens is None:
        cu_seqlens = dense_cu_seqlens(B, T, v.device)
    else:
        check_cu_seqlens(cu_seqlens, B, T)
    L = B * T

    def flat(x):
        return None if x is None else x.reshape(L, *x.shape[2:])

    write_w, read_w, write_mask = (flat(x) for x in routing.weights(opts.write_gate, opts.read_gate))
    plan = VarlenPlan.build(flat(routing.topk), cu_seqlens, N)
    pair_w = [x[plan.token, plan.partition] for x in (read_w, write_w, write_mask)]
    sparse_pairs = Branch(*(None if x is None else flat(x)[plan.token] for x in (sparse.q, sparse.k, sparse.g, sparse.beta)))
    q_s, k_s, v_s, g_s, beta_s = gate_partition(sparse_pairs, flat(v)[plan.token], *pair_w, opts)

    def join(first, rest):  # shared [B, T, H, ...] then the pairs [P, H, ...] -> [1, L + P, H, ...]
        if first is None:
            return None
        dtype = torch.promote_types(first.dtype, rest.dtype)
        return torch.cat([flat(first).to(dtype), rest.to(dtype)]).unsqueeze(0)

    segments = torch.cat([cu_seqlens.long(), L + plan.cu_seqlens[1:]])
    state = None
    if initial_state is not None:
        state = torch.cat([initial_state[:, 0], initial_state[:, 1:].reshape(num_seqs * N, H, K, V)])
    # partitions that no token of a sequence chose make empty segments; fla's chunk kernels mis-index the
    # segments after an empty one (seen with its gated delta rule), so the op only sees non-empty segments
    # and an empty segment's final state is its initial state
    keep = torch.nonzero(segments[1:] > segments[:-1]).squeeze(1)
    o, state_kept = linear_op(
        join(shared.q, q_s), join(shared.k, k_s), join(v, v_s), join(shared.g, g_s), join(shared.beta, beta_s),
        scale=opts.scale,
        initial_state=None if state is None else state[keep],
        output_final_state=output_final_state,
        cu_seqlens=torch.cat([segments[:1], segments[1:][keep]]),
        use_qk_l2norm=opts.qk_l2norm,
    )
    if state_kept is not None:
        empty = state_kept.new_zeros(segments.numel() - 1, H, K, V) if state is None else state.to(state_kept.dtype)
        state = empty.index_copy(0, keep, state_kept)
    else:
        state = None
    o = o[0]
    out = o[:L] + o[L:][plan.position].sum(1)  # a gather per token: deterministic, no atomics
    if state is not None:
        state = torch.cat([state[:num_seqs, None], state[num_seqs:].reshape(num_seqs, N, H, K, V)], dim=1)
    return out.reshape(B, T, H, V).to(v.dtype), state
