"""The Triton kernels against the PyTorch definitions, on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``conftest.py`` when there is no GPU). Sizes are small to keep it fast; the
real sizes run on the GPU in ``tests/gpu/test_kernels_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from sse_model.ops.dispatch import linear_decode
from sse_model.ops.sse import Branch, SSEOptions, route, sse_decode_step
from helpers import assert_close

triton = pytest.importorskip("triton")
decode = pytest.importorskip("kernels.decode")
routing = pytest.importorskip("kernels.routing")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def branch(B, H, K, transition, dtype):
    q, k = torch.randn(B, H, K, dtype=dtype), torch.randn(B, H, K, dtype=dtype).softmax(-1)
    if transition == "gla":
        return Branch(q, k, torch.nn.functional.logsigmoid(torch.randn(B, H, K)).to(dtype) / 4)
    return Branch(q, k, -torch.rand(B, H, dtype=dtype), torch.rand(B, H, dtype=dtype))


def to(b: Branch, device) -> Branch:
    return Branch(*(None if x is None else x.to(device) for x in (b.q, b.k, b.g, b.beta)))


CASES = [  # transition, gate_target, l2norm, write_gate, read_gate, N, Kw, Kr, K, V
    ("gla", "key", False, True, True, 4, 1, 1, 16, 16),
    ("gla", "key", False, True, True, 4, 2, 1, 12, 20),  # dims that are not powers of two
    ("gla", "key", False, False, True, 6, 1, 3, 16, 8),
    ("gla", "key", False, True, False, 4, 4, 4, 8, 16),
    ("gdn", "key", True, True, True, 4, 1, 2, 16, 16),
    ("gdn", "value", False, True, True, 4, 2, 2, 16, 12),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sse_decode_kernel_matches_reference(case, dtype):
    transition, target, l2, wg, rg, N, Kw, Kr, K, V = case
    B, H, rows = 3, 2, 5
    opts = SSEOptions(transition=transition, write_gate=wg, read_gate=rg, gate_target=target, qk_l2norm=l2)
    shared, sparse = branch(B, H, K, transition, dtype), branch(B, H, K, transition, dtype)
    v = torch.randn(B, H, V, dtype=dtype)
    r = route(torch.randn(B, N), Kw, Kr)
    pool = torch.randn(rows, 1 + N, H, K, V)
    slots = torch.tensor([3, 0, 4])

    expected_pool = pool.clone()
    expected = sse_decode_step(expected_pool, slots, shared, sparse, v, r, opts)
    got_pool = pool.to(DEVICE)
    r_dev = type(r)(r.probs.to(DEVICE), r.topk.to(DEVICE), Kw, Kr)
    got = decode.sse_decode_triton(got_pool, slots.to(DEVICE), to(shared, DEVICE), to(sparse, DEVICE), v.to(DEVICE),
                                   r_dev, opts)
    # bf16 inputs: gated inputs are rounded to bf16, which Triton's CPU interpreter does by truncation
    tol = torch.float32 if dtype == torch.float32 or DEVICE == "cuda" else torch.bfloat16
    assert_close(got.cpu(), expected, tol, "output")
    assert_close(got_pool.cpu(), expected_pool, tol, "state pool")
    untouched = torch.ones(rows, 1 + N, dtype=torch.bool)
    for b, row in enumerate(slots.tolist()):
        untouched[row, 0] = False
        untouched[row, 1 + r.topk[b, :Kw]] = False
    assert torch.equal(got_pool.cpu()[untouched], pool[untouched]), "unselected partitions must be bit-identical"


@pytest.mark.parametrize("transition,l2", [("gla", False), ("gdn", False), ("gdn", True)])
def test_linear_decode_kernel_matches_reference(transition, l2):
    B, H, K, V, rows = 2, 3, 16, 24, 4
    b = branch(B, H, K, transition, torch.float32)
    v = torch.randn(B, H, V)
    pool = torch.randn(rows, H, K, V)
    slots = torch.tensor([2, 1])
    expected_pool = pool.clone()
    expected = linear_decode(transition, expected_pool, slots, b.q, b.k, v, b.g, b.beta, use_qk_l2norm=l2)
    got_pool = pool.to(DEVICE)
    b_dev = to(b, DEVICE)
    got = decode.linear_decode_triton(transition, got_pool, slots.to(DEVICE), b_dev.q, b_dev.k, v.to(DEVICE),
                                      b_dev.g, b_dev.beta, use_qk_l2norm=l2)
    assert_close(got.cpu(), expected, torch.float32, "output")
    assert_close(got_pool.cpu(), expected_pool, torch.float32, "state pool")


def test_decode_kernel_rejects_mismatched_shapes():
    B, H, K, V, N = 2, 2, 8, 8, 4
    shared, sparse = branch(B, H, K, "gla", torch.float32), branch(B, H, K, "gla", torch.float32)
    r = route(torch.randn(B, N), 1, 1)
    with pytest.raises(ValueError, match="state pool"):
        decode.sse_decode_triton(torch.zeros(3, 1 + N, H, K, V + 1), torch.tensor([0, 1]), shared, sparse,
                                 torch.randn(B, H, V), r, SSEOptions())
    with pytest.raises(ValueError, match="slots"):
        decode.sse_decode_triton(torch.zeros(3, 1 + N, H, K, V), torch.tensor([0, 1, 2]), shared, sparse,
                                 torch.randn(B, H, V), r, SSEOptions())
    with pytest.raises(ValueError, match="sparse.k"):
        bad = Branch(sparse.q, sparse.k[:, :, :-1], sparse.g)
        decode.sse_decode_triton(torch.zeros(3, 1 + N, H, K, V), torch.tensor([0, 1]), shared, bad,
                                 torch.randn(B, H, V), r, SSEOptions())


@pytest.mark.parametrize("N,Kw,Kr", [(4, 1, 1), (8, 2, 3), (5, 5, 5), (64, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_kernel_matches_reference(N, Kw, Kr, dtype):
    logits = torch.randn(2, 37, N).to(dtype)
    ref = route(logits, Kw, Kr)
    x = logits.detach().clone().to(DEVICE).requires_grad_()
    got = routing.route_triton(x, Kw, Kr)
    assert_close(got.probs.detach().cpu(), ref.probs.detach(), torch.float32, "probs")
    # the same ranking up to ties (bfloat16 logits tie often): equal probabilities at every rank
    assert torch.equal(ref.probs.gather(-1, got.topk.cpu()), ref.probs.gather(-1, ref.topk)), "top-k ranking"
    weight = torch.randn(2, 37, N)
    (got.probs * weight.to(DEVICE)).sum().backward()
    logits_ref = logits.detach().clone().requires_grad_()
    (route(logits_ref, Kw, Kr).probs * weight).sum().backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad.float().cpu(), logits_ref.grad.float(), dtype, "router gradient")
