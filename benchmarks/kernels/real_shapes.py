"""Every Triton kernel of the model and the rollout engine against its PyTorch reference at the shapes real
checkpoints have: head dims 64, 80, 96, 128 and 256; 3 to 32 heads with 1 to 8 KV heads; bf16 and float32;
packed batches mixing sequences of 1, 63, 64, 65 and 4,097 tokens; N in {4, 16}, K in {1, 2}; and the exact
shapes of SmolLM2-135M, Qwen2.5-0.5B / 1.5B, Llama-3.2-1B and the paper's 2B model.

Each group of checks runs in a child process, so a kernel that crashes the GPU context (an illegal memory
access) costs its own rows only and is reported as a crash; ``--sanitize`` runs the children under
compute-sanitizer (memcheck), which also catches out-of-range accesses that happen not to crash. A kernel
that cannot serve a shape must decline (the dispatch point then runs the PyTorch op): such rows say
"declined" and check that it does. Prints one table; ``--markdown`` writes it to a file as well.

    python -m benchmarks.kernels.real_shapes [--only chunk decode ...] [--match D=64 smollm2 ...] [--groups NAME ...]
        [--sanitize] [--jobs 8] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
import torch.nn.functional as F

# name: heads, KV heads, head dim, hidden, MLP width, vocabulary (from each model's config.json)
MODELS = {
    "smollm2-135m": (9, 3, 64, 576, 1536, 49152),
    "qwen2.5-0.5b": (14, 2, 64, 896, 4864, 151936),
    "qwen2.5-1.5b": (12, 2, 128, 1536, 8960, 151936),
    "llama-3.2-1b": (32, 8, 64, 2048, 8192, 128256),
    "sse-h-2b": (18, 18, 128, 2304, 6144, 151936),
}
HEAD_DIMS = (64, 80, 96, 128, 256)
HEADS = ((3, 1), (9, 3), (14, 2), (16, 8), (32, 8))  # (heads, KV heads)
LENGTHS = (1, 63, 64, 65, 4097)  # one packed batch: chunk edges on both sides and a long row
TOL = {"float32": 1e-4, "bfloat16": 3e-2}
HEAVY_STATE = 2**21  # floats of one sequence's chunk states above which a check's reference needs the GPU to itself  # as tests/gpu/test_kernels_gpu.py; gradients get 4x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def row(kernel: str, shape: str, dtype: str, out: float, grad: float | None = None, tol: float | None = None,
        status: str | None = None) -> dict:
    tol = TOL[dtype] if tol is None else tol
    ok = out < tol and (grad is None or grad < 4 * tol)
    return dict(kernel=kernel, shape=shape, dtype=dtype, out=out, grad=grad, tol=tol,
                status=status or ("ok" if ok else "WRONG"))


# ------------------------------------------------------------------------------------------------------------
# the checks (each yields rows)


def _cu(lengths=LENGTHS) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)


def _gla_side(T: int, H: int, D: int):
    return [torch.randn(1, T, H, D, device="cuda"), torch.randn(1, T, H, D, device="cuda").softmax(-1),
            F.logsigmoid(torch.randn(1, T, H, D, device="cuda")) / 16]


def check_chunk(H: int, D: int, dtype: str, N: int, K: int):
    """SSE (and, at N = 4, GLA) chunk kernels, forward and backward, states in and out, against the PyTorch
    chunked ops in float32."""
    from kernels.sse_chunk import chunk_gla_triton, sse_chunk_triton
    from sse_model.ops.dispatch import torch_linear_op
    from sse_model.ops.sse import Branch, SSEOptions, route, sse_varlen

    dt = getattr(torch, dtype)
    cu = _cu()
    T, S = int(cu[-1]), cu.numel() - 1
    leaves = _gla_side(T, H, D) + _gla_side(T, H, D) + [torch.randn(1, T, H, D, device="cuda"),
                                                        torch.randn(1, T, N, device="cuda"),
                                                        torch.randn(S, 1 + N, H, D, D, device="cuda") * 0.1]
    ref_op = torch_linear_op("gla", "chunk", chunk_size=64)

    def sse(xs, ref):
        shared, sparse, v, r = Branch(*xs[:3]), Branch(*xs[3:6]), xs[6], route(xs[7], K, K)
        kw = dict(initial_state=xs[8], output_final_state=True, cu_seqlens=cu)
        if ref:
            return sse_varlen(shared, sparse, v, r, SSEOptions(), ref_op, **kw)
        return sse_chunk_triton(shared, sparse, v, r, SSEOptions(), **kw)

    def gla(xs, ref):
        op = ref_op if ref else chunk_gla_triton
        return op(xs[0], xs[1], xs[6], xs[2], initial_state=xs[8][:, 0], output_final_state=True, cu_seqlens=cu)

    def run(fn, ref):
        xs = [(x.float() if ref else x.to(dt) if i < 7 else x).requires_grad_() for i, x in enumerate(leaves)]
        o, s = fn(xs, ref)
        torch.manual_seed(1)
        do, ds = torch.randn_like(o, dtype=torch.float32), torch.randn_like(s, dtype=torch.float32)
        used = [x for x in xs if x.requires_grad]
        grads = torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), used, allow_unused=True)
        return o, s, [g for g in grads if g is not None]

    shape = f"H={H} D={D} N={N} K={K}"
    for name, fn in (("sse chunk", sse), ("gla chunk", gla)) if N == 4 and K == 1 else (("sse chunk", sse),):
        o, s, g = run(fn, False)
        o_ref, s_ref, g_ref = run(fn, True)
        grad = max(rel(a, b) for a, b in zip(g, g_ref))
        yield row(f"{name} fwd+bwd", shape, dtype, max(rel(o, o_ref), rel(s, s_ref)), grad)


def check_decode(H: int, D: int, N: int, K: int):
    """The SSE decode step (state pool updated in place) and the GLA / gated-delta-rule decode steps."""
    from kernels.decode import linear_decode_triton, sse_decode_triton
    from sse_model.ops.delta_rule import gated_delta_step
    from sse_model.ops.gla import gla_step
    from sse_model.ops.sse import Branch, SSEOptions, route, sse_decode_step

    B = 48
    bf = torch.bfloat16

    def side(gdn=False):
        q, k = torch.randn(B, H, D, device="cuda", dtype=bf), torch.randn(B, H, D, device="cuda").softmax(-1).to(bf)
        if gdn:
            return Branch(q, k, -torch.rand(B, H, device="cuda") * 0.1, torch.rand(B, H, device="cuda").to(bf))
        return Branch(q, k, (F.logsigmoid(torch.randn(B, H, D, device="cuda")) / 16).to(bf))

    v = torch.randn(B, H, D, device="cuda", dtype=bf)
    slots = torch.randperm(B + 5, device="cuda")[:B]
    shared, sparse = side(), side()
    r = route(torch.randn(B, N, device="cuda"), K, K)
    pool = torch.randn(B + 5, 1 + N, H, D, D, device="cuda")
    want_pool = pool.clone()
    want = sse_decode_step(want_pool, slots, shared, sparse, v, r, SSEOptions())
    got = sse_decode_triton(pool, slots, shared, sparse, v, r, SSEOptions())
    yield row("sse decode", f"H={H} D={D} N={N} K={K}", "bfloat16", max(rel(got, want), rel(pool, want_pool)), tol=1e-5)
    if N == 4 and K == 1:
        for transition in ("gla", "gdn"):
            b = side(transition == "gdn")
            pool = torch.randn(B + 5, H, D, D, device="cuda")
            want_pool = pool.clone()
            scale = D**-0.5
            if transition == "gla":
                state, want = gla_step(want_pool[slots], b.q, b.k, v, b.g, scale)
            else:
                state, want = gated_delta_step(want_pool[slots], b.q, b.k, v, b.g, b.beta, scale, True)
            want_pool[slots] = state
            got = linear_decode_triton(transition, pool, slots, b.q, b.k, v, b.g, b.beta,
                                       use_qk_l2norm=transition == "gdn")
            yield row(f"{transition} decode", f"H={H} D={D}", "bfloat16", max(rel(got, want), rel(pool, want_pool)),
                      tol=1e-5)


def check_routing(N: int, K: int):
    """Router softmax + top-k, and the chunk plans of a packed batch, at N partitions and K selected."""
    from kernels.plan import build_plans, build_plans_reference
    from kernels.routing import route_triton
    from sse_model.ops.sse import route

    for dtype in ("float32", "bfloat16"):
        logits = torch.randn(len(LENGTHS) * 4096, N, device="cuda", dtype=getattr(torch, dtype))
        want, got = route(logits, K, K), route_triton(logits, K, K)
        ties_ok = torch.equal(want.probs.gather(-1, got.topk), want.probs.gather(-1, want.topk))
        yield row("routing", f"N={N} K={K}", dtype, rel(got.probs, want.probs), tol=1e-6,
                  status=None if ties_ok else "WRONG (ranking)")
    cu = _cu()
    L = int(cu[-1])
    topk = route(torch.randn(L, N, device="cuda"), K, K).topk
    want_tables, want_pairs = build_plans_reference(cu, L, topk, N, K, K, 64)
    got_tables, got_pairs = build_plans(cu, L, topk, N, K, K, 64)
    same = all(torch.equal(got_tables[n], w) for n, w in want_tables.items() if w is not None)
    same &= all(torch.equal(getattr(got_pairs[0], n), getattr(want_pairs[0], n))
                for n in ("token", "partition", "cu_seqlens", "position"))
    same &= all(torch.equal(a, b) for a, b in zip(got_pairs[1:], want_pairs[1:]))
    yield row("chunk plan", f"N={N} K={K} lengths {'/'.join(map(str, LENGTHS))}", "int32", 0.0 if same else 1.0,
              tol=0.5, status="ok (identical)" if same else "WRONG")


def check_attention(H: int, H_kv: int, D: int):
    """The engine's decode attention: RoPE + store prologue and the paged kernel, or the cache's decline."""
    from kernels.paged_attention import paged_decode_attention, rotary_store_decode
    from benchmarks.kernels.bench_paged import gather_path
    from sse_model import SSEConfig
    from pipeline.rollout.cache import SlotCache

    shape = f"H={H} H_kv={H_kv} D={D}"
    cfg = SSEConfig(hidden_size=H * D, num_heads=H, head_dim=D, num_attention_heads=H, num_key_value_heads=H_kv,
                    num_hidden_layers=1, mixer_types=["attn"], vocab_size=256)
    cache = SlotCache(cfg, max_slots=2, max_len=512, device="cuda", dtype=torch.bfloat16)
    if D & (D - 1):
        status = "declined" if not cache.decode_in_place else "WRONG (accepted)"
        yield row("paged attention + RoPE/store", shape, "bfloat16", 0.0, tol=1.0, status=status)
        return
    B, block, per_seq = 8, 256, 5
    bf = torch.bfloat16
    pool_k = torch.randn(B * per_seq + 1, H_kv, block, D, device="cuda", dtype=bf)
    pool_v = torch.randn_like(pool_k)
    tables = torch.randperm(B * per_seq, device="cuda").view(B, per_seq)  # as the engine's cache keeps them
    lengths = torch.tensor([0, 254, 255, 256, 699, 1023, 1100, 1150], device="cuda")
    slots = torch.arange(B, device="cuda")
    q, k, v = (torch.randn(B, n, D, device="cuda", dtype=bf) for n in (H, H_kv, H_kv))
    positions = lengths
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    want_k, want_v = pool_k.clone(), pool_v.clone()
    got_q = rotary_store_decode(q, k, v, positions, inv_freq, 1.0, pool_k, pool_v, tables, lengths, slots)
    angle = positions[:, None].float() * inv_freq
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]

    def rope(x):
        x = x.float()
        return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin

    want_q = rope(q)
    for b in range(B):
        i = int(lengths[b])
        blk = int(tables[b, i // block])
        want_k[blk, :, i % block] = rope(k)[b].to(bf)
        want_v[blk, :, i % block] = v[b]
    yield row("rotary_store_decode", shape, "bfloat16", max(rel(got_q, want_q), rel(pool_k, want_k), rel(pool_v, want_v)))
    got = paged_decode_attention(got_q, pool_k, pool_v, tables, lengths, slots=slots)
    group = H // H_kv
    want = gather_path(got_q, pool_k.repeat_interleave(group, 1), pool_v.repeat_interleave(group, 1), tables,
                       lengths + 1)
    yield row("paged decode attention", shape, "bfloat16", rel(got, want))


def check_fused(H: int, D: int, hidden: int, inter: int):
    """RMSNorm (plain at the hidden size, gated at the head dim), the SwiGLU activation, the SSE feature prologue
    of training (with gradients) and of decode."""
    from kernels.fused import rms_norm_triton, silu_mul_triton, sse_decode_features_triton, sse_features_triton
    from sse_model.ops import fused

    bf = torch.bfloat16

    def fwd_bwd(fn, ref_fn, ins, **kw):
        def run(f, upcast):
            xs = [t.detach().float().requires_grad_() if upcast else t.detach().requires_grad_() for t in ins]
            outs = f(*xs, **kw)
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.manual_seed(1)
            loss = sum((o.float() * torch.randn_like(o, dtype=torch.float32)).sum() for o in outs)
            return outs, torch.autograd.grad(loss, xs)
        (outs, grads), (refs, ref_grads) = run(fn, False), run(ref_fn, True)
        return max(rel(a, b) for a, b in zip(outs, refs)), max(rel(a, b) for a, b in zip(grads, ref_grads))

    x = torch.randn(2048, hidden, device="cuda", dtype=bf)
    w = torch.rand(hidden, device="cuda") + 0.5
    yield row("rms_norm fwd+bwd", f"hidden={hidden}", "bfloat16",
              *fwd_bwd(lambda a, b: rms_norm_triton(a, b, 1e-6), lambda a, b: fused.rms_norm(a, b, 1e-6), [x, w]))
    x, gate = (torch.randn(2048, H, D, device="cuda", dtype=bf) for _ in range(2))
    yield row("gated rms_norm fwd+bwd", f"H={H} D={D}", "bfloat16",
              *fwd_bwd(lambda a, b, c: rms_norm_triton(a, b, 1e-6, c), lambda a, b, c: fused.rms_norm(a, b, 1e-6, c),
                       [x, torch.rand(D, device="cuda") + 0.5, gate]))
    with torch.no_grad():
        prod = torch.randn(16, 1, 2 * inter, device="cuda", dtype=bf)
        g, u = prod.split(inter, -1)
        yield row("silu_mul", f"width={inter}", "bfloat16", rel(silu_mul_triton(g, u), fused.silu_mul(g.float(), u.float())))
    opts = dict(lora_side="sparse", q_activation="silu", k_activation="softmax", normalizer=16.0)
    ins = [torch.randn(2, 1000, H, D, device="cuda", dtype=bf) for _ in range(6)]
    yield row("sse_features fwd+bwd", f"H={H} D={D}", "bfloat16",
              *fwd_bwd(lambda *a: sse_features_triton(*a, **opts), lambda *a: fused.sse_features(*a, **opts), ins))
    sizes = [H * D, H * D, H * D, 64, 64, 16, 16]
    for rows in (1, 16):
        proj = torch.randn(rows, 1, sum(sizes), device="cuda", dtype=bf)
        ups = [(torch.randn(H * D, r, device="cuda", dtype=bf) / r**0.5,
                torch.randn(H * D, device="cuda", dtype=bf) if gated else None)
               for r, gated in ((64, False), (64, False), (16, True), (16, True))]

        def decode(fn, proj, ups):
            q, k, v, *low = proj.split(sizes, dim=-1)
            return fn(q.unflatten(-1, (H, D)), k.unflatten(-1, (H, D)), v.unflatten(-1, (H, D)), low, ups,
                      v_activation="silu", **opts)

        with torch.no_grad():
            outs = decode(sse_decode_features_triton, proj, ups)
            refs = decode(fused.sse_decode_features, proj.float(),
                          [(a.float(), None if b is None else b.float()) for a, b in ups])
        yield row("sse_decode_features", f"H={H} D={D} rows={rows}", "bfloat16",
                  max(rel(a, b) for a, b in zip(outs, refs)))


def check_generation(model: str):
    """A decode step's matrix products (few rows, the residual in the epilogue) and the one-pass sampler, at one
    model's widths and vocabulary."""
    from kernels.skinny import skinny_linear

    H, H_kv, D, hidden, inter, vocab = MODELS[model]
    products = [(hidden, (H + 2 * H_kv) * D, False), (H * D, hidden, True), (hidden, 2 * inter, False),
                (inter, hidden, True), (hidden, vocab, False)]
    for rows in (1, 8, 16):
        worst = 0.0
        for K, N, residual in products:
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
            r = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16) if residual else None
            want = x.float() @ w.float().T + (r.float() if residual else 0)
            worst = max(worst, rel(skinny_linear(x, w, residual=r), want))
        yield row("skinny products", f"{model} rows={rows}", "bfloat16", worst)
    yield from check_sampler(vocab, 64)


