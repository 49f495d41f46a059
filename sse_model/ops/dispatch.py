"""The single dispatch point for linear-attention and SSE compute.

Every mixer calls :func:`linear_attention` or :func:`sse_attention`; this module decides which
implementation runs. The PyTorch ops of this package (recurrent definitions and chunked forms) always work;
accelerated backends (the Triton kernels of ``kernels/``) register themselves with :func:`register_backend`
and are used on the devices they support. ``SSE_BACKEND=torch`` in the environment forces the PyTorch path.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import fused
from .delta_rule import chunk_gated_delta_rule, gated_delta_step, recurrent_gated_delta_rule
from .gla import chunk_gla, gla_step, recurrent_gla
from .sse import Branch, Routing, SSEOptions, route, sse_decode_step, sse_masked, sse_recurrent, sse_varlen

SSE_IMPLEMENTATIONS = ("auto", "recurrent", "mask", "varlen")
LINEAR_MODES = ("auto", "recurrent", "chunk")
logger = logging.getLogger(__name__)


def _uniform(transition: str, fn: Callable, **fixed) -> Callable:
    """Gives GLA and gated-delta-rule functions one calling convention ``op(q, k, v, g, beta, **kw)``."""

    def op(q, k, v, g, beta=None, *, scale=None, initial_state=None, output_final_state=False,
           cu_seqlens=None, use_qk_l2norm=False):
        kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, **fixed)
        if transition == "gla":
            if use_qk_l2norm:
                raise ValueError("use_qk_l2norm is only defined for the gated delta rule")
            return fn(q, k, v, g, **kw)
        return fn(q, k, v, g, beta, use_qk_l2norm=use_qk_l2norm, **kw)

    op.is_reference = True  # the PyTorch ops: what choose_sse_implementation calls not accelerated
    return op


def torch_linear_op(transition: str, mode: str = "chunk", chunk_size: int = 16) -> Callable:
    if transition not in ("gla", "gdn"):
        raise ValueError(f"unknown transition {transition!r}; expected 'gla' or 'gdn'")
    if mode == "recurrent":
        return _uniform(transition, recurrent_gla if transition == "gla" else recurrent_gated_delta_rule)
    fn = chunk_gla if transition == "gla" else chunk_gated_delta_rule
    return _uniform(transition, fn, chunk_size=chunk_size)


@dataclass
class Backend:
    """An accelerated implementation. ``linear_op(transition, mode)`` returns an op with the uniform
    signature or None; ``sse`` replaces :func:`sse_attention`'s body (returns None to decline), and
    ``sse_low_rank`` :func:`sse_low_rank_attention`'s;
    ``sse_decode`` and ``linear_decode`` replace the in-place decode steps below; ``route`` the router;
    ``rms_norm``, ``silu_mul``, ``sse_low_rank_features`` and ``sse_decode_features`` the fused stages of
    :mod:`sse_model.ops.fused`; ``linear`` the matrix products of generation (None declines)."""

    name: str
    supports: Callable[[torch.Tensor], bool]
    linear_op: Callable[[str, str], Callable | None]
    sse: Callable | None = None
    sse_low_rank: Callable | None = None
    sse_decode: Callable | None = None
    linear_decode: Callable | None = None
    route: Callable | None = None
    rms_norm: Callable | None = None
    silu_mul: Callable | None = None
    sse_low_rank_features: Callable | None = None
    sse_decode_features: Callable | None = None
    linear: Callable | None = None


_BACKENDS: list[Backend] = []
_DECLINED: set[tuple[str, str]] = set()


def note_declined(kernel: str, reason: str) -> None:
    """Says once per (kernel, reason) that an accelerated kernel declined a shape it cannot serve, so that the
    PyTorch op runs instead: a slower path is a choice the user should see, never a silent one."""
    if (kernel, reason) not in _DECLINED:
        _DECLINED.add((kernel, reason))
        logger.warning("%s declined (%s): the PyTorch op runs instead", kernel, reason)


def register_backend(backend: Backend) -> None:
    _BACKENDS[:] = [b for b in _BACKENDS if b.name != backend.name] + [backend]


# The accelerated backends, each a module whose ``register()`` calls :func:`register_backend`. They are named here,
# not imported: the kernels are built on these ops (``kernels -> sse_model``), and the ops must not import them back.
BACKEND_MODULES = ("kernels.backend",)
_backends_loaded = False


def _load_backends() -> None:
    """Registers :data:`BACKEND_MODULES` the first time a CUDA tensor comes by; CPU-only runs never import Triton."""
    global _backends_loaded
    if not _backends_loaded:
        _backends_loaded = True
        for name in BACKEND_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            module.register()


def active_backend(x: torch.Tensor) -> Backend | None:
    if os.environ.get("SSE_BACKEND", "").lower() == "torch":
        return None
    if x.is_cuda:
        _load_backends()
    for backend in reversed(_BACKENDS):
        if backend.supports(x):
            return backend
    return None


def select_linear_op(transition: str, x: torch.Tensor, mode: str = "auto", chunk_size: int = 16) -> Callable:
    """The op for ``transition`` on ``x``'s device: a registered backend first, else PyTorch."""
    if mode not in LINEAR_MODES:
        raise ValueError(f"unknown linear-attention mode {mode!r}; expected one of {LINEAR_MODES}")
    backend = active_backend(x)
    if backend is not None and mode != "recurrent":
        op = backend.linear_op(transition, mode)
        if op is not None:
            return op
    if mode == "auto":
        mode = "recurrent" if x.shape[1] == 1 else "chunk"
    return torch_linear_op(transition, mode, chunk_size)


