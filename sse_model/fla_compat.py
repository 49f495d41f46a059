"""Checkpoints of flash-linear-attention's SSE models (``fla.models.sse``, ``model_type="sse"``).

fla's ``SSEForCausalLM`` stores SSE layers (``SSEGLA`` / ``SSEGDN``) and, for hybrids, fla ``Attention``
layers listed in ``config.attn["layers"]``. Our modules use the same parameter names, so a checkpoint maps
one to one; only the configuration is translated. Loading accepts ``model.safetensors`` (also sharded) and
``pytorch_model.bin``; saving writes fla's ``config.json`` and ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .configuration_sse import ATTENTION_MIXERS, SSEConfig, default_intermediate_size
from .modeling_sse import SSEForCausalLM

FLA_MODEL_TYPE = "sse"


def sse_config_from_fla(fla: dict, source: str = "config.json") -> SSEConfig:
    """Translates an fla SSE ``config.json`` dict into :class:`SSEConfig`."""

    def get(key, default=None):
        return fla.get(key, default)

    if get("model_type") != FLA_MODEL_TYPE:
        raise ValueError(f"{source}: model_type is {get('model_type')!r}, expected {FLA_MODEL_TYPE!r} (fla SSE)")
    if get("num_v_heads") not in (None, get("num_heads", 6)):
        raise ValueError(f"{source}: num_v_heads (grouped value heads) is not supported")
    if get("attn_mode", "chunk") not in ("chunk", "fused_recurrent"):
        raise ValueError(f"{source}: unknown attn_mode {get('attn_mode')!r}")
    hidden = get("hidden_size", 2048)
    layers = get("num_hidden_layers", 24)
    attn = get("attn") or {}
    attn_layers = set(attn.get("layers", []))
    window = attn.get("window_size")
    mixer_types = [("swa" if window else "attn") if i in attn_layers else "sse" for i in range(layers)]
    transition = get("linear_attn_type", "gla")
    if transition not in ("gla", "gdn"):
        raise ValueError(f"{source}: unknown linear_attn_type {transition!r}")
    return SSEConfig(
        vocab_size=get("vocab_size", 32000),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size") or default_intermediate_size(hidden, get("hidden_ratio") or 4),
        num_hidden_layers=layers,
        mixer_types=mixer_types,
        hidden_act="silu",
        rms_norm_eps=get("norm_eps", 1e-6),
        initializer_range=get("initializer_range", 0.02),
        max_position_embeddings=get("max_position_embeddings", 2048),
        num_heads=get("num_heads", 6),
        head_dim=get("head_dim", 256),
        expand_v=get("expand_v", 1.0),
        use_output_gate=get("use_output_gate", True),
        use_short_conv=get("use_short_conv", False),
        conv_size=get("conv_size", 4),
        allow_neg_eigval=get("allow_neg_eigval", False),
        q_activation="silu",
        k_activation=None,
        v_activation="silu",
        num_sparse_partitions=get("num_sparse_partition", 4),
        num_writers=get("num_writer", 2),
        num_readers=get("num_reader", 2),
        sse_transition=transition,
        sse_implementation=get("sse_implementation", "varlen"),
        aux_loss_coef=get("aux_loss_coef", 0.01),
        num_attention_heads=attn.get("num_heads", get("num_heads", 6)),
        num_key_value_heads=attn.get("num_kv_heads") or attn.get("num_heads"),
        attention_bias=attn.get("qkv_bias", False),
        rope_theta=attn.get("rope_theta", 10000.0),
        sliding_window=window,
        tie_word_embeddings=get("tie_word_embeddings", False),
        bos_token_id=get("bos_token_id", 1),
        eos_token_id=get("eos_token_id", 2),
        pad_token_id=get("pad_token_id"),
    )


def fla_config_from_sse(config: SSEConfig) -> dict:
    """The fla ``config.json`` for ``config``; raises if the model uses options fla's layer lacks."""
    problems = []
    kinds = set(config.mixer_types)
    if kinds - {"sse", *ATTENTION_MIXERS}:
        problems.append(f"mixers {sorted(kinds - {'sse', 'attn', 'swa'})}")
    checks = {
        "q_activation": (config.q_activation, "silu"),
        "k_activation": (config.key_activation(config.sse_transition), "softmax" if config.sse_transition == "gla" else "silu"),
        "v_activation": (config.v_activation, "silu"),
        "row_topk": (config.row_topk, None),
        "lora_side": (config.lora_side, "sparse"),
        "lora_rank": (config.resolved_lora_rank(), config.head_v_dim),
        "sse_gating": (config.sse_gating, "write_read"),
        "gdn_gate_target": (config.gdn_gate_target, "key"),
        "linear_qkv_bias": (config.linear_qkv_bias, False),
        "gate_low_rank_dim": (config.gate_low_rank_dim, 16),
        "gate_logit_normalizer": (config.gate_logit_normalizer, 16),
    }
    problems += [f"{k}={v!r} (fla has {want!r})" for k, (v, want) in checks.items() if v != want]
    if "swa" in kinds and "attn" in kinds:
        problems.append("both attn and swa layers (fla has one window for all attention layers)")
    if "sse" in kinds and (config.num_writers >= config.num_sparse_partitions
                           or config.num_readers >= config.num_sparse_partitions):
        problems.append("num_writers/num_readers must be below num_sparse_partitions in fla")
    if problems:
        raise ValueError("cannot save in fla's SSE format: " + "; ".join(problems))
    attn_layers = [i for i, kind in enumerate(config.mixer_types) if kind in ATTENTION_MIXERS]
    return {
        "model_type": FLA_MODEL_TYPE,
        "architectures": ["SSEForCausalLM"],
        "attn_mode": "chunk",
        "hidden_size": config.hidden_size,
        "expand_v": config.expand_v,
        "use_output_gate": config.use_output_gate,
        "use_short_conv": config.use_short_conv,
        "allow_neg_eigval": config.allow_neg_eigval,
        "conv_size": config.conv_size,
        "head_dim": config.head_dim,
        "num_heads": config.num_heads,
        "num_v_heads": None,
        "num_sparse_partition": config.num_sparse_partitions,
        "num_writer": config.num_writers,
        "num_reader": config.num_readers,
        "linear_attn_type": config.sse_transition,
        "sse_implementation": "mask" if config.sse_implementation == "mask" else "varlen",
        "aux_loss_coef": config.aux_loss_coef,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_ratio": 4,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "swish",
        "num_hidden_layers": config.num_hidden_layers,
        "norm_eps": config.rms_norm_eps,
        "attn": None if not attn_layers else {
            "layers": attn_layers,
            "num_heads": config.num_attention_heads,
            "num_kv_heads": config.num_key_value_heads,
            "qkv_bias": config.attention_bias,
            "window_size": config.sliding_window if "swa" in kinds else None,
            "rope_theta": config.rope_theta,
        },
        "use_cache": True,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "fuse_norm": True,
        "fuse_swiglu": True,
        "fuse_cross_entropy": True,
        "fuse_linear_cross_entropy": False,
        "use_l2warp": False,
        "vocab_size": config.vocab_size,
    }


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    single = path / "model.safetensors"
    if single.exists():
        return load_file(single)
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(path / shard))
        return state
    binary = path / "pytorch_model.bin"
    if binary.exists():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def load_fla_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> SSEForCausalLM:
    """Loads a directory written by fla's ``SSEForCausalLM.save_pretrained`` into our model."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} does not exist")
    try:
        fla_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file}: invalid JSON ({err})") from err
    config = sse_config_from_fla(fla_config, str(config_file))
    state = _read_state_dict(path)
    model = SSEForCausalLM(config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: parameters do not match fla's SSE layout; missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    return model.to(dtype) if dtype is not None else model


def save_fla_checkpoint(model: SSEForCausalLM, path: str | Path) -> None:
    """Writes ``model`` as fla's ``SSEForCausalLM`` would (config.json + model.safetensors), atomically."""
    path = Path(path)
    config = fla_config_from_sse(model.config)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, payload in (("model.safetensors", state), ("config.json", config)):
        fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{name}.")
        os.close(fd)
        if name.endswith(".json"):
            Path(tmp).write_text(json.dumps(payload, indent=2))
        else:
            save_file(payload, tmp, metadata={"format": "pt"})
        os.replace(tmp, path / name)