def check_sampler(vocab: int, B: int):
    """The one-pass sampler against the PyTorch sampler (bf16 logits): the same token in every row whose race is not
    a float tie, the same log-probability."""
    from kernels.sampling import race_sample
    from pipeline.rollout.sampling import sample, uniform_noise

    logits = (torch.randn(B, vocab, device="cuda") * 4).to(torch.bfloat16)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.2], device="cuda").repeat(B // 4)
    seeds = torch.randint(0, 2**62, (B,), device="cuda")
    steps = torch.randint(0, 32768, (B,), device="cuda")
    ones, off = torch.ones(B, device="cuda"), torch.zeros(B, dtype=torch.long, device="cuda")
    want, want_lp = sample(logits, temperature, ones, off, seeds, steps, need_filter=True)
    got, lp = race_sample(logits, temperature, seeds, steps)
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    race = torch.where(temperature[:, None] > 0, scaled - torch.log(-torch.log(uniform_noise(seeds, steps, vocab))),
                       logits.float())
    gap = (race.gather(1, want[:, None]) - race.gather(1, got[:, None])).abs()[:, 0]
    tie = (got == want) | (gap <= 1e-5 * race.abs().amax(1))
    same = got == want
    yield row("one-pass sampler (log-prob)", f"vocab={vocab} B={B}", "bfloat16",
              rel(lp[same], want_lp[same]), tol=1e-4, status=None if bool(tie.all()) else "WRONG (token)")


def check_model(model: str):
    """A converted model of ``model``'s exact shapes (random weights), each against the same model in float32 on the
    PyTorch ops, beside the PyTorch ops in bf16 (whose error is bf16's own, and sets the bound): one packed training
    step in bf16 autocast with the Triton backend (logits and every gradient), and the rollout engine's sampled
    tokens' log-probabilities (bf16 weights) beside a bf16 forward over the same tokens."""
    import copy

    from transformers import LlamaConfig

    from pipeline.rollout import Engine, SamplingParams
    from sse_model import SSEForCausalLM
    from sse_model.convert import sse_config_from_transformer

    H, H_kv, D, hidden, inter, vocab = MODELS[model]
    layers = {"smollm2-135m": 30, "qwen2.5-0.5b": 24, "qwen2.5-1.5b": 28, "llama-3.2-1b": 16}[model]
    source = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=H, num_key_value_heads=H_kv, head_dim=D, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    net = SSEForCausalLM(sse_config_from_transformer(source)).cuda().train()
    cu = _cu((700, 64, 1, 1500, 33))
    T = int(cu[-1])
    ids = torch.randint(0, vocab, (1, T), device="cuda")
    position_ids = torch.cat([torch.arange(int(b - a), device="cuda") for a, b in zip(cu[:-1], cu[1:])])[None]

    def backend(name: str):
        if name == "torch":
            os.environ["SSE_BACKEND"] = "torch"
        else:
            os.environ.pop("SSE_BACKEND", None)

    def step(name: str, bf16: bool):
        backend(name)
        net.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = net(input_ids=ids, labels=ids, position_ids=position_ids)
        out.loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in net.parameters() if p.grad is not None])
        return out.logits.detach().float(), grads

    truth, torch_bf16, triton_bf16 = step("torch", False), step("torch", True), step("triton", True)
    shape = f"{model} ({layers} layers, random weights)"
    for i, name in enumerate(("logits", "gradients")):
        bound = max(1.5 * rel(torch_bf16[i], truth[i]), 1e-3)
        yield row(f"model training step: {name} vs float32", shape, "bfloat16", rel(triton_bf16[i], truth[i]), tol=bound)
    del truth, torch_bf16, triton_bf16
    net.zero_grad(set_to_none=True)
    ref = copy.deepcopy(net).eval()
    net = net.to(torch.bfloat16).eval()
    backend("triton")
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 64, 300)]
    engine = Engine(net, None, max_slots=8, max_model_len=512, block_size=64)
    results = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=1.0, seed=0, ignore_eos=True))

    def logprobs(m, prompt, completion):
        x = torch.tensor([prompt + completion], device="cuda")
        logits = m(input_ids=x).logits[0, len(prompt) - 1:-1].float()
        return logits.log_softmax(-1).gather(-1, torch.tensor(completion, device="cuda")[:, None])[:, 0]

    err_engine, err_forward = [], []
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            completion = result.outputs[0].token_ids
            backend("torch")
            want = logprobs(ref, prompt, completion)
            backend("triton")
            err_forward.append((logprobs(net, prompt, completion) - want).abs().mean())
            err_engine.append((torch.tensor(result.outputs[0].logprobs, device="cuda") - want).abs().mean())
    bound = max(2 * float(torch.stack(err_forward).mean()), 1e-3)
    yield row("engine sampled-token log-probs vs float32 (mean abs)", shape, "bfloat16",
              float(torch.stack(err_engine).mean()), tol=bound)