def linear_attention(transition, q, k, v, g, beta=None, *, mode="auto", chunk_size=16, **kw):
    """GLA (``transition="gla"``) or gated delta rule (``"gdn"``) through the dispatch point."""
    op = select_linear_op(transition, q, mode, chunk_size)
    return op(q, k, v, g, beta, **kw)


# Accelerated kernels: masking wins while each partition's share of a sequence is short (it keeps chunks
# full), varlen beyond (it skips the replicated work); the crossover is measured in docs/benchmarks.md.
VARLEN_MIN_TOKENS_PER_PARTITION = 512


def choose_sse_implementation(seq_len: int, num_sparse_partitions: int, num_selected: int, accelerated: bool) -> str:
    """The PyTorch ops pay for every replicated head, so they always take varlen; kernels switch by length."""
    if not accelerated or seq_len * num_selected / num_sparse_partitions >= VARLEN_MIN_TOKENS_PER_PARTITION:
        return "varlen"
    return "mask"


def sse_attention(
    shared: Branch,
    sparse: Branch,
    v: torch.Tensor,
    routing: Routing,
    opts: SSEOptions,
    *,
    implementation: str = "auto",
    mode: str = "auto",
    chunk_size: int = 16,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SSE through the dispatch point. ``implementation``: auto | recurrent | mask | varlen."""
    if implementation not in SSE_IMPLEMENTATIONS:
        raise ValueError(f"unknown SSE implementation {implementation!r}; expected one of {SSE_IMPLEMENTATIONS}")
    kw = dict(initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    backend = active_backend(v)
    if backend is not None and backend.sse is not None and implementation != "recurrent":
        out = backend.sse(shared, sparse, v, routing, opts, implementation=implementation, **kw)
        if out is not None:
            return out
    if implementation == "recurrent":
        return sse_recurrent(shared, sparse, v, routing, opts, **kw)
    seq_len = v.shape[1] if cu_seqlens is None else int(v.shape[1] / max(cu_seqlens.numel() - 1, 1))
    op = select_linear_op(opts.transition, v, mode, chunk_size)
    if implementation == "auto":
        # A backend without its own chunked kernels (e.g. CUDA without fla) runs the PyTorch ops: varlen.
        accelerated = not getattr(op, "is_reference", False)
        implementation = choose_sse_implementation(
            seq_len, routing.num_sparse_partitions, max(routing.num_writers, routing.num_readers), accelerated
        )
    impl = sse_masked if implementation == "mask" else sse_varlen
    return impl(shared, sparse, v, routing, opts, op, **kw)


def sse_low_rank_attention(q, k, low, up, v, routing: Routing, opts: SSEOptions, *, feature_options: dict,
                           implementation: str = "auto", mode: str = "auto", chunk_size: int = 16,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SSE from its feature map's inputs (unpadded tokens): :func:`sse_low_rank_features` (``feature_options``),
    then :func:`sse_attention` (the other arguments). A backend may take both in one function
    (``Backend.sse_low_rank``): with ``opts.backward_head_groups`` > 1 the Triton one keeps the feature map's inputs
    rather than its six outputs for the backward, which makes them again a group of heads at a time
    (docs/paper_scale.md)."""
    if implementation not in SSE_IMPLEMENTATIONS:
        raise ValueError(f"unknown SSE implementation {implementation!r}; expected one of {SSE_IMPLEMENTATIONS}")
    kw = dict(implementation=implementation, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens)
    backend = active_backend(v)
    if backend is not None and backend.sse_low_rank is not None and implementation != "recurrent":
        out = backend.sse_low_rank(q, k, low, up, v, routing, opts, feature_options=feature_options, **kw)
        if out is not None:
            return out
    q_sh, k_sh, g_sh, q_sp, k_sp, g_sp = sse_low_rank_features(q, k, low, up, **feature_options)
    return sse_attention(Branch(q_sh, k_sh, g_sh, None), Branch(q_sp, k_sp, g_sp, None), v, routing, opts, **kw,
                         mode=mode, chunk_size=chunk_size)


def route_tokens(router_logits: torch.Tensor, num_writers: int, num_readers: int) -> Routing:
    """Router probabilities and top-k ranking through the dispatch point (see :func:`~sse_model.ops.sse.route`)."""
    backend = active_backend(router_logits)
    if backend is not None and backend.route is not None and router_logits.dtype != torch.float64:
        return backend.route(router_logits, num_writers, num_readers)
    return route(router_logits, num_writers, num_readers)


def sse_decode(pool, slots, shared: Branch, sparse: Branch, v, routing: Routing, opts: SSEOptions,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One SSE token per sequence, states updated in place in rows ``slots`` of ``pool``; see
    :func:`~sse_model.ops.sse.sse_decode_step` for shapes. The output is float32, or ``out_dtype`` (written so by
    the kernel: no cast after it)."""
    backend = active_backend(v)
    if backend is not None and backend.sse_decode is not None:
        return backend.sse_decode(pool, slots, shared, sparse, v, routing, opts, out_dtype=out_dtype)
    out = sse_decode_step(pool, slots, shared, sparse, v, routing, opts)
    return out if out_dtype is None else out.to(out_dtype)


def linear_decode(transition, pool, slots, q, k, v, g, beta=None, *, scale=None, use_qk_l2norm=False) -> torch.Tensor:
    """One GLA / gated-delta-rule token per sequence (``q, k: [B, H, K]``), states updated in place."""
    backend = active_backend(v)
    if backend is not None and backend.linear_decode is not None:
        return backend.linear_decode(transition, pool, slots, q, k, v, g, beta, scale=scale,
                                     use_qk_l2norm=use_qk_l2norm)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if transition == "gla":
        state, o = gla_step(pool[slots], q, k, v, g, scale)
    else:
        state, o = gated_delta_step(pool[slots], q, k, v, g, beta, scale, use_qk_l2norm)
    pool[slots] = state.to(pool.dtype)
    return o


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm (optionally gated) through the dispatch point; see :func:`sse_model.ops.fused.rms_norm`."""
    backend = active_backend(x)
    if backend is not None and backend.rms_norm is not None:
        out = backend.rms_norm(x, weight, eps, gate, out_dtype)
        if out is not None:
            return out
    return fused.rms_norm(x, weight, eps, gate, out_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ weight^T + bias`` (``residual``, ``bias`` optional). Without autograd (generation) a backend
    may take the product: a decode step's few rows through :mod:`kernels.skinny`, the residual added in its
    epilogue instead of by a separate kernel."""
    if not torch.is_grad_enabled():
        backend = active_backend(x)
        if backend is not None and backend.linear is not None:
            out = backend.linear(x, weight, bias, residual)
            if out is not None:
                return out
    out = F.linear(x, weight, bias)
    return out if residual is None else residual + out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation through the dispatch point; see :func:`sse_model.ops.fused.silu_mul`."""
    backend = active_backend(gate)
    if backend is not None and backend.silu_mul is not None:
        out = backend.silu_mul(gate, up)
        if out is not None:
            return out
    return fused.silu_mul(gate, up)


def sse_low_rank_features(q, k, low, up, **options):
    """The SSE layer's feature prologue from its low-rank inputs through the dispatch point; see
    :func:`sse_model.ops.fused.sse_low_rank_features`."""
    backend = active_backend(q)
    if backend is not None and backend.sse_low_rank_features is not None:
        out = backend.sse_low_rank_features(q, k, low, up, **options)
        if out is not None:
            return out
    return fused.sse_low_rank_features(q, k, low, up, **options)


def sse_decode_features(q, k, v, low, up, **options):
    """A decode step's SSE prologue through the dispatch point; see :func:`sse_model.ops.fused.sse_decode_features`."""
    backend = active_backend(q)
    if backend is not None and backend.sse_decode_features is not None:
        out = backend.sse_decode_features(q, k, v, low, up, **options)
        if out is not None:
            return out
    return fused.sse_decode_features(q, k, v, low, up, **options)


__all__ = [
    "Backend",
    "LINEAR_MODES",
    "SSE_IMPLEMENTATIONS",
    "active_backend",
    "choose_sse_implementation",
    "linear",
    "linear_attention",
    "linear_decode",
    "note_declined",
    "register_backend",
    "rms_norm",
    "route_tokens",
    "silu_mul",
    "select_linear_op",
    "sse_attention",
    "sse_decode",
    "sse_decode_features",
    "sse_low_rank_attention",
    "sse_low_rank_features",
    "torch_linear_op",
]
