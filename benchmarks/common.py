"""Helpers every benchmark may share."""

from __future__ import annotations

import gc

import torch


def release(device: torch.device) -> None:
    """Frees the models a benchmark has dropped before it builds the next one: a model patched with TRL's fused LM
    head or a forward hook sits in reference cycles that only the cyclic collector frees, so without this the next
    model's peak memory included the last one's weights (seen on an H100: 2B weights in the next row's peak)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def model_spec(spec: str) -> tuple[str, dict]:
    """``preset[:key=value,...]`` -> the preset and its config settings (values read as YAML: 4, true, 1e-3)."""
    import yaml

    preset, _, settings = spec.partition(":")
    pairs = [item.partition("=") for item in settings.split(",") if item]
    bad = [key for key, eq, _ in pairs if not eq]
    if bad:
        raise SystemExit(f"--models {spec}: {bad[0]!r} is not key=value")
    return preset, {key: yaml.safe_load(value) for key, _, value in pairs}
