"""The Triton backend at real sizes on a GPU (2B SSE-H layer shapes: 18 heads, head dim 128, N=4, K=1):
decode and routing kernels against the PyTorch definitions; our chunked SSE and GLA kernels against the
PyTorch chunked ops in float32 (outputs, final states, every gradient); SSE-GDN on fla's kernels (skipped
without fla); a whole model with and without the backend. ``pytest -s tests/gpu/test_kernels_gpu.py``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.decode import sse_decode_triton
from kernels.routing import route_triton
from sse_model.ops.dispatch import torch_linear_op
from sse_model.ops.sse import Branch, SSEOptions, route, sse_decode_step, sse_masked, sse_varlen

H, D, N = 18, 128, 4
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # fla's kernels use tf32 / bf16 matmuls
RESULTS = []


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def branch(shape, transition, dtype, device="cuda"):
    q = torch.randn(*shape, D, device=device, dtype=dtype)
    k = torch.randn(*shape, D, device=device).softmax(-1).to(dtype)
    if transition == "gla":
        return Branch(q, k, (F.logsigmoid(torch.randn(*shape, D, device=device)) / 16).to(dtype))
    return Branch(q, k, -torch.rand(*shape, device=device) * 0.1, torch.rand(*shape, device=device).to(dtype))


@pytest.mark.parametrize("transition", ["gla", "gdn"])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_real_sizes(transition, batch):
    opts = SSEOptions(transition=transition, qk_l2norm=transition == "gdn")
    shared, sparse = branch((batch, H), transition, torch.bfloat16), branch((batch, H), transition, torch.bfloat16)
    v = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    r = route(torch.randn(batch, N, device="cuda"), 1, 1)
    pool = torch.randn(batch + 3, 1 + N, H, D, D, device="cuda")
    slots = torch.randperm(batch + 3, device="cuda")[:batch]
    ref_pool = pool.clone()
    ref = sse_decode_step(ref_pool, slots, shared, sparse, v, r, opts)
    out = sse_decode_triton(pool, slots, shared, sparse, v, r, opts)
    errors = (rel(out, ref), rel(pool, ref_pool))
    RESULTS.append((f"decode {transition} B={batch}", *errors))
    assert max(errors) < 1e-5


def test_routing_real_sizes():
    logits = torch.randn(131072, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = route(logits, 1, 1)
    got = route_triton(logits, 1, 1)
    assert torch.equal(ref.probs.gather(-1, got.topk), ref.probs.gather(-1, ref.topk))
    RESULTS.append(("routing L=128k", rel(got.probs, ref.probs), 0.0))
    assert rel(got.probs, ref.probs) < 1e-6


def sse_case(lengths, N, Kw, Kr, dtype, decay=16.0, state=True):
    """Inputs of a packed SSE call at the 2B layer shape (``decay`` divides the log-sigmoid gate)."""
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    shared, sparse = branch((1, T, H), "gla", dtype), branch((1, T, H), "gla", dtype)
    if decay != 16.0:
        for b in (shared, sparse):
            b.g = (F.logsigmoid(torch.randn(1, T, H, D, device="cuda") * 4 - 2) * 16 / decay).to(dtype)
    v = torch.randn(1, T, H, D, device="cuda", dtype=dtype)
    logits = torch.randn(1, T, N, device="cuda")
    leaves = [shared.q, shared.k, shared.g, sparse.q, sparse.k, sparse.g, v, logits]
    state0 = torch.randn(len(lengths), 1 + N, H, D, D, device="cuda") * 0.1 if state else None
    return cu, leaves + ([state0] if state else [])


def sse_run(impl, cu, leaves, N, Kw, Kr, upcast=None):
    """Output, final state and every gradient of one SSE call; ``upcast``: the reference's dtype."""
    leaves = [x.detach().to(upcast) if upcast else x.detach() for x in leaves]
    leaves = [x.requires_grad_() for x in leaves]
    shared, sparse = Branch(*leaves[:3]), Branch(*leaves[3:6])
    v, logits = leaves[6], leaves[7]
    state0 = leaves[8] if len(leaves) > 8 else None
    r = route(logits, Kw, Kr)
    o, s = impl(shared, sparse, v, r, SSEOptions(), initial_state=state0, output_final_state=True, cu_seqlens=cu)
    torch.manual_seed(1)
    do, ds = torch.randn_like(o, dtype=torch.float32), torch.randn_like(s, dtype=torch.float32)  # same draws for any dtype
    grads = torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), leaves)
    return o, s, grads


def reference(shared, sparse, v, routing, opts, **kw):
    return sse_varlen(shared, sparse, v, routing, opts, torch_linear_op("gla", "chunk", chunk_size=64), **kw)


# Against float32 references, float32 kernels agree to ~1e-6. Under strong decays (hundreds of nats per step)
# the in-chunk cumulative log-decays reach thousands, whose float32 rounding (~1e-4 absolute) moves every
# exp(G_i - G_j): that case is held to a float64 reference at a looser bound.
CHUNK_CASES = {  # name: lengths, N, Kw, Kr, dtype, decay
    "n4k1 fp32": ([700, 64, 1500, 33], 4, 1, 1, torch.float32, 16.0),
    "n4k1 bf16": ([700, 64, 1500, 33], 4, 1, 1, torch.bfloat16, 16.0),
    "n4k2 bf16": ([900, 17, 600], 4, 2, 2, torch.bfloat16, 16.0),
    "n4 Kw1 Kr2 fp32": ([300, 5, 250], 4, 1, 2, torch.float32, 16.0),
    "n16k1 short seqs fp32": ([40, 17, 300, 1], 16, 1, 1, torch.float32, 16.0),
    "K=N=4 fp32": ([130, 260], 4, 4, 4, torch.float32, 16.0),
    "strong decay (elementwise chunks) fp32": ([500, 700], 4, 1, 1, torch.float32, 0.25),
}


