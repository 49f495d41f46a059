"""Decode attention over the engine's paged KV: the paged kernel the engine runs (``kernels/paged_attention.py``)
against gathering the blocks + SDPA (its path before, still its path with ``paged_decode=False``) and the memory
roofline; prints one markdown table (GPU).

    python -m benchmarks.kernels.bench_paged [--shapes 256x1536 64x8192 8x32768]
    python -m benchmarks.kernels.bench_paged --fp8 --shapes 8x32768 64x32768   # launch settings, bf16 and float8

Per shape ``BxT`` (sequences x cached tokens each; one attention layer of ``transformer-2b``/``sse-h-2b``: 18
heads of 128, bf16, blocks of 256 tokens scattered over the pool): the gather path is what
``SlotCache.attend`` and ``SoftmaxAttention`` do without the kernel (each sequence's blocks gathered into one
tensor, then SDPA with the validity mask); the roofline reads every cached key and value once at the measured copy
bandwidth.

``--fp8``: per shape, the kernel on bf16 and on float8 e4m3 pools (``engine.kv_cache_dtype: fp8``) at each launch
setting of ``TIMED`` (tokens a tile, pipeline stages; the engine's launch, ``kernels.paged_attention``'s
``TOKENS_PER_STEP`` and ``STAGES``, marked), against each dtype's roofline (``benchmarks.kernels.paged_ptx`` gives
each setting's registers and shared memory).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.kernels.bench_sse import bench, copy_bandwidth
from kernels.paged_attention import STAGES, TOKENS_PER_STEP, default_splits, paged_decode_attention

# (tokens a tile, stages): deeper pipelines and bigger tiles around the engine's launches
TIMED = ((64, 3), (64, 5), (128, 2), (128, 3), (256, 1), (256, 2))


def inputs(B: int, T: int, heads: int = 18, dim: int = 128, block_size: int = 256):
    per_seq = -(-T // block_size)
    num_blocks = B * per_seq
    pool_k = torch.randn(num_blocks + 1, heads, block_size, dim, device="cuda", dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    tables = torch.randperm(num_blocks, device="cuda").view(B, per_seq)
    lengths = torch.full((B,), T, device="cuda")
    q = torch.randn(B, heads, dim, device="cuda", dtype=torch.bfloat16)
    return q, pool_k, pool_v, tables, lengths


def gather_path(q, pool_k, pool_v, tables, lengths):
    B, H, D = q.shape
    k = pool_k[tables].transpose(1, 2).reshape(B, H, -1, D)
    v = pool_v[tables].transpose(1, 2).reshape(B, H, -1, D)
    valid = torch.arange(k.shape[2], device=q.device)[None] < lengths[:, None]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid[:, None, None])[:, :, 0]


def float8_ways(shapes: list[str], bandwidth: float) -> None:
    """The kernel on bf16 and float8 pools at each of ``TIMED``: ms and x each dtype's roofline."""
    from pipeline.rollout.cache import to_kv

    print("| sequences x tokens | KV | tokens a tile | stages | engine's | kernel ms | roofline ms | x roofline | "
          "max abs diff to bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in shapes:
        B, T = map(int, shape.split("x"))
        q, pool_k, pool_v, tables, lengths = inputs(B, T)
        reference = paged_decode_attention(q, pool_k, pool_v, tables, lengths).float()
        for name, (k, v) in (("bf16", (pool_k, pool_v)),
                             ("float8", (to_kv(pool_k, torch.float8_e4m3fn), to_kv(pool_v, torch.float8_e4m3fn)))):
            roofline = 2 * B * T * k.shape[1] * k.shape[3] * k.element_size() / bandwidth * 1e3
            for tile, stages in TIMED:
                options = {"tokens_per_step": tile, "stages": stages}
                engine = "yes" if (tile, stages) == (TOKENS_PER_STEP, STAGES) else ""
                out = paged_decode_attention(q, k, v, tables, lengths, **options)
                ms = bench(lambda: paged_decode_attention(q, k, v, tables, lengths, **options))
                diff = (out.float() - reference).abs().max().item()
                print(f"| {B} x {T} | {name} | {tile} | {stages} | {engine} | {ms:.3f} | "
                      f"{roofline:.3f} | {ms / roofline:.2f}x | {diff:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["256x1536", "64x8192", "8x32768"])
    parser.add_argument("--fp8", action="store_true", help="the kernel's ways on bf16 and float8 pools instead")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"Copy bandwidth {bandwidth / 1e12:.2f} TB/s; one layer, 18 heads of 128, bf16, blocks of 256 tokens\n")
    if args.fp8:
        return float8_ways(args.shapes, bandwidth)
    print("| sequences x tokens | splits | roofline ms | gather + SDPA ms | paged kernel ms | kernel / roofline | "
          "gather / kernel | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        B, T = map(int, shape.split("x"))
        args_ = inputs(B, T)
        q, pool_k = args_[0], args_[1]
        roofline = 2 * B * T * pool_k.shape[1] * pool_k.shape[3] * pool_k.element_size() / bandwidth * 1e3
        ours, ref = paged_decode_attention(*args_), gather_path(*args_)
        diff = (ours.float() - ref.float()).abs().max().item()
        t_gather, t_paged = bench(lambda: gather_path(*args_)), bench(lambda: paged_decode_attention(*args_))
        splits = default_splits(B, pool_k.shape[1], q.device)
        print(f"| {B} x {T} | {splits} | {roofline:.3f} | {t_gather:.3f} | {t_paged:.3f} | {t_paged / roofline:.2f}x | "
              f"{t_gather / t_paged:.2f}x | {diff:.1e} |", flush=True)
        del args_, q, pool_k, ours, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
