"""Checkpoints in flash-linear-attention's SSE format: config translation, loading and saving back."""

import json

import pytest
import torch

from sse_model import SSEConfig, SSEForCausalLM
from sse_model.fla_compat import fla_config_from_sse, load_fla_checkpoint, save_fla_checkpoint, sse_config_from_fla

FLA_HYBRID = {  # a config.json as fla's SSEConfig(...).save_pretrained writes it (non-default values)
    "model_type": "sse", "attn_mode": "chunk", "hidden_size": 64, "expand_v": 1.0, "use_output_gate": True,
    "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "head_dim": 16, "num_heads": 4,
    "num_v_heads": None, "num_sparse_partition": 4, "num_writer": 1, "num_reader": 1, "linear_attn_type": "gla",
    "sse_implementation": "mask", "aux_loss_coef": 0.01, "max_position_embeddings": 2048, "hidden_ratio": 4,
    "intermediate_size": None, "hidden_act": "swish", "num_hidden_layers": 3, "norm_eps": 1e-6,
    "attn": {"layers": [2], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": False, "window_size": None,
             "rope_theta": 10000.0},
    "vocab_size": 128, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
}


def test_config_translation():
    config = sse_config_from_fla(FLA_HYBRID)
    assert config.mixer_types == ["sse", "sse", "attn"]
    assert config.intermediate_size == 256  # fla's GatedMLP rule: 64 * 4 * 2/3 -> next multiple of 256
    assert config.num_key_value_heads == 2 and config.use_short_conv and config.sse_implementation == "mask"
    assert config.key_activation("gla") == "softmax" and config.resolved_lora_rank() == 16
    back = fla_config_from_sse(config)
    for key in ("num_sparse_partition", "num_writer", "linear_attn_type", "head_dim", "use_short_conv"):
        assert back[key] == FLA_HYBRID[key]
    assert back["attn"]["layers"] == [2]


@pytest.mark.parametrize("transition", ["gla", "gdn"])
def test_round_trip_through_fla_format(tmp_path, transition):
    torch.manual_seed(0)
    model = SSEForCausalLM(sse_config_from_fla({**FLA_HYBRID, "linear_attn_type": transition})).eval()
    save_fla_checkpoint(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "sse" and written["linear_attn_type"] == transition
    loaded = load_fla_checkpoint(tmp_path).eval()
    x = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_parameter_names_follow_fla(tmp_path):
    model = SSEForCausalLM(sse_config_from_fla(FLA_HYBRID))
    names = set(model.state_dict())
    for expected in ("model.embeddings.weight", "model.layers.0.attn.lora_q_proj.1.weight",
                     "model.layers.0.attn.gk_proj.1.1.bias", "model.layers.0.attn.e_proj.weight",
                     "model.layers.0.attn.q_conv1d_shared.weight", "model.layers.0.attn.g_proj.0.weight",
                     "model.layers.0.attn.o_norm.weight", "model.layers.2.attn.k_proj.weight",
                     "model.layers.2.mlp.gate_proj.weight", "model.layers.1.attn_norm.weight", "lm_head.weight"):
        assert expected in names, expected


def test_unrepresentable_options_are_refused(tmp_path):
    config = SSEConfig(**{**sse_config_from_fla(FLA_HYBRID).to_dict(), "row_topk": 4, "lora_side": "shared"})
    with pytest.raises(ValueError, match="row_topk.*lora_side"):
        save_fla_checkpoint(SSEForCausalLM(config), tmp_path)


def test_bad_checkpoints_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_fla_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**FLA_HYBRID, "model_type": "gla"}))
    with pytest.raises(ValueError, match="model_type"):
        load_fla_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_fla_checkpoint(tmp_path)
