"""Which gradients change between two backward passes of one batch: where a training run stops reproducing.

    python -m benchmarks.kernels.determinism --tokens 16384 --lengths 200 2048 --attention varlen per-sequence

The SmolLM2-135M shape (``benchmarks.kernels.bench_packed``: SSE-H 5:1 and the Transformer, random weights, bf16 autocast
over float32 weights, packed rows) takes the same batch twice from the same weights; the table counts, per group of
parameters (embeddings, softmax attention, SSE, MLP, norms), the tensors whose gradients differ bitwise between the
two passes and the largest difference relative to the gradient's largest entry; a second table the second pass's
time (one pass, a rough price of ``--deterministic``, not a benchmark of steps). A group that differs holds an
operator that sums in an order the GPU picks (atomics, split reductions). Sequences long enough matter: flash
attention's backward adds a query's gradient over key blocks as they finish, and two blocks (sequences of 200
tokens) sum the same either way, as float addition commutes; three or more need not. ``--deterministic`` runs the
passes as ``deterministic: true`` recipes train (``torch.use_deterministic_algorithms(True)``; its warn-only form
leaves flash attention's backward as it is): an operator without a deterministic form raises, named.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.kernels.bench_packed import SMOLLM2, attention_path, packed, step
from sse_model.convert import convert_to_sse


def group(name: str, mixers: dict[int, str]) -> str:
    """The part of the model a parameter belongs to, by its name (``model.layers.7.attn.q_proj.weight``)."""
    if "embed" in name or "lm_head" in name:
        return "embeddings / LM head"
    parts = name.split(".")
    if "layers" in parts:
        at = parts.index("layers") + 1
        module = parts[at + 1]  # attn (the mixer), mlp, or the layer's own norms
        return {"attn": f"mixer: {mixers[int(parts[at])]}", "mlp": "MLP"}.get(module, "norms")
    return "norms"


def gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step(model, batch)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model, batch, mixers: dict[int, str]) -> tuple[dict[str, list], float]:
    """group -> [tensors, tensors that differ, the largest relative difference], and the second pass's seconds
    (what deterministic algorithms cost)."""
    sync = torch.cuda.synchronize if batch["input_ids"].is_cuda else (lambda: None)
    first = gradients(model, batch)
    sync()
    start = time.perf_counter()
    second = gradients(model, batch)
    sync()
    seconds = time.perf_counter() - start
    table: dict[str, list] = {}
    for name, a in first.items():
        row = table.setdefault(group(name, mixers), [0, 0, 0.0])
        row[0] += 1
        if not torch.equal(a, second[name]):
            row[1] += 1
            scale = a.abs().max().clamp_min(1e-30)
            row[2] = max(row[2], ((a - second[name]).abs().max() / scale).item())
    return table, seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--lengths", type=int, nargs="+", default=[200, 2048])
    parser.add_argument("--attention", nargs="+", default=["varlen"], choices=["varlen", "per-sequence", "cudnn"])
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args(argv)
    if args.deterministic:  # as transformers' full_determinism sets it (cuBLAS reads its workspace at first use)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU a check of the tool itself, at a few tokens
    models = {"sse-h": convert_to_sse(llama).to(device).train(),
              "transformer": convert_to_sse(llama, mixer_types=["attn"] * 30).to(device).train()}
    print("| model | attention | sequence length | parameters | tensors | differ | largest relative difference |\n"
          + "| --- " * 7 + "|")
    timings = []
    for path, length, (name, model) in itertools.product(args.attention, args.lengths, models.items()):
        mixers = dict(enumerate(model.config.mixer_types))
        torch.manual_seed(1)
        batch = packed(args.tokens, length, SMOLLM2["vocab_size"], device)
        with attention_path(path):
            try:
                table, seconds = compare(model, batch, mixers)
            except RuntimeError as error:  # an operator without a deterministic form, under --deterministic
                print(f"| {name} | {path} | {length} | raised: {str(error).splitlines()[0][:160]} | | | |", flush=True)
                continue
        for part, (tensors, differ, worst) in sorted(table.items()):
            print(f"| {name} | {path} | {length} | {part} | {tensors} | {differ} | {worst:.1e} |", flush=True)
        timings.append(f"| {name} | {path} | {length} | {1e3 * seconds:.0f} |")
    print("\n| model | attention | sequence length | ms a forward-backward (one, after the first) |\n"
          + "| --- " * 4 + "|\n" + "\n".join(timings))


if __name__ == "__main__":
    main()