@pytest.mark.parametrize("name", list(CHUNK_CASES))
def test_sse_chunk_kernels(name):
    from kernels.sse_chunk import sse_chunk_triton

    lengths, N, Kw, Kr, dtype, decay = CHUNK_CASES[name]
    cu, leaves = sse_case(lengths, N, Kw, Kr, dtype, decay)
    o, s, g = sse_run(sse_chunk_triton, cu, leaves, N, Kw, Kr)
    strong = decay < 1
    o_ref, s_ref, g_ref = sse_run(reference, cu, leaves, N, Kw, Kr, upcast=torch.float64 if strong else torch.float32)
    grad_err = max(rel(a, b) for a, b in zip(g, g_ref))
    RESULTS.append((f"SSE chunk {name}: o / state / worst grad", rel(o, o_ref), max(rel(s, s_ref), grad_err)))
    tol = (3e-3 if strong else 1e-4) if dtype == torch.float32 else TOL[dtype]
    assert rel(o, o_ref) < tol and rel(s, s_ref) < tol and grad_err < 4 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_walks_in_pieces_equal_whole_walks(dtype):
    """One sequence of 32,768 tokens and an initial state (a paper-2b training row: 72 programs a walk at 18
    heads): the walks go in pieces (``kernels.sse_chunk._piece_chunks``) and give the whole walks' outputs, final
    states and gradients to rounding (bf16: the pieces' states are rounded once more before the carry)."""
    from kernels import sse_chunk

    assert sse_chunk._piece_chunks(1, 32768, H, D, D, 64, torch.device("cuda")) == sse_chunk.PIECE_CHUNKS > 0
    cu, leaves = sse_case([32768], 4, 1, 1, dtype)
    split = sse_run(sse_chunk.sse_chunk_triton, cu, leaves, 4, 1, 1)
    pieces, sse_chunk.PIECE_CHUNKS = sse_chunk.PIECE_CHUNKS, 0
    try:
        whole = sse_run(sse_chunk.sse_chunk_triton, cu, leaves, 4, 1, 1)
    finally:
        sse_chunk.PIECE_CHUNKS = pieces
    errors = [rel(a, b) for a, b in zip((split[0], split[1], *split[2]), (whole[0], whole[1], *whole[2]))]
    RESULTS.append((f"walks in pieces vs whole, 32k {dtype}: o / worst", errors[0], max(errors)))
    assert max(errors) < (1e-5 if dtype == torch.float32 else 1e-2), errors


@pytest.mark.parametrize("D", [64, 80, 96, 256])
def test_chunk_kernels_at_real_head_dims(D):
    """bf16 SSE and GLA chunk kernels, 9 heads, at the head dims of real checkpoints other than the 2B model's
    (packed lengths 1 / 63 / 64 / 65 / 4097): at 64 the first backward died with an illegal memory access (a
    one-value-block ``_bwd_dqkg`` that Triton miscompiles, ``kernels/sse_chunk.py::CONFIGS``)."""
    from benchmarks.kernels.real_shapes import check_chunk

    rows = list(check_chunk(9, D, "bfloat16", 4, 1))
    RESULTS.extend((f"{r['kernel']} {r['shape']}: o+state / grad", r["out"], r["grad"]) for r in rows)
    assert all(r["status"] == "ok" for r in rows), rows


def test_converted_smollm2_shapes_train_and_generate():
    """SmolLM2-135M converted to SSE-H (its exact shapes, random weights): a packed bf16 training step on the
    Triton backend and the engine's sampled log-probabilities, each against float32 within 1.5x / 2x of what the
    PyTorch ops give in bf16 (``benchmarks.kernels.real_shapes.check_model``)."""
    from benchmarks.kernels.real_shapes import check_model

    rows = list(check_model("smollm2-135m"))
    RESULTS.extend((f"smollm2 shapes: {r['kernel']} (bound {r['tol']:.1e})"[:45], r["out"], 0.0) for r in rows)
    assert all(r["status"] == "ok" for r in rows), rows


@pytest.mark.parametrize("Kw,Kr", [(1, 1), (1, 2)])
def test_side_stream_equals_one_stream(Kw, Kr):
    """The sparse launches on a second stream (``kernels.sse_chunk.OVERLAP``) give bit-identical outputs, states
    and gradients to one stream, at sizes where the streams really run side by side (a race shows here)."""
    from kernels import sse_chunk

    cu, leaves = sse_case([16384, 3000, 9000], 4, Kw, Kr, torch.bfloat16)
    results = {}
    for overlap in (True, False):
        sse_chunk.OVERLAP = overlap
        try:
            results[overlap] = [sse_run(sse_chunk.sse_chunk_triton, cu, leaves, 4, Kw, Kr) for _ in range(3)]
        finally:
            sse_chunk.OVERLAP = True
    want_o, want_s, want_g = results[False][0]
    for o, s, g in results[True] + results[False][1:]:
        assert torch.equal(o, want_o) and torch.equal(s, want_s)
        assert all(torch.equal(a, b) for a, b in zip(g, want_g))


