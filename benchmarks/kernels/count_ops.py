"""Host work per layer: PyTorch operators and Triton launches of one training step, by mixer (runs on CPU).

Where a model's step is bound by the host rather than the GPU (a GPU busy time well under the step's wall
time in ``bench_model --profile``), what costs is the number of operators and kernel launches the host issues,
not their size. This counts them for one block of each mixer on the CUDA code path, without a GPU: the Triton
kernels are replaced by launch counters (nothing runs in them, so their outputs are garbage: the router runs
its PyTorch definition and the plan's tables come from its PyTorch definition outside the count, since later
operators read them), every other operator runs on small CPU tensors.
The block is checkpointed as in training (non-reentrant), so the backward's count includes the rebuild.

    python -m benchmarks.kernels.count_ops [--mixers attn gla sse] [--top 25] [--no-checkpointing] [--keep-chunks]
"""

from __future__ import annotations

import argparse
import collections
from contextlib import contextmanager

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# operators that only make a view (no kernel, a few microseconds of host time each)
VIEWS = ("view", "t.default", "_unsafe_view", "slice", "alias", "expand", "unsqueeze", "select", "split",
         "reshape", "transpose", "permute", "detach", "squeeze", "as_strided", "unbind")


class _Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _LaunchCounter:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` counts a launch and runs nothing."""

    def __init__(self, name: str, launches: collections.Counter):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] += 1

        return launch


@contextmanager
def kernels_on_cpu(launches: collections.Counter):
    """The CUDA backend's code path for CPU tensors, its Triton kernels replaced by launch counters (the
    router keeps its PyTorch definition: the plan reads its output); everything is restored on exit."""
    from kernels import decode, fused, plan, routing, sse_chunk
    from kernels.backend import linear_op
    from sse_model.ops import dispatch

    saved = [(module, name, obj) for module in (sse_chunk, fused, routing, decode, plan)
             for name, obj in list(vars(module).items()) if isinstance(obj, triton.runtime.jit.KernelInterface)]
    saved.append((sse_chunk, "build_plans", sse_chunk.build_plans))
    backends = list(dispatch._BACKENDS)

    def build_plans(*args, **kwargs):  # the host work of the plan kernels counts; the plan used is the reference's
        plan.build_plans(*args, **kwargs)
        with _disable_current_modes():
            return plan.build_plans_reference(*args, **kwargs)

    try:
        for module, name, _ in saved:
            setattr(module, name, _LaunchCounter(name, launches))
        sse_chunk.build_plans = build_plans
        dispatch._BACKENDS[:] = [dispatch.Backend(
            "kernels-on-cpu", lambda x: True, linear_op, sse=sse_chunk.sse_chunk_triton,
            rms_norm=fused.rms_norm_triton, sse_low_rank_features=fused.sse_low_rank_features_triton)]
        yield
    finally:
        for module, name, obj in saved:
            setattr(module, name, obj)
        dispatch._BACKENDS[:] = backends


def split(counts: collections.Counter) -> tuple[int, int]:
    """(operators that launch work, views)."""
    views = sum(n for op, n in counts.items() if any(v in op for v in VIEWS))
    return sum(counts.values()) - views, views


def count(mixer: str, launches: collections.Counter, checkpointing: bool = True, keep_chunks: bool = False) -> dict:
    from sse_model import SSEConfig, SSEForCausalLM

    config = SSEConfig(vocab_size=64, hidden_size=256, num_hidden_layers=1, mixer_types=[mixer], num_heads=2,
                       head_dim=128, num_attention_heads=2, intermediate_size=512,
                       checkpointing_keeps_linear_attention=keep_chunks)
    model = SSEForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 128))
    launches.clear()
    with _Operators() as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        forward = collections.Counter(ops.counts)
        forward_launches = sum(launches.values())
        loss.backward()
    backward = ops.counts - forward
    return dict(forward=forward, backward=backward, forward_launches=forward_launches,
                backward_launches=sum(launches.values()) - forward_launches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixers", nargs="*", default=["attn", "gla", "sse"])
    parser.add_argument("--top", type=int, default=25, help="the most frequent forward operators of the last mixer")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--keep-chunks", action="store_true", help="checkpointing_keeps_linear_attention=True")
    args = parser.parse_args()
    launches: collections.Counter = collections.Counter()
    with kernels_on_cpu(launches):
        report(args, launches)


def report(args, launches: collections.Counter) -> None:
    how = "checkpointing" + (", chunks kept" if args.keep_chunks else "")
    how = "no checkpointing" if args.no_checkpointing else how
    print(f"\n### Host work of a one-block model per training step ({how}; embedding, final norm and loss "
          "included)\n")
    print("| mixer | forward ops | forward views | forward launches | backward ops | backward views "
          "| backward launches | step: ops + launches |")
    print("|---|---|---|---|---|---|---|---|")
    result = None
    for mixer in args.mixers:
        result = count(mixer, launches, not args.no_checkpointing, args.keep_chunks)
        f_ops, f_views = split(result["forward"])
        b_ops, b_views = split(result["backward"])
        fl, bl = result["forward_launches"], result["backward_launches"]
        print(f"| {mixer} | {f_ops} | {f_views} | {fl} | {b_ops} | {b_views} | {bl} | {f_ops + fl + b_ops + bl} |")
    if result is not None and args.top:
        print(f"\nMost frequent forward operators ({args.mixers[-1]}):\n")
        for op, n in result["forward"].most_common():
            if not any(v in op for v in VIEWS):
                print(f"    {n:4d}  {op}")
                args.top -= 1
                if args.top == 0:
                    break


if __name__ == "__main__":
    main()
