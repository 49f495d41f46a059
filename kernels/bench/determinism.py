"""Which gradients change between two backward passes of one batch: where a training run stops reproducing.

    python -m kernels.bench.determinism --tokens 16384 --lengths 200 --attention varlen per-sequence

The SmolLM2-135M shape (``kernels.bench.bench_packed``: SSE-H 5:1 and the Transformer, random weights, bf16 autocast
over float32 weights, packed rows) takes the same batch twice from the same weights; the table counts, per group of
parameters (embeddings, softmax attention, SSE, MLP, norms), the tensors whose gradients differ bitwise between the
two passes and the largest difference relative to the gradient's largest entry. A group that differs holds an
operator that sums in an order the GPU picks (atomics, split reductions); ``--deterministic`` runs the passes under
``torch.use_deterministic_algorithms`` to see whether PyTorch's own deterministic paths remove it.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kernels.bench.bench_packed import SMOLLM2, attention_path, packed, step
from sse_model.convert import convert_to_sse


def group(name: str, mixers: dict[int, str]) -> str:
    """The part of the model a parameter belongs to, by its name (``model.layers.7.mixer.q_proj.weight``)."""
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


def compare(model, batch, mixers: dict[int, str]) -> dict[str, list]:
    """group -> [tensors, tensors that differ, the largest relative difference]."""
    first, second = gradients(model, batch), gradients(model, batch)
    table: dict[str, list] = {}
    for name, a in first.items():
        row = table.setdefault(group(name, mixers), [0, 0, 0.0])
        row[0] += 1
        if not torch.equal(a, second[name]):
            row[1] += 1
            scale = a.abs().max().clamp_min(1e-30)
            row[2] = max(row[2], ((a - second[name]).abs().max() / scale).item())
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--lengths", type=int, nargs="+", default=[200])
    parser.add_argument("--attention", nargs="+", default=["varlen"], choices=["varlen", "per-sequence", "cudnn"])
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args(argv)
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    models = {"sse-h": convert_to_sse(llama).cuda().train(),
              "transformer": convert_to_sse(llama, mixer_types=["attn"] * 30).cuda().train()}
    print("| model | attention | sequence length | parameters | tensors | differ | largest relative difference |\n"
          + "| --- " * 7 + "|")
    for path, length, (name, model) in itertools.product(args.attention, args.lengths, models.items()):
        mixers = dict(enumerate(model.config.mixer_types))
        torch.manual_seed(1)
        batch = packed(args.tokens, length, SMOLLM2["vocab_size"], "cuda")
        with attention_path(path):
            for part, (tensors, differ, worst) in sorted(compare(model, batch, mixers).items()):
                print(f"| {name} | {path} | {length} | {part} | {tensors} | {differ} | {worst:.1e} |", flush=True)


if __name__ == "__main__":
    main()