# ------------------------------------------------------------------------------------------------------------
# the groups and the runner


def groups() -> list[tuple[str, str, dict]]:
    """(family, name, arguments) of every child process."""
    out = []
    for D in HEAD_DIMS:
        for H, _ in HEADS:
            for dtype in ("bfloat16", "float32"):
                out.append(("chunk", f"chunk H={H} D={D} {dtype}", dict(H=H, D=D, dtype=dtype, N=4, K=1)))
        for N, K in ((4, 2), (16, 1), (16, 2)):
            out.append(("chunk", f"chunk H=9 D={D} N={N} K={K}", dict(H=9, D=D, dtype="bfloat16", N=N, K=K)))
    for name, (H, H_kv, D, hidden, inter, vocab) in MODELS.items():
        for dtype in ("bfloat16", "float32"):
            out.append(("chunk", f"chunk {name} {dtype}", dict(H=H, D=D, dtype=dtype, N=4, K=1)))
    for D in HEAD_DIMS:
        for N, K in ((4, 1), (16, 2)):
            out.append(("decode", f"decode D={D} N={N} K={K}", dict(H=9, D=D, N=N, K=K)))
    for N, K in ((4, 1), (4, 2), (16, 1), (16, 2)):
        out.append(("routing", f"routing N={N} K={K}", dict(N=N, K=K)))
    for D in HEAD_DIMS:
        for H, H_kv in HEADS:
            out.append(("attention", f"attention H={H}/{H_kv} D={D}", dict(H=H, H_kv=H_kv, D=D)))
    for name, (H, H_kv, D, hidden, inter, vocab) in MODELS.items():
        out.append(("attention", f"attention {name}", dict(H=H, H_kv=H_kv, D=D)))
        out.append(("fused", f"fused {name}", dict(H=H, D=D, hidden=hidden, inter=inter)))
        out.append(("generation", f"generation {name}", dict(model=name)))
    for D in (80, 96, 256):
        out.append(("fused", f"fused D={D}", dict(H=9, D=D, hidden=9 * D, inter=1536)))
    for name in ("smollm2-135m", "qwen2.5-0.5b"):
        out.append(("model", f"model {name}", dict(model=name)))
    return out


