"""Small building blocks shared by the mixers: norms, SwiGLU MLP, short convolution, feature maps, RoPE."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ops.dispatch import linear, rms_norm, silu_mul


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the matrix products that read a norm's output compute in: autocast's where it is on, else that of
    the weights they hold, which is the norm's own ``weight``'s (a float32 residual stream between bf16 weights,
    :attr:`SSEModel.residual_dtype`, is normed into bf16)."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoints) whose product goes through the dispatch point
    (:func:`sse_model.ops.dispatch.linear`: a decode step's few rows on the GPU through :mod:`kernels.skinny`), and
    that can add a ``residual`` to its output: the block's skip connection, in the product's epilogue when
    generating."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, residual)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight named ``weight`` (Llama and fla layout); see
    :func:`sse_model.ops.fused.rms_norm`. Under autocast the output is written in autocast's dtype: every
    layer reads a norm's output only through matrix products, which would each cast it again (and, in the
    backward, cast and sum each one's input gradient in float32)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, out_dtype=compute_dtype(x, self.weight))


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(gate)``: the GLA output norm and gate (fla ``FusedRMSNormGated``)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, gate, out_dtype=compute_dtype(x, self.weight))


def project(x: torch.Tensor, *linears: nn.Linear) -> list[torch.Tensor]:
    """Several linear maps of one input. With autograd on (training), one matrix product over the maps'
    concatenated weights: ``x`` is read once, the backward runs one input-gradient product instead of one per
    map plus their sum, and the host issues a few operators instead of a product and a cast per map; the
    outputs are column slices (views). Without autograd (generation), one product over the weights in place
    where :func:`pack_linears` laid them side by side, else one product per map (a concatenation would copy
    every weight at every decode step)."""
    sizes = [m.out_features for m in linears]
    if not torch.is_grad_enabled():
        packed = packed_weights(linears)
        if packed is None:
            return [m(x) for m in linears]
        return list(linear(x, *packed).split(sizes, dim=-1))
    weight = torch.cat([m.weight for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in linears])
    return list(F.linear(x, weight, bias).split(sizes, dim=-1))


def pack_linears(*linears: nn.Linear) -> None:
    """Moves the weights of ``linears`` (and their biases, when all have one) into consecutive rows of one new
    tensor, so that :func:`project` reads them in one matrix product when autograd is off.

    Why: a decode step multiplies a few rows by each weight; one product per map leaves most of the GPU idle
    for the narrow ones (LoRA and gate ranks of 16-64 outputs) and costs a launch each. The parameters stay
    the same objects (their ``.data`` becomes a view), so optimizers, hooks and ``load_state_dict`` keep
    working and in-place weight updates land in the packed tensor. Anything that replaces a parameter's data
    (e.g. a ``.to()`` that converts) unpacks it again; :func:`project` then falls back to one product per map.
    """
    if len({(m.in_features, m.weight.dtype, m.weight.device) for m in linears}) != 1:
        raise ValueError("pack_linears: the maps must share their input size, dtype and device")
    with torch.no_grad():
        weights = torch.cat([m.weight for m in linears])
        for m, w in zip(linears, weights.split([m.out_features for m in linears])):
            m.weight.data = w
        if all(m.bias is not None for m in linears):
            biases = torch.cat([m.bias for m in linears])
            for m, b in zip(linears, biases.split([m.out_features for m in linears])):
                m.bias.data = b


def packed_weights(linears) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight, bias)`` covering ``linears`` in order when :func:`pack_linears` laid them out side by side
    (views of the packed tensors, no copy); None otherwise."""
    weight = _covering([m.weight for m in linears])
    if weight is None:
        return None
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    bias = _covering(biases) if all(b is not None for b in biases) else None
    return None if bias is None else (weight, bias)


