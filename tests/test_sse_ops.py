"""SSE: the masking (Algorithm 1) and varlen (Algorithm 2) implementations against the recurrent definition."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from sse_model.ops.dispatch import torch_linear_op
from sse_model.ops.gla import recurrent_gla
from sse_model.ops.sse import Branch, SSEOptions, route, sse_masked, sse_recurrent, sse_varlen

CU = torch.tensor([0, 3, 3, 21, 40])  # one sequence shorter than a chunk, one empty
VARIANTS = {
    "gla": SSEOptions(transition="gla"),
    "gdn-key": SSEOptions(transition="gdn", qk_l2norm=True, gate_target="key"),
    "gdn-value": SSEOptions(transition="gdn", gate_target="value"),
    "gla-write-only": SSEOptions(transition="gla", read_gate=False),
    "gla-read-only": SSEOptions(transition="gla", write_gate=False),
    "gla-no-gate": SSEOptions(transition="gla", write_gate=False, read_gate=False),
}


def make_inputs(B, T, H, K, V, N, transition, dtype, num_seqs=None):
    def branch():
        q = torch.randn(B, T, H, K, dtype=dtype)
        k = F.softmax(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
        if transition == "gla":
            return [q, k, F.logsigmoid(torch.randn(B, T, H, K, dtype=dtype)) / 4]
        k = k / k.norm(dim=-1, keepdim=True)
        return [q, k, F.logsigmoid(torch.randn(B, T, H, dtype=dtype)), torch.rand(B, T, H, dtype=dtype)]

    tensors = branch() + branch() + [torch.randn(B, T, H, V, dtype=dtype), torch.randn(B, T, N, dtype=dtype),
                                     torch.randn(num_seqs or B, 1 + N, H, K, V, dtype=dtype)]
    return [t.requires_grad_() for t in tensors]


def call(impl, opts, tensors, Kw, Kr, cu_seqlens=None):
    n = 3 if opts.transition == "gla" else 4
    shared, sparse = Branch(*tensors[:n]), Branch(*tensors[n:2 * n])
    v, logits, h0 = tensors[2 * n:]
    routing = route(logits, Kw, Kr)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    if impl == "recurrent":
        return sse_recurrent(shared, sparse, v, routing, opts, **kw)
    op = torch_linear_op(opts.transition, "chunk", chunk_size=8)
    return (sse_masked if impl == "mask" else sse_varlen)(shared, sparse, v, routing, opts, op, **kw)


def grad_floor(opts, index, tensors):
    """With the reference GDN gating (gate before the in-op L2 norm) the router's gradient is only the
    norm's eps term, ~1e-4 of the others; in float32 it sits at rounding level, so its error is measured
    against the O(1) scale of the other gradients."""
    return 1.0 if opts.transition == "gdn" and opts.qk_l2norm and index == len(tensors) - 2 else 0.0


def outputs_and_grads(impl, opts, tensors, Kw, Kr, cu_seqlens=None):
    o, state = call(impl, opts, tensors, Kw, Kr, cu_seqlens)
    weights = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
    loss = (o * weights).sum() + (state ** 2).sum()
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)  # router unused without gates
    return o, state, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, tensors)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("Kw,Kr", [(1, 1), (2, 1), (1, 2)])
def test_implementations_agree(variant, dtype, Kw, Kr):
    opts = VARIANTS[variant]
    tensors = make_inputs(2, 19, 2, 8, 4, 4, opts.transition, dtype)
    ref = outputs_and_grads("recurrent", opts, tensors, Kw, Kr)
    for impl in ("mask", "varlen"):
        o, state, grads = outputs_and_grads(impl, opts, tensors, Kw, Kr)
        assert_close(o, ref[0], dtype, f"{impl} output")
        assert_close(state, ref[1], dtype, f"{impl} final state")
        for i, (a, b) in enumerate(zip(grads, ref[2])):
            assert_close(a, b, dtype, f"{impl} gradient of input {i}", grad_floor(opts, i, tensors))


@pytest.mark.parametrize("variant", ["gla", "gdn-key", "gdn-value"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("Kw,Kr", [(1, 1), (2, 2), (2, 1)])
def test_packed_batches_agree(variant, dtype, Kw, Kr):
    opts = VARIANTS[variant]
    tensors = make_inputs(1, 40, 2, 8, 4, 4, opts.transition, dtype, num_seqs=4)
    ref = outputs_and_grads("recurrent", opts, tensors, Kw, Kr, CU)
    for impl in ("mask", "varlen"):
        o, state, grads = outputs_and_grads(impl, opts, tensors, Kw, Kr, CU)
        assert_close(o, ref[0], dtype, f"{impl} output")
        assert_close(state, ref[1], dtype, f"{impl} final state")
        for i, (a, b) in enumerate(zip(grads, ref[2])):
            assert_close(a, b, dtype, f"{impl} gradient of input {i}", grad_floor(opts, i, tensors))
    assert torch.equal(ref[1][1], tensors[-1][1]), "the empty sequence's state must not change"


@pytest.mark.parametrize("variant", ["gla", "gdn-value"])
def test_recurrent_packed_gradients_pass_gradcheck(variant):
    """Packed sequences pad to a common length; padding steps must not index a partition twice (with K >= 2
    that doubled the gradient of the state at every padded step)."""
    opts = VARIANTS[variant]
    cu = torch.tensor([0, 2, 7])
    tensors = make_inputs(1, 7, 1, 3, 2, 3, opts.transition, torch.float64, num_seqs=2)

    def fn(*xs):
        return call("recurrent", opts, list(xs), 2, 2, cu)

    assert torch.autograd.gradcheck(fn, tensors, atol=1e-7)


def test_packed_equals_separate_sequences():
    opts = VARIANTS["gla"]
    tensors = [t.detach() for t in make_inputs(1, 40, 2, 8, 4, 4, "gla", torch.float64, num_seqs=4)]
    o_packed, s_packed = call("varlen", opts, tensors, 1, 1, CU)
    for i in range(4):
        a, b = int(CU[i]), int(CU[i + 1])
        if a == b:
            continue
        piece = [t[:, a:b] for t in tensors[:-1]] + [tensors[-1][i:i + 1]]
        o, s = call("recurrent", opts, piece, 1, 1)
        assert_close(o_packed[:, a:b], o, torch.float64, f"sequence {i}")
        assert_close(s_packed[i:i + 1], s, torch.float64, f"state {i}")


def test_all_partitions_selected_reduces_to_gla():
    """K = N without gates: every sparse partition is the same GLA, so SSE = GLA(shared) + N * GLA(sparse)."""
    N, dtype = 4, torch.float64
    opts = VARIANTS["gla-no-gate"]
    q0, k0, g0, q1, k1, g1, v, logits, h0 = (t.detach() for t in make_inputs(2, 21, 2, 8, 4, N, "gla", dtype))
    h0 = h0[:, :1].expand(-1, 1 + N, -1, -1, -1).contiguous()
    for impl in ("recurrent", "mask", "varlen"):
        o, state = call(impl, opts, [q0, k0, g0, q1, k1, g1, v, logits, h0], N, N)
        o_shared, s_shared = recurrent_gla(q0, k0, v, g0, initial_state=h0[:, 0], output_final_state=True)
        o_sparse, s_sparse = recurrent_gla(q1, k1, v, g1, initial_state=h0[:, 1], output_final_state=True)
        assert_close(o, o_shared + N * o_sparse, dtype, impl)
        assert_close(state[:, 0], s_shared, dtype, impl)
        for i in range(1, 1 + N):
            assert_close(state[:, i], s_sparse, dtype, f"{impl} partition {i}")


def test_all_partitions_selected_with_gates_is_weighted_gla():
    """K = N with write-read gates: partition i is a GLA with key p_i k and query p_i q."""
    N, dtype = 3, torch.float64
    q0, k0, g0, q1, k1, g1, v, logits, h0 = (t.detach() for t in make_inputs(1, 17, 2, 8, 4, N, "gla", dtype))
    o, state = call("mask", VARIANTS["gla"], [q0, k0, g0, q1, k1, g1, v, logits, h0], N, N)
    p = torch.softmax(logits, -1)
    expected = recurrent_gla(q0, k0, v, g0, initial_state=h0[:, 0])[0]
    for i in range(N):
        w = p[..., i, None, None]
        expected = expected + recurrent_gla(q1 * w, k1 * w, v, g1, initial_state=h0[:, 1 + i])[0]
    assert_close(o, expected, dtype, "weighted GLA sum")


@pytest.mark.parametrize("impl", ["recurrent", "mask"])
@pytest.mark.parametrize("variant", ["gla", "gdn-key", "gdn-value"])
def test_unselected_partitions_are_bit_identical(variant, impl):
    """A partition that is read but not written (K_read > K_write) is neither written nor decayed, in every
    transition. fla's reference layer, in its masking path for SSE-GDN, masks the decay and write strength
    with the *read* set instead: its read-only partitions decay and its write-only ones are never written,
    unlike its own varlen path and the paper; we follow the write set everywhere."""
    opts = VARIANTS[variant]
    tensors = [t.detach() for t in make_inputs(2, 1, 2, 8, 4, 4, opts.transition, torch.float32)]
    before = tensors[-1]
    _, after = call(impl, opts, tensors, 1, 2)
    chosen = route(tensors[-2], 1, 2).write_mask[:, 0]  # [B, N]
    for b in range(2):
        for i in range(4):
            same = torch.equal(after[b, 1 + i], before[b, 1 + i])
            assert same != bool(chosen[b, i]), f"batch {b} partition {i}: written={bool(chosen[b, i])}"


def test_route_checks_k():
    with pytest.raises(ValueError, match="num_writers"):
        route(torch.randn(2, 3, 4), 5, 1)


def test_auto_implementation_follows_the_linear_op(monkeypatch):
    """Short sequences take the masking path only with accelerated chunk kernels; a backend that falls back to
    the PyTorch ops (e.g. CUDA without fla) takes varlen, which does N+1 / K+1 times less of that work."""
    from sse_model.ops import dispatch

    chosen = []
    for name in ("sse_masked", "sse_varlen"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _real=real, _name=name, **kw: chosen.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(dispatch, "_BACKENDS", [])
    opts = SSEOptions(transition="gla")
    tensors = make_inputs(1, 12, 2, 4, 4, 4, "gla", torch.float64)
    shared, sparse = Branch(*tensors[:3]), Branch(*tensors[3:6])
    v, logits, h0 = tensors[6:]

    def run():
        return dispatch.sse_attention(shared, sparse, v, route(logits, 1, 1), opts, initial_state=h0)[0]

    reference = run()  # no backend: PyTorch ops
    dispatch.register_backend(dispatch.Backend("no-kernels", lambda x: True, lambda transition, mode: None))
    fallback = run()
    reference_op = torch_linear_op("gla", "chunk")
    dispatch.register_backend(dispatch.Backend("kernels", lambda x: True,
                                               lambda transition, mode: lambda *a, **kw: reference_op(*a, **kw)))
    accelerated = run()
    assert chosen == ["sse_varlen", "sse_varlen", "sse_masked"]
    assert_close(fallback, reference, torch.float64)
    assert_close(accelerated, reference, torch.float64)


def test_varlen_never_hands_the_linear_op_an_empty_segment():
    """Accelerated inner ops (fla's chunked gated delta rule) mis-index the segments after an empty one, so a
    partition that no token of a sequence chose must not become a zero-length segment; its state passes
    through unchanged."""
    opts = VARIANTS["gdn-value"]
    tensors = make_inputs(1, 40, 2, 8, 4, 4, "gdn", torch.float64, num_seqs=4)
    logits = tensors[-2]
    with torch.no_grad():
        logits[..., 3] -= 100.0  # partition 3 is never chosen: one empty segment per sequence
    reference_op = torch_linear_op("gdn", "chunk", chunk_size=8)
    seen = []

    def checking_op(*args, cu_seqlens=None, **kw):
        seen.append(cu_seqlens)
        assert bool((cu_seqlens[1:] > cu_seqlens[:-1]).all()), f"empty segment in {cu_seqlens.tolist()}"
        return reference_op(*args, cu_seqlens=cu_seqlens, **kw)

    n = 4
    shared, sparse = Branch(*tensors[:n]), Branch(*tensors[n:2 * n])
    o, state = sse_varlen(shared, sparse, tensors[2 * n], route(logits, 1, 1), opts, checking_op,
                          initial_state=tensors[-1], output_final_state=True, cu_seqlens=CU)
    ref_o, ref_state = call("recurrent", opts, tensors, 1, 1, CU)
    assert seen
    assert_close(o, ref_o, torch.float64, "output")
    assert_close(state, ref_state, torch.float64, "final state")
    assert torch.equal(state[:, 4], tensors[-1][:, 4]), "the never-chosen partition keeps its initial state"


def test_cu_seqlens_are_checked_once_per_tensor_and_again_after_a_change():
    """A forward hands one ``cu_seqlens`` to every layer: the check reads its values on the host (a device sync on a
    GPU) at the first call only, and again once the tensor changes in place or meets another token count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sse_model.ops.varlen import check_cu_seqlens

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    cu = CU.clone()
    check_cu_seqlens(cu, 1, 40)
    with CountOps() as counted:
        check_cu_seqlens(cu, 1, 40)
    assert counted.ops == 0  # nothing read again
    with pytest.raises(ValueError, match=r"end at the number of tokens \(41\), got 0\.\.40"):
        check_cu_seqlens(cu, 1, 41)
    cu[2] = 30  # 3, 30, 21: decreasing, written in place after the check
    with pytest.raises(ValueError, match="non-decreasing"):
        check_cu_seqlens(cu, 1, 40)
    with pytest.raises(ValueError, match=r"start at 0 .* got 1\.\.40"):
        check_cu_seqlens(torch.tensor([1, 3, 40]), 1, 40)
    with torch.inference_mode():  # no version counter: every call reads it
        frozen = CU.clone()
        check_cu_seqlens(frozen, 1, 40)
        frozen[2] = 30
        with pytest.raises(ValueError, match="non-decreasing"):
            check_cu_seqlens(frozen, 1, 40)
