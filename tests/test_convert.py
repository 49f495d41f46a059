"""Conversion of Llama/Qwen2-style Transformers into SSE-H by weight inheritance."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from helpers import assert_close
from sse_model.convert import convert_to_sse

SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


ROPE = {
    "llama3": dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "yarn": dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64),
}


def source_model(kind, **overrides):
    torch.manual_seed(0)
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[kind]
    model = cls(cfg(**{**SHAPE, **overrides})).eval()
    with torch.no_grad():  # give Qwen2's zero-initialised Q/K/V biases some values to inherit
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_kept_attention_layers_compute_the_same(kind, tmp_path):
    source = source_model(kind)
    source.save_pretrained(tmp_path)
    converted = convert_to_sse(tmp_path).eval()  # from a local path
    assert converted.config.mixer_types == ["sse"] * 5 + ["attn"]
    hidden = torch.randn(2, 11, 64)
    position_ids = torch.arange(11)[None].expand(2, -1)
    src_layer, our_layer = source.model.layers[5], converted.model.layers[5]
    cos_sin = source.model.rotary_emb(hidden, position_ids)
    with torch.no_grad():
        expected = src_layer.self_attn(hidden, position_embeddings=cos_sin, attention_mask=None)[0]
        from sse_model.layers.common import ForwardContext
        got = our_layer.attn(hidden, ForwardContext(position_ids, torch.arange(11)[None]))[0]
    assert_close(got, expected, torch.float32, f"{kind} attention layer")
    for name in ("attn_norm", "mlp_norm"):
        assert torch.equal(getattr(our_layer, name).weight,
                           getattr(src_layer, "input_layernorm" if name == "attn_norm" else "post_attention_layernorm").weight)
    assert torch.equal(converted.model.embeddings.weight, source.model.embed_tokens.weight)
    sse = converted.model.layers[0].attn
    assert torch.equal(sse.q_proj.weight, source.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(sse.k_proj.weight[:16], source.model.layers[0].self_attn.k_proj.weight[:16])
    assert torch.equal(sse.k_proj.weight[16:32], source.model.layers[0].self_attn.k_proj.weight[:16])  # GQA repeat
    assert (sse.q_proj.bias is not None) == (kind == "qwen2")


@pytest.mark.parametrize("case", ["llama3-rope", "yarn-rope", "llama-attention-bias"])
def test_kept_attention_layers_compute_the_same_with_rope_scaling_and_biases(case):
    """Scaled RoPE (Llama-3, YaRN) and Llama's ``attention_bias`` (Q/K/V and O) are inherited exactly, at
    positions beyond the source's original context."""
    overrides = {"llama-attention-bias": dict(attention_bias=True)}.get(case) or dict(rope_parameters=ROPE[case[:-5]])
    source = source_model("llama", **overrides)
    converted = convert_to_sse(source).eval()
    T = 200
    hidden = torch.randn(2, T, 64)
    position_ids = torch.arange(T)[None].expand(2, -1)
    src_layer, our_layer = source.model.layers[5], converted.model.layers[5]
    with torch.no_grad():
        cos_sin = source.model.rotary_emb(hidden, position_ids)
        expected = src_layer.self_attn(hidden, position_embeddings=cos_sin, attention_mask=None)[0]
        from sse_model.layers.common import ForwardContext
        got = our_layer.attn(hidden, ForwardContext(position_ids, torch.arange(T)[None]))[0]
    assert_close(got, expected, torch.float32, case)
    if case == "llama-attention-bias":
        assert torch.equal(converted.model.layers[0].attn.o_proj.bias, source.model.layers[0].self_attn.o_proj.bias)


def test_length_dependent_rope_is_refused():
    source = source_model("llama", rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0))
    with pytest.raises(ValueError, match="rope_parameters.*'dynamic'.*sequence length"):
        convert_to_sse(source)


def test_converted_model_trains():
    model = convert_to_sse(source_model("qwen2")).train()
    torch.manual_seed(1)
    batch = torch.randint(0, 101, (4, 24))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(batch, labels=batch).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_unsupported_source_is_rejected():
    from transformers import GPT2Config

    from sse_model.convert import sse_config_from_transformer
    with pytest.raises(ValueError, match="model_type"):
        sse_config_from_transformer(GPT2Config())


@pytest.mark.parametrize("case", ["plain", "gqa-tied-llama3-rope-biases"])
def test_all_attention_model_exports_to_llama(case):
    """``export_to_llama`` gives a transformers Llama with the same logits (the peer engines serve Llama), and
    converting it back gives the same weights."""
    from sse_model import SSEConfig, SSEForCausalLM
    from sse_model.convert import export_to_llama

    extra = {} if case == "plain" else dict(num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True,
                                            output_bias=True, rope_parameters=ROPE["llama3"])
    torch.manual_seed(0)
    config = SSEConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       mixer_types=["attn"] * 3, num_attention_heads=4, max_position_embeddings=256, **extra)
    model = SSEForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    llama = export_to_llama(model)
    ids = torch.randint(0, 101, (2, 40))
    with torch.no_grad():
        assert_close(llama(ids).logits, model(ids).logits, torch.float32, f"{case}: Llama logits")
    back = convert_to_sse(llama, mixer_types=["attn"] * 3)
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_export_to_llama_refuses_linear_mixers():
    from sse_model import SSEConfig, SSEForCausalLM
    from sse_model.convert import export_to_llama

    model = SSEForCausalLM(SSEConfig.from_preset("sse-h-tiny"))
    with pytest.raises(ValueError, match="only all-attention models export to Llama.*sse"):
        export_to_llama(model)