def _covering(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``tensors`` when they are contiguous and follow each other in one storage."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return first.detach().as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"SwiGLU MLP supports hidden_act 'silu', got {hidden_act!r}")
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        """The maps that read the block's input: packed side by side for generation (:func:`pack_linears`)."""
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual + down(silu(gate(x)) * up(x))`` (``residual`` optional)."""
        if torch.is_grad_enabled():  # a concatenated copy of these weights would be kept for every block's backward
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x), residual)
        return self.down_proj(silu_mul(*project(x, *self.input_projections())), residual)


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over time (no activation), with a decode cache and packed sequences.

    The cache holds the last ``kernel_size`` inputs, ``[B, D, kernel_size]`` (fla's layout).
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias, padding=0)

    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None):  # noqa: D102
        B, T, D = x.shape
        W = self.kernel_size[0]
        history = x.new_zeros(B, W - 1, D) if cache is None else cache[..., 1:].transpose(1, 2).to(x.dtype)
        full = torch.cat([history, x], dim=1)  # [B, W - 1 + T, D]
        weight = self.weight[:, 0, :]  # [D, W]; tap W-1 multiplies the current token
        if cu_seqlens is not None:
            pos = torch.arange(T, device=x.device)
            seq_start = cu_seqlens.long()[torch.searchsorted(cu_seqlens.long()[1:], pos, right=True)]
            pos_in_seq = pos - seq_start
        out = 0
        for j in range(W):  # j = how many steps back
            tap = full[:, W - 1 - j: W - 1 - j + T] * weight[:, W - 1 - j]
            if cu_seqlens is not None and j:
                tap = tap * (pos_in_seq >= j)[None, :, None]
            out = out + tap
        if self.bias is not None:
            out = out + self.bias
        new_cache = full[:, -W:].transpose(1, 2).contiguous() if output_final_state else None
        return out, new_cache


def row_topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(top-k(logits))`` over the last dim (zeros off the top k) and the boolean row mask."""
    top = torch.topk(logits.detach(), k, dim=-1).indices
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top, True)
    masked = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(masked.float() if masked.dtype != torch.float64 else masked, dim=-1)
    return probs.to(logits.dtype), mask


# RoPE variants whose frequencies do not depend on the sequence length at run time (``dynamic`` and
# ``longrope`` do: they are refused rather than silently computed as plain RoPE)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_frequencies(dim: int, base: float, parameters: dict | None = None,
                     max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim / 2]`` and the factor on cos/sin (YaRN's attention scaling; 1 otherwise).

    ``parameters`` are a transformers ``rope_parameters`` dict (``rope_type`` plus its keys); scaled types go
    through transformers' own initialisers, so a converted Llama-3 or YaRN model rotates as its source did.
    """
    kind = (parameters or {}).get("rope_type", "default")
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind in LENGTH_DEPENDENT_ROPE or kind not in ROPE_INIT_FUNCTIONS:
        supported = ["default"] + [k for k in ROPE_INIT_FUNCTIONS if k not in LENGTH_DEPENDENT_ROPE]
        raise ValueError(f"rope_type {kind!r} is not supported (supported: {supported}); its frequencies depend on "
                         "the sequence length at run time" if kind in LENGTH_DEPENDENT_ROPE else
                         f"rope_type {kind!r} is not supported (supported: {supported})")
    shim = LlamaConfig(hidden_size=dim, num_attention_heads=1, head_dim=dim,
                       max_position_embeddings=max_position_embeddings or 2048,
                       rope_parameters={**parameters, "rope_theta": base})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](shim, "cpu")
    return inv_freq.float(), float(factor)


class RotaryEmbedding(nn.Module):
    """RoPE with the rotate-half layout of Llama, Qwen2 and fla; optionally scaled (see :func:`rope_frequencies`)."""

    def __init__(self, dim: int, base: float = 10000.0, parameters: dict | None = None,
                 max_position_embeddings: int | None = None):
        super().__init__()
        self.dim = dim
        self.base = base
        self.rope_parameters = parameters
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_factor = rope_frequencies(dim, base, parameters, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return rope_frequencies(self.dim, self.base, self.rope_parameters, self.max_position_embeddings)[0]

    def _apply(self, fn, recurse=True):
        """Moves with the model but never drops below float32: a bf16 ``inv_freq`` puts the rotary angle of a 2B
        model off by radians beyond position 2k, so a bf16 engine would not attend like the trainer."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype in (torch.float16, torch.bfloat16):
            self._buffers["inv_freq"] = self.compute_inv_freq().to(self.inv_freq.device)
        return self

    def forward(self, q, k, position_ids):
        """``q, k: [B, T, H, D]``; ``position_ids: [B, T]``."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device)
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [B, T, 1, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor

        def rotate(x):
            x1, x2 = x.chunk(2, dim=-1)
            xf = x.to(cos.dtype) if x.dtype != torch.float64 else x
            rotated = torch.cat([-x2, x1], dim=-1).to(xf.dtype)
            return (xf * cos.to(xf.dtype) + rotated * sin.to(xf.dtype)).to(x.dtype)

        return rotate(q), rotate(k)
