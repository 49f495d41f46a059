"""Whole-model training speed: SSE-H against the same-size Transformer (SDPA flash) and GLA-H, on one GPU.

A 24-layer, hidden-1024 model (8 heads of 128; the hybrids put one softmax-attention layer after every five
linear ones) with random weights takes forward+backward steps under bf16 autocast with gradient
checkpointing (float32 master weights), on dense rows of ``B x T`` tokens. Prints tokens/s, the first
step's time (compilation included; models run in the order given, so kernels shared with an earlier model
are already compiled), and peak memory.

    python -m kernels.bench.bench_model [--shapes 8x4096 2x16384] [--models transformer gla-h sse-h] [--profile]
"""

from __future__ import annotations

import argparse
import time

import torch

from sse_model import SSEConfig, SSEForCausalLM
from sse_model.configuration_sse import hybrid_mixer_types

LAYERS, HIDDEN, HEADS = 24, 1024, 8


def model_config(kind: str) -> SSEConfig:
    mixers = {"transformer": ["attn"] * LAYERS, "gla-h": hybrid_mixer_types(LAYERS, "gla"),
              "sse-h": hybrid_mixer_types(LAYERS, "sse")}[kind]
    return SSEConfig(vocab_size=32000, hidden_size=HIDDEN, num_hidden_layers=LAYERS, mixer_types=mixers,
                     num_heads=HEADS, head_dim=128, num_attention_heads=HEADS, max_position_embeddings=65536)


def measure(kind: str, B: int, T: int, steps: int, profile: bool = False) -> dict:
    torch.manual_seed(0)
    model = SSEForCausalLM(model_config(kind)).cuda().train()
    model.gradient_checkpointing_enable()
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
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"\n{kind} {B}x{T}: top CUDA kernels of one step")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    del model
    torch.cuda.empty_cache()
    return dict(params=params, tokens_per_s=B * T / elapsed, step_s=elapsed, first_s=first, peak_gib=peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["8x4096", "2x16384"])
    parser.add_argument("--models", nargs="*", default=["transformer", "gla-h", "sse-h"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", nargs="*", default=[], help="models to profile (top kernels of one step)")
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
            r = measure(kind, B, T, args.steps, kind in args.profile)
            base = base or (r["tokens_per_s"] if kind == "transformer" else None)
            rows.append((shape, kind, r, r["tokens_per_s"] / base if base else float("nan")))
            print(f"  {shape} {kind}: {r['tokens_per_s']:,.0f} tok/s", flush=True)
    print(f"\n### Training step, {LAYERS} layers x {HIDDEN}, bf16 autocast + checkpointing, forward+backward\n")
    print("| shape | model | params | tokens/s | vs Transformer | step s | first step s | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, kind, r, ratio in rows:
        print(f"| {shape} | {kind} | {r['params'] / 1e6:.0f}M | {r['tokens_per_s']:,.0f} | {ratio:.2f}x "
              f"| {r['step_s']:.3f} | {r['first_s']:.1f} | {r['peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
