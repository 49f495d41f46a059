"""Loading a saved model from a local path, with errors that say what is wrong with the path.

One place for every caller (stages, the rollout engine, evaluation): a directory that does not exist, has no
``config.json``, holds truncated weights, or holds another architecture where an SSE model is needed is a
one-line error naming the file and what to do, not a traceback from deep inside transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class CheckpointError(ValueError):
    pass


def load_pretrained(path: str | Path, dtype: torch.dtype | None = None, require_sse: bool = False):
    """The model saved at ``path`` (ours, fla's SSE format, or any transformers causal LM); a hub name is
    passed through to transformers. ``require_sse``: refuse models that are not :class:`SSEForCausalLM`."""
    from transformers import AutoModelForCausalLM

    import sse_model  # noqa: F401 - registers the SSE architectures with the Auto classes

    from .fla_compat import FLA_MODEL_TYPE, load_fla_checkpoint
    from .modeling_sse import SSEForCausalLM

    local = Path(path)
    if local.suffix == ".gguf":
        return _load_gguf(local, dtype, require_sse)
    looks_local = local.is_absolute() or str(path).startswith(".") or local.exists() or str(path).count("/") != 1
    if looks_local:
        if not local.exists():
            raise CheckpointError(f"{local}: no such model directory")
        config_file = local / "config.json"
        if not config_file.exists():
            raise CheckpointError(f"{local}: no config.json here, so it is not a saved model directory "
                                  "(a stage's model is in <output_dir>/<stage>/final)")
        try:
            config = json.loads(config_file.read_text())
        except ValueError as err:
            raise CheckpointError(f"{config_file}: not valid JSON ({err})") from err
        kind = config.get("model_type")
        if require_sse and kind not in ("sse_hybrid", FLA_MODEL_TYPE):
            raise CheckpointError(f"{local}: a {kind!r} model; an SSE model is needed here (convert a Llama/Qwen2 "
                                  "model with sse_model.convert.convert_to_sse, or model.convert_from in a recipe)")
        try:
            if kind == FLA_MODEL_TYPE:
                return load_fla_checkpoint(local, dtype or torch.float32)
            return AutoModelForCausalLM.from_pretrained(local, dtype=dtype or torch.float32)
        except Exception as err:  # noqa: BLE001 - name the file whose contents are broken
            broken = [p for p in sorted(local.glob("*.safetensors")) + sorted(local.glob("*.bin"))]
            raise CheckpointError(f"{local}: its weights do not load ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:200]}); files: {[p.name for p in broken]}. A run killed "
                                  "while saving leaves such files; use an earlier checkpoint") from err
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    if require_sse and not isinstance(model, SSEForCausalLM):
        raise CheckpointError(f"{path}: a {model.config.model_type!r} model; an SSE model is needed here")
    return model


def _load_gguf(file: Path, dtype: torch.dtype | None, require_sse: bool):
    """A GGUF file (llama.cpp's format: one file with the weights, possibly quantised, and the tokenizer) through
    transformers' GGUF support, dequantised to ``dtype``."""
    from transformers import AutoModelForCausalLM

    if not file.is_file():
        raise CheckpointError(f"{file}: no such GGUF file")
    if require_sse:
        raise CheckpointError(f"{file}: a GGUF file holds a Transformer; an SSE model is needed here (convert it with "
                              "model.convert_from in a recipe)")
    try:
        import gguf  # noqa: F401
    except ImportError as err:
        raise CheckpointError(f"{file}: loading GGUF files needs the gguf package (pip install gguf)") from err
    try:
        return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=dtype or torch.float32)
    except Exception as err:  # noqa: BLE001 - name the file
        raise CheckpointError(f"{file}: does not load as a GGUF model ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''})") from err
