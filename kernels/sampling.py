"""Sampling a token per row from the whole vocabulary in one pass over the logits (no top-p / top-k).

The rollout engine's sampler (:func:`pipeline.rollout.sampling.sample`) builds ``[B, V]`` float32 and int64
temporaries: log-softmax, the counter-based noise (a hash per token), the exponential race. At GRPO's batch of 256
rows and a 152k vocabulary each of them is 150-300 MB, and a decode step writes and reads a dozen. Without
filtering, none of that needs to exist: a program walks its row once, keeping the running maximum and sum of
``exp`` for the log-softmax and the running winner of the race ``argmax(logit / T - log(-log u))``, where ``u`` is
the same hash of ``(row key, token id)`` as :func:`pipeline.rollout.sampling.uniform_noise`. So the kernel picks
the token the PyTorch sampler picks (the race is the same float32 expression) and reads the logits once.

``temperature <= 0`` is greedy (argmax of the logits, log-probability at ``T = 1``), as in the PyTorch sampler.

With top-p (:func:`top_p_sample`), the PyTorch sampler sorts every row of the vocabulary, which at 256 rows costs as
much as a decode step of a small model (``docs/benchmarks.md``). The kernel finds the cut instead: the kept
tokens are those whose scaled logit is at least a threshold ``t``, the lowest value whose strictly larger tokens
hold less than ``top_p`` of the mass (all tokens tied at the cut are kept, as the PyTorch sampler keeps them). The
threshold is found by bisection over the order-preserving integer keys of float32 (exact after at most 32 passes
over the row, which stays in L2), then one more pass runs the race over the kept tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pcg(x):
    """The PCG-style hash of :func:`pipeline.rollout.sampling._pcg` on uint32 (wrapping products)."""
    x = x * 747796405 + 2891336453
    word = ((x >> ((x >> 28) + 4)) ^ x) * 277803737
    return (word >> 22) ^ word


@triton.jit
def _row_key(seeds, steps, b):
    """Row ``b``'s noise key, as :func:`pipeline.rollout.sampling.noise_keys` (seed's low 32 bits, then high, then
    the step)."""
    seed = tl.load(seeds + b)
    key = _pcg(seed.to(tl.uint32) ^ _pcg((seed >> 32).to(tl.uint32)))
    return _pcg(key ^ _pcg(tl.load(steps + b).to(tl.uint32)))


def _check_rows(name: str, logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"{name}: logits must be [B, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"with strides {logits.stride()}")


@triton.jit
def _race_kernel(logits, temperature, seeds, steps, tokens, logprobs, stride_b, V, BV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(temperature + b)
    greedy = t <= 0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    key = _row_key(seeds, steps, b)
    offs = tl.arange(0, BV)
    m = tl.full([BV], float("-inf"), tl.float32)  # per lane: running max of the scaled logits
    s = tl.zeros([BV], tl.float32)  # per lane: sum of exp(scaled - m)
    best = tl.full([BV], float("-inf"), tl.float32)  # per lane: best race value (or logit when greedy)
    best_i = tl.zeros([BV], tl.int32)
    for start in range(0, V, BV):
        i = start + offs
        valid = i < V
        x = tl.load(logits + b * stride_b + i, mask=valid, other=float("-inf")).to(tl.float32)
        scaled = x * inv_t
        m_new = tl.maximum(m, scaled)
        s = s * tl.exp(m - tl.where(m_new == float("-inf"), 0.0, m_new)) + \
            tl.where(valid, tl.exp(scaled - tl.where(m_new == float("-inf"), 0.0, m_new)), 0.0)
        m = m_new
        bits = _pcg(key ^ i.to(tl.uint32))
        u = ((bits >> 8).to(tl.float32) + 0.5) / 16777216.0
        race = tl.where(greedy, x, scaled - tl.log(-tl.log(u)))
        race = tl.where(valid, race, float("-inf"))
        better = race > best  # strict: within a lane the lowest index wins a tie, as torch.argmax
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, race, best)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, best_i, V), 0)  # across lanes: the lowest index among the best
    row_max = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - row_max), 0)
    chosen = tl.load(logits + b * stride_b + token).to(tl.float32) * inv_t
    tl.store(tokens + b, token.to(tl.int64))
    tl.store(logprobs + b, chosen - row_max - tl.log(total))


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [B, V]`` (any float dtype), ``temperature [B]``, ``seeds, steps [B]`` (int64, as
    :func:`pipeline.rollout.sampling.sample` takes them) -> ``(tokens [B] int64, logprobs [B] float32)``. One
    launch: at small batches the sampler's cost is its launches."""
    _check_rows("race_sample", logits)
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    _race_kernel[(B,)](logits, temperature.float().contiguous(), seeds.long().contiguous(), steps.long().contiguous(),
                       tokens, logprobs, logits.stride(0), V, BV=block)
    return tokens, logprobs


