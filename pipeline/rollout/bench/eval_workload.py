"""The rollout engine on an evaluation-shaped workload; prints a markdown table.

    python -m pipeline.rollout.bench.eval_workload --preset sse-h-smollm2 --max-slots 256 1024 --top-p 0.95 1.0

Evaluation and GRPO with a small model are not one long batch: many requests of ``--samples`` samples each, prompts
of varied length, completions of varied length (most short, some to the limit), so slots free and refill all the
time and every admitted request is prefilled while the others decode. Random weights (the end of each completion
is drawn, EOS ignored): ``--requests`` prompts of ``--prompt-len LOW HIGH`` tokens, each sample's length drawn from
a geometric distribution of mean ``--mean-new-tokens`` capped at ``--max-new-tokens``. For each engine setting,
one row: wall time, generated tokens/s, the engine's own split of its time (decode steps, prefill, the rest: the
host's admission and bookkeeping), decode steps, mean slot occupancy and prefill forwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import time

import torch

from ..engine import Engine
from ..sampling import SamplingParams


def workload(vocab: int, requests: int, prompt_len: tuple[int, int], mean_new: int, max_new: int, seed: int):
    """``[(prompt ids, max_tokens)]``, one entry per request (its samples share the drawn length)."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))]
        length = min(max_new, 1 + int(rng.expovariate(1 / mean_new)))
        out.append((prompt, length))
    return out


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine: Engine, jobs, samples: int, top_p: float) -> dict:
    """Serves every request of ``jobs`` through ``engine.step`` as evaluation does; the engine's stats and wall."""
    for prompt, length in jobs:
        engine.add_request(prompt, SamplingParams(n=samples, temperature=0.7, top_p=top_p, max_tokens=length,
                                                  ignore_eos=True, seed=len(prompt), logprobs=False))
    synchronize()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    synchronize()
    stats = {**engine.get_stats(), **dataclasses.asdict(engine.stats)}
    stats["wall_s"] = time.perf_counter() - start
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sse-h-smollm2")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[80, 250])
    parser.add_argument("--mean-new-tokens", type=int, default=250)
    parser.add_argument("--max-new-tokens", type=int, default=768)
    parser.add_argument("--max-slots", type=int, nargs="+", default=[256])
    parser.add_argument("--top-p", type=float, nargs="+", default=[0.95])
    parser.add_argument("--prefill-chunk-size", type=int, nargs="+", default=[2048])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import kernels
    from sse_model import SSEConfig, SSEForCausalLM

    kernels.register()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of a tiny preset
    torch.manual_seed(args.seed)
    model = SSEForCausalLM(SSEConfig.from_preset(args.preset)).to(device, torch.bfloat16 if device == "cuda" else
                                                                   torch.float32).eval()
    jobs = workload(model.config.vocab_size, args.requests, tuple(args.prompt_len), args.mean_new_tokens,
                    args.max_new_tokens, args.seed)
    max_len = args.prompt_len[1] + args.max_new_tokens
    print(f"{args.preset}: {args.requests} requests x {args.samples} samples, prompts {args.prompt_len[0]}-"
          f"{args.prompt_len[1]} tokens, completions mean {args.mean_new_tokens} capped at {args.max_new_tokens}; "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}\n", flush=True)
    rows = []
    for slots, top_p, chunk in itertools.product(args.max_slots, args.top_p, args.prefill_chunk_size):
        engine = Engine(model, None, max_slots=slots, max_model_len=max_len, prefill_chunk_size=chunk)
        run(engine, jobs[:2 * slots // args.samples], args.samples, top_p)  # warm-up: graphs, autotuning
        engine.stats = type(engine.stats)()
        s = run(engine, jobs, args.samples, top_p)
        other = s["wall_s"] - s["decode_seconds"] - s["prefill_seconds"]
        rows.append((slots, top_p, chunk, s["wall_s"], s["generated_tokens"] / s["wall_s"], s["decode_seconds"],
                     s["prefill_seconds"], other, s["decode_steps"], s["mean_slot_occupancy"], s["prefill_forwards"]))
        print(f"max_slots {slots}, top_p {top_p}, chunk {chunk}: {s['generated_tokens']} tokens in "
              f"{s['wall_s']:.1f} s", flush=True)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n| max slots | top-p | prefill chunk | wall s | generated tok/s | decode s | prefill s | rest s "
          "| decode steps | mean occupancy | prefill forwards |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:,.0f} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.1f} | {r[8]} "
              f"| {r[9]:.2f} | {r[10]} |")


if __name__ == "__main__":
    main()
