"""Loading the model and tokenizer a stage starts from."""

from __future__ import annotations

from pathlib import Path

import torch

from .recipe import ModelSpec
from .tokenizer import build_char_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("recipe asks for device=cuda but no CUDA device is available")
    return torch.device(name)


def load_tokenizer(name: str | None, fallback: str | Path | None = None):
    from transformers import AutoTokenizer

    if name == "char":
        return build_char_tokenizer()
    source = name or fallback
    if source is None:
        raise ValueError("model.tokenizer is needed to build a model from a preset (a path, hub name, or 'char')")
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(spec: ModelSpec, checkpoint: str | Path | None = None, seed: int = 0):
    """``(model, tokenizer)``: from ``checkpoint`` (a previous stage) if given, else from ``spec``."""
    from sse_model import SSEConfig, SSEForCausalLM
    from sse_model.checkpoint import load_pretrained
    from sse_model.convert import convert_to_sse

    dtype = DTYPES[spec.dtype]
    path = checkpoint or spec.path
    if path is not None:
        return load_pretrained(path, dtype), load_tokenizer(spec.tokenizer if checkpoint is None else None, path)
    if spec.convert_from is not None:
        model = convert_to_sse(spec.convert_from, torch_dtype=dtype, **spec.config_overrides)
        return model, load_tokenizer(spec.tokenizer, spec.convert_from)
    tokenizer = load_tokenizer(spec.tokenizer)
    config = SSEConfig.from_preset(spec.preset, **{
        "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **spec.config_overrides})
    torch.manual_seed(seed)
    return SSEForCausalLM(config).to(dtype), tokenizer


def in_ray_worker() -> bool:
    """Inside a Ray task or actor, where terminal progress bars print a new line per refresh: the stages then
    turn the trainer's bars off and log a progress line with rate and ETA instead."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def use_bf16(recipe, device: torch.device) -> bool:
    """TRL's ``bf16`` flag for a stage: the recipe's ``bf16``, by default on for CUDA (weights stay in
    ``model.dtype``; float32 weights with bf16 autocast is the usual mixed precision)."""
    if device.type != "cuda":
        return False
    return recipe.bf16 if recipe.bf16 is not None else recipe.model.dtype != "float16"


def engine_dtype(engine_config, model_dtype: str) -> torch.dtype:
    return DTYPES[engine_config.dtype or model_dtype]
