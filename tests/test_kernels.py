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
    got_pool = pool.clone().to(DEVICE)  # a copy on CPU too: the kernel updates it in place
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
    # a decode step writes its output in the model's dtype (no cast after the kernel): the same values, rounded
    again = decode.sse_decode_triton(pool.clone().to(DEVICE), slots.to(DEVICE), to(shared, DEVICE), to(sparse, DEVICE),
                                     v.to(DEVICE), r_dev, opts, out_dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16
    assert_close(again.float().cpu(), expected, torch.bfloat16, "output in bf16")


@pytest.mark.parametrize("case", CASES[:1] + CASES[4:5], ids=lambda c: "-".join(map(str, c)))
def test_sse_decode_kernel_on_a_bf16_state_pool(case):
    """``engine.state_cache_dtype: bfloat16``: the kernel reads the bf16 states into float32, updates them there
    and stores them rounded to bf16: the float32 reference's step from the same states, rounded once."""
    transition, target, l2, wg, rg, N, Kw, Kr, K, V = case
    B, H, rows = 3, 2, 5
    opts = SSEOptions(transition=transition, write_gate=wg, read_gate=rg, gate_target=target, qk_l2norm=l2)
    shared, sparse = branch(B, H, K, transition, torch.float32), branch(B, H, K, transition, torch.float32)
    v = torch.randn(B, H, V)
    r = route(torch.randn(B, N), Kw, Kr)
    pool = torch.randn(rows, 1 + N, H, K, V).to(torch.bfloat16)
    slots = torch.tensor([3, 0, 4])
    expected_pool = pool.float()
    expected = sse_decode_step(expected_pool, slots, shared, sparse, v, r, opts)
    got_pool = pool.clone().to(DEVICE)
    got = decode.sse_decode_triton(got_pool, slots.to(DEVICE), to(shared, DEVICE), to(sparse, DEVICE), v.to(DEVICE),
                                   type(r)(r.probs.to(DEVICE), r.topk.to(DEVICE), Kw, Kr), opts)
    assert got_pool.dtype == torch.bfloat16
    assert_close(got.cpu(), expected, torch.float32, "output (from the same bf16 states, in float32)")
    assert_close(got_pool.cpu().float(), expected_pool.to(torch.bfloat16).float(), torch.bfloat16, "state pool")


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


# ----------------------------------------------------------------------------------------------------------
# chunked SSE / GLA kernels against the PyTorch varlen algorithm in float64


def _sse_grads(fn, leaves, state, seed=1):
    """Output, final state and the gradients of every leaf for a random linear loss."""
    o, s = fn()
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o)
    ds = torch.randn(s.shape, generator=gen).to(s)
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves + ([state] if state is not None else []))
    return o, s, grads


CHUNK_CASES = [  # N, Kw, Kr, write gate, read gate, sequence lengths, SAFE (0: every chunk elementwise), key dim
    (4, 1, 1, True, True, [5, 35, 1, 49], 86.0, 16),
    (4, 1, 1, True, True, [5, 35, 1, 49], 0.0, 16),
    (4, 2, 2, True, True, [37, 33], 86.0, 16),
    (3, 1, 3, False, True, [50], 86.0, 16),  # read-only pairs (write mask 0), write gate off
    (4, 4, 4, True, False, [20, 13], 86.0, 16),  # K = N
    (8, 1, 1, True, True, [3, 9], 86.0, 16),  # partitions that receive no token
    (4, 1, 1, True, True, [21, 30], 86.0, 80),  # key dims that are no multiple of the kernels' key tiles
    (4, 2, 2, True, True, [21, 30], 86.0, 144),
]


@pytest.fixture
def pieces(monkeypatch):
    """Every call's state walks in pieces of one chunk (``kernels/sse_chunk.py::_carry``), as a GPU walks few
    long sequences; yields the list of the carry's launch grids."""
    from kernels import sse_chunk

    monkeypatch.setattr(sse_chunk, "PIECE_CHUNKS", 1)
    monkeypatch.setattr(sse_chunk, "_multiprocessors", lambda device: 1 << 30)
    grids, carry = [], sse_chunk._carry

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return carry[grid]

    monkeypatch.setattr(sse_chunk, "_carry", Spy())
    yield grids


@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sse_chunk_kernels_match_reference(case):
    """Outputs, final states and every gradient (router logits and initial states included), float32 kernels
    against float64 Algorithm 2; chunk size 16 so that short sequences span several chunks."""
    _check_chunk_case(case)


@pytest.mark.parametrize("case", [CHUNK_CASES[i] for i in (0, 1, 2, 4, 6)], ids=lambda c: "-".join(map(str, c)))
def test_sse_chunk_state_walks_in_pieces_match_reference(pieces, case):
    """The state walks split into pieces walked from zero and completed by the carry (one 32k row on a GPU):
    the reference's outputs, final states and gradients, the initial states' and final states' included, with
    sequences of one token and of several pieces (their sparse segments empty, short or long)."""
    _check_chunk_case(case)
    assert len(pieces) == 4  # the shared and the sparse walk, forward and backward


