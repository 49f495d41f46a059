"""The vLLM plugin's parts that need no vLLM (``pipeline/rollout/vllm_plugin.py``): what it refuses, the state
shapes it asks vLLM for, and where each checkpoint tensor lands. The model itself runs on the GPU
(``python -m pipeline.rollout.vllm_site check-plugin``)."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from pipeline.rollout.vllm_plugin import check_supported, linear_kind, state_dtypes, state_shapes, vllm_weight_name
from sse_model import SSEConfig, SSEForCausalLM


def test_the_plugin_imports_without_vllm():
    code = ("import sys; import pipeline.rollout.vllm_plugin; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sse_state_is_the_shared_and_sparse_partitions_in_float32():
    config = SSEConfig.from_preset("sse-h-2b")
    assert state_shapes(config) == ((1 + 4, 18, 128, 128),)
    assert state_dtypes(config, torch.bfloat16) == (torch.float32,)
    check_supported(config)


def test_short_convolutions_add_two_caches_in_the_model_dtype():
    config = SSEConfig.from_preset("sse-h-tiny", use_short_conv=True, conv_size=4)
    H, K = config.num_heads, config.head_dim
    assert state_shapes(config) == ((1 + 4, H, K, K), (H * K, 4), (H * K, 4))
    assert state_dtypes(config, torch.bfloat16) == (torch.float32, torch.bfloat16, torch.bfloat16)


def test_gla_hybrid_state_has_no_partitions():
    config = SSEConfig.from_preset("sse-h-tiny", mixer_types=["gla", "gla", "attn", "gla", "gla", "attn"])
    assert linear_kind(config) == "gla"
    assert state_shapes(config) == ((config.num_heads, config.head_dim, config.head_dim),)


@pytest.mark.parametrize("change, key", [
    (dict(mixer_types=["sse", "gla", "attn", "sse", "sse", "attn"]), "mixer_types"),
    (dict(mixer_types=["attn"] * 6), "export_to_llama"),
    (dict(num_attention_heads=2), "head_dim"),
])
def test_what_vllm_cannot_serve_is_refused_by_name(change, key):
    config = SSEConfig.from_preset("sse-h-tiny", **change)
    with pytest.raises(ValueError, match=key):
        check_supported(config)


def test_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        check_supported(SSEConfig.from_preset("sse-h-tiny"), tensor_parallel_size=2)


class _Wrapped(nn.Module):
    """What the vLLM model does to each mixer: it becomes ``.inner`` of a vLLM layer."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner


@pytest.mark.parametrize("tied", [False, True])
def test_every_checkpoint_tensor_lands_on_one_parameter(tmp_path, tied):
    from safetensors.torch import load_file

    config = SSEConfig.from_preset("sse-h-tiny", tie_word_embeddings=tied)
    model = SSEForCausalLM(config)
    model.save_pretrained(tmp_path)
    for block in model.model.layers:
        block.attn = _Wrapped(block.attn)
    params = dict(model.named_parameters())
    names = [vllm_weight_name(n) for n in load_file(tmp_path / "model.safetensors")]
    loaded = [n for n in names if n is not None and not (tied and n == "lm_head.weight")]
    assert sorted(loaded) == sorted(params)  # each parameter once, nothing left over
    assert any(".attn.inner.q_proj." in n for n in loaded)
    assert vllm_weight_name("model.layers.5.attn.rotary.inv_freq") is None
    assert vllm_weight_name("model.embeddings.weight") == "model.embeddings.weight"
