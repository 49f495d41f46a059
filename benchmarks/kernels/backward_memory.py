"""Memory of one SSE chunk call at a layer's shape: what its forward keeps for the backward, and its backward's peak.

    python -m benchmarks.kernels.backward_memory --groups 1 3 6            # the sse-h-2b layer: 32k tokens, 18 x 128

For each ``SSEOptions.backward_head_groups``: the memory allocated between the forward and the backward (the op's
inputs and output, and what it saved: with groups above 1, no chunk states) and the peak while the backward runs,
in GiB and in units of one ``[tokens, heads x head_dim]`` bf16 tensor, the units ``docs/paper_scale.md`` counts in.
The op alone: inside a model, which moment sets the step's peak is ``benchmarks.pipeline.train_at_length``'s to say.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def measure(tokens: int, heads: int, dim: int, partitions: int, groups: int) -> tuple[int, int]:
    """(bytes allocated between forward and backward, peak bytes during the backward) of one bf16 SSE call."""
    from kernels.sse_chunk import sse_chunk_triton
    from sse_model.ops.sse import Branch, SSEOptions, route

    torch.manual_seed(0)

    def leaf(decay: bool = False) -> torch.Tensor:
        x = torch.randn(1, tokens, heads, dim, device="cuda")
        return (F.logsigmoid(x) / 16 if decay else x).to(torch.bfloat16).requires_grad_()

    shared = Branch(leaf(), leaf(), leaf(decay=True))
    sparse = Branch(leaf(), leaf(), leaf(decay=True))
    v = leaf()
    logits = torch.randn(1, tokens, partitions, device="cuda", requires_grad=True)
    cu = torch.tensor([0, tokens], device="cuda")
    o, _ = sse_chunk_triton(shared, sparse, v, route(logits, 1, 1), SSEOptions(backward_head_groups=groups),
                            cu_seqlens=cu)
    torch.cuda.synchronize()
    between = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o.float().sum().backward()
    torch.cuda.synchronize()
    return between, torch.cuda.max_memory_allocated()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=18)
    parser.add_argument("--dim", type=int, default=128, help="head dim (keys and values)")
    parser.add_argument("--partitions", type=int, default=4, help="sparse partitions (one read and written a token)")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 3, 6], help="backward_head_groups to measure")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("backward_memory measures CUDA memory: run it on a GPU")
    measure(1024, args.heads, args.dim, args.partitions, 1)  # compile outside the measured calls
    unit = args.tokens * args.heads * args.dim * 2
    print(f"\nOne SSE chunk call, {args.tokens:,} tokens x {args.heads} heads x {args.dim}, bf16, n{args.partitions}k1 "
          f"({torch.cuda.get_device_name()}); units of [{args.tokens:,}, {args.heads} x {args.dim}] bf16 "
          f"({unit / 2**30:.3f} GiB)\n")
    print("| backward_head_groups | kept between forward and backward | backward's peak | peak above what was kept |")
    print("| --- | --- | --- | --- |")
    for groups in args.groups:
        between, peak = measure(args.tokens, args.heads, args.dim, args.partitions, groups)
        print(f"| {groups} | {between / 2**30:.2f} GiB ({between / unit:.1f}) | {peak / 2**30:.2f} GiB "
              f"({peak / unit:.1f}) | {(peak - between) / unit:.1f} |")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
