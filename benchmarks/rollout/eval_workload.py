"""The rollout engine on an evaluation-shaped workload; prints a markdown table.

    python -m benchmarks.rollout.eval_workload --preset sse-h-smollm2 --max-slots 256 1024 --top-p 0.95 1.0
    python -m benchmarks.rollout.eval_workload --backend sse vllm --max-slots 1024 --prefill-chunk-size 8192
    python -m benchmarks.rollout.eval_workload --checkpoint runs/smollm2-135m/grpo/final --benchmark gsm8k \
        --backend sse vllm --vllm-detokenize on --max-slots 1024 --prefill-chunk-size 8192

Evaluation and GRPO with a small model are not one long batch: many requests of ``--samples`` samples each, prompts
of varied length, completions of varied length (most short, some to the limit), so slots free and refill all the
time and every admitted request is prefilled while the others decode. Random weights (the end of each completion
is drawn, EOS ignored): ``--requests`` prompts of ``--prompt-len LOW HIGH`` tokens, each sample's length drawn from
a geometric distribution of mean ``--mean-new-tokens`` capped at ``--max-new-tokens``. For each engine setting,
one row: wall time, generated tokens/s, the engine's own split of its time (decode steps, prefill, the rest: the
host's admission and bookkeeping), decode steps, mean slot occupancy and prefill forwards. ``--backend vllm`` serves
the same model, saved to a temporary folder, through vLLM and this package's plugin (``engine.backend: vllm``; vLLM
on the path): wall time and generated tokens/s only, vLLM keeping no such split; one vLLM setting a run (its
sleep-mode allocator takes one engine a process).

``--checkpoint`` serves a trained model instead, on a benchmark's problems as evaluation prompts them
(``--benchmark``, ``--instruction``), each sample to its end of sequence or ``--max-new-tokens``: evaluation's own
workload, so that a gap between an evaluation's speed and this bench's can be taken apart. ``--vllm-detokenize
off`` gives vLLM the checkpoint without its tokenizer files (prompts go in as token ids either way), so that vLLM
does not detokenize every step: what that costs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import tempfile
import time
from pathlib import Path

import torch

from pipeline.rollout import create_engine
from pipeline.rollout.sampling import SamplingParams


def workload(vocab: int, requests: int, prompt_len: tuple[int, int], mean_new: int, max_new: int, seed: int):
    """``[(prompt ids, max_tokens)]``, one entry per request (its samples share the drawn length)."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))]
        length = min(max_new, 1 + int(rng.expovariate(1 / mean_new)))
        out.append((prompt, length))
    return out


def benchmark_workload(tokenizer, benchmark: str, instruction: str, max_new: int, limit: int | None):
    """``[(prompt ids, max_tokens)]``: a benchmark's problems as evaluation prompts them (the chat template around
    the problem and the instruction), each to ``max_new`` tokens at most."""
    from eval.benchmarks import load_problems
    from eval.generation import build_prompt

    return [(tokenizer(build_prompt(tokenizer, p.problem, instruction), add_special_tokens=False)["input_ids"], max_new)
            for p in load_problems(benchmark, limit=limit)]


def without_tokenizer(checkpoint: str, folder: str) -> str:
    """``folder`` holding links to ``checkpoint``'s files but its tokenizer's: vLLM then serves token ids and
    detokenizes nothing."""
    for path in Path(checkpoint).iterdir():
        if not path.name.startswith(("tokenizer", "special_tokens_map", "vocab", "merges", "chat_template")):
            Path(folder, path.name).symlink_to(path.resolve())
    return folder


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine, jobs, samples: int, top_p: float, ignore_eos: bool = True) -> dict:
    """Serves every request of ``jobs`` through ``engine.step`` as evaluation does; the tokens generated, the wall
    time, and the engine's own stats where it keeps them (ours; vLLM's keeps none of these)."""
    for prompt, length in jobs:
        engine.add_request(prompt, SamplingParams(n=samples, temperature=0.7, top_p=top_p, max_tokens=length,
                                                  ignore_eos=ignore_eos, seed=len(prompt), logprobs=False))
    synchronize()
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished():
        generated += sum(len(c.token_ids) for out in engine.step() for c in out.outputs)
    synchronize()
    stats = {**engine.get_stats(), **(dataclasses.asdict(engine.stats) if hasattr(engine, "stats") else {})}
    return {**stats, "generated": generated, "wall_s": time.perf_counter() - start}