def _check_chunk_case(case):
    from kernels.sse_chunk import sse_chunk_triton
    from sse_model.ops.dispatch import torch_linear_op
    from sse_model.ops.sse import sse_varlen

    N, Kw, Kr, wg, rg, lengths, safe, K = case
    H, V = 2, 32
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    sides = [branch(T, H, K, "gla", torch.float32) for _ in range(2)]
    base = [sides[0].q[None], sides[0].k[None], sides[0].g[None], sides[1].q[None], sides[1].k[None],
            sides[1].g[None], torch.randn(1, T, H, V), torch.randn(1, T, N)]
    state0 = torch.randn(len(lengths), 1 + N, H, K, V)
    opts = SSEOptions(write_gate=wg, read_gate=rg)
    results = []
    for dtype in (torch.float32, torch.float64):
        leaves = [x.to(dtype).requires_grad_() for x in base]
        state = state0.to(dtype).requires_grad_()
        r = route(leaves[7], Kw, Kr)
        shared, sparse = Branch(*leaves[:3]), Branch(*leaves[3:6])
        if dtype == torch.float32:
            to_dev = [x.to(DEVICE) for x in leaves[:7]]
            r_dev = type(r)(r.probs.to(DEVICE), r.topk.to(DEVICE), Kw, Kr)
            fn = lambda: sse_chunk_triton(Branch(*to_dev[:3]), Branch(*to_dev[3:6]), to_dev[6], r_dev, opts,  # noqa: E731
                                          initial_state=state.to(DEVICE), output_final_state=True,
                                          cu_seqlens=cu.to(DEVICE), chunk_size=16, safe=safe)
        else:
            fn = lambda: sse_varlen(shared, sparse, leaves[6], r, opts, torch_linear_op("gla", "chunk"),  # noqa: E731
                                    initial_state=state, output_final_state=True, cu_seqlens=cu)
        results.append(_sse_grads(fn, leaves, state))
    (o, s, g), (o_ref, s_ref, g_ref) = results
    assert_close(o.cpu(), o_ref, torch.float32, "output")
    assert_close(s.cpu(), s_ref, torch.float32, "final state")
    names = ["q shared", "k shared", "g shared", "q sparse", "k sparse", "g sparse", "v", "router logits", "state"]
    for name, a, b in zip(names, g, g_ref):
        assert_close(a.cpu(), b, torch.float32, f"gradient of {name}")


@pytest.mark.parametrize("Kw,Kr,lengths,groups,split", [(1, 1, [5, 35, 1, 49], 4, False), (2, 2, [37, 33], 2, False),
                                                       (1, 1, [5, 35, 1, 49], 2, True)])  # K = 1: by token
