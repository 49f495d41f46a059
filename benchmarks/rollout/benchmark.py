"""Rollout throughput on one GPU: our engine against Hugging Face ``generate``; prints markdown tables.

    python -m benchmarks.rollout.benchmark                       # defaults below
    python -m benchmarks.rollout.benchmark --new-tokens 8192     # longer generations
    python -m benchmarks.rollout.benchmark --residual float32    # the engine's float32 residual stream

Models have random weights (throughput does not depend on them); EOS is ignored so every sample runs to
``--new-tokens``. Rows: the engine on the 2B SSE-H preset (``--prompts`` x ``--samples`` sequences), HF
``generate`` on the same model and on the same-size Transformer preset (batch ``--hf-batch``, fewer new
tokens: its tokens/s is flat in length for SSE and falls for the Transformer, so this favours the peers).
Then the decode step of the engine against its memory roofline, peak memory, and how many concurrent
32k-token sequences fit in the memory left after the weights, for SSE-H and for the Transformer.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.kernels.bench_sse import copy_bandwidth
from pipeline.rollout.cache import SlotCache

from pipeline.rollout.engine import Engine
from pipeline.rollout.sampling import SamplingParams


def build(preset: str):
    from sse_model import SSEConfig, SSEForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = SSEForCausalLM(SSEConfig.from_preset(preset)).to(torch.bfloat16).eval()
    return model


def decode_step_bytes(model, batch: int, context: int) -> dict[str, int]:
    """What one decode step must move at least: every weight read once; each SSE layer's shared and selected
    states read and written (float32); each attention layer's keys and values of ``context`` tokens read."""
    cfg = model.config
    states = kv = 0
    for kind in cfg.mixer_types:
        if kind == "sse":
            states += 2 * batch * (1 + cfg.num_writers) * cfg.num_heads * cfg.head_dim * cfg.head_v_dim * 4
        elif kind == "attn":
            kv += batch * 2 * cfg.num_key_value_heads * context * cfg.attn_head_dim * 2
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weights": weights, "states": states, "KV": kv}


def decode_step_ms(engine: Engine, batch: int, context: int, steps: int = 20) -> float:
    """The engine's decode step (as it runs: CUDA graph, paged attention) for ``batch`` sequences each holding
    ``context`` tokens: their KV blocks taken and lengths set (what a step reads does not depend on the values)."""
    slots = torch.arange(batch, device="cuda")
    ids = torch.randint(100, 1000, (batch,), device="cuda")
    cache = engine.cache
    cache.grow(list(range(batch)), [context + 1] * batch)  # the KV blocks the step reads and writes
    cache.lengths[:batch] = context
    cache.view_blocks = cache.blocks_for(context + 1)
    with torch.no_grad():
        for _ in range(3):
            engine.runner.forward_decode(ids, slots)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.runner.forward_decode(ids, slots)
        torch.cuda.synchronize()
    cache.reset(slots)
    return (time.perf_counter() - start) / steps * 1e3


