"""The ``triton`` backend of :mod:`sse_model.ops.dispatch`: which kernel serves which op on CUDA.

- SSE over the GLA transition, GLA: our chunked kernels (:mod:`kernels.sse_chunk`), no fla needed;
- the gated delta rule (GDN mixers, SSE-GDN): fla's chunked kernels when fla is installed (its WY
  building blocks), else the PyTorch chunked ops;
- decode and routing: :mod:`kernels.decode`, :mod:`kernels.routing`;
- the matrix products of generation (few rows): :mod:`kernels.skinny`;
- the fused elementwise stages (norms, the SwiGLU activation, the SSE feature prologue and its decode
  form): :mod:`kernels.fused`.
"""

from __future__ import annotations

from typing import Callable

import torch

from sse_model.ops.dispatch import Backend, register_backend


def fla_gdn_op() -> Callable | None:
    """fla's chunked gated delta rule with the dispatch point's calling convention, or None without fla.

    fla wants one dtype for q, k, v (we use their promoted type) and a float32 log-decay; its states are
    float32 like ours.
    """
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    except ImportError:
        return None

    def op(q, k, v, g, beta=None, *, scale=None, initial_state=None, output_final_state=False,
           cu_seqlens=None, use_qk_l2norm=False):
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        state = None if initial_state is None else initial_state.float()
        return fla_op(q, k, v, g.float(), beta.to(dtype), scale=scale, initial_state=state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=use_qk_l2norm)

    return op


def linear_op(transition: str, mode: str) -> Callable | None:
    if mode == "recurrent":
        return None
    if transition == "gla":
        from .sse_chunk import chunk_gla_triton

        return chunk_gla_triton
    return fla_gdn_op()


def _supports(x: torch.Tensor) -> bool:
    return x.is_cuda


def register() -> None:
    from .decode import linear_decode_triton, sse_decode_triton
    from .fused import rms_norm_triton, silu_mul_triton, sse_decode_features_triton, sse_low_rank_features_triton
    from .routing import route_triton
    from .skinny import skinny_linear_op
    from .sse_chunk import sse_chunk_triton, sse_low_rank_chunk_triton

    register_backend(Backend(
        name="triton",
        supports=_supports,
        linear_op=linear_op,
        sse=sse_chunk_triton,
        sse_low_rank=sse_low_rank_chunk_triton,
        sse_decode=sse_decode_triton,
        linear_decode=linear_decode_triton,
        route=route_triton,
        rms_norm=rms_norm_triton,
        silu_mul=silu_mul_triton,
        sse_low_rank_features=sse_low_rank_features_triton,
        sse_decode_features=sse_decode_features_triton,
        linear=skinny_linear_op,
    ))
