"""The ``triton`` backend of :mod:`sse_model.ops.dispatch`: which kernel serves which op on CUDA."""

from __future__ import annotations

from typing import Callable

import torch

from sse_model.ops.dispatch import Backend, register_backend


def fla_linear_op(transition: str, mode: str) -> Callable | None:
    """fla's chunked kernels with the dispatch point's calling convention, or None without fla.

    fla wants one dtype for q, k, v (we use their promoted type) and a float32 log-decay; its states are
    float32 like ours.
    """
    if mode == "recurrent":
        return None
    try:
        if transition == "gla":
            from fla.ops.gla import chunk_gla as fla_op
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    except ImportError:
        return None

    def op(q, k, v, g, beta=None, *, scale=None, initial_state=None, output_final_state=False,
           cu_seqlens=None, use_qk_l2norm=False):
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        state = None if initial_state is None else initial_state.float()
        kw = dict(scale=scale, initial_state=state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        if transition == "gla":
            if use_qk_l2norm:
                raise ValueError("use_qk_l2norm is only defined for the gated delta rule")
            return fla_op(q, k, v, g.float(), **kw)
        return fla_op(q, k, v, g.float(), beta.to(dtype), use_qk_l2norm_in_kernel=use_qk_l2norm, **kw)

    return op


def _supports(x: torch.Tensor) -> bool:
    return x.is_cuda


def register() -> None:
    from .decode import linear_decode_triton, sse_decode_triton
    from .routing import route_triton

    register_backend(Backend(
        name="triton",
        supports=_supports,
        linear_op=fla_linear_op,
        sse_decode=sse_decode_triton,
        linear_decode=linear_decode_triton,
        route=route_triton,
    ))
