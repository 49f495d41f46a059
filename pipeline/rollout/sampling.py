"""Sampling parameters (vLLM's names) and a batched sampler whose randomness belongs to each sequence.

Every sequence draws its noise from a counter-based generator keyed by ``(seed, step, token id)``, so a
sample is the same whether it runs alone, in any batch, forked from a shared prefix, or on another engine.
Sample ``i`` of a request with ``seed=s`` uses seed ``s + i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True  # log-probability of each sampled token under the distribution sampled (after top-p/top-k)
    include_stop_str_in_output: bool = False
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        def fail(name, message):
            raise ValueError(f"SamplingParams.{name}: {message}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            fail("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if any(not s for s in self.stop_strings):
            fail("stop", "stop strings must be non-empty")


def _pcg(x: torch.Tensor) -> torch.Tensor:
    """PCG-style 32-bit hash of int64 tensors holding values in [0, 2^32); no int64 overflow."""
    x = (x * 747796405 + 2891336453) & _MASK32
    word = (((x >> ((x >> 28) + 4)) ^ x) * 277803737) & _MASK32
    return ((word >> 22) ^ word) & _MASK32


def noise_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``[B]`` 32-bit keys (in int64) of each row's noise: a hash of its seed and step."""
    key = _pcg((seeds & _MASK32) ^ _pcg((seeds >> 32) & _MASK32))
    return _pcg(key ^ _pcg(steps & _MASK32))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` uniforms in (0, 1), a pure function of (seed, step, token id)."""
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None]
    bits = _pcg(noise_keys(seeds, steps)[:, None] ^ token)
    return ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    need_filter: bool | None = None,
    need_top_k: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probabilities for a batch ``[B, V]`` of logits.

    ``temperature == 0`` is greedy. Otherwise the distribution ``softmax(logits / T)`` is restricted to
    its top-k tokens and to the smallest top set of probability >= top_p, and one token is drawn with the
    exponential race ``argmax p_i / E_i`` (``E_i = -log u_i``; computed as ``argmax logits_i / T - log E_i``),
    which samples exactly from it. The returned log-probability is the chosen token's under the distribution it
    was drawn from: ``log_softmax(logits / T)`` renormalised over the tokens top-k / top-p keep (``T = 1`` when
    greedy), as vLLM's ``processed_logprobs``, so that GRPO's importance weights ``pi / q`` see the real ``q``.

    ``need_filter``: whether any row has top-p < 1 or top-k > 0, when the caller knows it (the engine does,
    from its requests); unknown, it is read from the tensors on the CPU and assumed on a GPU (no host sync).
    Without filtering, a GPU samples in one pass over the logits (:func:`kernels.sampling.race_sample`), the
    same tokens as below; with top-p alone (``need_top_k`` False: no row has top-k, as the caller knows) in one
    kernel that finds each row's cut without a sort (:func:`kernels.sampling.top_p_sample`). Tokens tied at the
    top-p cut are all kept, whatever order a sort would put them in."""
    if need_filter is None:
        need_filter = bool(((top_p < 1) | (top_k > 0)).any()) if logits.device.type == "cpu" else True
    if logits.device.type == "cuda" and not need_filter:
        from kernels.sampling import race_sample

        return race_sample(logits, temperature, seeds, steps)
    if logits.device.type == "cuda" and need_top_k is False:
        from kernels.sampling import top_p_sample

        return top_p_sample(logits, temperature, top_p, seeds, steps)
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    if need_filter:
        sorted_scaled, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = logprobs.exp().gather(-1, order)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)[None]
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass above each token in the sorted order
        # tokens tied at the cut are all kept: a token's mass strictly above is the one before the first of its ties
        before = before.gather(-1, torch.searchsorted(-sorted_scaled, -sorted_scaled))
        keep_sorted = (before < top_p[:, None]) | (rank == 0)
        keep_sorted &= (top_k[:, None] <= 0) | (rank < top_k[:, None])
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        scaled = torch.where(keep, scaled, float("-inf"))
        logprobs = torch.log_softmax(scaled, dim=-1)
    race = scaled - torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))
    tokens = torch.where(greedy, logits.argmax(dim=-1), race.argmax(dim=-1))
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
