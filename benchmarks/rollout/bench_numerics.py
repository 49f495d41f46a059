"""Engine against trainer log-probabilities far into a sequence: are the rollouts the policy being trained?

For each position P in ``--positions``: a random prompt of P tokens; the engine (its weights in ``--engine-dtype``,
chunked prefill, recurrent decode) samples ``--new-tokens`` tokens and returns their log-probabilities; the
trainer (float32 master weights under bf16 autocast on CUDA, one full forward as in a training step) scores the
same tokens. Prints, per position, mean and max |logp_engine - logp_trainer| and the token-level importance ratio
that GRPO's correction would see (mean, min, max, fraction outside [1/2, 2]), for each ``--residual`` of the
engine: its skip connections in the weights' dtype, or in float32 as the trainer adds them (``residual_dtype``).
Beside them, how far each is from the same weights computed in float32 throughout (no autocast): the gap two
bf16 computations of one model leave between them is what neither can close alone. Random weights and random
prompts, or, with ``--model``, a trained checkpoint reading GSM8K test's worked solutions laid end to end (a
softmax layer's keys and values then have the outliers training gives them, which a float8 cache must hold).

Routing: each SSE layer's top-k partition choice at every position, engine (chunked prefill, then one decode step a
token) against trainer: the share of (token, layer) pairs whose write or read partitions differ, over the prompt and
over the sampled tokens' inputs; the share of sampled tokens with a flip in any layer; and the mean |logp gap| of
sampled tokens with and without one: if flips carry the gap, replaying the engine's choices in the trainer closes it.

    python -m benchmarks.rollout.bench_numerics                                # sse-h-2b at 2k, 8k, 32k (GPU)
    python -m benchmarks.rollout.bench_numerics --preset sse-h-tiny --positions 256 1024 --device cpu
    python -m benchmarks.rollout.bench_numerics --model smollm2-135m --positions 512 2048 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from pipeline.rollout.engine import Engine
from pipeline.rollout.options import KV_CACHE_DTYPES, STATE_CACHE_DTYPES
from pipeline.rollout.sampling import SamplingParams


def trainer_logprobs(model, ids: list[int], start: int, device: torch.device, autocast: bool = True) -> torch.Tensor:
    """Log-probabilities of ``ids[start:]`` as the GRPO trainer computes them (bf16 autocast on CUDA), or in
    float32 throughout (``autocast=False``: the reference both bf16 computations stray from)."""
    x = torch.tensor([ids], device=device)
    on = autocast and device.type == "cuda"
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=on):
        logits = model(x, logits_to_keep=len(ids) - start + 1).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, start:, None]).squeeze(-1).cpu()


def sse_layers(model) -> list:
    from sse_model.layers.sse import SSEAttention

    return [m for m in model.modules() if isinstance(m, SSEAttention)]


def recording(model) -> list[list]:
    """Starts each SSE layer's record of its partition choices; the records, a list per layer."""
    records = []
    for layer in sse_layers(model):
        layer.routing_record = []
        records.append(layer.routing_record)
    return records


def routing_choices(records: list[list], positions: int) -> torch.Tensor:
    """``[layers, positions, k]``: each layer's calls (prefill chunks, decode steps, or one forward) laid end to end."""
    choices = torch.stack([torch.cat([t.reshape(-1, t.shape[-1]) for t in calls]) for calls in records]).cpu()
    if choices.shape[1] < positions:
        raise RuntimeError(f"{choices.shape[1]} routed positions recorded, {positions} expected")
    return choices[:, :positions]


def flips(engine: torch.Tensor, trainer: torch.Tensor, writers: int, readers: int) -> torch.Tensor:
    """``[layers, positions]``: where the write set or the read set of partitions differs (the order within a set
    does not matter to the layer)."""
    def differ(k):
        return (engine[..., :k].sort(-1).values != trainer[..., :k].sort(-1).values).any(-1)
    return differ(writers) | differ(readers)


