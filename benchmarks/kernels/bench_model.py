"""Whole-model training speed: SSE-H against the same-size Transformer (SDPA flash) and GLA-H, on one GPU.

A 24-layer, hidden-1024 model (8 heads of 128; the hybrids put one softmax-attention layer after every five
linear ones) with random weights takes forward+backward steps under bf16 autocast with gradient
checkpointing (non-reentrant, as the pipeline's trainers use it; float32 master weights), on dense rows of
``B x T`` tokens. Prints tokens/s (median step), the first step's time (compilation included; models run in
the order given, so kernels shared with an earlier model are already compiled), and peak memory.

    python -m benchmarks.kernels.bench_model [--shapes 8x4096 2x16384] [--models transformer gla-h sse-h]
        [--profile sse-h ...] [--no-checkpointing | --also-keep-chunks] [--steps 5]

``--also-keep-chunks`` adds, for each hybrid, a row where checkpointing keeps the chunk kernels' forward
instead of recomputing it (``checkpointing_keeps_linear_attention=True``), measured in the same process.

``--profile`` prints, per model named, one step's wall time against GPU busy time, GPU time by category
(chunk kernels, attention, matmuls, fused norms, routing, everything elementwise) and the top kernels.
"""

from __future__ import annotations

import argparse
import re
import time

import torch

from sse_model import SSEConfig, SSEForCausalLM
from sse_model.configuration_sse import hybrid_mixer_types

LAYERS, HIDDEN, HEADS = 24, 1024, 8


def model_config(kind: str, keep_chunks: bool = False) -> SSEConfig:
    mixers = {"transformer": ["attn"] * LAYERS, "gla-h": hybrid_mixer_types(LAYERS, "gla"),
              "sse-h": hybrid_mixer_types(LAYERS, "sse")}[kind]
    return SSEConfig(vocab_size=32000, hidden_size=HIDDEN, num_hidden_layers=LAYERS, mixer_types=mixers,
                     num_heads=HEADS, head_dim=128, num_attention_heads=HEADS, max_position_embeddings=65536,
                     checkpointing_keeps_linear_attention=keep_chunks)


CATEGORIES = [  # (category, pattern of kernel names), first match wins
    ("sse chunk", r"^_(fwd_h|fwd_o|bwd_dh|bwd_dv|bwd_dqkg)$"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|cutlass|nvjet|sm90_|cublas|splitK"),
    ("fused norm/features", r"^_(rms|gated|norm|sse_feat|feat)"),
    ("routing/plan", r"route|^_(block_counts|count_before|segments|pairs|chunks)$|topk|sort|scan|searchsorted|"
                     r"cumsum|bincount|histc|index|scatter|gather"),
    ("cross-entropy/softmax", r"softmax|log_softmax|nll|cross"),
    ("elementwise/other", r""),
]


def print_profile(label: str, step) -> None:
    """Where one step's time goes: wall time against GPU busy time (kernels, overlaps merged), GPU time by
    category and the top kernels, and the host synchronisations the step makes."""
    from torch.autograd import DeviceType

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += (e.time_range.end - e.time_range.start) / 1e3
        entry[1] += 1
    by_cat: dict[str, float] = {}
    for name, (ms, _) in by_name.items():
        cat = next(c for c, pat in CATEGORIES if re.search(pat, name, re.IGNORECASE))
        by_cat[cat] = by_cat.get(cat, 0.0) + ms
    syncs = sum(e.count for e in prof.key_averages() if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    gpu = sum(ms for ms, _ in by_name.values())
    print(f"\n#### {label}: wall {wall:.1f} ms (profiled), GPU busy {busy / 1e3:.1f} ms, kernel time {gpu:.1f} ms, "
          f"{len(kernels)} kernels, {syncs} host synchronisations\n")
    print("| category | ms | share |\n|---|---|---|")
    for cat, ms in sorted(by_cat.items(), key=lambda x: -x[1]):
        print(f"| {cat} | {ms:.1f} | {ms / gpu:.0%} |")
    print("\n| kernel | ms | launches |\n|---|---|---|")
    for name, (ms, n) in sorted(by_name.items(), key=lambda x: -x[1][0])[:25]:
        print(f"| {name[:90]} | {ms:.1f} | {n} |")
    # the operators behind those kernels (GPU time they launched themselves, by input shapes): which module's
    # glue an elementwise kernel belongs to
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    print("\n| operator | input shapes | ms | calls |\n|---|---|---|---|")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"| {e.key[:40]} | {str(e.input_shapes)[:80]} | {e.self_device_time_total / 1e3:.1f} | {e.count} |")
    # the host's side: a step whose GPU busy time is well under its wall time is bound by these
    host = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in host) / 1e3
    print(f"\nHost time inside operators and launches (profiled, so inflated): {total:.1f} ms\n")
    print("| host: operator or launch | self CPU ms | calls |\n|---|---|---|")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:20]:
        print(f"| {e.key[:60]} | {e.self_cpu_time_total / 1e3:.1f} | {e.count} |")


def measure(kind: str, B: int, T: int, steps: int, profile: bool = False, checkpointing: bool = True,
            keep_chunks: bool = False) -> dict:
    torch.manual_seed(0)
    model = SSEForCausalLM(model_config(kind, keep_chunks)).cuda().train()
    if checkpointing:  # as the pipeline's trainers do
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    step()
    times = []  # the median step: one slow step (a host hiccup) does not move it
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    elapsed = sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30
    if profile:
        print_profile(f"{kind} {B}x{T}", step)
    del model
    torch.cuda.empty_cache()
    return dict(params=params, tokens_per_s=B * T / elapsed, step_s=elapsed, first_s=first, peak_gib=peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["8x4096", "2x16384"])
    parser.add_argument("--models", nargs="*", default=["transformer", "gla-h", "sse-h"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", nargs="*", default=[],
                        help="models to profile: GPU time by category, top kernels and operators, host time")
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every activation (no recompute)")
    parser.add_argument("--also-keep-chunks", action="store_true",
                        help="for each hybrid also measure checkpointing that keeps the chunk kernels' forward")
    args = parser.parse_args()
    import kernels

    kernels.register()
    props = torch.cuda.get_device_properties(0)
    print(f"Device: {props.name}, torch {torch.__version__}")
    rows = []
    for shape in args.shapes:
        B, T = map(int, shape.split("x"))
        base = None
        for kind in args.models:
            variants = [False, True] if args.also_keep_chunks and kind != "transformer" else [False]
            for keep in variants:
                r = measure(kind, B, T, args.steps, kind in args.profile and not keep, not args.no_checkpointing, keep)
                base = base or (r["tokens_per_s"] if kind == "transformer" else None)
                label = f"{kind}, chunks kept" if keep else kind
                rows.append((shape, label, r, r["tokens_per_s"] / base if base else float("nan")))
                print(f"  {shape} {label}: {r['tokens_per_s']:,.0f} tok/s", flush=True)
    recompute = "no checkpointing" if args.no_checkpointing else "checkpointing"
    print(f"\n### Training step, {LAYERS} layers x {HIDDEN}, bf16 autocast + {recompute}, forward+backward\n")
    print("| shape | model | params | tokens/s | vs Transformer | step s | first step s | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, kind, r, ratio in rows:
        print(f"| {shape} | {kind} | {r['params'] / 1e6:.0f}M | {r['tokens_per_s']:,.0f} | {ratio:.2f}x "
              f"| {r['step_s']:.3f} | {r['first_s']:.1f} | {r['peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
