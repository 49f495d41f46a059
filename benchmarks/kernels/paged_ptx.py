"""What the compiler makes of the paged decode kernel, read without a GPU: its PTX for sm_90, per launch setting.

    python -m benchmarks.kernels.paged_ptx [--arch 90]    # bf16 and float8 pools at bench_paged's TIMED launches

Compiles ``kernels/paged_attention.py``'s kernel as a launch at the engine's shape specializes it (one query head
per KV head padded to 16 rows, head size 128, blocks of 256, 4 splits; pointers and strides divisible by 16) and
counts, in its PTX, the instructions that move the key and value tiles: global loads and shared-memory loads by
width, ``ldmatrix``, asynchronous copies and float8 conversions; and from its cubin the registers a thread holds,
and its shared memory, hence how many programs an SM runs at once and how much of the cache they stage together.
Static counts of the loop body as compiled, not timings: they say which way a tile travels and how much of the cache
is on its way at once (``docs/benchmarks.md``); ``benchmarks.kernels.bench_paged --fp8`` times the same launches on
a GPU. The Triton installed here compiles; another version may compile otherwise.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

from kernels.paged_attention import WARPS

STRIDES = ("sq_b", "sq_h", "sk_blk", "sk_h", "sk_t", "st_b", "so_b", "so_h", "so_s")  # multiples of 16 at launch
POINTERS = {"q": "*bf16", "tables": "*i64", "lengths": "*i64", "slots": "*i64", "o": "*fp32", "part_m": "*fp32",
            "part_l": "*fp32"}


def compiled(kv: str, tile: int, arch: int, stages: int = 3):
    """The kernel compiled for ``kv`` pools (``bf16`` or ``fp8``), ``tile`` tokens a tile, ``stages`` deep."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.paged_attention import _paged_decode_kernel as kernel

    pool = {"bf16": "*bf16", "fp8": "*fp8e4nv"}[kv]
    constants = dict(GROUP=1, GP=16, D=128, BLOCK_SIZE=256, BT=tile, SPLITS=4, F32=False, HAS_SLOTS=False,
                     FP8=kv == "fp8")
    names = kernel.arg_names
    types = {**POINTERS, "pool_k": pool, "pool_v": pool, "scale": "fp32"}
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    aligned = [n for n in names if signature[n].startswith("*") or n in STRIDES]
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": WARPS, "num_stages": stages})


def registers(kernel) -> tuple[int | None, int | None]:
    """Registers a thread of ``kernel`` (a compiled kernel) holds and its stack bytes (spills), from its cubin
    (``cuobjdump``, which Triton's NVIDIA backend ships); Nones where that tool is missing."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def programs_per_sm(regs: int | None, shared: int) -> int | None:
    """How many programs of ``WARPS`` warps one Hopper SM holds at once, by registers (64k, allocated 8 a thread at
    a time) and shared memory (228 KiB): the tiles in flight that hide the memory's latency."""
    if regs is None:
        return None
    by_registers = 65536 // (-(-regs // 8) * 8 * 32 * WARPS)
    return min(by_registers, 228 * 1024 // max(shared, 1), 32)


def counts(code: str) -> Counter:
    """The tile-moving instructions of ``code`` by kind."""
    found = Counter()
    for op in re.findall(r"\b(ld\.global[.\w]*|ld\.shared[.\w]*|ldmatrix[.\w]*|cp\.async\.c[ag][.\w]*)", code):
        kind = op.split(".")[0] if op.startswith(("ldmatrix", "cp")) else op
        found["cp.async" if op.startswith("cp") else kind] += 1
    found["cvt e4m3"] = len(re.findall(r"cvt\.\w+\.f16x2\.e4m3x2", code))
    return found


def main() -> None:
    from benchmarks.kernels.bench_paged import TIMED

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="the compute capability compiled for (90: Hopper)")
    args = parser.parse_args()
    rows = []
    for kv in ("bf16", "fp8"):
        for tile, stages in TIMED:
            kernel = compiled(kv, tile, args.arch, stages)
            (regs, stack), shared = registers(kernel), kernel.metadata.shared
            rows.append((kv, tile, stages, counts(kernel.asm["ptx"]), regs, stack, shared,
                         programs_per_sm(regs, shared)))
    kinds = sorted({k for *_, c, _, _, _, _ in rows for k in c if c[k]})
    print(f"Tile-moving instructions in the paged kernel's PTX (sm_{args.arch}, static counts), a thread's registers "
          f"and spilled bytes, the shared memory that stages the tiles, and the programs of {WARPS} warps an SM holds "
          f"with their shared memory together:\n")
    print("| KV | tokens a tile | stages | " + " | ".join(f"`{k}`" for k in kinds) +
          " | registers | stack bytes | shared KiB | programs an SM | shared KiB an SM |")
    print("|---|---:|---:|" + "---:|" * (len(kinds) + 5))
    for kv, tile, stages, c, regs, stack, shared, programs in rows:
        held = "" if programs is None else f"{programs * shared / 1024:.0f}"
        print(f"| {kv} | {tile} | {stages} | " + " | ".join(str(c[k]) for k in kinds) +
              f" | {regs} | {stack} | {shared / 1024:.0f} | {programs} | {held} |")


if __name__ == "__main__":
    main()
