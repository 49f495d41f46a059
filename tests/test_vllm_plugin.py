"""The vLLM plugin's parts that need no vLLM (``pipeline/rollout/vllm/plugin.py``): what it refuses, the state
shapes it asks vLLM for, and where each checkpoint tensor lands. The model itself runs on the GPU
(``python -m scripts.vllm_site check-plugin``)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from pipeline.rollout.vllm.plugin import (check_supported, linear_kind, run_linear_layer, state_dtypes, state_shapes,
                                          vllm_weight_name)
from sse_model import SSEConfig, SSEForCausalLM
from sse_model.layers.common import ForwardContext


def test_the_plugin_imports_without_vllm():
    code = ("import sys; import pipeline.rollout.vllm.plugin; "
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


def _meta(decodes: list[int], prefills: list[tuple[int, int, int]]):
    """vLLM's linear-attention metadata for ``decodes`` (state rows of one-token sequences) then ``prefills``
    (``(row, tokens this step, tokens before)``): the fields :func:`run_linear_layer` reads."""
    lengths = [1] * len(decodes) + [n for _, n, _ in prefills]
    return SimpleNamespace(
        num_decodes=len(decodes), num_decode_tokens=len(decodes), num_prefills=len(prefills),
        query_start_loc=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor([0] * len(decodes) + [n + before for _, n, before in prefills], dtype=torch.int32),
        state_indices_tensor=torch.tensor(decodes + [row for row, _, _ in prefills], dtype=torch.int32))


@pytest.mark.parametrize("overrides", [{}, dict(use_short_conv=True), dict(mixer_types=["gla"] * 5 + ["attn"])])
def test_a_linear_layer_over_vllm_batches_equals_each_sequence_alone(overrides):
    """Three steps as vLLM schedules them: two new prompts; then both decode while a third prompt arrives and a
    fourth is prefilled in two chunks; then three decode beside the fourth's second chunk and a fifth, new prompt.
    State rows hold stale values from earlier sequences. Every token's output equals the mixer run over its whole
    sequence, and a step's prompts take one call of the mixer (one per prompt with convolution caches)."""
    torch.manual_seed(0)
    config = SSEConfig.from_preset("sse-h-tiny", **overrides)
    mixer = SSEForCausalLM(config).model.layers[0].attn.eval()
    D, lengths = config.hidden_size, {0: 7, 1: 5, 2: 5, 3: 6, 4: 4}
    seqs = {s: torch.randn(n, D) for s, n in lengths.items()}
    rows = {0: 4, 1: 1, 2: 2, 3: 5, 4: 3}
    with torch.no_grad():
        want = {s: mixer(x[None], ForwardContext(torch.arange(len(x))[None], torch.arange(len(x))[None]))[0][0]
                for s, x in seqs.items()}
        states = tuple(torch.randn(6, *shape).to(dtype) for shape, dtype in
                       zip(state_shapes(config), state_dtypes(config, torch.float32)))
        # (decoding sequences, [(sequence, first token, tokens)] of prompts) per step
        steps = [([], [(0, 0, 5), (1, 0, 3)]),
                 ([0, 1], [(2, 0, 4), (3, 0, 3)]),
                 ([0, 1, 2], [(3, 3, 3), (4, 0, 4)])]
        done = {s: 0 for s in seqs}
        for decoding, prompts in steps:
            parts = [seqs[s][done[s]:done[s] + 1] for s in decoding] + [seqs[s][a:a + n] for s, a, n in prompts]
            pos = [torch.tensor([done[s]]) for s in decoding] + [torch.arange(a, a + n) for s, a, n in prompts]
            meta = _meta([rows[s] for s in decoding], [(rows[s], n, a) for s, a, n in prompts])
            calls = []
            hook = mixer.register_forward_hook(lambda *_: calls.append(1))
            out = run_linear_layer(mixer, torch.cat(parts), torch.cat(pos), states, meta)
            hook.remove()
            assert len(calls) == bool(decoding) + (len(prompts) if config.use_short_conv else 1)
            first = 0
            for s, part, p in zip(decoding + [s for s, _, _ in prompts], parts, pos):
                torch.testing.assert_close(out[first:first + len(part)], want[s][p], atol=2e-5, rtol=1e-4)
                first += len(part)
            for s in decoding:
                done[s] += 1
            for s, a, n in prompts:
                done[s] = a + n