@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (finite values): negative floats' magnitude bits reversed."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _top_p_kernel(logits, temperature, top_p, seeds, steps, tokens, logprobs, stride_b, V, BV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(temperature + b)
    greedy = t <= 0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    p = tl.load(top_p + b)
    key = _row_key(seeds, steps, b)
    row = logits + b * stride_b
    offs = tl.arange(0, BV)
    # pass 1: the row's maximum, minimum and sum of exp(scaled - max) (per lane, merged at the end)
    m = tl.full([BV], float("-inf"), tl.float32)
    lo_lane = tl.full([BV], float("inf"), tl.float32)
    s = tl.zeros([BV], tl.float32)
    for start in range(0, V, BV):
        i = start + offs
        valid = i < V
        scaled = tl.load(row + i, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, scaled)
        s = s * tl.exp(m - tl.where(m_new == float("-inf"), 0.0, m_new)) + \
            tl.where(valid, tl.exp(scaled - tl.where(m_new == float("-inf"), 0.0, m_new)), 0.0)
        m = m_new
        lo_lane = tl.minimum(lo_lane, tl.where(valid, scaled, float("inf")))
    row_max = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - row_max), 0)
    # bisection over keys: P(k) = mass of tokens with key > k is below top_p; P(hi) holds, P(lo) does not
    hi = _order_key(row_max).to(tl.int64)
    lo = _order_key(tl.min(lo_lane, 0)).to(tl.int64) - 1
    lo = tl.where(p >= 1.0, hi, lo)  # top-p 1 keeps every token: no search
    budget = p * total
    while hi - lo > 1:
        mid = (lo + hi) // 2
        above = tl.zeros([BV], tl.float32)
        for start in range(0, V, BV):
            i = start + offs
            valid = i < V
            scaled = tl.load(row + i, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            above += tl.where(valid & (_order_key(scaled).to(tl.int64) > mid), tl.exp(scaled - row_max), 0.0)
        if tl.sum(above, 0) < budget:
            hi = mid
        else:
            lo = mid
    cut = tl.where(p >= 1.0, lo - (1 << 40), hi)  # tokens with a key >= cut are kept
    # pass 3: the race over the kept tokens, and their mass
    kept = tl.zeros([BV], tl.float32)
    best = tl.full([BV], float("-inf"), tl.float32)
    best_i = tl.zeros([BV], tl.int32)
    for start in range(0, V, BV):
        i = start + offs
        valid = i < V
        x = tl.load(row + i, mask=valid, other=float("-inf")).to(tl.float32)
        scaled = x * inv_t
        keep = valid & (_order_key(scaled).to(tl.int64) >= cut)
        kept += tl.where(keep, tl.exp(scaled - row_max), 0.0)
        bits = _pcg(key ^ i.to(tl.uint32))
        u = ((bits >> 8).to(tl.float32) + 0.5) / 16777216.0
        race = tl.where(greedy, x, scaled - tl.log(-tl.log(u)))
        race = tl.where(tl.where(greedy, valid, keep), race, float("-inf"))  # greedy: argmax of all, as torch
        better = race > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, race, best)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, best_i, V), 0)
    chosen = tl.load(row + token).to(tl.float32) * inv_t
    tl.store(tokens + b, token.to(tl.int64))
    tl.store(logprobs + b, chosen - row_max - tl.log(tl.sum(kept, 0)))


def top_p_sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
                 steps: torch.Tensor, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`race_sample` restricted to each row's top-p set (``top_p [B]``; no top-k): the tokens and
    log-probabilities (under the renormalised kept set) of :func:`pipeline.rollout.sampling.sample`, without a
    sort. One launch, one program per row."""
    _check_rows("top_p_sample", logits)
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    _top_p_kernel[(B,)](logits, temperature.float().contiguous(), top_p.float().contiguous(),
                        seeds.long().contiguous(), steps.long().contiguous(), tokens, logprobs, logits.stride(0), V,
                        BV=block)
    return tokens, logprobs
