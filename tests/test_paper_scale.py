"""The tools that measure the paper's recipe at its real lengths (docs/paper_scale.md), on CPU at tiny sizes: what
they time must be the trainer's real work, or their tables say nothing."""

from __future__ import annotations

import contextlib

import pytest
import torch

from sse_model import SSEConfig, SSEForCausalLM


def tiny_hybrid() -> SSEForCausalLM:
    torch.manual_seed(0)
    config = SSEConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, mixer_types=["sse", "attn"], num_heads=2,
                       head_dim=16, num_attention_heads=2, num_sparse_partitions=2, intermediate_size=64,
                       lora_rank=4, max_position_embeddings=256)
    return SSEForCausalLM(config)


def test_packed_rows_restart_positions_and_score_no_token_across_sequences():
    from benchmarks.pipeline.train_at_length import packed_rows

    (row,) = packed_rows(40, 16, 1, 96, "cpu")
    assert row["position_ids"][0].tolist() == [*range(16), *range(16), *range(8)]
    starts = (row["position_ids"][0] == 0).nonzero().squeeze(-1).tolist()
    assert starts == [0, 16, 32]
    assert (row["labels"][0, starts] == -100).all() and (row["labels"] != -100).sum() == 37


def test_a_bench_step_is_the_trainers_loss_and_moves_the_weights():
    """The optimizer step of ``train_at_length`` scores every row with the model's own LM loss (TRL's fused head over
    the packed rows, normalised by the step's scored tokens), adds the balance loss and updates the weights."""
    from benchmarks.pipeline.train_at_length import measure, optimizer_step, packed_rows, prepare

    model = tiny_hybrid()
    batches = packed_rows(48, 16, 2, 96, "cpu")
    with torch.no_grad():  # the model's own loss, row by row, before the fused head is patched in
        own = [(model(**b).lm_loss, int((b["labels"][0, 1:] != -100).sum())) for b in batches]
    expected = sum(loss * n for loss, n in own) / sum(n for _, n in own)
    balance = prepare(model)
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)
    total = optimizer_step(model, frozen, batches, balance, contextlib.nullcontext)
    assert total == pytest.approx(float(expected), rel=1e-5)
    assert balance, "the backbone's balance loss was not collected"

    model = tiny_hybrid()
    before = [p.detach().clone() for p in model.parameters()]
    result = measure(model, 48, 16, accumulation=2, steps=1, device=torch.device("cpu"))
    moved = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert moved == len(before), f"{len(before) - moved} parameters did not move"
    assert len(result["losses"]) == 2 and all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["tokens_per_s"] > 0 and result["first_s"] > 0


def test_a_benchmarked_model_is_a_preset_with_typed_settings():
    """``--models sse-h-2b:sse_backward_head_groups=3,...``: the preset, and its settings read as YAML values."""
    from benchmarks.common import model_spec

    assert model_spec("sse-h-2b") == ("sse-h-2b", {})
    assert model_spec("sse-h-2b:sse_backward_head_groups=3,checkpointing_keeps_linear_attention=true") == (
        "sse-h-2b", {"sse_backward_head_groups": 3, "checkpointing_keeps_linear_attention": True})
    with pytest.raises(SystemExit, match="'groups' is not key=value"):
        model_spec("sse-h-2b:groups")


def test_a_benchmarked_model_is_freed_before_the_next_is_built():
    """A model patched as the trainer patches it lives on after ``del`` (reference cycles): on the GPU the next row's
    peak memory held its weights. ``release`` frees it."""
    import gc
    import weakref

    from benchmarks.common import release
    from benchmarks.pipeline.train_at_length import measure

    enabled = gc.isenabled()
    gc.disable()  # the collector must not run on its own during the check
    try:
        model = SSEForCausalLM(SSEConfig.from_preset("sse-h-tiny"))
        measure(model, 64, 32, 1, 0, torch.device("cpu"))
        alive = weakref.ref(model)
        del model
        assert alive() is not None  # what made the peaks wrong
        release(torch.device("cpu"))
        assert alive() is None
    finally:
        if enabled:
            gc.enable()