def text_prompt(tokenizer, length: int, skip: int = 0) -> list[int]:
    """``length`` tokens of GSM8K test's problems and worked solutions laid end to end, from record ``skip`` on."""
    from common.files import read_records
    from pipeline.data import PACKAGED

    ids: list[int] = []
    records = [record for _, record in read_records(PACKAGED["gsm8k_test"])]
    for record in records[skip:] + records[:skip]:
        ids += tokenizer(f"{record['problem']}\n{record['solution']}\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"GSM8K test holds fewer than {length} tokens")


def measure(trainer_model, engine: Engine, prompt: list[int], new_tokens: int, device: torch.device, seed: int,
            routing: bool = False) -> dict:
    position = len(prompt)
    engine_records = recording(engine.model) if routing else None
    start = time.perf_counter()
    out = engine.generate(prompt, SamplingParams(max_tokens=new_tokens, seed=seed, ignore_eos=True))[0].outputs[0]
    engine_s = time.perf_counter() - start
    engine_logps = torch.tensor(out.logprobs)
    trainer_records = recording(trainer_model) if routing else None
    trainer_logps = trainer_logprobs(trainer_model, prompt + out.token_ids, position, device)
    for layer in sse_layers(trainer_model) + (sse_layers(engine.model) if routing else []):
        layer.routing_record = None
    reference = trainer_logprobs(trainer_model, prompt + out.token_ids, position, device, autocast=False)
    gap = (engine_logps - trainer_logps).abs()
    ratio = (trainer_logps - engine_logps).exp()
    row = {"position": position, "tokens": len(gap), "mean": gap.mean().item(), "max": gap.max().item(),
           "engine_fp32": (engine_logps - reference).abs().mean().item(),
           "trainer_fp32": (trainer_logps - reference).abs().mean().item(),
           "ratio_mean": ratio.mean().item(), "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item(),
           "outside": ((ratio > 2) | (ratio < 0.5)).float().mean().item(), "engine_s": engine_s}
    if routing:  # the sampled token i is scored from the model's output at position position - 1 + i
        routed = position + len(gap) - 1  # the engine never runs the last sampled token
        cfg = trainer_model.config
        flipped = flips(routing_choices(engine_records, routed), routing_choices(trainer_records, routed),
                        cfg.num_writers, cfg.num_readers)
        scored = flipped[:, position - 1:]
        any_layer = scored.any(0)
        row.update(prompt_flips=flipped[:, :position - 1].float().mean().item() if position > 1 else 0.0,
                   sampled_flips=scored.float().mean().item(), tokens_flipped=any_layer.float().mean().item(),
                   gap_flipped=gap[any_layer].mean().item() if any_layer.any() else float("nan"),
                   gap_unflipped=gap[~any_layer].mean().item() if not any_layer.all() else float("nan"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sse-h-2b")
    parser.add_argument("--model", default=None, help="a trained checkpoint (folder, GGUF or known model) instead "
                                                      "of the preset's random weights, reading text")
    parser.add_argument("--positions", type=int, nargs="+", default=[2048, 8192, 32000])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--residual", nargs="+", default=["weights", "float32"], choices=["weights", "float32"],
                        help="the engine's residual stream: the weights' dtype, or float32 (engine residual_dtype)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routing", action="store_true", help="also where engine and trainer route tokens apart")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the engine's KV cache of the softmax layers (fp8: float8 e4m3)")
    parser.add_argument("--state-cache-dtype", default="float32", choices=STATE_CACHE_DTYPES,
                        help="the engine's recurrent states of the SSE layers")
    args = parser.parse_args()
    from sse_model import SSEConfig, SSEForCausalLM

    device = torch.device(args.device)
    if device.type == "cuda":
        import kernels

        kernels.register()
    torch.manual_seed(args.seed)
    longest = max(args.positions) + args.new_tokens
    if args.model:
        from pipeline.lm_loss import packed_reader
        from pipeline.models import load_tokenizer, local_model
        from sse_model.checkpoint import load_pretrained

        path = local_model(args.model)
        trainer_model = packed_reader(load_pretrained(path, torch.float32)).to(device).eval()
        if longest > trainer_model.config.max_position_embeddings:
            parser.error(f"--positions: {longest} tokens with the sampled ones, beyond {args.model}'s "
                         f"{trainer_model.config.max_position_embeddings}")
        tokenizer = load_tokenizer(None, path)
        prompts = [text_prompt(tokenizer, p, skip=100 * i) for i, p in enumerate(args.positions)]
        name = args.model
    else:
        config = SSEConfig.from_preset(args.preset, max_position_embeddings=longest)
        trainer_model = SSEForCausalLM(config).to(device).eval()  # float32 master weights
        generator = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, config.vocab_size, (p,), generator=generator).tolist() for p in args.positions]
        name = args.preset
    rows = []
    for residual in args.residual:
        engine_model = copy.deepcopy(trainer_model).to(getattr(torch, args.engine_dtype))
        engine = Engine(engine_model, None, max_slots=1, max_model_len=longest,
                        prefill_chunk_size=8192, use_cuda_graphs=False, kv_cache_dtype=args.kv_cache_dtype,
                        state_cache_dtype=args.state_cache_dtype,
                        residual_dtype=torch.float32 if residual == "float32" else None)
        rows += [{"residual": residual, **measure(trainer_model, engine, prompt, args.new_tokens, device, args.seed + i,
                                                  args.routing)} for i, prompt in enumerate(prompts)]
        del engine, engine_model
    print(f"\n{name}: engine {args.engine_dtype} (KV cache {args.kv_cache_dtype}, states "
          f"{args.state_cache_dtype}) vs trainer float32 weights"
          f"{' under bf16 autocast' if device.type == 'cuda' else ''}, {args.new_tokens} sampled tokens per position "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'})\n")
    print("| engine residual | position | mean abs logp gap | max abs logp gap | ratio mean | ratio min | ratio max "
          "| outside [1/2, 2] | mean gap, engine to float32 | mean gap, trainer to float32 | engine s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['residual']} | {r['position']} | {r['mean']:.2e} | {r['max']:.2e} | {r['ratio_mean']:.3f} "
              f"| {r['ratio_min']:.3f} | {r['ratio_max']:.3f} | {r['outside']:.1%} | {r['engine_fp32']:.2e} "
              f"| {r['trainer_fp32']:.2e} | {r['engine_s']:.2f} |")
    if args.routing:
        print("\n| engine residual | position | (token, layer) flipped, prompt | (token, layer) flipped, sampled "
              "| sampled tokens with a flip | mean abs logp gap, flipped tokens | mean abs logp gap, the others |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['residual']} | {r['position']} | {r['prompt_flips']:.3%} | {r['sampled_flips']:.3%} "
                  f"| {r['tokens_flipped']:.1%} | {r['gap_flipped']:.2e} | {r['gap_unflipped']:.2e} |")


if __name__ == "__main__":
    main()