@pytest.mark.parametrize("Kw,Kr", [(1, 1), (2, 2)])
def test_backward_head_groups_equal_keeping_the_states(Kw, Kr):
    """``SSEOptions.backward_head_groups`` at the 2B layer shape in bf16 (18 heads in 3 and 6 groups): the states
    made again a group at a time give bit-identical gradients to the kept ones (each head's work is the same)."""
    from kernels.sse_chunk import sse_chunk_triton

    cu, leaves = sse_case([16384, 3000, 9000], 4, Kw, Kr, torch.bfloat16)
    results = {}
    for groups in (1, 3, 6):
        xs = [x.detach().requires_grad_() for x in leaves]
        o, s = sse_chunk_triton(Branch(*xs[:3]), Branch(*xs[3:6]), xs[6], route(xs[7], Kw, Kr),
                                SSEOptions(backward_head_groups=groups), initial_state=xs[8], output_final_state=True,
                                cu_seqlens=cu)
        torch.manual_seed(1)
        do, ds = torch.randn_like(o, dtype=torch.float32), torch.randn_like(s, dtype=torch.float32)
        results[groups] = torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), xs)
    for groups in (3, 6):
        assert all(torch.equal(a, b) for a, b in zip(results[groups], results[1])), groups


@pytest.mark.parametrize("Kw,Kr", [(1, 1), (2, 2)])
def test_sse_from_its_feature_inputs_by_head_groups_equals_the_two_functions(Kw, Kr):
    """``sse_low_rank_attention`` at the 2B layer shape in bf16 (18 heads, LoRA rank 64, gate rank 16; autocast's
    bf16 inputs, float32 weights): with 3 head groups, one function that keeps the feature map's inputs and makes
    each group's features again in its backward; with 1, the feature map's function and the chunk function. The
    outputs are the same computation; the gradients differ only by the backward's products of a group's rows of the
    low-rank maps (bf16 rounding)."""
    from sse_model.ops.dispatch import sse_low_rank_attention

    lengths, RQ, RG = [16384, 3000, 9000], 64, 16
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    sizes = [H * D, H * D, RQ, RQ, RG, RG]
    proj = torch.randn(1, T, sum(sizes), device="cuda", dtype=torch.bfloat16)
    maps = [torch.randn(H * D, r, device="cuda") / r**0.5 for r in (RQ, RQ, RG, RG)]
    biases = [torch.randn(H * D, device="cuda") for _ in range(2)]
    v = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(1, T, N, device="cuda")
    features = dict(lora_side="sparse", q_activation="silu", k_activation="softmax", normalizer=16.0)
    results = {}
    for groups in (1, 3):
        xs = [x.detach().requires_grad_() for x in (proj, v, logits, *maps, *biases)]
        q, k, *low = xs[0].split(sizes, dim=-1)
        ups = [(xs[3], None), (xs[4], None), (xs[5], xs[7]), (xs[6], xs[8])]
        o, s = sse_low_rank_attention(q.unflatten(-1, (H, D)), k.unflatten(-1, (H, D)), low, ups, xs[1],
                                      route(xs[2], Kw, Kr), SSEOptions(backward_head_groups=groups),
                                      feature_options=features, output_final_state=True, cu_seqlens=cu)
        torch.manual_seed(1)
        do, ds = torch.randn_like(o, dtype=torch.float32), torch.randn_like(s, dtype=torch.float32)
        results[groups] = (o, s, torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), xs))
    (o1, s1, g1), (o3, s3, g3) = results[1], results[3]
    assert torch.equal(o1, o3) and torch.equal(s1, s3)
    names = ["projection", "v", "router logits", "lora q weight", "lora k weight", "gate weights", "gate weights",
             "gate bias", "gate bias"]
    for name, a, b in zip(names, g3, g1):
        assert rel(a.float(), b.float()) < TOL[torch.bfloat16], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gla_chunk_kernel(dtype):
    from kernels.sse_chunk import chunk_gla_triton

    lengths = [700, 64, 1500, 33]
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    b = branch((1, T, H), "gla", dtype)
    v = torch.randn(1, T, H, D, device="cuda", dtype=dtype)
    h0 = torch.randn(len(lengths), H, D, D, device="cuda") * 0.1
    leaves = [b.q, b.k, v, b.g, h0]

    def run(op, upcast):
        xs = [(x.detach().float() if upcast else x.detach()).requires_grad_() for x in leaves]
        o, s = op(*xs[:4], initial_state=xs[4], output_final_state=True, cu_seqlens=cu)
        torch.manual_seed(1)
        grads = torch.autograd.grad((o.float() * torch.randn_like(o, dtype=torch.float32)).sum() + s.sum(), xs)
        return o, s, grads

    o, s, g = run(chunk_gla_triton, False)
    o_ref, s_ref, g_ref = run(torch_linear_op("gla", "chunk", chunk_size=64), True)
    grad_err = max(rel(a, c) for a, c in zip(g, g_ref))
    RESULTS.append((f"GLA chunk {str(dtype)[6:]}: o / state / worst grad", rel(o, o_ref), max(rel(s, s_ref), grad_err)))
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    assert rel(o, o_ref) < tol and rel(s, s_ref) < tol and grad_err < 4 * tol