def main(argv=None) -> None:
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
    parser.add_argument("--backend", nargs="+", default=["sse"], choices=["sse", "vllm"],
                        help="sse: this package's engine; vllm: vLLM with this package's plugin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="a trained model's folder instead of --preset's random one")
    parser.add_argument("--benchmark", default="gsm8k", help="with --checkpoint: whose problems are the prompts")
    parser.add_argument("--instruction", default=None, help="with --checkpoint: the prompt's instruction "
                        "(default: evaluation's)")
    parser.add_argument("--limit", type=int, default=None, help="with --checkpoint: the first problems only")
    parser.add_argument("--vllm-detokenize", default=None, choices=["on", "off"],
                        help="on (with --checkpoint, the default): vLLM detokenizes as in evaluation; off: vLLM gets "
                             "the checkpoint without its tokenizer")
    args = parser.parse_args(argv)
    if not args.checkpoint and args.vllm_detokenize == "on":
        parser.error("--vllm-detokenize on needs --checkpoint: a random model has no tokenizer to detokenize with")
    if "vllm" in args.backend and len(args.max_slots) * len(args.top_p) * len(args.prefill_chunk_size) > 1:
        parser.error("one vLLM engine a process (its sleep-mode allocator takes one): give vLLM one setting a run")
    import kernels
    from sse_model import SSEConfig, SSEForCausalLM

    kernels.register()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of a tiny preset
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    folder = tempfile.TemporaryDirectory()
    if args.checkpoint:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from common.generation import INSTRUCTION

        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        jobs = benchmark_workload(tokenizer, args.benchmark, args.instruction or INSTRUCTION, args.max_new_tokens,
                                  args.limit)
        max_len = max(len(prompt) for prompt, _ in jobs) + args.max_new_tokens
        served = {"on": args.checkpoint, "off": without_tokenizer(args.checkpoint, folder.name)}
        args.vllm_detokenize = args.vllm_detokenize or "on"
        print(f"{args.checkpoint}: {len(jobs)} {args.benchmark} problems x {args.samples} samples, to the end of "
              f"sequence or {args.max_new_tokens} tokens", end="")
    else:
        model = SSEForCausalLM(SSEConfig.from_preset(args.preset)).to(device, dtype).eval()
        tokenizer = None
        jobs = workload(model.config.vocab_size, args.requests, tuple(args.prompt_len), args.mean_new_tokens,
                        args.max_new_tokens, args.seed)
        max_len = args.prompt_len[1] + args.max_new_tokens
        if "vllm" in args.backend:  # vLLM serves a checkpoint folder (no tokenizer: it detokenizes nothing)
            model.save_pretrained(folder.name)
        served = {"off": folder.name}
        args.vllm_detokenize = "off"
        print(f"{args.preset}: {args.requests} requests x {args.samples} samples, prompts {args.prompt_len[0]}-"
              f"{args.prompt_len[1]} tokens, completions mean {args.mean_new_tokens} capped at "
              f"{args.max_new_tokens}", end="")
    print(f"; {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}\n", flush=True)
    settings = [(backend, args.vllm_detokenize if backend == "vllm" else None) for backend in args.backend]
    rows = []
    for (backend, detok), slots, top_p, chunk in itertools.product(settings, args.max_slots, args.top_p,
                                                                   args.prefill_chunk_size):
        options = dict(max_slots=slots, max_model_len=max_len, prefill_chunk_size=chunk)
        engine = (create_engine(served[detok], None, backend="vllm", dtype=torch.bfloat16, seed=args.seed, **options)
                  if backend == "vllm" else create_engine(model, tokenizer, **options))
        backend = backend if detok is None else f"{backend}, detokenize {detok}"
        ignore_eos = not args.checkpoint  # a trained model ends its answers; random weights run to the drawn length
        run(engine, jobs[:2 * slots // args.samples], args.samples, top_p, ignore_eos)  # warm-up: graphs, autotuning
        if hasattr(engine, "stats"):
            engine.stats = type(engine.stats)()
        s = run(engine, jobs, args.samples, top_p, ignore_eos)
        split = [s.get(k) for k in ("decode_seconds", "prefill_seconds")]
        other = s["wall_s"] - sum(split) if None not in split else None
        rows.append((backend, slots, top_p, chunk, s["wall_s"], s["generated"] / s["wall_s"], *split, other,
                     s.get("decode_steps"), s.get("mean_slot_occupancy"), s.get("prefill_forwards")))
        print(f"{backend}, max_slots {slots}, top_p {top_p}, chunk {chunk}: {s['generated']} tokens in "
              f"{s['wall_s']:.1f} s", flush=True)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()

    def cell(value, spec):
        return "" if value is None else format(value, spec)

    print("\n| engine | max slots | top-p | prefill chunk | wall s | generated tok/s | decode s | prefill s | rest s "
          "| decode steps | mean occupancy | prefill forwards |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:,.0f} | {cell(r[6], '.1f')} | "
              f"{cell(r[7], '.1f')} | {cell(r[8], '.1f')} | {cell(r[9], 'd')} | {cell(r[10], '.2f')} | "
              f"{cell(r[11], 'd')} |")
    folder.cleanup()


if __name__ == "__main__":
    main()
