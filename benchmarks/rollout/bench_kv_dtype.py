"""The softmax layers' KV cache in bf16 against float8 e4m3 (``engine.kv_cache_dtype: fp8``), the SSE layers'
states in float32 against bf16 (``engine.state_cache_dtype: bfloat16``), and the engine's weights in bf16 against
float32 (``engine.dtype: float32``, with ``precision: fp32`` the way to agree with the trainer: bench_numerics):
the engine's decode step at long contexts, against its memory roofline, and whole generations' tokens/s.

    python -m benchmarks.rollout.bench_kv_dtype                                  # sse-h-2b, 64 sequences at 16k and 32k
    python -m benchmarks.rollout.bench_kv_dtype --batch 32 --contexts 4096 --generate 8192
    python -m benchmarks.rollout.bench_kv_dtype --state-dtypes float32 bfloat16 --contexts 4096 32768
    python -m benchmarks.rollout.bench_kv_dtype --engine-dtypes bfloat16 float32 --kv-dtypes auto --generate 0

Decode step: ``--batch`` sequences each holding ``--contexts`` tokens (their KV blocks taken, lengths set; what a
step reads does not depend on the values), the engine's step as it runs (CUDA graph, paged attention), timed over
20 steps; the roofline is the bytes it must read (every weight, each SSE layer's states read and written at the
states' width, each attention layer's keys and values at the KV dtype's width, the weights' unless float8) over the
copy bandwidth. Generation:
``--generate-prompts`` prompts of 512 tokens x 8 samples, ``--generate`` new tokens each (EOS ignored), random
weights. The log-prob gap each dtype leaves against the trainer: ``bench_numerics --kv-cache-dtype``.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.kernels.bench_sse import copy_bandwidth
from benchmarks.rollout.benchmark import build, decode_step_bytes, decode_step_ms
from pipeline.rollout.engine import Engine
from pipeline.rollout.sampling import SamplingParams

KV_BYTES = {"auto": None, "fp8": 1}  # auto: the weights' width
STATE_BYTES = {"float32": 4, "bfloat16": 2}
WEIGHT_BYTES = {"bfloat16": 2, "float32": 4}


def generate_rate(engine: Engine, prompts: int, new_tokens: int) -> float:
    ids = [torch.randint(100, 1000, (512,)).tolist() for _ in range(prompts)]
    engine.generate(ids[:1], SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=0))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(ids, SamplingParams(n=8, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0))
    torch.cuda.synchronize()
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sse-h-2b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--generate", type=int, default=8192, help="new tokens a sample (0: no generation)")
    parser.add_argument("--generate-prompts", type=int, default=4)
    parser.add_argument("--kv-dtypes", nargs="+", default=list(KV_BYTES), choices=list(KV_BYTES))
    parser.add_argument("--state-dtypes", nargs="+", default=["float32"], choices=list(STATE_BYTES))
    parser.add_argument("--engine-dtypes", nargs="+", default=["bfloat16"], choices=list(WEIGHT_BYTES),
                        help="the engine's weights (and its KV cache, unless float8)")
    args = parser.parse_args()
    import kernels

    kernels.register()
    model = build(args.preset)
    bandwidth = copy_bandwidth()
    rows, rates = [], {}
    settings = [(w, kv, state) for w in args.engine_dtypes for kv in args.kv_dtypes for state in args.state_dtypes]
    for weights, kv, state in settings:
        cache = (f"weights {weights}, " if len(args.engine_dtypes) > 1 else "") + f"KV {kv}, states {state}"
        longest = max(args.contexts) + 1
        engine = Engine(model, None, max_slots=args.batch, max_model_len=max(longest, 512 + args.generate),
                        kv_cache_dtype=kv, state_cache_dtype=state, dtype=getattr(torch, weights))
        for context in args.contexts:
            ms = decode_step_ms(engine, args.batch, context)
            parts = decode_step_bytes(model, args.batch, context)  # weights at the engine's width (it cast them)
            kv_bytes = KV_BYTES[kv] or WEIGHT_BYTES[weights]
            total = parts["weights"] + parts["states"] * STATE_BYTES[state] // 4 + parts["KV"] * kv_bytes // 2
            rows.append((cache, context, ms, total / bandwidth * 1e3, total))
            print(f"{cache}, context {context}: {ms:.2f} ms", flush=True)
        if args.generate:
            rates[cache] = generate_rate(engine, args.generate_prompts, args.generate)
            print(f"{cache}: generation {rates[cache]:,.0f} tok/s", flush=True)
        del engine
        torch.cuda.empty_cache()
    first = rows[0][0]
    base = {context: ms for cache, context, ms, *_ in rows if cache == first}
    print(f"\n{args.preset}, {torch.cuda.get_device_name()}, decode step of {args.batch} sequences "
          f"(copy bandwidth {bandwidth / 1e12:.2f} TB/s)\n")
    print(f"| caches | context | step ms | x {first}'s speed | roofline ms | x roofline | bytes read (GB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for cache, context, ms, roof, total in rows:
        print(f"| {cache} | {context} | {ms:.2f} | {base[context] / ms:.2f} | {roof:.2f} | {ms / roof:.2f} | "
              f"{total / 1e9:.1f} |")
    if rates:
        print(f"\nGeneration, {args.generate_prompts} x 8 samples of {args.generate} tokens: "
              + ", ".join(f"{cache} {rate:,.0f} tok/s ({rate / rates[first]:.2f}x)" for cache, rate in rates.items()))


if __name__ == "__main__":
    main()
