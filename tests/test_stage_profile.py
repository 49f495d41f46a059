"""``python -m benchmarks.pipeline.stage_profile``: a recipe's align and distill steps timed and profiled."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.pipeline.stage_profile import main
from pipeline.tokenizer import build_char_tokenizer


def test_both_stages_of_a_converted_model_are_timed_and_profiled(tmp_path):
    """A tiny Llama converted as a real checkpoint is: its align and distill stages run the steps asked (then stop),
    each step timed, the profiled ones' ops tabled with the device waits that ``.item()`` calls cause."""
    source = tmp_path / "llama"
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                 tie_word_embeddings=False)).save_pretrained(source)
    tokenizer.save_pretrained(source)
    out = tmp_path / "profile"
    results = main(["demo", "--warmup", "1", "--steps", "2", "--out", str(out), "--set", "model.preset=null",
                    "model.tokenizer=null", f"model.convert_from={source}", "align.batch_size=2",
                    "align.max_length=128", "distill.data.max_samples=100", "distill.batch_size=4",
                    "distill.teacher_kl=0.5"])
    assert set(results) == {"align", "distill"}
    for stage, result in results.items():
        assert len(result["step_s"]) == 4 and all(t > 0 for t in result["step_s"])  # 1 + 2 + the stacked one
        assert result["profiled_step_s"] > 0 and result["by_host"]
        names = {op["name"] for op in result["by_host"]}
        assert any(n.startswith("aten::") for n in names), names
        text = (out / f"{stage}.md").read_text()
        assert text.startswith(f"## {stage}: ") and "| op (by host time) |" in text
    # the distillation logs its metrics with .item() every micro-batch: waits, and their origin in our code
    waits = results["distill"]["waits"]
    assert waits.get("aten::_local_scalar_dense", 0) >= 4, waits
    assert any("distill.py" in frame for o in results["distill"]["wait_origins"] for frame in o["stack"])
    assert json.loads((out / "profile.json").read_text())["align"]["step_s"] == results["align"]["step_s"]
    # the stages stopped where asked: 4 optimizer steps, not the recipe's
    assert json.loads((out / "align" / "align" / "final" / "stage_done.json").read_text())["global_step"] == 4