def test_the_memory_peak_is_found_in_the_allocator_trace_and_charged_to_project_lines():
    """A synthetic trace of the allocator's events: the peak is the highest running total (frees of memory held
    from before the trace count), and what is alive then is summed by the innermost frame of this project."""
    from benchmarks.pipeline.memory_peak import peak, peak_table

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    torch_frame = frame("/venv/torch/nn/functional.py", 10, "linear")
    h = [torch_frame, frame("/repo/kernels/sse_chunk.py", 540, "_forward"), frame("/repo/benchmarks/pipeline/x.py", 1, "s")]
    dh = [frame("/repo/kernels/sse_chunk.py", 585, "_backward")]
    other = [torch_frame]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": h},
        {"action": "alloc", "addr": 2, "size": 50, "frames": other},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 99, "size": 30},  # held from before the trace
        {"action": "alloc", "addr": 3, "size": 60, "frames": dh},
        {"action": "alloc", "addr": 4, "size": 40, "frames": h},  # the peak: 100 - 30 + 60 + 40 = 170
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 5, "size": 20, "frames": other},
    ]
    found = peak({"device_traces": [events]}, start_bytes=1000)
    assert found["peak_bytes"] == 1170 and found["before_bytes"] == 970
    assert found["live"] == [("kernels/sse_chunk.py:540 (_forward)", 140, 2),
                             ("kernels/sse_chunk.py:585 (_backward)", 60, 1)]
    assert "`kernels/sse_chunk.py:540 (_forward)` | 0.000 | 2" in peak_table(found)
    assert peak(None) is None and "no CUDA" in peak_table(None)


def test_the_dry_run_keeps_the_recipes_lengths_and_micro_batches():
    """DRY_RUN shrinks counts only: 32k rows and rollouts, the recipe's micro-batches of 2 rows, a mini-batch per
    optimizer step, and exactly one generation batch trained on in full."""
    from scripts.paper_dry_run import DRY_RUN
    from pipeline.batching import grpo_batching
    from pipeline.recipe import load_recipe

    full = load_recipe("paper-2b")
    dry = load_recipe("paper-2b", DRY_RUN + ["distill.data.source=math_train"])
    assert dry.model.path is None and dry.model.preset == "sse-h-2b"
    assert dry.model.config_overrides["vocab_size"] == 151936
    assert (dry.distill.max_length, dry.distill.batch_size, dry.distill.micro_batch_size) == \
        (full.distill.max_length, full.distill.batch_size, full.distill.micro_batch_size) == (32768, 16, 1)
    assert dry.grpo.max_completion_length == full.grpo.max_completion_length == 32768
    assert grpo_batching(dry, 1).micro == grpo_batching(full, 1).micro == 2
    assert dry.grpo.steps == dry.grpo.mini_batches * dry.grpo.num_iterations  # one generation batch
    assert not dry.grpo.dynamic_sampling and dry.eval.limit * dry.eval.repeats == 4


def test_long_records_have_the_trace_lengths_of_openr1_math(tmp_path):
    from scripts.paper_dry_run import write_long_records
    from pipeline.data import read_records

    stats = write_long_records(tmp_path / "long.jsonl", 2000, 32768)
    assert abs(stats["median"] / 3600 - 1) < 0.1 and abs(stats["p90"] / 9100 - 1) < 0.15
    records = [r for _, r in read_records(tmp_path / "long.jsonl")]
    lengths = sorted(len(r["solution"]) for r in records)
    assert len(records) == 2000 and lengths[1000] == stats["median"] and lengths[-1] == stats["max"] <= 32768
    assert all(r["solution"].endswith("\\boxed{1}") for r in records)


