"""GLA and gated delta rule: chunked forms against the recurrent definitions, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from sse_model.ops.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from sse_model.ops.gla import chunk_gla, recurrent_gla

CU = torch.tensor([0, 3, 3, 21, 40])  # lengths 3 (< chunk), 0, 18, 19


def gla_inputs(B, T, H, K, V, dtype, num_seqs=None):
    q, k = torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, K, dtype=dtype)) / 4
    h0 = torch.randn(num_seqs or B, H, K, V, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, h0)]


def gdn_inputs(B, T, H, K, V, dtype, num_seqs=None):
    q, k = torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, dtype=dtype))
    beta = torch.rand(B, T, H, dtype=dtype)
    h0 = torch.randn(num_seqs or B, H, K, V, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


def run_and_grads(fn, inputs, **kw):
    *tensors, h0 = inputs
    o, state = fn(*tensors, initial_state=h0, output_final_state=True, **kw)
    loss = (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() + (state.double() ** 2).sum()
    grads = torch.autograd.grad(loss, inputs)
    return o, state, grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_chunk_gla_matches_recurrent(dtype, packed):
    if packed:
        inputs = gla_inputs(1, 40, 2, 8, 6, dtype, num_seqs=4)
        kw = dict(cu_seqlens=CU)
    else:
        inputs = gla_inputs(2, 37, 2, 8, 6, dtype)
        kw = {}
    ref = run_and_grads(recurrent_gla, inputs, **kw)
    out = run_and_grads(chunk_gla, inputs, chunk_size=16, **kw)
    assert_close(out[0], ref[0], dtype, "output")
    assert_close(out[1], ref[1], dtype, "final state")
    for name, a, b in zip("q k v g h0".split(), out[2], ref[2]):
        assert_close(a, b, dtype, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunk_delta_rule_matches_recurrent(dtype, packed, l2norm):
    if packed:
        inputs = gdn_inputs(1, 40, 2, 8, 6, dtype, num_seqs=4)
        kw = dict(cu_seqlens=CU)
    else:
        inputs = gdn_inputs(2, 37, 2, 8, 6, dtype)
        kw = {}
    if not l2norm:  # keep the unnormalised recurrence contractive
        with torch.no_grad():
            inputs[1].div_(inputs[1].norm(dim=-1, keepdim=True))
    ref = run_and_grads(recurrent_gated_delta_rule, inputs, use_qk_l2norm=l2norm, **kw)
    out = run_and_grads(chunk_gated_delta_rule, inputs, use_qk_l2norm=l2norm, chunk_size=16, **kw)
    assert_close(out[0], ref[0], dtype, "output")
    assert_close(out[1], ref[1], dtype, "final state")
    for name, a, b in zip("q k v g beta h0".split(), out[2], ref[2]):
        assert_close(a, b, dtype, f"d{name}")


def test_empty_sequence_keeps_its_state():
    q, k, v, g, h0 = (x.detach() for x in gla_inputs(1, 40, 2, 8, 6, torch.float64, num_seqs=4))
    for fn in (recurrent_gla, chunk_gla):
        _, state = fn(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=CU)
        assert torch.equal(state[1], h0[1])


def test_bad_shapes_raise():
    q, k, v, g, h0 = (x.detach() for x in gla_inputs(1, 10, 2, 8, 6, torch.float32))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gla(q, k, v, g, initial_state=h0[:, :1])
    with pytest.raises(ValueError, match="same shape"):
        chunk_gla(q, k[..., :4], v, g)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 4, 9]))
