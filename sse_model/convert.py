"""Build an SSE-H model from a pretrained Llama/Qwen2-style Transformer by weight inheritance.

Which layers become SSE: by default the paper's pattern, ``[sse] * 5 + [attn]`` repeated, so with L layers
the layers ``5, 11, 17, ...`` (0-based) stay softmax attention and every other layer becomes SSE. Pass
``mixer_types`` for any other pattern.

What is inherited: token embeddings, the LM head, every RMSNorm, every MLP, and the Q/K/V/O projections of
every layer (biases too: Qwen2's Q/K/V biases set ``linear_qkv_bias``, Llama's ``attention_bias`` also
``output_bias``). Kept attention layers are copied exactly (same heads, GQA, RoPE base and scaling, e.g.
Llama-3 or YaRN ``rope_parameters``), so they compute what they computed in the source. In SSE layers the
source's K/V heads are repeated across its GQA groups, so every query head keeps reading the keys and
values it read before; SSE gives every partition the same Q/K/V.

What is new, and how it starts: the LoRA difference between the sparse and the shared partitions starts at
zero (its up-projection is zero), so all partitions begin with the inherited projections; the router starts
near uniform (small weights); decay gates, output gate and output norm start as a freshly initialised
SSE layer (fla's initialisation), which is what training from scratch uses; ``start="attention_like"`` gives
the decays a memory of thousands of tokens instead. Neither makes the layers compute what attention computed:
:mod:`sse_model.align` (the recipes' ``align`` stage) teaches them that.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from .configuration_sse import ATTENTION_MIXERS, SSEConfig, hybrid_mixer_types
from .modeling_sse import SSEForCausalLM

SUPPORTED = ("llama", "qwen2")
# how the new parts of a converted SSE layer start: "fresh" as a layer trained from scratch, "attention_like" with
# decays near 1 (sse_model.align.attention_like_start), closer to attention's memory of the whole context
CONVERT_STARTS = ("fresh", "attention_like")


def _rope(cfg) -> dict:
    """``rope_theta`` and, for a scaled RoPE (Llama-3, YaRN, linear, ...), the source's ``rope_parameters``."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    params = dict(params) if isinstance(params, dict) else {}
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=theta)
    return dict(rope_theta=theta, rope_parameters={**params, "rope_type": kind, "rope_theta": theta})


def sse_config_from_transformer(cfg, mixer_types: list[str] | None = None, **overrides) -> SSEConfig:
    """The SSE-H configuration matching a Llama/Qwen2-style config (same widths, heads and vocabulary)."""
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"conversion supports {SUPPORTED}, got model_type={cfg.model_type!r}")
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"conversion needs a SwiGLU MLP (hidden_act='silu'), got {cfg.hidden_act!r}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
    out_bias = bool(getattr(cfg, "attention_bias", False)) and cfg.model_type == "llama"  # Qwen2: Q/K/V only
    layers = cfg.num_hidden_layers
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=layers,
        mixer_types=mixer_types or hybrid_mixer_types(layers),
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        num_heads=cfg.num_attention_heads,
        head_dim=head_dim,
        linear_qkv_bias=qkv_bias,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        attention_head_dim=head_dim,
        attention_bias=qkv_bias,
        output_bias=out_bias,
        **_rope(cfg),
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )
    kwargs.update(overrides)
    return SSEConfig(**kwargs)


def _repeat_kv(weight: torch.Tensor, num_kv: int, groups: int, head_dim: int) -> torch.Tensor:
    """``[num_kv * D, ...]`` -> ``[num_kv * groups * D, ...]``: each KV head copied for its query heads."""
    shape = weight.shape
    w = weight.reshape(num_kv, 1, head_dim, *shape[1:]).expand(num_kv, groups, head_dim, *shape[1:])
    return w.reshape(num_kv * groups * head_dim, *shape[1:])


