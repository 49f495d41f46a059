"""Causal softmax attention over a packed batch without a ``[T, T]`` mask.

A packed row ``[1, H, T, D]`` holds several sequences back to back (``cu_seqlens``). A dense boolean mask over
the whole row costs ``T^2`` memory and turns SDPA's flash kernel off (one 2B attention layer at 33.8k tokens
needed 6.3 GiB for it). On a GPU the flash kernel's variable-length form attends the whole row in one launch
(``cu_seqlens``, a causal window where asked); elsewhere (CPU, float32, head dims flash was not built for) SDPA
attends sequence by sequence with ``is_causal``, a band mask per sequence only where a window cuts it. Neither
materialises anything quadratic in the row.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class Segments(list):
    """``[(start, end), ...]`` of the non-empty sequences of a packed row, in order. :meth:`bounds` builds their
    int32 bounds on the device once for all the attention layers of a forward that read them (a host-to-device copy
    per layer would wait for the GPU each time)."""

    _bounds: tuple[torch.Tensor, int] | None = None

    def bounds(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """``(cu_seqlens int32 on device, longest length)``: the flash varlen kernel's view of the row."""
        if self._bounds is None or self._bounds[0].device != device:
            cu = torch.tensor([0] + [e for _, e in self], dtype=torch.int32).to(device)
            self._bounds = cu, max(e - s for s, e in self)
        return self._bounds


def segments_of(cu_seqlens: torch.Tensor) -> Segments:
    """The non-empty sequences of a packed row (one host sync)."""
    bounds = cu_seqlens.tolist()
    return Segments((s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s)


# SDPA's backends for the sequences of a packed row when the flash varlen kernel cannot serve it (CPU, float32, odd
# head dims), cuDNN left out: cuDNN builds an execution plan for every new shape, and packed rows of real data bring
# new sequence lengths at every step, so every step paid the plans again (python -m benchmarks.pipeline.distill_step;
# python -m benchmarks.kernels.bench_packed --lengths 0 --attention varlen per-sequence cudnn compares the paths).
PACKED_SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def packed_backends(device: torch.device):
    """The context that restricts SDPA to :data:`PACKED_SDPA_BACKENDS` on CUDA (a no-op elsewhere)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in PACKED_SDPA_BACKENDS])


def flash_varlen_serves(q: torch.Tensor) -> bool:
    """Whether the flash kernel's variable-length form can attend the whole packed row in one launch: CUDA on
    sm80 or newer, half precision, head dims a multiple of 8 up to 256 (what the kernel was built for)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and torch.backends.cuda.flash_sdp_enabled() and torch.cuda.get_device_capability(q.device)[0] >= 8)


class _FlashVarlen(torch.autograd.Function):
    """Causal (windowed) attention over ``[T, H, D]`` tokens of several sequences (``cu`` int32 bounds) through
    ATen's flash kernels, one launch for the whole row whatever its lengths. Their positional arguments have been
    stable across torch releases; the two opaque random-state tensors pass from forward to backward untouched."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, window):
        left = None if window is None else window - 1
        out, lse, rng0, rng1, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
            window_size_left=left, window_size_right=None if window is None else 0)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng0, rng1)
        ctx.max_len, ctx.left = max_len, left
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, rng0, rng1 = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng0, rng1,
            window_size_left=ctx.left, window_size_right=None if ctx.left is None else 0)
        return dq, dk, dv, None, None, None


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments | list[tuple[int, int]],
    window: int | None = None,
) -> torch.Tensor:
    """``q [1, Hq, T, D]``, ``k, v [1, Hkv, T, D]`` (GQA when ``Hkv < Hq``) -> ``[1, Hq, T, D]``: each query
    sees the keys of its own sequence at positions ``<= i`` (and ``> i - window``)."""
    if q.shape[0] != 1:
        raise ValueError(f"a packed batch has one row, got {q.shape[0]}")
    covered = sum(e - s for s, e in segments)
    if covered != q.shape[2]:
        raise ValueError(f"the segments cover {covered} of the row's {q.shape[2]} tokens")
    if flash_varlen_serves(q):
        cu, max_len = (segments if isinstance(segments, Segments) else Segments(segments)).bounds(q.device)
        out = _FlashVarlen.apply(*(x[0].transpose(0, 1) for x in (q, k, v)), cu, max_len, window)
        return out.transpose(0, 1)[None]
    gqa = k.shape[1] != q.shape[1]
    outs = []
    with packed_backends(q.device):
        for start, end in segments:
            qs, ks, vs = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            L = end - start
            mask = None
            if window is not None and L > window:
                i = torch.arange(L, device=q.device)
                mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None and L > 1,
                                                       enable_gqa=gqa))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
