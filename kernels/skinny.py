"""Matrix products of few rows (a decode step's ``x @ W^T`` for up to 64 sequences), reading the weight once.

At 8 rows cuBLAS picks 64-column tiles: a 2304 x 2304 map (the SSE-H output projection) becomes 36 programs on 132
SMs, most of the GPU idle while the weight is read (``python -m benchmarks.kernels.bench_skinny``; the table in
``docs/benchmarks.md``). Here a program owns
``BN`` output columns (``BN`` rows of the ``[N, K]`` weight, each a contiguous run of ``K`` values) and streams
them through ``BK``-wide tiles against the rows of ``x``, padded to 16 for the tensor cores; narrow blocks give
even a 2304-column map 72 programs. The epilogue adds the bias and, optionally, a residual
(``residual + x @ W^T``: the block's skip connection in the same pass, no separate add).

No autograd: this serves generation (the dispatch point sends products with gradients to PyTorch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import interpreting

MAX_ROWS = 64
SERVED_ROWS = 16  # where the dispatch point sends products here (cuBLAS is as fast from 32 rows)


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x, w, bias, res, y, M, N, K, sx, sr, sy,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, F32: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    row_ok, col_ok = m < M, n < N
    acc = tl.zeros([BM, BN], tl.float32)
    for start in range(0, K, BK):
        k = start + tl.arange(0, BK)
        k_ok = k < K
        a = tl.load(x + m[:, None].to(tl.int64) * sx + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + n[:, None].to(tl.int64) * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if F32:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RES:
        acc += tl.load(res + m[:, None].to(tl.int64) * sr + n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y + m[:, None].to(tl.int64) * sy + n[None, :], acc.to(y.dtype.element_ty), mask=mask)


def skinny_config(M: int, N: int, K: int, sms: int) -> tuple[int, int, int, int, int]:
    """``(BM, BN, BK, num_warps, num_stages)`` from a sweep on an H100 at 8 rows (``bench_skinny --sweep``):
    32-column blocks (64 for the vocabulary head), long ``K`` tiles where few programs share a narrow map."""
    BM = max(16, triton.next_power_of_2(M))
    BN = 16 if N <= 16 else 32 if N <= 32768 else 64
    BK = min(512 if N <= 4096 else 256, max(64, triton.next_power_of_2(K)))
    return BM, BN, BK, 4, 4


@functools.lru_cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """The dispatch point's ``linear`` (:func:`sse_model.ops.dispatch.linear`, called without autograd): a product
    of at most :data:`SERVED_ROWS` rows in bf16 / fp16, the residual in their dtype or in float32 (an engine's
    float32 residual stream); None declines (cuBLAS then runs it)."""
    rows = x.numel() // max(1, x.shape[-1])
    tensors = [t for t in (x, weight, bias) if t is not None]
    if rows > SERVED_ROWS or x.dtype not in (torch.bfloat16, torch.float16) or len({t.dtype for t in tensors}) != 1:
        return None
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        return None
    if not weight.is_contiguous() or (residual is not None and residual.shape != (*x.shape[:-1], weight.shape[0])):
        return None
    return skinny_linear(x, weight, bias, residual)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias) (+ residual)`` for ``x [..., K]`` of at most :data:`MAX_ROWS` rows (the rows may be
    strided, the last dimension contiguous), ``weight [N, K]`` contiguous; output ``[..., N]`` in ``x``'s dtype, or in
    the residual's when one is given (a float32 stream gets its sum unrounded).
    ``config`` overrides :func:`skinny_config` (benchmarks)."""
    K = x.shape[-1]
    N = weight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_ROWS or weight.shape[1] != K or weight.stride(1) != 1 or weight.stride(0) != K:
        raise ValueError(f"skinny_linear: x {list(x.shape)} and weight {list(weight.shape)} (contiguous, at most "
                         f"{MAX_ROWS} rows)")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype if residual is None else residual.dtype)
    r2 = None
    if residual is not None:
        r2 = residual.reshape(M, N)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    BM, BN, BK, warps, stages = config or skinny_config(M, N, K, _sms(x.device))
    _skinny_kernel[(triton.cdiv(N, BN),)](
        x2, weight, weight if bias is None else bias, y if r2 is None else r2, y, M, N, K,
        x2.stride(0), 0 if r2 is None else r2.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=r2 is not None, BM=BM, BN=BN, BK=BK,
        F32=x.dtype == torch.float32 or interpreting(), num_warps=warps, num_stages=stages)
    return y.view(*lead, N)
