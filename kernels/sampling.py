"""Sampling a token per row from the whole vocabulary in one pass over the logits (no top-p / top-k).

The rollout engine's sampler (:func:`pipeline.rollout.sampling.sample`) builds ``[B, V]`` float32 and int64
temporaries: log-softmax, the counter-based noise (a hash per token), the exponential race. At GRPO's batch of 256
rows and a 152k vocabulary each of them is 150-300 MB, and a decode step writes and reads a dozen. Without
filtering, none of that needs to exist: a program walks its row once, keeping the running maximum and sum of
``exp`` for the log-softmax and the running winner of the race ``argmax(logit / T - log(-log u))``, where ``u`` is
the same hash of ``(row key, token id)`` as :func:`pipeline.rollout.sampling.uniform_noise`. So the kernel picks
the token the PyTorch sampler picks (the race is the same float32 expression) and reads the logits once.

``temperature <= 0`` is greedy (argmax of the logits, log-probability at ``T = 1``), as in the PyTorch sampler.
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
def _race_kernel(logits, temperature, seeds, steps, tokens, logprobs, stride_b, V, BV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(temperature + b)
    greedy = t <= 0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    seed = tl.load(seeds + b)  # the row's key, as pipeline.rollout.sampling.noise_keys (low 32 bits, then high)
    key = _pcg(seed.to(tl.uint32) ^ _pcg((seed >> 32).to(tl.uint32)))
    key = _pcg(key ^ _pcg(tl.load(steps + b).to(tl.uint32)))
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
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"race_sample: logits must be [B, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"with strides {logits.stride()}")
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    _race_kernel[(B,)](logits, temperature.float().contiguous(), seeds.long().contiguous(), steps.long().contiguous(),
                       tokens, logprobs, logits.stride(0), V, BV=block)
    return tokens, logprobs