@torch.no_grad()
def convert_to_sse(
    source: PreTrainedModel | str | Path,
    mixer_types: list[str] | None = None,
    torch_dtype: torch.dtype | None = None,
    start: str = "fresh",
    **config_overrides,
) -> SSEForCausalLM:
    """Converts ``source`` (a model object, or a local path / hub name of one) into an SSE-H model; ``start`` is one
    of :data:`CONVERT_STARTS`."""
    if start not in CONVERT_STARTS:
        raise ValueError(f"start must be one of {CONVERT_STARTS}, got {start!r}")
    if not isinstance(source, PreTrainedModel):
        source = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype or torch.float32)
    src_cfg = source.config
    config = sse_config_from_transformer(src_cfg, mixer_types, **config_overrides)
    model = SSEForCausalLM(config).to(dtype=next(source.parameters()).dtype)
    src = source.model
    model.model.embeddings.weight.copy_(src.embed_tokens.weight)
    model.model.norm.weight.copy_(src.norm.weight)
    if not config.tie_word_embeddings:
        model.lm_head.weight.copy_(source.lm_head.weight)

    groups = src_cfg.num_attention_heads // src_cfg.num_key_value_heads
    for i, (ours, theirs) in enumerate(zip(model.model.layers, src.layers)):
        ours.attn_norm.weight.copy_(theirs.input_layernorm.weight)
        ours.mlp_norm.weight.copy_(theirs.post_attention_layernorm.weight)
        ours.mlp.load_state_dict(theirs.mlp.state_dict())
        attn, mixer = theirs.self_attn, ours.attn
        if config.mixer_types[i] in ATTENTION_MIXERS:
            mixer.load_state_dict(attn.state_dict())
            continue
        for name in ("q_proj", "k_proj", "v_proj"):
            src_lin, dst_lin = getattr(attn, name), getattr(mixer, name)
            repeat = name != "q_proj" and groups > 1
            dst_lin.weight.copy_(_repeat_kv(src_lin.weight, src_cfg.num_key_value_heads, groups, config.head_dim)
                                 if repeat else src_lin.weight)
            if dst_lin.bias is not None and src_lin.bias is not None:
                dst_lin.bias.copy_(_repeat_kv(src_lin.bias, src_cfg.num_key_value_heads, groups, config.head_dim)
                                   if repeat else src_lin.bias)
        mixer.o_proj.weight.copy_(attn.o_proj.weight)
        if attn.o_proj.bias is not None:
            mixer.o_proj.bias.copy_(attn.o_proj.bias)
        if hasattr(mixer, "lora_q_proj"):
            mixer.lora_q_proj[1].weight.zero_()
            mixer.lora_k_proj[1].weight.zero_()
    if start == "attention_like":
        from .align import attention_like_start

        attention_like_start(model)
    return model


@torch.no_grad()
def export_to_llama(model: SSEForCausalLM):
    """The Llama model that computes what an all-attention ``model`` (e.g. the ``transformer-2b`` preset) computes:
    the same weights under transformers' Llama names, for tools that serve only standard architectures (vLLM as
    the rollout engine's peer). The inverse of :func:`convert_to_sse` on such models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    others = sorted({m for m in cfg.mixer_types if m not in ATTENTION_MIXERS})
    if others:
        raise ValueError(f"only all-attention models export to Llama; mixer_types has {others}")
    if cfg.attention_bias != cfg.output_bias:
        raise ValueError("Llama has one attention_bias for Q/K/V and O: attention_bias and output_bias must agree")
    rope = dict(cfg.rope_parameters) if cfg.rope_parameters else dict(rope_type="default", rope_theta=cfg.rope_theta)
    llama_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.attn_head_dim, hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        attention_bias=cfg.attention_bias, rope_parameters=rope, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )
    weight = next(model.parameters())
    with torch.device(weight.device):  # built where the weights are: a 2B model on the GPU in seconds
        llama = LlamaForCausalLM(llama_cfg).to(weight.dtype)
    dst = llama.model
    dst.embed_tokens.weight.copy_(model.model.embeddings.weight)
    dst.norm.weight.copy_(model.model.norm.weight)
    if not cfg.tie_word_embeddings:
        llama.lm_head.weight.copy_(model.lm_head.weight)
    for ours, theirs in zip(model.model.layers, dst.layers):
        theirs.input_layernorm.weight.copy_(ours.attn_norm.weight)
        theirs.post_attention_layernorm.weight.copy_(ours.mlp_norm.weight)
        theirs.mlp.load_state_dict(ours.mlp.state_dict())
        theirs.self_attn.load_state_dict(ours.attn.state_dict())
    return llama.eval()