def test_sse_chunk_backward_by_head_groups_keeps_no_states_and_the_same_gradients(request, Kw, Kr, lengths, groups,
                                                                                  split):
    """``backward_head_groups``: the backward makes the chunk states again a group of heads at a time instead of
    keeping the forward's (less memory at its peak): nothing of the states' shape is saved for it, and every
    gradient is the one of the backward that keeps them, at each group count that divides the heads (``split``:
    with the walks in pieces, which the groups' walks take as the forward's did)."""
    from kernels.sse_chunk import sse_chunk_triton

    if split:
        request.getfixturevalue("pieces")

    N, H, K, V = 4, 4, 16, 32
    T, chunk = sum(lengths), 16
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]).to(DEVICE)
    sides = [branch(T, H, K, "gla", torch.float32) for _ in range(2)]
    base = [sides[0].q[None], sides[0].k[None], sides[0].g[None], sides[1].q[None], sides[1].k[None],
            sides[1].g[None], torch.randn(1, T, H, V), torch.randn(1, T, N), torch.randn(len(lengths), 1 + N, H, K, V)]
    results = {}
    for groups in (1, groups):
        leaves = [x.to(DEVICE).requires_grad_() for x in base]
        r = route(leaves[7], Kw, Kr)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
            fn = lambda: sse_chunk_triton(Branch(*leaves[:3]), Branch(*leaves[3:6]), leaves[6], r,  # noqa: E731
                                          SSEOptions(backward_head_groups=groups), initial_state=leaves[8],
                                          output_final_state=True, cu_seqlens=cu, chunk_size=chunk)
            results[groups] = _sse_grads(fn, leaves[:8], leaves[8])
        states = [s for s in saved if len(s) == 4 and s[1:] == (H, K, V)]  # the initial states, and h if kept
        assert len(states) == (2 if groups == 1 else 1), (groups, states)
    names = ["output", "final state", "q shared", "k shared", "g shared", "q sparse", "k sparse", "g sparse", "v",
             "router logits", "initial state"]
    (o, s, g), (o1, s1, g1) = results[groups], results[1]
    for name, a, b in zip(names, (o, s, *g), (o1, s1, *g1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name} at {groups} head groups")
    with pytest.raises(ValueError, match="backward_head_groups \\(3\\) must divide the 4 heads"):
        sse_chunk_triton(Branch(*base[:3]), Branch(*base[3:6]), base[6], route(base[7], Kw, Kr),
                         SSEOptions(backward_head_groups=3), cu_seqlens=cu.cpu(), chunk_size=chunk)


@pytest.mark.parametrize("Kw,Kr,lengths,groups,lora_side", [(1, 1, [5, 35, 1, 49], 3, "sparse"),
                                                             (2, 2, [37, 33], 3, "shared")])
def test_sse_from_its_feature_inputs_keeps_no_features_and_the_same_gradients(monkeypatch, Kw, Kr, lengths, groups,
                                                                              lora_side):
    """``sse_low_rank_attention`` with the backward by head groups: the feature map and SSE in one function that
    keeps the map's inputs, not its six outputs, and makes each group's features again in the backward. Outputs,
    final states and every gradient (the projection's, the low-rank maps' weights and biases, the values', the
    router's, the initial states') equal those of the two functions one after the other."""
    from kernels.backend import linear_op
    from kernels.fused import sse_low_rank_features_triton
    from kernels.sse_chunk import sse_chunk_triton, sse_low_rank_chunk_triton
    from sse_model.ops import dispatch

    monkeypatch.setattr(dispatch, "_BACKENDS", [])
    dispatch.register_backend(dispatch.Backend("kernels", lambda x: True, linear_op, sse=sse_chunk_triton,
                                               sse_low_rank=sse_low_rank_chunk_triton,
                                               sse_low_rank_features=sse_low_rank_features_triton))
    N, H, K, V, RQ, RG = 4, 3, 16, 32, 8, 4
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]).to(DEVICE)
    sizes = [H * K, H * K, RQ, RQ, RG, RG]  # q, k, then the rank-r inputs: column slices of one product
    base = [torch.randn(1, T, sum(sizes)), torch.randn(1, T, H, V), torch.randn(1, T, N),
            torch.randn(len(lengths), 1 + N, H, K, V)]
    maps = [torch.randn(H * K, r) / r**0.5 for r in (RQ, RQ, RG, RG)] + [torch.randn(H * K) for _ in range(2)]
    features = dict(lora_side=lora_side, q_activation="silu", k_activation="softmax", normalizer=16.0)
    results, kept = {}, {}
    for g in (1, groups):  # 1: the backend declines, and the two functions run
        leaves = [x.to(DEVICE).requires_grad_() for x in base + maps]
        proj, v, logits, h0, wq, wk, wg0, wg1, bg0, bg1 = leaves
        q, k, *low = proj.split(sizes, dim=-1)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
            fn = lambda: dispatch.sse_low_rank_attention(  # noqa: E731
                q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), low, [(wq, None), (wk, None), (wg0, bg0), (wg1, bg1)],
                v, route(logits, Kw, Kr), SSEOptions(backward_head_groups=g), feature_options=features,
                initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=16)
            results[g] = _sse_grads(fn, [proj, v, logits, wq, wk, wg0, wg1, bg0, bg1], h0)
        kept[g] = saved.count(T * H * K)  # q and k, and the six features where the chunk function keeps them
    assert kept == {1: 8, groups: 2}, kept
    names = ["output", "final state", "projection", "v", "router logits", "lora q weight", "lora k weight",
             "gate weight", "gate weight", "gate bias", "gate bias", "initial state"]
    (o, s, grads), (o1, s1, grads1) = results[groups], results[1]
    for name, a, b in zip(names, (o, s, *grads), (o1, s1, *grads1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name} at {groups} head groups")


@pytest.mark.parametrize("K,V,split", [(16, 32, False), (80, 32, False), (144, 32, False), (64, 64, False),
                                       (16, 32, True), (80, 32, True), (64, 64, True)])  # 64: SmolLM2's heads
def test_gla_chunk_kernel_matches_reference(request, K, V, split):
    """Outputs, final states and gradients against float64 (``split``: the state walks in pieces); a forward
    without gradients gives the same output and state as one that keeps the chunk states for the backward."""
    from kernels.sse_chunk import chunk_gla_triton

    if split:
        request.getfixturevalue("pieces")
    from sse_model.ops.gla import recurrent_gla

    lengths, H = [21, 1, 40], 2
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    b = branch(T, H, K, "gla", torch.float32)
    base = [b.q[None], b.k[None], torch.randn(1, T, H, V), b.g[None]]
    state0 = torch.randn(len(lengths), H, K, V)
    results = []
    for dtype in (torch.float32, torch.float64):
        leaves = [x.to(dtype).requires_grad_() for x in base]
        state = state0.to(dtype).requires_grad_()
        if dtype == torch.float32:
            fn = lambda: chunk_gla_triton(*(x.to(DEVICE) for x in leaves), initial_state=state.to(DEVICE),  # noqa: E731
                                          output_final_state=True, cu_seqlens=cu.to(DEVICE), chunk_size=16)
        else:
            fn = lambda: recurrent_gla(*leaves, initial_state=state, output_final_state=True, cu_seqlens=cu)  # noqa: E731
        results.append(_sse_grads(fn, leaves, state))
        if dtype == torch.float32:
            with torch.no_grad():
                o_plain, s_plain = fn()
    (o, s, g), (o_ref, s_ref, g_ref) = results
    assert torch.equal(o_plain, o.detach()) and torch.equal(s_plain, s.detach())
    assert_close(o.cpu(), o_ref, torch.float32, "output")
    assert_close(s.cpu(), s_ref, torch.float32, "final state")
    for name, a, c in zip(["q", "k", "v", "g", "state"], g, g_ref):
        assert_close(a.cpu(), c, torch.float32, f"gradient of {name}")


@pytest.mark.parametrize("D", [32, 48, 64, 80, 96, 128, 256])
def test_dqkg_kernel_walks_two_value_blocks_or_more(D):
    """``_bwd_dqkg`` with one value block (V = 64 at the 2B shape's 64-wide blocks: SmolLM2's heads) was
    miscompiled by Triton 3.6 on Hopper in bf16: illegal memory access in the first backward (found on an H100,
    ``docs/real_shapes.md``). The interpreter cannot show a miscompile, so this holds the tile choice."""
    from kernels.sse_chunk import CONFIGS

    assert CONFIGS["bwd_dqkg"].blocks(D, D)["NV"] >= 2


def test_chunk_kernels_take_the_exact_path_for_strong_decays():
    """Log-decays far beyond float32's exponent range inside a chunk: the factored product would overflow,
    the elementwise path keeps the result finite and exact."""
    from kernels.sse_chunk import chunk_gla_triton
    from sse_model.ops.gla import recurrent_gla

    T, H, K, V = 48, 1, 16, 16
    q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, H, K).softmax(-1), torch.randn(1, T, H, V)
    g = -torch.rand(1, T, H, K) * 40  # ~20 nats per step: e^(sum) underflows within a chunk of 16
    leaves = [x.requires_grad_() for x in (q, k, v, g)]
    o, _ = chunk_gla_triton(*(x.to(DEVICE) for x in leaves), chunk_size=16)
    ref, _ = recurrent_gla(*(x.double() for x in leaves))
    assert torch.isfinite(o).all()
    assert_close(o.cpu(), ref, torch.float32, "output")
    grads = torch.autograd.grad(o.sum(), leaves)
    ref_grads = torch.autograd.grad(ref.sum(), leaves)
    for name, a, b in zip("qkvg", grads, ref_grads):
        assert torch.isfinite(a).all()
        assert_close(a.cpu(), b, torch.float32, f"gradient of {name}")


