"""The one-pass sampler (``kernels/sampling.py``) against the PyTorch sampler it replaces on GPUs when no row
filters (top-p = 1, top-k off); on CPU through Triton's interpreter."""

import pytest
import torch

from kernels.sampling import race_sample
from pipeline.rollout.sampling import sample


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_race_sample_picks_the_pytorch_samplers_tokens(dtype):
    B, V = 12, 1000  # V not a multiple of the block: a partial last block
    logits = (torch.randn(B, V) * 3).to(dtype)
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.3] * 3)
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62 - 1] * 3, dtype=torch.long)  # high words matter too
    steps = torch.arange(B, dtype=torch.long) * 1000
    ones, off = torch.ones(B), torch.zeros(B, dtype=torch.long)
    want_tokens, want_logprobs = sample(logits, temperature, ones, off, seeds, steps, need_filter=False)
    tokens, logprobs = race_sample(logits, temperature, seeds, steps, block=256)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=1e-5)
    assert len(set(tokens[1:4].tolist())) > 1  # seeds and steps matter


def test_race_sample_follows_the_distribution():
    """Known distribution p = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]; 1.5k seeded draws."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    draws = 1500
    logits = probs.log().expand(draws, -1).contiguous()
    steps = torch.zeros(draws, dtype=torch.long)
    tokens, logprobs = race_sample(logits, torch.ones(draws), torch.arange(draws), steps, block=16)
    counts = torch.bincount(tokens, minlength=6).float()
    expected = probs * draws
    assert ((counts - expected) ** 2 / expected).sum().item() < 25.0  # chi2, p < 1e-3 at 5 degrees of freedom
    torch.testing.assert_close(logprobs, probs.log()[tokens], atol=1e-5, rtol=1e-5)


def test_race_sample_refuses_rows_that_are_not_contiguous():
    with pytest.raises(ValueError, match="contiguous rows"):
        zeros = torch.zeros(4, dtype=torch.long)
        race_sample(torch.zeros(8, 4).t(), torch.ones(4), zeros, zeros)
