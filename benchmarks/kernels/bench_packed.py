"""A training step on packed rows of many short sequences, as distillation batches are, at a real model's shape.

    python -m benchmarks.kernels.bench_packed --tokens 16384 --lengths 2048 200 0 --attention varlen per-sequence cudnn

The SmolLM2-135M shape (30 layers, 9 heads of 64, 3 KV heads, SSE-H 5:1) with random weights, bf16 autocast over
float32 weights, forward + backward of the LM loss: per-step time and tokens/s for each sequence length
(``--tokens`` per row, sequences of ``length`` tokens, the last shorter; length 0: random lengths, new each step),
the Transformer of the same shape beside
it, and with ``--profile L`` the top operators of one step at length ``L`` (host and device time). ``--attention``
picks how the softmax layers attend a packed row: ``varlen`` (one flash launch per row, the default path),
``per-sequence`` (SDPA sequence by sequence, the fallback) or ``cudnn`` (the fallback with cuDNN allowed, which
builds a plan for every new length).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sse_model.convert import convert_to_sse

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
               rms_norm_eps=1e-5, rope_theta=100000.0)


def packed(tokens: int, length: int, vocab: int, device) -> dict:
    """One row of ``tokens``: sequences of ``length`` tokens, or with ``length`` 0 of random lengths in [50, 400]
    (new lengths at every step, as packed rows of real data have)."""
    if length:
        lengths = [length] * (tokens // length) + ([tokens % length] if tokens % length else [])
    else:
        lengths = torch.randint(50, 401, (tokens // 50,)).tolist()
        ends = torch.tensor(lengths).cumsum(0)
        lengths = lengths[:int((ends < tokens).sum())]
        lengths.append(tokens - sum(lengths))
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    ids = torch.randint(0, vocab, (1, tokens), device=device)
    return dict(input_ids=ids, labels=ids, cu_seqlens=cu)


def step(model, batch) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch, use_cache=False).loss
    loss.backward()


ATTENTION_PATHS = ("varlen", "per-sequence", "cudnn")


@contextlib.contextmanager
def attention_path(path: str):
    """Packed attention through one of :data:`ATTENTION_PATHS` inside the block."""
    from sse_model.ops import attention

    saved = attention.flash_varlen_serves, attention.PACKED_SDPA_BACKENDS
    if path != "varlen":
        attention.flash_varlen_serves = lambda q: False
    if path == "cudnn":
        attention.PACKED_SDPA_BACKENDS = ("CUDNN_ATTENTION", *attention.PACKED_SDPA_BACKENDS)
    try:
        yield
    finally:
        attention.flash_varlen_serves, attention.PACKED_SDPA_BACKENDS = saved


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 200])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", type=int, default=None)
    parser.add_argument("--attention", nargs="+", default=["varlen"], choices=list(ATTENTION_PATHS))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    models = {"sse-h": convert_to_sse(llama).cuda().train(),
              "transformer": convert_to_sse(llama, mixer_types=["attn"] * 30).cuda().train()}
    print("| model | attention | tokens | sequence length | ms/step | tokens/s |\n" + "| --- " * 6 + "|")
    for path, length, (name, model) in itertools.product(args.attention, args.lengths, models.items()):
        with attention_path(path):
            batch = packed(args.tokens, length, SMOLLM2["vocab_size"], "cuda")
            step(model, batch)  # compile and warm up
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, packed(args.tokens, length, SMOLLM2["vocab_size"], "cuda"))
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / args.steps
            print(f"| {name} | {path} | {args.tokens} | {length} | {1e3 * seconds:.0f} | "
                  f"{args.tokens / seconds:,.0f} |", flush=True)
            model.zero_grad(set_to_none=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        batch = packed(args.tokens, args.profile, SMOLLM2["vocab_size"], "cuda")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(models["sse-h"], batch)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