# ----------------------------------------------------------------------------------------------------------
# fused elementwise stages against their PyTorch definitions


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,T", [(128, 37), (96, 37), (1000, 37), (128, 201)])
def test_rms_norm_kernel_matches_reference(gated, dtype, D, T):
    """111 rows: one row per program (a decode step's shape); 603 rows: two per program, the last one short."""
    from kernels.fused import rms_norm_triton
    from sse_model.ops.fused import rms_norm

    x = torch.randn(3, T, D).to(dtype)
    gate = torch.randn(3, T, D).to(dtype) if gated else None
    weight = torch.rand(D) + 0.5
    dy = torch.randn(3, T, D)
    leaves_ref = [t.detach().double().requires_grad_() for t in (x, weight) + ((gate,) if gated else ())]
    ref = rms_norm(leaves_ref[0], leaves_ref[1], 1e-6, leaves_ref[2] if gated else None)
    grads_ref = torch.autograd.grad((ref * dy.double()).sum(), leaves_ref)
    leaves = [t.detach().to(DEVICE).requires_grad_() for t in (x, weight) + ((gate,) if gated else ())]
    out = rms_norm_triton(leaves[0], leaves[1], 1e-6, leaves[2] if gated else None)
    assert out.dtype == dtype
    grads = torch.autograd.grad((out.float() * dy.to(DEVICE)).sum(), leaves)
    tol = torch.float32 if dtype == torch.float32 else torch.bfloat16
    assert_close(out.float().cpu(), ref, tol, "output")
    for name, a, b in zip(["x", "weight", "gate"], grads, grads_ref):
        assert_close(a.float().cpu(), b, tol, f"gradient of {name}")


@pytest.mark.parametrize("gated", [False, True])
def test_rms_norm_kernel_writes_the_compute_dtype(gated):
    """Under autocast a float32 residual stream is normalised into bfloat16 in the same pass: the output is the
    float32 result rounded once, the input gradient float32 from a bfloat16 output gradient."""
    from kernels.fused import rms_norm_triton
    from sse_model.ops.fused import rms_norm

    D = 96
    x, weight = torch.randn(4, 21, D), torch.rand(D) + 0.5
    gate = torch.randn(4, 21, D) if gated else None
    dy = torch.randn(4, 21, D).to(torch.bfloat16)
    leaves_ref = [t.detach().clone().requires_grad_() for t in (x, weight) + ((gate,) if gated else ())]
    ref = rms_norm(leaves_ref[0], leaves_ref[1], 1e-6, leaves_ref[2] if gated else None, torch.bfloat16)
    assert ref.dtype == torch.bfloat16
    grads_ref = torch.autograd.grad(ref, leaves_ref, dy)
    leaves = [t.detach().to(DEVICE).requires_grad_() for t in (x, weight) + ((gate,) if gated else ())]
    out = rms_norm_triton(leaves[0], leaves[1], 1e-6, leaves[2] if gated else None, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out, leaves, dy.to(DEVICE))
    assert_close(out.float().cpu(), ref.float(), torch.bfloat16, "output")
    for name, a, b in zip(["x", "weight", "gate"], grads, grads_ref):
        assert a.dtype == torch.float32
        assert_close(a.cpu(), b, torch.float32, f"gradient of {name}")