def hf_generate(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.randint(100, 1000, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_new_tokens=new_tokens,
              max_new_tokens=new_tokens, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :32], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sse-h-2b")
    parser.add_argument("--peer-preset", default="transformer-2b")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--hf-new-tokens", type=int, default=256)
    parser.add_argument("--long", type=int, default=32768)
    parser.add_argument("--residual", default="weights", choices=["weights", "float32"],
                        help="the engine's residual stream: the weights' dtype, or float32 (engine residual_dtype)")
    args = parser.parse_args()
    from benchmarks.kernels.bench_sse import limit_autotune

    limit_autotune()  # fla's prefill kernels: first autotune config only (compile time; see bench_sse)
    import kernels

    kernels.register()

    props = torch.cuda.get_device_properties(0)
    print(f"Device: {props.name}, torch {torch.__version__}\n")
    rows = []
    model = build(args.preset)
    max_len = args.prompt_len + args.new_tokens
    prompts = [torch.randint(100, 1000, (args.prompt_len,)).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    for graphs in (True, False):
        engine = Engine(model, None, max_slots=args.prompts * args.samples, max_model_len=max_len,
                        prefill_chunk_size=8192, use_cuda_graphs=graphs,
                        residual_dtype=torch.float32 if args.residual == "float32" else None)
        try:
            engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=0))  # warm-up
            break
        except Exception as err:  # noqa: BLE001 - report and measure without graphs
            print(f"CUDA graph capture failed ({type(err).__name__}: {err}); measuring without graphs", flush=True)
            del engine
            torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    engine_tps = generated / elapsed
    peak = torch.cuda.max_memory_allocated()
    rows.append((f"engine, {args.preset}" + (", float32 residual" if args.residual == "float32" else ""),
                 args.prompts * args.samples, args.new_tokens, engine_tps))
    print(f"engine: {generated} tokens in {elapsed:.1f} s; graphs={engine.runner.use_cuda_graphs}", flush=True)

    # decode step vs roofline at the full batch
    B = args.prompts * args.samples
    context = args.prompt_len + args.new_tokens // 2
    step_ms = decode_step_ms(engine, B, context)
    bw = copy_bandwidth()
    cfg = model.config
    parts = decode_step_bytes(model, B, context)
    weight_bytes, state_bytes, kv_bytes = parts["weights"], parts["states"], parts["KV"]
    roof_ms = (weight_bytes + state_bytes + kv_bytes) / bw * 1e3

    hf_sse = hf_generate(model, args.hf_batch, args.prompt_len, args.hf_new_tokens)
    rows.append((f"HF generate, {args.preset}", args.hf_batch, args.hf_new_tokens, hf_sse))
    print(f"HF generate SSE-H: {hf_sse:.0f} tok/s", flush=True)

    per_seq_sse = SlotCache.bytes_per_slot(cfg, args.long, torch.bfloat16)
    del engine, model, outs
    torch.cuda.empty_cache()

    peer = build(args.peer_preset)
    hf_peer = hf_generate(peer, args.hf_batch, args.prompt_len, args.hf_new_tokens)
    rows.append((f"HF generate, {args.peer_preset}", args.hf_batch, args.hf_new_tokens, hf_peer))
    per_seq_peer = SlotCache.bytes_per_slot(peer.config, args.long, torch.bfloat16)
    del peer
    torch.cuda.empty_cache()

    free = props.total_memory - weight_bytes
    print("\n| system | concurrent sequences | new tokens each | tokens/s | vs engine |")
    print("|---|---|---|---|---|")
    for name, batch, new, tps in rows:
        print(f"| {name} | {batch} | {new} | {tps:,.0f} | {engine_tps / tps:.1f}x slower |" if tps != engine_tps
              else f"| {name} | {batch} | {new} | {tps:,.0f} | - |")
    print(f"\nDecode step at batch {B} (context {context}): {step_ms:.2f} ms; roofline "
          f"{roof_ms:.2f} ms (weights {weight_bytes / 1e9:.2f} GB + states {state_bytes / 1e9:.2f} GB + KV "
          f"{kv_bytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s copy bandwidth): {step_ms / roof_ms:.2f}x roofline.")
    print(f"Peak GPU memory during the engine run: {peak / 2**30:.1f} GiB.")
    print(f"\n| model | memory per {args.long}-token sequence | concurrent {args.long}-token sequences in "
          f"{free / 2**30:.0f} GiB (GPU memory minus weights) |")
    print("|---|---|---|")
    print(f"| {args.preset} | {per_seq_sse / 2**20:.0f} MiB | {int(free // per_seq_sse)} |")
    print(f"| {args.peer_preset} | {per_seq_peer / 2**20:.0f} MiB | {int(free // per_seq_peer)} |")
    print(f"\nRatio: {per_seq_peer / per_seq_sse:.1f}x more concurrent {args.long}-token sequences for SSE-H.")


if __name__ == "__main__":
    main()