def test_a_stage_that_fails_is_reported_and_the_next_still_runs(tmp_path, monkeypatch):
    """The first H100 dry run's GRPO ran out of memory; the run went on to the evaluation and its report says why."""
    import json

    import pipeline.run
    from scripts import paper_dry_run

    ran = []

    def run_recipe(recipe, stages):
        ran.append(stages[0])
        if stages[0] == "grpo":
            raise RuntimeError("\x1b[36mCUDA out of memory\x1b[39m. Tried to allocate 1.30 GiB\nmore")

    monkeypatch.setattr(pipeline.run, "run_recipe", run_recipe)
    paper_dry_run.main(["--out", str(tmp_path), "--records", "20", "--stages", "distill", "grpo", "eval"])
    assert ran == ["distill", "grpo", "eval"]
    stages = json.loads((tmp_path / "dry_run.json").read_text())["stages"]["stages"]
    assert stages["grpo"]["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 1.30 GiB"
    assert "error" not in stages["eval"]
    assert "(stopped: RuntimeError: CUDA out of memory" in (tmp_path / "dry_run.md").read_text()


def test_measured_rates_agree_with_a_real_runs_report():
    """Read from an SSE-H SmolLM2-135M run kept in docs/runs/smollm2-135m (its records gzip, as keep writes them):
    its report gave its distillation as 3.95M tokens in 299 s of training and its GRPO as 40 generation batches at
    3.56 s of rollout, 2.96 s of training and 12,318 generated tokens/s (the mean of the logged rates)."""
    from pathlib import Path

    from scripts.paper_dry_run import measured_rates

    rates = measured_rates(Path(__file__).resolve().parents[1] / "docs" / "runs" / "smollm2-135m")
    assert 3.95e6 / 299 * 0.95 < rates["distill"]["tokens_per_s"] < 3.95e6 / 299 * 1.15  # the first steps left out
    g = rates["grpo"]
    assert g["rollout_s"] / 40 == pytest.approx(3.56, rel=0.02) and g["train_s"] / 40 == pytest.approx(2.96, rel=0.02)
    assert g["generated_per_s"] == pytest.approx(12318, rel=0.05)
    assert g["rollouts"] == 40 * 3 * 16 * 8  # every prompt of three sampling rounds, 8 rollouts each
    assert rates["eval"]["generated_tokens"] > 0


def test_projection_scales_each_stage_as_its_assumptions_say():
    from pipeline.recipe import load_recipe
    from scripts.paper_dry_run import Scaling, projection

    full = load_recipe("paper-2b")
    rates = {"distill": {"tokens_per_s": 10000.0},
             "grpo": {"rollouts": 64, "mean_prompt": 200.0, "generated_per_s": 5000.0, "trained_per_s": 20000.0,
                      "weight_sync_s": 10.0, "reward_s": 4.0}}
    scaling = Scaling(data_parallel={1: 1.0, 2: 1.9, 4: 3.6}, weight_sync_s=None)  # (the dry run's own sync)
    one, eight = (projection(rates, full, gpus, 4000, 8192, scaling) for gpus in (1, 8))
    assert one["distill_h"] == pytest.approx(80000 * 5 * 4000 / 10000 / 3600)
    assert eight["distill_h"] == pytest.approx(one["distill_h"] / (8 * 3.6 / 4))  # the largest measured efficiency
    rollouts = 32 * 8  # more than the 64 an engine holds: one engine runs at its measured rate
    generate, train, fixed = rollouts * 8192 / 5000, rollouts * (200 + 8192) / 20000, 10 + 4 * rollouts / 64
    assert one["grpo_batch_s"] == pytest.approx(generate + train + fixed)
    assert one["grpo_h"] == pytest.approx(230 * one["grpo_batch_s"] / 3600)

    def engines_s(e):  # each engine's share at its rate for that share (fewer sequences: fewer tokens a step)
        return rollouts / e * 8192 / scaling.engine_rate(5000.0, 64, rollouts / e)

    layouts = [generate_s + t for generate_s, t in
               [(engines_s(8), train / (8 * 3.6 / 4))] + [(engines_s(e), train / scaling.speedup(8 - e))
                                                         for e in range(1, 8)]]
    assert eight["grpo_batch_s"] == pytest.approx(min(layouts) + fixed)
    # generating ahead: the slower of the engines' generation and the trainers' training, over the splits; one GPU
    # cannot overlap them
    ahead = min(max(engines_s(e), train / scaling.speedup(8 - e)) for e in range(1, 8))
    assert eight["grpo_ahead_batch_s"] == pytest.approx(ahead + fixed)
    assert one["grpo_ahead_h"] is None
    measured_sync = projection(rates, full, 1, 4000, 8192, Scaling(weight_sync_s=0.03))
    assert measured_sync["grpo_batch_s"] == pytest.approx(generate + train + 0.03 + 4 * rollouts / 64)
    assert eight["eval_h"] == pytest.approx(1275 * 32 * 8192 / (5000 * 8) / 3600)  # every engine full


def test_an_engine_with_fewer_sequences_makes_fewer_tokens_a_second_not_proportionally_fewer():
    """A decode step reads the weights once whatever the sequences (the step's fixed part) and each sequence's
    cache; the rate measured at 64 sequences is met there, halved sequences keep more than half the rate, and no
    engine goes past the sequences it holds."""
    from scripts.paper_dry_run import Scaling

    scaling = Scaling(weights_read_s=2e-3, max_in_flight=64)
    measured = 64 / 10e-3  # 10 ms a step at 64
    assert scaling.engine_rate(measured, 64, 64) == pytest.approx(measured)
    assert measured / 2 < scaling.engine_rate(measured, 64, 32) < measured
    assert scaling.engine_rate(measured, 64, 32) == pytest.approx(32 / (2e-3 + 32 * 8e-3 / 64))
    assert scaling.engine_rate(measured, 64, 500) == pytest.approx(measured)  # waves of 64
    assert Scaling(data_parallel={1: 1.0, 4: 3.8}).speedup(8) == pytest.approx(7.6)


def test_a_kept_dry_run_is_projected_again_without_a_gpu(tmp_path, capsys):
    """``--rates``: the kept paper-2b dry run (docs/runs/paper-2b-dry-run), its stages from two runs, projected
    under this command's assumptions (the doc's table comes from it)."""
    from pathlib import Path

    from scripts import paper_dry_run

    kept = Path(__file__).resolve().parents[1] / "docs" / "runs" / "paper-2b-dry-run"
    paper_dry_run.main(["--rates", str(kept / "distill_eval.json"), str(kept / "grpo.json"), "--gpus", "1", "8",
                        "--generated-tokens", "32768", "--sampling-rounds", "2", "--out", str(tmp_path)])
    text = (tmp_path / "projection.md").read_text()
    assert "| 32,768 | 1 | 17.5 |" in text and "2 sampling round(s)" in text
    assert "NVIDIA H100 80GB HBM3" in text and "| grpo | 661 |" in text


def test_every_packaged_problem_with_an_answer_field_has_an_answer():
    """GRPO refuses a prompt without an answer (it cannot be rewarded), so one such record in packaged data stops
    every recipe that trains on it; ``recipes/paper-2b``'s prompts (math_train) had two."""
    from pipeline.data import PACKAGED, prompt_dataset, read_records
    from pipeline.recipe import load_recipe

    for name, path in PACKAGED.items():
        empty = [i for i, r in read_records(path) if "answer" in r and not str(r["answer"]).strip()]
        assert not empty, f"{name}: records {empty} have no answer"
    recipe = load_recipe("paper-2b")
    assert len(prompt_dataset(recipe.grpo.data, recipe.prompt_instruction)) == 7472