def test_norm_output_follows_autocast():
    from sse_model.modules import GatedRMSNorm, RMSNorm

    x = torch.randn(2, 5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert RMSNorm(64)(x).dtype == torch.bfloat16
        assert GatedRMSNorm(64)(x, x).dtype == torch.bfloat16
    assert RMSNorm(64)(x).dtype == torch.float32


@pytest.mark.parametrize("q_act,k_act", [("silu", "softmax"), ("identity", "silu"), ("softmax", "identity")])
@pytest.mark.parametrize("lora_side", ["sparse", "shared"])
def test_sse_features_kernel_matches_reference(q_act, k_act, lora_side):
    from kernels.fused import sse_features_triton
    from sse_model.ops.fused import sse_features

    shape = (2, 19, 3, 32)
    ins = [torch.randn(shape) for _ in range(6)]
    options = dict(lora_side=lora_side, q_activation=q_act, k_activation=k_act, normalizer=16.0)
    dys = [torch.randn(shape) for _ in range(6)]
    leaves_ref = [t.double().requires_grad_() for t in ins]
    ref = sse_features(*leaves_ref, **options)
    grads_ref = torch.autograd.grad(sum((r * d.double()).sum() for r, d in zip(ref, dys)), leaves_ref)
    leaves = [t.to(DEVICE).requires_grad_() for t in ins]
    out = sse_features_triton(*leaves, **options)
    grads = torch.autograd.grad(sum((o * d.to(DEVICE)).sum() for o, d in zip(out, dys)), leaves)
    for name, a, b in zip(["q sh", "k sh", "g sh", "q sp", "k sp", "g sp"], out, ref):
        assert_close(a.cpu(), b, torch.float32, f"output {name}")
    for name, a, b in zip(["q", "q lora", "k", "k lora", "gk shared", "gk sparse"], grads, grads_ref):
        assert_close(a.cpu(), b, torch.float32, f"gradient of {name}")


def test_sse_features_kernel_reads_column_slices():
    """q and k as column slices of one wider projection (how the SSE layer computes them in training) are read
    in place: outputs and the gradient of the whole projection equal the reference on the same slices."""
    from kernels.fused import sse_features_triton
    from sse_model.ops.fused import sse_features

    B, T, H, K = 2, 19, 3, 32
    proj = torch.randn(B, T, 3 * H * K + 16)  # q, k, v and a narrow map, as in the layer
    rest = [torch.randn(B, T, H, K) for _ in range(4)]
    options = dict(lora_side="sparse", q_activation="silu", k_activation="softmax", normalizer=16.0)
    dys = [torch.randn(B, T, H, K) for _ in range(6)]

    def run(fn, proj, rest):
        q, k = (proj[..., i * H * K:(i + 1) * H * K].view(B, T, H, K) for i in (0, 1))
        out = fn(q, rest[0], k, rest[1], rest[2], rest[3], **options)
        return out, torch.autograd.grad(sum((o * d.to(o)).sum() for o, d in zip(out, dys)), [proj, *rest])

    ref, grads_ref = run(sse_features, proj.double().requires_grad_(), [t.double().requires_grad_() for t in rest])
    out, grads = run(sse_features_triton, proj.to(DEVICE).requires_grad_(),
                     [t.to(DEVICE).requires_grad_() for t in rest])
    for a, b in zip(out, ref):
        assert_close(a.cpu(), b, torch.float32, "output")
    for name, a, b in zip(["projection", "q lora", "k lora", "gk shared", "gk sparse"], grads, grads_ref):
        assert_close(a.cpu(), b, torch.float32, f"gradient of {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_act,k_act,lora_side", [("silu", "softmax", "sparse"), ("identity", "silu", "shared")])
def test_sse_low_rank_features_kernel_matches_reference(q_act, k_act, lora_side, dtype):
    """The training prologue from the layer's first product (q, k and the four rank-r inputs as column slices of
    it, in ``dtype``, the weights float32 as autocast leaves them; ranks that are not powers of two; biases on the
    gates only): outputs and the gradients of the product, the four weights and the two biases against float64."""
    from kernels.fused import sse_low_rank_features_triton
    from sse_model.ops.fused import sse_low_rank_features

    B, T, H, K, RQ, RG = 2, 19, 3, 32, 24, 8
    sizes = [H * K, H * K, H * K, RQ, RQ, RG, RG]  # q, k, v, then the low-rank inputs
    proj = torch.randn(B, T, sum(sizes))
    ups = [(torch.randn(H * K, r) / r**0.5, torch.randn(H * K) if gate else None)
           for r, gate in ((RQ, False), (RQ, False), (RG, True), (RG, True))]
    options = dict(lora_side=lora_side, q_activation=q_act, k_activation=k_act, normalizer=16.0)
    dys = [torch.randn(B, T, H, K) for _ in range(6)]

    def run(fn, proj, ups):
        q, k, _, *low = proj.split(sizes, dim=-1)
        out = fn(q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), low, ups, **options)
        leaves = [proj, *(t for pair in ups for t in pair if t is not None)]
        return out, torch.autograd.grad(sum((o * d.to(o)).sum() for o, d in zip(out, dys)), leaves)

    ref, grads_ref = run(sse_low_rank_features, proj.double().requires_grad_(),
                         [tuple(None if t is None else t.double().requires_grad_() for t in pair) for pair in ups])
    out, grads = run(sse_low_rank_features_triton, proj.to(DEVICE, dtype).requires_grad_(),
                     [tuple(None if t is None else t.to(DEVICE).requires_grad_() for t in pair) for pair in ups])
    for name, a, b in zip(["q sh", "k sh", "g sh", "q sp", "k sp", "g sp"], out, ref):
        assert a.dtype == dtype
        assert_close(a.float().cpu(), b, dtype, f"output {name}")
    names = ["projection", "lora q weight", "lora k weight", "gate weight", "gate bias", "gate weight", "gate bias"]
    for name, a, b in zip(names, grads, grads_ref):
        assert a.dtype == (dtype if name == "projection" else torch.float32)
        assert_close(a.float().cpu(), b, dtype, f"gradient of {name}")