@pytest.mark.parametrize("impl", ["varlen", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_sse_gdn_on_fla_kernels(impl, dtype):
    """SSE-GDN runs Algorithm 1 / 2 around fla's gated delta rule when fla is installed."""
    fla_op = pytest.importorskip("kernels.backend").fla_gdn_op()
    if fla_op is None:
        pytest.skip("flash-linear-attention is not installed")
    lengths = [700, 64, 1500, 33]
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    opts = SSEOptions(transition="gdn", qk_l2norm=True)
    shared, sparse = branch((1, T, H), "gdn", dtype), branch((1, T, H), "gdn", dtype)
    v = torch.randn(1, T, H, D, device="cuda", dtype=dtype)
    logits = torch.randn(1, T, N, device="cuda")
    leaves = [x for b in (shared, sparse) for x in (b.q, b.k, b.g, b.beta) if x is not None] + [v, logits]
    for x in leaves:
        x.requires_grad_()
    state0 = torch.randn(len(lengths), 1 + N, H, D, D, device="cuda") * 0.1
    impl_fn = sse_varlen if impl == "varlen" else sse_masked
    do = torch.randn(1, T, H, D, device="cuda", dtype=dtype)

    def run(op):
        r = route(logits, 1, 1)
        o, s = impl_fn(shared, sparse, v, r, opts, op, initial_state=state0, output_final_state=True, cu_seqlens=cu)
        grads = torch.autograd.grad((o.float() * do.float()).sum() + s.sum(), leaves)
        return o, s, grads

    o_ref, s_ref, g_ref = run(torch_linear_op("gdn", "chunk", chunk_size=64))
    o, s, g = run(fla_op)
    grad_err = max(rel(a, b) for a, b in zip(g, g_ref))
    RESULTS.append((f"{impl} gdn (fla) {str(dtype)[6:]} o/state/grad", rel(o, o_ref), max(rel(s, s_ref), grad_err)))
    assert rel(o, o_ref) < TOL[dtype] and rel(s, s_ref) < TOL[dtype] and grad_err < 5 * TOL[dtype]


@pytest.mark.parametrize("D,gated", [(2304, False), (128, True)])
def test_fused_rms_norm_real_sizes(D, gated):
    from kernels.fused import rms_norm_triton
    from sse_model.ops.fused import rms_norm

    x = torch.randn(8192, D, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn_like(x) if gated else None
    weight = torch.rand(D, device="cuda") + 0.5
    leaves = [t for t in (x, weight, gate) if t is not None]

    def run(fn, upcast):
        xs = [t.detach().float().requires_grad_() if upcast else t.detach().requires_grad_() for t in leaves]
        out = fn(xs[0], xs[1], 1e-6, xs[2] if gated else None)
        torch.manual_seed(1)
        return out, torch.autograd.grad((out.float() * torch.randn_like(out, dtype=torch.float32)).sum(), xs)

    out, grads = run(rms_norm_triton, False)
    ref, ref_grads = run(rms_norm, True)
    err = max(rel(a, b) for a, b in zip(grads, ref_grads))
    RESULTS.append((f"fused rms_norm D={D} gated={gated}: y / worst grad", rel(out, ref), err))
    assert rel(out, ref) < TOL[torch.bfloat16] and err < TOL[torch.bfloat16]


def errors_against_float32(run, kernel, reference):
    """``run(fn, upcast) -> (outputs, leaves)`` for the kernel (bf16) and the float32 reference: the worst
    relative error of the outputs and of the leaves' gradients under one random projection of the outputs,
    and the kernel's gradients."""
    results = []
    for fn, upcast in ((kernel, False), (reference, True)):
        outs, leaves = run(fn, upcast)
        torch.manual_seed(1)
        loss = sum((o.float() * torch.randn_like(o, dtype=torch.float32)).sum() for o in outs)
        results.append((outs, torch.autograd.grad(loss, leaves)))
    (outs, grads), (refs, ref_grads) = results
    return (max(rel(a, b) for a, b in zip(outs, refs)), max(rel(a, b) for a, b in zip(grads, ref_grads)), grads)


def test_fused_sse_features_real_sizes():
    from kernels.fused import sse_features_triton
    from sse_model.ops.fused import sse_features

    ins = [torch.randn(4, 2048, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    options = dict(lora_side="sparse", q_activation="silu", k_activation="softmax", normalizer=16.0)

    def run(fn, upcast):
        xs = [t.detach().float().requires_grad_() if upcast else t.detach().requires_grad_() for t in ins]
        return fn(*xs, **options), xs

    out_err, grad_err, _ = errors_against_float32(run, sse_features_triton, sse_features)
    RESULTS.append(("fused sse_features: worst output / worst grad", out_err, grad_err))
    assert out_err < TOL[torch.bfloat16] and grad_err < TOL[torch.bfloat16]


def test_fused_sse_low_rank_features_real_sizes():
    """A 2B layer's training prologue (q, k and the rank-64 and rank-16 inputs as column slices of one bf16
    product, float32 weights cast as autocast casts them) against the float32 reference: outputs and the
    gradients of the product and of the weights and biases."""
    from kernels.fused import sse_low_rank_features_triton
    from sse_model.ops.fused import sse_low_rank_features

    sizes = [H * D, H * D, H * D, 64, 64, 16, 16]
    proj = torch.randn(4, 2048, sum(sizes), device="cuda", dtype=torch.bfloat16)
    ups = [(torch.randn(H * D, r, device="cuda") / r**0.5, torch.randn(H * D, device="cuda") if gate else None)
           for r, gate in ((64, False), (64, False), (16, True), (16, True))]
    options = dict(lora_side="sparse", q_activation="silu", k_activation="softmax", normalizer=16.0)

    def run(fn, upcast):
        x = proj.detach().float().requires_grad_() if upcast else proj.detach().requires_grad_()
        params = [tuple(None if t is None else t.detach().requires_grad_() for t in pair) for pair in ups]
        q, k, _, *low = x.split(sizes, dim=-1)
        outs = fn(q.unflatten(-1, (H, D)), k.unflatten(-1, (H, D)), low, params, **options)
        return outs, [x, *(t for pair in params for t in pair if t is not None)]

    out_err, grad_err, grads = errors_against_float32(run, sse_low_rank_features_triton, sse_low_rank_features)
    RESULTS.append(("fused low-rank features: worst output / grad", out_err, grad_err))
    assert all(g.dtype == torch.float32 for g in grads[1:])
    assert out_err < TOL[torch.bfloat16] and grad_err < TOL[torch.bfloat16]


@pytest.mark.parametrize("rows", [8, 256])
def test_fused_sse_decode_features_real_sizes(rows):
    """A 2B layer's decode prologue (ranks 64 and 16, q/k/v and the low-rank inputs as column slices of one
    product) against the float32 reference."""
    from kernels.fused import sse_decode_features_triton
    from sse_model.ops.fused import sse_decode_features

    sizes = [H * D, H * D, H * D, 64, 64, 16, 16]
    proj = torch.randn(rows, 1, sum(sizes), device="cuda", dtype=torch.bfloat16)
    ups = [(torch.randn(H * D, r, device="cuda", dtype=torch.bfloat16) / r**0.5,
            torch.randn(H * D, device="cuda", dtype=torch.bfloat16) if gate else None)
           for r, gate in ((64, False), (64, False), (16, True), (16, True))]
    options = dict(lora_side="sparse", q_activation="silu", k_activation="softmax", v_activation="silu",
                   normalizer=16.0)

    def run(fn, proj, ups):
        q, k, v, *low = proj.split(sizes, dim=-1)
        return fn(q.unflatten(-1, (H, D)), k.unflatten(-1, (H, D)), v.unflatten(-1, (H, D)), low, ups, **options)

    with torch.no_grad():
        outs = run(sse_decode_features_triton, proj, ups)
        refs = run(sse_decode_features, proj.float(), [(w.float(), None if b is None else b.float()) for w, b in ups])
    err = max(rel(a, b) for a, b in zip(outs, refs))
    RESULTS.append((f"fused sse_decode_features {rows} rows: worst output", err, 0.0))
    assert err < TOL[torch.bfloat16]


def test_model_with_and_without_backend():
    from sse_model import SSEConfig, SSEForCausalLM

    cfg = SSEConfig.from_preset("sse-h-tiny", hidden_size=256, num_heads=2, head_dim=128, num_attention_heads=2)
    model = SSEForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 300), device="cuda")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
        logits = model(ids).logits
        os.environ["SSE_BACKEND"] = "torch"
        try:
            ref_out = model.generate(ids, max_new_tokens=16, do_sample=False)
            ref_logits = model(ids).logits
        finally:
            del os.environ["SSE_BACKEND"]
    RESULTS.append(("tiny model logits (backend vs torch)", rel(logits, ref_logits), 0.0))
    assert rel(logits, ref_logits) < 2e-3
    assert (out == ref_out).float().mean() > 0.9  # greedy may flip on near-ties after tf32 differences


def test_engine_float32_residual_with_and_without_cuda_graphs():
    """The engine's float32 residual stream (bf16 weights, the skinny kernel summing into float32) at SmolLM2's
    shape: CUDA graph replay and eager steps give the same log-probabilities, closer to the float32 model under
    bf16 autocast (the trainer) than the all-bf16 engine's."""
    import copy

    from pipeline.rollout import Engine, SamplingParams
    from sse_model import SSEConfig, SSEForCausalLM

    torch.manual_seed(0)
    model = SSEForCausalLM(SSEConfig.from_preset("sse-h-smollm2")).cuda().eval()
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (17, 300, 1000)]
    params = SamplingParams(temperature=1.0, max_tokens=48, seed=1, ignore_eos=True)
    logps, gaps = {}, {}
    for residual, graphs in ((None, True), (torch.float32, True), (torch.float32, False)):
        engine = Engine(copy.deepcopy(model), None, dtype=torch.bfloat16, max_slots=4, max_model_len=1100,
                        use_cuda_graphs=graphs, residual_dtype=residual)
        outs = [o.outputs[0] for o in engine.generate(prompts, params)]
        logps[(residual, graphs)] = torch.tensor([lp for o in outs for lp in o.logprobs])
        trainer = []
        for prompt, out in zip(prompts, outs):
            full = torch.tensor([prompt + out.token_ids], device="cuda")
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                lp = torch.log_softmax(model(full).logits[0, len(prompt) - 1:-1].float(), -1)
            trainer.append(lp.gather(-1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0].cpu())
        gaps[(residual, graphs)] = (logps[(residual, graphs)] - torch.cat(trainer)).abs().mean().item()
        del engine
    RESULTS.append(("engine logp gap to trainer: bf16 residual, float32", gaps[(None, True)],
                    gaps[(torch.float32, True)]))
    assert torch.allclose(logps[(torch.float32, True)], logps[(torch.float32, False)], atol=2e-2)
    assert gaps[(torch.float32, True)] < gaps[(None, True)], gaps


def test_engine_warm_up_captures_every_bucket_and_changes_no_output():
    """``Engine.warm_up`` (evaluation calls it before its timed generation) captures the decode graph of every
    batch bucket up to the sequences asked; a generation after it captures none and returns, greedy and sampled,
    what an engine that captured lazily returns. (Graphs captured before the cache's first prefill, warm_up's first
    form, changed greedy tokens from the second one on an H200.)"""
    import copy

    from pipeline.rollout import Engine, SamplingParams
    from sse_model import SSEConfig, SSEForCausalLM

    torch.manual_seed(0)
    model = SSEForCausalLM(SSEConfig.from_preset("sse-h-smollm2")).cuda().eval()
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (17, 40, 90, 5, 33)]
    outputs = {}
    for warm in (True, False):
        engine = Engine(copy.deepcopy(model), None, dtype=torch.bfloat16, max_slots=8, max_model_len=256)
        if warm:
            assert engine.warm_up() == 4  # batch buckets 1, 2, 4, 8
            assert engine.get_stats()["generated_tokens"] == 0
        outputs[warm] = [o.outputs[0].token_ids for temperature in (0.0, 1.0) for o in engine.generate(
            prompts, SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True))]
        if warm:
            assert engine.warm_up() == 0
        del engine
    assert outputs[True] == outputs[False]


