"""What storing a trained model's keys and values costs, format by format: the relative error of each softmax
layer's keys (after rotary) and values on real text, as the engine's cache would hold them.

    python -m benchmarks.rollout.kv_rounding --model smollm2-135m [--tokens 1024]

Formats: bf16; float8 e4m3 (``engine.kv_cache_dtype: fp8``) at unit scale, with one scale per tensor, and with one
per token and head (absmax mapped to 448); int8 with one scale per token and head (absmax mapped to 127). Printed:
the relative error ``||stored - x|| / ||x||`` averaged over layers, for keys and for values, and the largest
magnitudes seen. If every float8 scaling rounds alike, the mantissa, not the range, sets its error. CPU is enough.
"""

from __future__ import annotations

import argparse
import statistics

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def relative_error(x: torch.Tensor, stored: torch.Tensor) -> float:
    return ((stored - x).norm() / x.norm()).item()


def float8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def int8_per_row(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (x / scale).round().clamp(-127, 127) * scale


FORMATS = {
    "bf16": lambda x: x.to(torch.bfloat16).float(),
    "float8, unit scale": lambda x: float8(x, torch.tensor(1.0)),
    "float8, a scale per tensor": lambda x: float8(x, x.abs().max() / FP8_MAX),
    "float8, a scale per token and head": lambda x: float8(x, x.abs().amax(-1, keepdim=True) / FP8_MAX),
    "int8, a scale per token and head": int8_per_row,
}


def captured(model, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Each softmax layer's keys after rotary and values, as rows of one head's vector per token."""
    from sse_model.layers.attention import SoftmaxAttention

    seen: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}
    hooks = []
    for layer in (m for m in model.modules() if isinstance(m, SoftmaxAttention)):
        d = layer.head_dim
        hooks.append(layer.rotary.register_forward_hook(  # (q, k) rotated
            lambda module, args, out, d=d: seen["keys"].append(out[1].detach().float().reshape(-1, d))))
        hooks.append(layer.v_proj.register_forward_hook(
            lambda module, args, out, d=d: seen["values"].append(out.detach().float().reshape(-1, d))))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def main() -> None:
    from benchmarks.rollout.bench_numerics import text_prompt
    from pipeline.lm_loss import packed_reader
    from pipeline.models import load_tokenizer, local_model
    from sse_model.checkpoint import load_pretrained

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint folder, GGUF file or known model")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of GSM8K test's worked solutions read")
    args = parser.parse_args()
    path = local_model(args.model)
    model = packed_reader(load_pretrained(path, torch.float32)).eval()
    ids = torch.tensor([text_prompt(load_tokenizer(None, path), args.tokens)])
    seen = captured(model, ids)
    layers = len(seen["keys"])
    print(f"{args.model}: {layers} softmax layers, {args.tokens} tokens of GSM8K test's worked solutions\n")
    print("| format | keys: relative error | values: relative error |")
    print("|---|---:|---:|")
    for name, store in FORMATS.items():
        errors = [statistics.mean(relative_error(x, store(x)) for x in seen[kind]) for kind in ("keys", "values")]
        print(f"| {name} | {errors[0]:.2%} | {errors[1]:.2%} |")
    for kind in ("keys", "values"):
        largest = statistics.median(x.abs().max().item() for x in seen[kind])
        typical = statistics.median(x.abs().median().item() for x in seen[kind])
        print(f"\n{kind}: largest magnitude, median over layers {largest:.2f}; median magnitude {typical:.3f}")


if __name__ == "__main__":
    main()