def test_sse_low_rank_features_kernel_keeps_the_rank_r_inputs_for_its_backward():
    """What autograd keeps for the training prologue: q, k, the rank-r inputs and the weights, not the four
    full-width products of the low-rank maps (0.56 GiB in an SSE layer of the 2B shape at 32k tokens)."""
    from kernels.fused import sse_low_rank_features_triton

    B, T, H, K, R = 1, 64, 4, 32, 8
    q, k = (torch.randn(B, T, H, K, device=DEVICE, requires_grad=True) for _ in range(2))
    low = [torch.randn(B, T, R, device=DEVICE, requires_grad=True) for _ in range(4)]
    ups = [(torch.randn(H * K, R, device=DEVICE, requires_grad=True), None) for _ in range(4)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = sse_low_rank_features_triton(q, k, low, ups, lora_side="sparse", q_activation="silu",
                                           k_activation="softmax", normalizer=16.0)
    assert out is not None
    full = B * T * H * K
    assert sum(saved) == 2 * full + 4 * B * T * R + 4 * H * K * R  # before: q, k and the four products (6 x full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,D", [(5, 96), (300, 1500)])  # one row per program; several, and column blocks
def test_silu_mul_kernel_reads_column_slices(dtype, rows, D):
    """The SwiGLU activation of generation from the packed gate/up product's two halves, read in place."""
    from kernels.fused import silu_mul_triton
    from sse_model.ops.fused import silu_mul

    gate_up = torch.randn(rows, 2 * D)
    ref = silu_mul(*gate_up.double().split(D, dim=-1))
    with torch.no_grad():
        out = silu_mul_triton(*gate_up.to(DEVICE, dtype).split(D, dim=-1))
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close(out.float().cpu(), ref, dtype, "silu(gate) * up")
    assert silu_mul_triton(gate_up.requires_grad_(), gate_up) is None  # training keeps PyTorch's (autograd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,N,K", [(3, 40, 70), (16, 300, 130), (37, 20, 600)])  # K over several tiles
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
def test_skinny_linear_matches_reference(dtype, rows, N, K, bias, residual):
    """Few-row products from a column slice of a wider tensor (as a packed product leaves it), with bias and the
    residual added in the epilogue; N and K not multiples of the tiles."""
    from kernels.skinny import skinny_linear

    x = torch.randn(rows, 1, K + 9)[..., 5:K + 5]
    w, b, r = torch.randn(N, K) / K**0.5, torch.randn(N), torch.randn(rows, 1, N)
    ref = x.double() @ w.double().T + (b.double() if bias else 0) + (r.double() if residual else 0)
    dev = [t.to(DEVICE, dtype) for t in (x, w, b, r)]
    out = skinny_linear(dev[0], dev[1], dev[2] if bias else None, dev[3] if residual else None)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close(out.float().cpu(), ref, dtype, "x @ w.T + b + r")


def test_skinny_dispatch_serves_generation_only():
    """The dispatch point sends few-row bf16 products without autograd to the kernel (equal to F.linear + residual
    within bf16 rounding; a float32 residual summed in float32) and everything else to PyTorch: gradients, float32,
    too many rows."""
    from kernels.skinny import SERVED_ROWS, skinny_linear_op

    x, w, r = (torch.randn(4, 64).to(DEVICE, torch.bfloat16), torch.randn(48, 64).to(DEVICE, torch.bfloat16),
               torch.randn(4, 48).to(DEVICE, torch.bfloat16))
    out = skinny_linear_op(x, w, None, r)
    assert_close(out.float().cpu(), (r.double() + x.double() @ w.double().T).cpu(), torch.bfloat16, "served")
    assert skinny_linear_op(x.float(), w.float()) is None
    assert skinny_linear_op(x.repeat(SERVED_ROWS, 1), w) is None
    assert skinny_linear_op(x, w, None, r[:, :5]) is None
    wide = torch.randn(4, 48).to(DEVICE) * 1e3  # a float32 residual stream: the sum is written in float32
    out = skinny_linear_op(x, w, None, wide)
    assert out.dtype == torch.float32
    assert_close(out.cpu(), (wide.double() + x.double() @ w.double().T).cpu().float(), torch.float32, "wide")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_act,k_act,v_act,lora_side", [("silu", "softmax", "silu", "sparse"),
                                                         ("identity", "silu", "identity", "shared")])
@pytest.mark.parametrize("rows", [5, 37])  # one program per head, and three (the last one short)
def test_sse_decode_features_kernel_matches_reference(dtype, q_act, k_act, v_act, lora_side, rows):
    """A decode step's prologue from the layer's first product (q, k, v and the four low-rank inputs as column
    slices of it, as the packed product leaves them), ranks that are not powers of two, K != V."""
    from kernels.fused import sse_decode_features_triton
    from sse_model.ops.fused import sse_decode_features

    H, K, V, RQ, RG = 3, 32, 16, 24, 8
    sizes = [H * K, H * K, H * V, RQ, RQ, RG, RG]
    proj = torch.randn(rows, 1, sum(sizes))
    ups = [(torch.randn(H * K, r) / r**0.5, torch.randn(H * K) if gate else None)
           for r, gate in ((RQ, False), (RQ, False), (RG, True), (RG, True))]
    options = dict(lora_side=lora_side, q_activation=q_act, k_activation=k_act, v_activation=v_act, normalizer=16.0)

    def run(fn, proj, ups):
        q, k, v, *low = proj.split(sizes, dim=-1)
        return fn(q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (H, V)), low, ups, **options)

    ref = run(sse_decode_features, proj.double(), [(w.double(), None if b is None else b.double()) for w, b in ups])
    with torch.no_grad():
        out = run(sse_decode_features_triton, proj.to(DEVICE, dtype),
                  [(w.to(DEVICE, dtype), None if b is None else b.to(DEVICE, dtype)) for w, b in ups])
    assert out is not None
    for name, a, b in zip(["q sh", "k sh", "g sh", "q sp", "k sp", "g sp", "v"], out, ref):
        assert a.shape == b.shape and a.dtype == dtype
        assert_close(a.float().cpu(), b, dtype, f"output {name}")


def test_sse_decode_features_kernel_declines_autograd():
    from kernels.fused import sse_decode_features_triton

    q = torch.randn(2, 1, 2, 16, requires_grad=True)
    ups = [(torch.randn(32, 16), None), (torch.randn(32, 16), None), (torch.randn(32, 16), torch.randn(32)),
           (torch.randn(32, 16), torch.randn(32))]
    assert sse_decode_features_triton(q, q, q, [torch.randn(2, 1, 16)] * 4, ups, lora_side="sparse",
                                      q_activation="silu", k_activation="softmax", v_activation="silu",
                                      normalizer=16.0) is None


