"""The vLLM peer benchmark's table (``benchmarks/rollout/bench_vllm.py``); the runs themselves need vLLM and a GPU."""

from pathlib import Path

from benchmarks.rollout.bench_vllm import table


def test_each_row_is_compared_with_vllm_at_its_length():
    gib = 2**30
    rows = [dict(new_tokens=1024, system="vllm", model="transformer-2b", tokens=20000, seconds=2.0, peak=70 * gib,
                 prompts=32, samples=8),
            dict(new_tokens=1024, system="engine", model="sse-h-2b", tokens=30000, seconds=2.0, peak=20 * gib),
            dict(new_tokens=8192, system="engine", model="sse-h-2b", tokens=9000, seconds=1.0, peak=21 * gib),
            dict(new_tokens=8192, system="vllm", model="transformer-2b", tokens=3000, seconds=1.0, peak=70 * gib)]
    lines = table(rows).splitlines()
    assert lines[2] == "| 1024 | 32 x 8 | vllm | transformer-2b | 10,000 | 1.00x | 70.0 |"
    assert lines[3] == "| 1024 | ? x ? | engine | sse-h-2b | 15,000 | 1.50x | 20.0 |"
    assert lines[4] == "| 8192 | ? x ? | engine | sse-h-2b | 9,000 | 3.00x | 21.0 |"
    assert table(rows[1:2]).splitlines()[2].endswith("| - | 20.0 |")  # no vLLM row at that length


def test_vllm_serving_sse_h_is_not_the_reference():
    """vLLM + our plugin on SSE-H is a row like the others; every row compares with vLLM on the Transformer."""
    rows = [dict(new_tokens=8192, system="vllm", model="transformer-2b", tokens=3000, seconds=1.0, peak=0),
            dict(new_tokens=8192, system="vllm", model="sse-h-2b", tokens=6000, seconds=1.0, peak=0)]
    assert table(rows).splitlines()[3] == "| 8192 | ? x ? | vllm | sse-h-2b | 6,000 | 2.00x | 0.0 |"


def test_the_evaluation_workload_serves_a_checkpoint_on_a_benchmarks_prompts(tmp_path, capsys):
    """``eval_workload --checkpoint``: a trained model's folder (here a tiny converted one with the character
    tokenizer) on word problems as evaluation prompts them, each sample to its end or the token limit; the folder
    vLLM would get with ``--vllm-detokenize off`` has every file but the tokenizer's."""
    import pytest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.rollout.eval_workload import benchmark_workload, main, without_tokenizer
    from pipeline.tokenizer import build_char_tokenizer
    from sse_model.convert import convert_to_sse

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    checkpoint = tmp_path / "model"
    convert_to_sse(llama).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    jobs = benchmark_workload(tokenizer, "word_problems", "Box it.", 12, limit=3)
    assert len(jobs) == 3 and all(length == 12 for _, length in jobs)
    assert "Box it." in tokenizer.decode(jobs[0][0])  # the problem, the instruction, in the chat template
    main(["--checkpoint", str(checkpoint), "--benchmark", "word_problems", "--limit", "3", "--samples", "2",
          "--max-new-tokens", "12", "--max-slots", "4", "--prefill-chunk-size", "256"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| sse | 4 |"))
    assert float(row.split("|")[6].replace(",", "")) > 0  # generated tokens/s
    (tmp_path / "ids-only").mkdir()
    names = {p.name for p in Path(without_tokenizer(str(checkpoint), str(tmp_path / "ids-only"))).iterdir()}
    assert "config.json" in names and "model.safetensors" in names and not any("token" in n for n in names)
    with pytest.raises(SystemExit):  # a random model has no tokenizer to detokenize with
        main(["--backend", "vllm", "--vllm-detokenize", "on"])
    with pytest.raises(SystemExit):  # two vLLM engines in one process
        main(["--checkpoint", str(checkpoint), "--backend", "vllm", "--max-slots", "256", "1024"])