CHECKS = {"chunk": check_chunk, "decode": check_decode, "routing": check_routing, "attention": check_attention,
          "fused": check_fused, "generation": check_generation, "model": check_model}


def child(family: str, kwargs: dict) -> None:
    import kernels

    kernels.register()
    torch.manual_seed(0)
    for r in CHECKS[family](**kwargs):
        print("ROW " + json.dumps(r), flush=True)


def run_group(family: str, name: str, kwargs: dict, sanitize: bool) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.kernels.real_shapes", "--child", family, json.dumps(kwargs)]
    if sanitize:
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "3", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    text = done.stdout + done.stderr
    problem = next((line.strip(" =") for line in text.splitlines()
                    if "Out-of-range" in line or "Invalid __" in line or "illegal memory access" in line), None)
    if sanitize and "ERROR SUMMARY: 0 errors" not in text:
        problem = problem or "compute-sanitizer reported errors"
    if done.returncode != 0 or problem:
        lines = [line for line in text.strip().splitlines() if "Error" in line or "error" in line]
        tail = problem or (lines or text.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        status = "OOM" if "out of memory" in text else f"CRASH: {tail[:120]}"
        rows.append(dict(kernel=name, shape="", dtype="", out=float("nan"), grad=None, tol=0.0, status=status,
                         log="\n".join(text.strip().splitlines()[-25:])))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| kernel | shape | dtype | rel. error (output) | rel. error (worst gradient) | tolerance | result |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        grad = "" if r["grad"] is None else f"{r['grad']:.1e}"
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['out']:.1e} | {grad} | {r['tol']:.0e} "
                     f"| {r['status']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="families to run (default: all)")
    parser.add_argument("--match", nargs="*", help="only groups whose name contains one of these")
    parser.add_argument("--groups", nargs="*", help="only the groups of these exact names")
    parser.add_argument("--sanitize", action="store_true", help="run the children under compute-sanitizer")
    parser.add_argument("--jobs", type=int, default=8, help="children at a time (they compile in parallel)")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--child", nargs=2, metavar=("FAMILY", "ARGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], json.loads(args.child[1]))
        return
    todo = [g for g in groups() if (not args.only or g[0] in args.only)
            and (not args.match or any(m in g[1] for m in args.match)) and (not args.groups or g[1] in args.groups)]
    start = time.time()
    results: list[list[dict]] = [[] for _ in todo]

    def report(i: int, n: int) -> None:
        bad = [r for r in results[i] if not r["status"].startswith(("ok", "declined"))]
        elapsed = time.time() - start
        print(f"[{n}/{len(todo)}] {todo[i][1]}: {'; '.join(r['status'] for r in bad) or 'ok'} "
              f"({elapsed:.0f} s, ETA {elapsed / n * (len(todo) - n):.0f} s)", flush=True)
        for r in bad:
            if "log" in r and r["status"] != "OOM":
                print(r["log"], flush=True)
        print("\n".join(table(results[i]).splitlines()[2:]), flush=True)  # the rows so far survive an interruption

    # the chunk checks' float32 references of large states (H * D * D * (1 + N) floats per sequence) take up to
    # ~20 GiB each: those run after the others, a quarter as many at a time
    heavy = {i for i, (family, _, kw) in enumerate(todo)
             if family == "chunk" and kw["H"] * kw["D"] ** 2 * (1 + kw["N"]) >= HEAVY_STATE}
    done = 0
    for phase, jobs in (([i for i in range(len(todo)) if i not in heavy], args.jobs),
                        (sorted(heavy), max(1, args.jobs // 4))):
        with ThreadPoolExecutor(jobs) as pool:
            futures = {pool.submit(run_group, *todo[i], args.sanitize): i for i in phase}
            for future in as_completed(futures):
                done += 1
                results[futures[future]] = future.result()
                report(futures[future], done)
    # children that still ran out of GPU memory beside the others run again, one at a time
    for i in [i for i, rs in enumerate(results) if any(r["status"] == "OOM" for r in rs)]:
        results[i] = run_group(*todo[i], args.sanitize)
        report(i, len(todo))
    rows = [{k: v for k, v in r.items() if k != "log"} for rs in results for r in rs]
    props = torch.cuda.get_device_properties(0)
    import triton

    head = (f"{props.name}, torch {torch.__version__}, triton {triton.__version__}"
            f"{', compute-sanitizer memcheck' if args.sanitize else ''}: {len(rows)} rows, "
            f"{sum(not r['status'].startswith(('ok', 'declined')) for r in rows)} failing")
    text = f"{head}\n\n{table(rows)}\n"
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    sys.exit(0 if all(r["status"].startswith(("ok", "declined")) for r in rows) else 1)


if __name__ == "__main__":
    main()