PLAN_CASES = [  # sequence lengths, N, Kw, Kr, chunk
    ([5, 35, 1, 49], 4, 1, 1, 16),
    ([37, 33], 4, 2, 2, 16),
    ([50], 3, 1, 3, 16),
    ([20, 13], 4, 4, 4, 16),  # K = N
    ([0, 7, 0, 30, 3], 8, 1, 1, 16),  # empty sequences, partitions that receive no token
    ([7] * 300, 4, 2, 1, 16),  # more sequences than one block of the segment pass
    ([1500, 700], 6, 1, 2, 4),  # several token blocks, more chunk ids than one block
    ([900, 400], 64, 1, 1, 16),  # N = 64: eleven token blocks of the partition counts
]


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: f"S{len(c[0])}-N{c[1]}-K{c[2]}{c[3]}-C{c[4]}")
def test_plan_kernels_match_the_pytorch_builders(case):
    """``kernels/plan.py`` builds exactly what ``VarlenPlan.build`` and ``ChunkPlan.build`` define (plus each
    pair's source index and masks), for SSE and for plain GLA."""
    from kernels.plan import build_plans, build_plans_reference

    lengths, N, Kw, Kr, chunk = case
    L = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    topk = route(torch.randn(L, N), Kw, Kr).topk
    for args in ((cu, L, topk, N, Kw, Kr, chunk), (cu, L, None, 0, 1, 1, chunk)):
        want_tables, want_pairs = build_plans_reference(*args)
        got_tables, got_pairs = build_plans(*(x.to(DEVICE) if torch.is_tensor(x) else x for x in args))
        for name, want in want_tables.items():
            got = got_tables[name]
            assert (got is None) == (want is None), name
            assert want is None or (got.dtype == want.dtype and torch.equal(got.cpu(), want)), name
        assert (got_pairs is None) == (want_pairs is None)
        if want_pairs is not None:
            (got_plan, *got_rest), (want_plan, *want_rest) = got_pairs, want_pairs
            for name in ("token", "partition", "cu_seqlens", "position"):
                got, want = getattr(got_plan, name), getattr(want_plan, name)
                assert got.dtype == want.dtype and torch.equal(got.cpu(), want), name
            for name, got, want in zip(("tok32", "source", "write", "read"), got_rest, want_rest):
                assert got.dtype == want.dtype and torch.equal(got.cpu(), want), name


# ----------------------------------------------------------------------------------------------------------
# gradient checkpointing keeps the chunk kernels' forward


@pytest.mark.parametrize("keep", [True, False])
def test_checkpointing_keeps_the_chunk_forward(monkeypatch, keep):
    """With ``checkpointing_keeps_linear_attention`` a checkpointed SSE / GLA block runs the chunk forward once
    per step (its outputs kept for the backward), not twice; the chunk plans are built once per step either
    way; the gradients are those of a run without checkpointing."""
    from kernels import sse_chunk
    from kernels.backend import linear_op
    from sse_model import SSEConfig, SSEForCausalLM
    from sse_model.ops import dispatch

    monkeypatch.setattr(dispatch, "_BACKENDS", [])
    dispatch.register_backend(dispatch.Backend(  # the chunk kernels for CPU tensors (Triton's interpreter)
        "chunk-kernels", lambda x: True, linear_op, sse=sse_chunk.sse_chunk_triton))
    calls, plans = [], []
    forward, build = sse_chunk._forward, sse_chunk.build_plans
    monkeypatch.setattr(sse_chunk, "_forward", lambda *a: calls.append(1) or forward(*a))
    monkeypatch.setattr(sse_chunk, "build_plans", lambda *a, **k: plans.append(1) or build(*a, **k))
    config = SSEConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, mixer_types=["sse", "gla"],
                       num_heads=2, head_dim=16, num_attention_heads=2, intermediate_size=64,
                       checkpointing_keeps_linear_attention=keep)
    torch.manual_seed(0)
    model = SSEForCausalLM(config).train()
    ids = torch.randint(0, 61, (2, 40))

    def grads():
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    assert len(calls) == 2 and len(plans) == 2
    calls.clear(), plans.clear()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = grads()
    assert len(calls) == (2 if keep else 4) and len(plans) == 2
    for a, b in zip(checkpointed, plain):
        assert_close(a, b, torch.float32, "gradient under checkpointing")