def test_engine_graphs_replay_the_eager_steps_exactly_whenever_they_were_captured():
    """Greedy tokens of an engine replaying CUDA graphs equal an eager engine's, token for token, in a first
    generation (graphs captured as the batch shrinks and grows) and in a second that replays graphs captured during
    the first, at other lengths. A graph captured before its cache's first prefill once broke this."""
    import copy

    from pipeline.rollout import Engine, SamplingParams
    from sse_model import SSEConfig, SSEForCausalLM

    torch.manual_seed(0)
    model = SSEForCausalLM(SSEConfig.from_preset("sse-h-smollm2")).cuda().eval()
    first = [torch.randint(100, 40000, (n,)).tolist() for n in (17, 40, 90, 5, 33, 120)]
    second = [torch.randint(100, 40000, (n,)).tolist() for n in (64, 3, 200)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (24, 8, 40, 16, 30, 12)]
    tokens = {}
    for graphs in (True, False):
        engine = Engine(copy.deepcopy(model), None, dtype=torch.bfloat16, max_slots=8, max_model_len=512,
                        use_cuda_graphs=graphs)
        tokens[graphs] = [o.outputs[0].token_ids for o in engine.generate(first, params)]
        tokens[graphs] += [o.outputs[0].token_ids for o in engine.generate(second, params[:3])]
        del engine
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("preset", ["sse-h-smollm2", "transformer-smollm2"])
def test_engine_packed_prefill_equals_prompts_alone(preset):
    """The engine's packed prefill (many new prompts in one forward: flash varlen attention, the SSE kernels'
    per-sequence states) at SmolLM2's shape in bf16, against each prompt prefilled alone (its own forward, the
    cached attention path): the first tokens' log-probabilities and the next decode step's logits agree to bf16."""
    from pipeline.rollout import Engine, SamplingParams
    from sse_model import SSEConfig, SSEForCausalLM

    torch.manual_seed(0)
    kinds = SSEConfig.from_preset(preset).mixer_types[:12]
    config = SSEConfig.from_preset(preset, num_hidden_layers=12, mixer_types=kinds)
    model = SSEForCausalLM(config).cuda().to(torch.bfloat16).eval()
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (17, 300, 1, 260, 90)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    packed = Engine(model, None, max_slots=8, max_model_len=512, prefill_chunk_size=4096)
    outs = packed.generate(prompts, params)
    assert packed.stats.prefill_forwards == 1
    alone = [Engine(model, None, max_slots=8, max_model_len=512, prefill_chunk_size=4096).generate(p, params)[0]
             for p in prompts]
    got = torch.tensor([lp for o in outs for lp in o.outputs[0].logprobs])
    want = torch.tensor([lp for o in alone for lp in o.outputs[0].logprobs])
    gap = (got - want).abs()
    RESULTS.append((f"packed prefill vs alone, greedy logp ({preset})", gap.max().item(), gap.median().item()))
    assert gap.max() < 0.2 and gap.median() < 2e-2  # bf16 logits: one unit in the last place at 16-32 is 0.125
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, alone))
    assert same >= len(prompts) - 1  # a greedy near-tie may flip in bf16


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_top_p_sample_equals_the_sort_at_real_sizes(vocab):
    """The top-p kernel (no sort) against the PyTorch sampler's sort at 256 rows of bf16 logits of SmolLM2's and
    Qwen's vocabularies: the same tokens (a row whose mass sums land on either side of the cut in the two orders
    of summation may differ) and log-probabilities."""
    from kernels.sampling import top_p_sample
    from pipeline.rollout.sampling import sample

    torch.manual_seed(0)
    B = 256
    logits = (torch.randn(B, vocab, device="cuda") * 4).to(torch.bfloat16)
    temperature = torch.tensor([0.0, 0.6, 0.7, 1.0], device="cuda").repeat(B // 4)
    top_p = torch.tensor([0.7, 0.95, 0.9, 1.0, 0.5, 0.99, 0.8, 0.3], device="cuda").repeat(B // 8)
    seeds, steps = torch.arange(B, device="cuda") * 31 + 5, torch.full((B,), 3, device="cuda")
    off = torch.zeros(B, dtype=torch.long, device="cuda")
    want, want_lp = sample(logits, temperature, top_p, off, seeds, steps, need_filter=True)
    got, got_lp = top_p_sample(logits, temperature, top_p, seeds, steps)
    same = (got == want).float().mean().item()
    RESULTS.append((f"top-p kernel vs sort, tokens equal ({vocab})", same, 1.0))
    assert same >= 0.99
    assert torch.allclose(got_lp[got == want], want_lp[got == want], atol=1e-3)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_decode_step_paged_equals_gather(kv_cache_dtype):
    """One decode step of the rollout engine (bf16, sequences of 300-900 tokens over several KV blocks, forks
    sharing blocks; keys and values in bf16 or float8): logits with the attention read in place (the engine's path,
    in its CUDA graph and eager) against gathering the blocks + SDPA, and the Triton backend's decode step against
    the PyTorch ops."""
    from pipeline.rollout import Engine, SamplingParams
    from sse_model import SSEConfig, SSEForCausalLM

    cfg = SSEConfig.from_preset("sse-h-tiny", hidden_size=256, num_heads=2, head_dim=128, num_attention_heads=2,
                                max_position_embeddings=4096)
    model = SSEForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    engine = Engine(model, None, max_slots=16, max_model_len=1024, block_size=64, kv_cache_dtype=kv_cache_dtype)
    for n in (300, 517, 900):
        engine.add_request(torch.randint(0, cfg.vocab_size, (n,)).tolist(),
                           SamplingParams(n=4, max_tokens=64, ignore_eos=True, seed=n))
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    for _ in range(5):
        engine.step()  # the graph is captured and replayed
    ids = torch.tensor([s.token_ids[-1] for s in engine.scheduler.running], device="cuda")
    slots = torch.tensor([s.slot for s in engine.scheduler.running], device="cuda")
    cache = engine.cache  # each forward below decodes the same token from the same lengths and states
    live = [cache.lengths, *cache.linear.values(), *(c for pair in cache.conv.values() for c in pair)]
    saved = [t.clone() for t in live]
    logits = {}
    with torch.no_grad():
        for name, graphs, paged in (("graph", True, True), ("eager", False, True), ("gather", False, False),
                                    ("torch", False, False)):
            engine.runner.use_cuda_graphs, cache.paged_decode = graphs, paged
            for t, value in zip(live, saved):
                t.copy_(value)
            os.environ["SSE_BACKEND"] = "torch" if name == "torch" else ""
            try:
                logits[name] = engine.runner.forward_decode(ids, slots).float().clone()
            finally:
                del os.environ["SSE_BACKEND"]
    errors = rel(logits["graph"], logits["gather"]), rel(logits["eager"], logits["gather"])
    RESULTS.append((f"engine decode step, KV {kv_cache_dtype}: paged (graph / eager) vs gather", *errors))
    RESULTS.append((f"engine decode step, KV {kv_cache_dtype}: Triton backend (gather) vs PyTorch ops",
                    rel(logits["gather"], logits["torch"]), 0.0))
    assert max(errors) < TOL[torch.bfloat16]
    assert rel(logits["gather"], logits["torch"]) < TOL[torch.bfloat16]  # the decode prologue, norms, routing, SSE step


@pytest.mark.parametrize("lengths,N,K", [([32768] * 4, 4, 1), ([int(x) for x in torch.randint(1, 3000, (64,))], 8, 2)])
def test_plan_kernels_real_sizes(lengths, N, K):
    """The plan kernels against the PyTorch builders at training sizes (every table identical)."""
    from kernels.plan import build_plans, build_plans_reference

    L = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    topk = route(torch.randn(L, N, device="cuda"), K, K).topk
    want_tables, want_pairs = build_plans_reference(cu, L, topk, N, K, K, 64)
    got_tables, got_pairs = build_plans(cu, L, topk, N, K, K, 64)
    for name, want in want_tables.items():
        assert torch.equal(got_tables[name], want), name
    for name in ("token", "partition", "cu_seqlens", "position"):
        assert torch.equal(getattr(got_pairs[0], name), getattr(want_pairs[0], name)), name
    for got, want in zip(got_pairs[1:], want_pairs[1:]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("keep", [False, True])
def test_checkpointing_rebuild_keeps_what_it_should(keep):
    """Non-reentrant checkpointing under bf16 autocast: the chunk plans (and with ``keep`` the chunk forward)
    are taken from the forward when the backward (on autograd's device thread) rebuilds the block; the
    gradients match a run without checkpointing."""
    from kernels import sse_chunk
    from sse_model import SSEConfig, SSEForCausalLM

    cfg = SSEConfig.from_preset("sse-h-tiny", hidden_size=256, num_heads=2, head_dim=128, num_attention_heads=2,
                                checkpointing_keeps_linear_attention=keep)
    torch.manual_seed(0)
    model = SSEForCausalLM(cfg).cuda().train()
    ids = torch.randint(0, cfg.vocab_size, (2, 1000), device="cuda")
    calls = []
    forward = sse_chunk._forward
    sse_chunk._forward = lambda *a: calls.append(1) or forward(*a)
    try:
        def grads():
            model.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return torch.cat([p.grad.float().flatten() for p in model.parameters()])

        plain = grads()
        per_step = len(calls)
        calls.clear()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointed = grads()
    finally:
        sse_chunk._forward = forward
    assert len(calls) == (per_step if keep else 2 * per_step)
    RESULTS.append((f"checkpointed grads (keep={keep}) vs plain", rel(checkpointed, plain), 0.0))
    assert rel(checkpointed, plain) < TOL[torch.bfloat16]


@pytest.mark.parametrize("kv_heads", [H, 6])
def test_paged_decode_attention_real_sizes(kv_heads):
    """The paged kernel against the engine's gather + SDPA path (``benchmarks/kernels/bench_paged.py``), bf16 cache,
    blocks of 256 tokens, lengths from one token to four blocks and a half."""
    from benchmarks.kernels.bench_paged import gather_path
    from kernels.paged_attention import paged_decode_attention

    B, block_size, per_seq = 8, 256, 5
    pool_k = torch.randn(B * per_seq + 1, kv_heads, block_size, D, device="cuda", dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    tables = torch.randperm(B * per_seq, device="cuda").view(B, per_seq)
    lengths = torch.tensor([1, 255, 256, 257, 700, 1024, 1100, 1151], device="cuda")
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    k = pool_k.repeat_interleave(H // kv_heads, dim=1)  # the gather path's SDPA with every head its own keys
    v = pool_v.repeat_interleave(H // kv_heads, dim=1)
    got = paged_decode_attention(q, pool_k, pool_v, tables, lengths)
    want = gather_path(q, k, v, tables, lengths)
    RESULTS.append((f"paged decode attention (H_kv={kv_heads}) vs gather", rel(got, want), 0.0))
    assert rel(got, want) < TOL[torch.bfloat16]


def test_paged_decode_attention_reads_float8_pools_and_the_store_clamps():
    """Float8 e4m3 pools (kv_cache_dtype fp8): the kernel against SDPA over the same values widened to bf16; and
    the decode prologue's store against the rotated keys computed in PyTorch, rounded to float8 the same way, with
    values beyond e4m3's range clamped to 448 (the bare cast gives NaN)."""
    from benchmarks.kernels.bench_paged import gather_path
    from kernels.paged_attention import paged_decode_attention, rotary_store_decode
    from pipeline.rollout.cache import to_kv
    from sse_model.modules import RotaryEmbedding

    B, kv_heads, block_size, per_seq = 8, 6, 256, 5
    f8 = torch.float8_e4m3fn
    pool_k = (4 * torch.randn(B * per_seq + 1, kv_heads, block_size, D, device="cuda")).to(f8)
    pool_v = torch.randn(B * per_seq + 1, kv_heads, block_size, D, device="cuda").to(f8)
    tables = torch.randperm(B * per_seq, device="cuda").view(B, per_seq)
    lengths = torch.tensor([1, 255, 256, 257, 700, 1024, 1100, 1151], device="cuda")
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    want = gather_path(q, pool_k.to(torch.bfloat16).repeat_interleave(H // kv_heads, dim=1),
                       pool_v.to(torch.bfloat16).repeat_interleave(H // kv_heads, dim=1), tables, lengths)
    from benchmarks.kernels.bench_paged import TIMED

    for tile, stages in TIMED:
        got = paged_decode_attention(q, pool_k, pool_v, tables, lengths, tokens_per_step=tile, stages=stages)
        RESULTS.append((f"paged decode attention, float8 pools vs gather (bf16), {tile} tokens a tile, {stages} stages",
                        rel(got, want), 0.0))
        assert got.dtype == torch.bfloat16 and rel(got, want) < TOL[torch.bfloat16]

    rotary = RotaryEmbedding(D).cuda()
    k = 300 * torch.randn(B, kv_heads, D, device="cuda", dtype=torch.bfloat16)  # some beyond 448
    v = 300 * torch.randn(B, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    positions = lengths - 1
    slots = torch.arange(B, device="cuda")
    before = lengths - 1  # the cache's lengths before this step's token
    q_rot = rotary_store_decode(q, k, v, positions, rotary.inv_freq, rotary.attention_factor, pool_k, pool_v,
                                tables, before, slots)
    assert q_rot.dtype == torch.bfloat16
    angle = positions[:, None].float() * rotary.inv_freq[None]
    cos, sin = (torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1))
    kf = k.float()
    k_rot = kf * cos[:, None] * rotary.attention_factor + torch.cat([-kf[..., D // 2:], kf[..., :D // 2]], -1) * \
        sin[:, None] * rotary.attention_factor
    block = tables.gather(1, (before // block_size)[:, None])[:, 0]
    stored_k = pool_k[block, :, before % block_size].float()  # [B, H_kv, D]
    stored_v = pool_v[block, :, before % block_size].float()
    assert torch.isfinite(stored_k).all() and stored_k.abs().max() == 448 and stored_v.abs().max() == 448
    # the rotation in float32 on both sides, whose last bits may differ: one e4m3 step (12.5%) apart at most
    for stored, exact in ((stored_k, to_kv(k_rot, f8).float()), (stored_v, to_kv(v, f8).float())):
        RESULTS.append(("float8 store: values equal to PyTorch's rounding", (stored == exact).float().mean().item(),
                        0.0))
        assert ((stored - exact).abs() <= 0.125 * exact.abs() + 4e-3).all()


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_skinny_linear_real_sizes(rows):
    """A decode step's products of sse-h-2b (``benchmarks/kernels/bench_skinny.py``) against float32 products, the
    residual in the epilogue."""
    from benchmarks.kernels.bench_skinny import SHAPES
    from kernels.skinny import skinny_linear

    worst = 0.0
    for _, N, K, residual in SHAPES:
        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
        r = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16) if residual else None
        want = x.float() @ w.float().T + (r.float() if residual else 0)
        worst = max(worst, rel(skinny_linear(x, w, residual=r), want))
    RESULTS.append((f"skinny products, {rows} rows, every sse-h-2b shape vs float32", worst, 0.0))
    assert worst < TOL[torch.bfloat16]


def test_race_sample_real_sizes():
    """The one-pass sampler against the PyTorch sampler at GRPO's batch and Qwen's vocabulary (bf16 logits): the
    same token in every row whose race is not a float tie, the same log-probability."""
    from benchmarks.kernels.real_shapes import check_sampler

    (r,) = check_sampler(151936, 256)
    RESULTS.append(("one-pass sampler: log-prob rel err", r["out"], 0.0))
    assert r["status"] == "ok", r


@pytest.mark.parametrize("D,heads,kv_heads,window", [(64, 9, 3, None), (128, 18, 18, None), (256, 8, 1, None),
                                                     (64, 9, 3, 100)])
def test_packed_attention_flash_varlen(D, heads, kv_heads, window):
    """The packed row in one flash varlen launch (bf16) against the dense-mask reference in float32, output and
    gradients, at real head dims with GQA and a window; lengths from 1 token to 3000."""
    from sse_model.ops.attention import flash_varlen_serves, packed_causal_attention

    cu = torch.tensor([0, 1, 700, 701, 3701, 3900])
    T = int(cu[-1])
    q = torch.randn(1, heads, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, heads, T, D, device="cuda", dtype=torch.bfloat16)
    assert flash_varlen_serves(q)
    segments = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    out = packed_causal_attention(q, k, v, segments, window)
    i = torch.arange(T, device="cuda")
    seq = torch.searchsorted(cu[1:].cuda(), i, right=True)
    allowed = (i[None] <= i[:, None]) & (seq[None] == seq[:, None])
    if window is not None:
        allowed &= i[None] > i[:, None] - window
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                         v.float().repeat_interleave(rep, 1), attn_mask=allowed)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.float())
    errs = [rel(out, ref)] + [rel(g, w) for g, w in zip(got, want)]
    RESULTS.append((f"packed flash varlen D={D} H={heads}/{kv_heads} w={window}: out, worst grad", errs[0],
                    max(errs[1:])))
    assert max(errs) < TOL[torch.bfloat16], errs


def test_zz_print_table():
    print(f"\n{'case':45s} {'rel err 1':>10s} {'rel err 2':>10s}")
    for name, a, b in RESULTS:
        print(f"{name:45s} {a:10.2e} {b:10.2e}")
