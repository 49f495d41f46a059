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


def test_logprobs_are_those_of_the_distribution_sampled():
    """With top-p / top-k the returned log-probability is the token's under the renormalised distribution the
    race drew from (vLLM's processed_logprobs): GRPO divides the trainer's probability by it. Without filtering it
    is the temperature-scaled softmax's."""
    from pipeline.rollout.sampling import sample

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 1.0])
    top_p = torch.tensor([0.5, 0.9, 1.0, 0.3, 1.0, 0.8])
    top_k = torch.tensor([0, 0, 5, 0, 0, 3])
    seeds, steps = torch.arange(6) + 100, torch.zeros(6, dtype=torch.long)
    tokens, logprobs = sample(logits, temperature, top_p, top_k, seeds, steps)
    for b in range(6):
        p = torch.softmax(logits[b] / temperature[b], -1)
        order = p.argsort(descending=True)
        keep = order[:int(top_k[b])] if top_k[b] > 0 else order
        mass = p[keep].cumsum(0) - p[keep]
        keep = keep[(mass < top_p[b]) | (torch.arange(len(keep)) == 0)]
        assert int(tokens[b]) in keep.tolist()
        want = torch.log(p[tokens[b]] / p[keep].sum())
        torch.testing.assert_close(logprobs[b], want, atol=1e-5, rtol=1e-5)
    assert float(logprobs[4]) == pytest.approx(float(torch.log_softmax(logits[4], -1)[tokens[4]]), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_sample_picks_the_pytorch_samplers_tokens(dtype):
    """The kernel that finds each row's top-p cut without a sort, against the PyTorch sampler's sort: same tokens,
    same log-probabilities under the renormalised kept set; bf16 logits bring ties at the cut."""
    from kernels.sampling import top_p_sample

    torch.manual_seed(0)
    B, V = 16, 1000
    logits = (torch.randn(B, V) * 3).to(dtype)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * 4)
    top_p = torch.tensor([0.3, 0.9, 0.95, 1.0, 0.5, 0.99, 0.8, 0.6] * 2)
    seeds = torch.arange(B, dtype=torch.long) * 7919 + 2**40
    steps = torch.arange(B, dtype=torch.long)
    off = torch.zeros(B, dtype=torch.long)
    want_tokens, want_logprobs = sample(logits, temperature, top_p, off, seeds, steps, need_filter=True)
    tokens, logprobs = top_p_sample(logits, temperature, top_p, seeds, steps, block=256)
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [False, True])
def test_top_p_keeps_every_token_tied_at_the_cut(kernel):
    """p = [0.4, 0.2, 0.2, 0.2] at top-p 0.5: the three tied tokens have 0.4 above them, so all are kept (a sort
    would keep whichever it put first); the first token's log-probability is log 0.4 under the kept set."""
    from kernels.sampling import top_p_sample

    draws = 120  # each tied token is missed with probability 0.8^120
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2]).log().expand(draws, -1).contiguous()
    ones, top_p = torch.ones(draws), torch.full((draws,), 0.5)
    seeds, steps = torch.arange(draws), torch.zeros(draws, dtype=torch.long)
    if kernel:
        tokens, logprobs = top_p_sample(logits, ones, top_p, seeds, steps, block=16)
    else:
        tokens, logprobs = sample(logits, ones, top_p, torch.zeros(draws, dtype=torch.long), seeds, steps)
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    assert logprobs[tokens == 0][0].item() == pytest.approx(torch.tensor(0.4).log().item(), abs=1e-5)


@pytest.mark.parametrize("kernel", [False, True])
def test_top_p_sample_follows_the_renormalised_distribution(kernel):
    """p = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04] at top-p 0.75 keeps the first three (0.65 above the third, 0.8 above
    the fourth): seeded draws against 0.4/0.8, 0.25/0.8, 0.15/0.8 (fewer through Triton's slow interpreter)."""
    from kernels.sampling import top_p_sample

    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    draws = 150 if kernel else 1500
    logits = probs.log().expand(draws, -1).contiguous()
    args = (torch.ones(draws), torch.full((draws,), 0.75), torch.arange(draws), torch.zeros(draws, dtype=torch.long))
    if kernel:
        tokens, logprobs = top_p_sample(logits, *args, block=16)
    else:
        tokens, logprobs = sample(logits, args[0], args[1], torch.zeros(draws, dtype=torch.long), *args[2:])
    assert tokens.max().item() <= 2
    kept = probs[:3] / probs[:3].sum()
    counts = torch.bincount(tokens, minlength=3).float()
    expected = kept * draws
    assert ((counts - expected) ** 2 / expected).sum().item() < 14.0  # chi2, p < 1e-3 at 2 degrees of freedom
    torch.testing.assert_close(logprobs, kept.log()[tokens], atol=1e-5, rtol=1e-5)