@pytest.mark.parametrize("features_too", [False, True])
def test_a_models_sse_backward_head_groups_reach_the_kernels_and_keep_its_gradients(monkeypatch, features_too):
    """``SSEConfig.sse_backward_head_groups`` under checkpointing that keeps the chunk forward: the backward makes
    the states again, a group of heads at a time (two groups a layer call, the first group's freed before the
    second's are made), and the model's gradients are those of the backward that keeps them; a count that does
    not divide the heads is refused naming the setting. ``features_too``: with the feature map's kernel, which
    SSE then takes in one function (``sse_low_rank_attention``) whose backward makes each group's features again
    (the forward's not kept, a group's freed before the next's), each group an SSE call of its own heads."""
    import weakref

    from kernels import sse_chunk
    from kernels.backend import linear_op
    from kernels.fused import sse_low_rank_features_triton
    from sse_model import SSEConfig, SSEForCausalLM
    from sse_model.ops import dispatch

    monkeypatch.setattr(dispatch, "_BACKENDS", [])
    fused = dict(sse_low_rank=sse_chunk.sse_low_rank_chunk_triton,
                 sse_low_rank_features=sse_low_rank_features_triton) if features_too else {}
    dispatch.register_backend(dispatch.Backend(
        "chunk-kernels", lambda x: True, linear_op, sse=sse_chunk.sse_chunk_triton, **fused))
    features_of, made_features = sse_chunk._features, []

    def features_one_group_at_a_time(*args):
        assert all(ref() is None for ref in made_features), "the forward's or the previous group's features are alive"
        out = features_of(*args)
        made_features.extend(weakref.ref(x) for x in out[0])
        return out

    monkeypatch.setattr(sse_chunk, "_features", features_one_group_at_a_time)
    rebuilt, made = [], []
    states, walk_dh = sse_chunk._states, sse_chunk._bwd_dh
    dh_at = walk_dh.arg_names.index("dh")

    def one_group_at_a_time(*args):
        assert all(ref() is None for ref in made), "the previous group's states or state gradients are still alive"
        rebuilt.append(args[-2:])
        h = states(*args)
        made.append(weakref.ref(h))
        return h

    class RecordingStateGradients:  # the state-gradient walk's launches, recording the buffer they fill
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                made.append(weakref.ref(args[dh_at]))
                return walk_dh[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(sse_chunk, "_states", one_group_at_a_time)
    monkeypatch.setattr(sse_chunk, "_bwd_dh", RecordingStateGradients())
    settings = dict(vocab_size=61, hidden_size=32, num_hidden_layers=1, mixer_types=["sse"], num_heads=2,
                    head_dim=16, num_attention_heads=2, intermediate_size=64, checkpointing_keeps_linear_attention=True)
    ids = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(0))
    grads = []
    for groups in (1, 2):
        torch.manual_seed(0)
        model = SSEForCausalLM(SSEConfig(**settings, sse_backward_head_groups=groups)).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    groups = [(0, 1), (0, 1)] if features_too else [(0, 1), (1, 1)]  # an SSE call of each group's heads, or offsets
    assert rebuilt == groups, "one state pass per group of one head, in the second model only"
    assert len(made_features) == (6 * 3 if features_too else 0), "the forward's features, then each group's"
    for a, b in zip(*grads):
        assert_close(a, b, torch.float32, "gradient with the states made again by head groups")
    with pytest.raises(ValueError, match="sse_backward_head_groups \\(3\\) must divide num_heads \\(2\\)"):
        SSEForCausalLM(SSEConfig(**settings, sse_backward_head_groups=3))


def test_count_ops_takes_the_kernel_path_and_restores_it():
    """``benchmarks/kernels/count_ops.py`` counts the host's work of the CUDA code path on CPU: the SSE block must
    reach the chunk kernels (their launch counters) and the real kernels must be back afterwards."""
    import collections

    from kernels import sse_chunk
    from benchmarks.kernels.count_ops import count, kernels_on_cpu, split
    from sse_model.ops import dispatch

    backends = list(dispatch._BACKENDS)
    launches = collections.Counter()
    with kernels_on_cpu(launches):
        attn = count("attn", launches)
        sse = count("sse", launches)
    assert launches["_fwd_h"] >= 1 and launches["_bwd_dqkg"] >= 2
    assert sse["forward_launches"] > attn["forward_launches"]
    assert split(sse["forward"])[0] > split(attn["forward"])[0]
    assert isinstance(sse_chunk._fwd_h, triton.runtime.jit.KernelInterface)
    assert dispatch._BACKENDS == backends


def test_token_rows_reads_column_slices_in_place():
    """A decode step's q/k/v are column slices of one product, viewed as heads; a token dimension of size 1 gets any
    stride from ``view`` (here H * K, not the product's width), which once made every decode step copy them."""
    from kernels.fused import _token_rows

    out = torch.randn(8, 1, 7200)
    q = out[..., :2304].view(8, 1, 18, 128)
    assert q.stride()[:2] == (7200, 2304)
    for x, dims in ((q, 2), (out[..., 6912:6976], 1), (out[:, 0, :2304].view(8, 18, 128), 2)):
        rows, stride = _token_rows(x, dims)
        assert rows.data_ptr() == x.data_ptr() and stride == 7200
    strided = torch.randn(4, 6, 10)[:, ::2, :5]  # rows 20 apart: still evenly spaced
    assert _token_rows(strided, 1)[1] == 20
    uneven = torch.randn(4, 6, 10)[:, :3, :5]  # 4 x 3 rows, 10 apart within a group, 60 between groups
    rows, stride = _token_rows(uneven, 1)
    assert rows.data_ptr() != uneven.data_ptr() and stride == 5 and torch.equal(rows, uneven)


def test_real_shapes_sweep_covers_the_shapes_of_real_checkpoints():
    """``benchmarks/kernels/real_shapes.py`` (run on a GPU, ``docs/real_shapes.md``) checks every kernel family at the
    head dims, head counts, dtypes and routing sizes real checkpoints have, and each named model's exact shape."""
    from benchmarks.kernels.real_shapes import CHECKS, HEAD_DIMS, MODELS, groups

    every = groups()
    assert {family for family, _, _ in every} == set(CHECKS)
    chunk = [kw for family, _, kw in every if family == "chunk"]
    assert set(HEAD_DIMS) == {64, 80, 96, 128, 256} <= {kw["D"] for kw in chunk}
    assert {3, 9, 14, 16, 32} <= {kw["H"] for kw in chunk}
    assert {(kw["N"], kw["K"]) for kw in chunk} >= {(4, 1), (4, 2), (16, 1), (16, 2)}
    assert {kw["dtype"] for kw in chunk} == {"bfloat16", "float32"}
    attention = {(kw["H"], kw["H_kv"], kw["D"]) for family, _, kw in every if family == "attention"}
    for name, (H, H_kv, D, *_) in MODELS.items():
        assert (H, H_kv, D) in attention and any(n.endswith(name) for _, n, _ in every), name
    assert len({name for _, name, _ in every}) == len(every)  # each child's rows are told apart by its name
