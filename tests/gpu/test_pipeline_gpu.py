"""The ``gpu-100m`` recipe shrunk to a minute on one GPU: all three stages through Ray, with the placement the
full run uses (trainer and engine sharing the GPU). Catches what only shows on CUDA (engines left on the CPU,
bf16 autocast, CUDA graphs after weight updates) before a long run, with our engine and with vLLM.
``pytest -s tests/gpu/test_pipeline_gpu.py``
(ray, trl, datasets and math-verify on the path)."""

from __future__ import annotations

import json

import pytest

from pipeline.metrics import read_metrics
from pipeline.recipe import load_recipe
from pipeline.run import run_recipe


def test_gpu_recipe_end_to_end_small(tmp_path):
    ray = pytest.importorskip("ray")
    recipe = load_recipe("gpu-100m", [
        f"output_dir={tmp_path}", "model.config_overrides={hidden_size: 256, num_heads: 2, num_attention_heads: 4}",
        "distill.max_steps=6", "distill.logging_steps=2", "distill.save_steps=3",
        "grpo.steps=3", "grpo.prompts_per_batch=4", "grpo.save_steps=3", "eval.limit=4", "eval.repeats=2",
        "eval.max_new_tokens=64"])
    try:
        report = run_recipe(recipe)
    finally:
        ray.shutdown()
    rows = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "time/rollout_s" in r]
    assert len(rows) == 3 and all(r["tokens/generated"] > 0 for r in rows)
    engines = json.loads((tmp_path / "grpo" / "engines.json").read_text())
    assert engines and all(e["device"].startswith("cuda") and e["dtype"] == "bfloat16" for e in engines)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())["benchmarks"]
    assert set(summary) == set(recipe.eval.benchmarks)  # the recipe's, each with its summary
    assert "| steps | s/step | rollout | reward | weight_sync | train |" in report.read_text()


def test_gpu_recipe_with_vllm_engines(tmp_path):
    """The same run with vLLM (this package's plugin) as the rollout engine of GRPO and evaluation
    (``engine.backend: vllm``; vLLM on the path: ``python -m scripts.vllm_site``). Attention heads as wide
    as the linear ones: vLLM sizes its KV pages from ``head_dim``."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    recipe = load_recipe("gpu-100m", [
        f"output_dir={tmp_path}", "model.config_overrides={hidden_size: 256, num_heads: 2, num_attention_heads: 2}",
        "distill.max_steps=6", "distill.logging_steps=2", "distill.save_steps=3",
        "grpo.steps=3", "grpo.prompts_per_batch=4", "grpo.save_steps=3", "eval.limit=4", "eval.repeats=2",
        "eval.max_new_tokens=64", "grpo.engine.backend=vllm", "eval.engine.backend=vllm"])
    try:
        run_recipe(recipe)
    finally:
        ray.shutdown()
    rows = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "time/rollout_s" in r]
    assert len(rows) == 3 and all(r["tokens/generated"] > 0 for r in rows)
    engines = json.loads((tmp_path / "grpo" / "engines.json").read_text())
    assert engines and all(e["backend"] == "vllm" for e in engines)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())["benchmarks"]
    assert set(summary) == set(recipe.eval.benchmarks)  # the recipe's, each with its summary


def test_cuda_ipc_weight_sync(caplog):
    """``weight_sync="cuda_ipc"``: an engine on the trainer's GPU (half of it, as colocated GRPO places it) opens the
    float32 policy's weights, cast to its bf16, in the trainer's memory; its greedy tokens are those of an engine
    given the same weights directly, after each of two syncs, and no sync fell back to the object store."""
    ray = pytest.importorskip("ray")
    import copy

    import torch

    import kernels
    from pipeline.rollout import Engine, SamplingParams
    from pipeline.rollout.actor import EngineFleet
    from sse_model import SSEConfig, SSEForCausalLM

    kernels.register()
    config = SSEConfig.from_preset("sse-h-tiny", vocab_size=512, hidden_size=512, num_heads=4, head_dim=128,
                                   num_attention_heads=4, intermediate_size=1024)
    torch.manual_seed(0)
    start = SSEForCausalLM(config)
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        fleet = EngineFleet(start, None, num_engines=1, num_gpus=0.5, weight_sync="cuda_ipc", max_slots=4,
                            max_model_len=128, device="cuda", dtype=torch.bfloat16, sleep_between_calls=True)
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = [[1, 2, 3, 4], list(range(5, 40))]
        for version, seed in ((1, 1), (2, 2)):
            torch.manual_seed(seed)
            policy = SSEForCausalLM(config).cuda()  # float32 masters on the trainer's GPU
            assert fleet.update_weights(policy.state_dict()) == [version]
            reference = Engine(copy.deepcopy(policy), None, max_slots=4, max_model_len=128, dtype=torch.bfloat16)
            assert [o.outputs[0].token_ids for o in fleet.generate(prompts, greedy)] == \
                [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
            del reference
        assert fleet.weight_sync == "cuda_ipc" and "CUDA IPC failed" not in caplog.text
        fleet.shutdown()
    finally:
        ray.shutdown()


def test_weights_synced_into_running_sequences_on_the_gpu():
    """Partial rollouts on CUDA: the engine's own loop thread steps it (CUDA graphs captured and replayed there)
    while weights arrive by the object store between two of its steps; the running sequences finish under the new
    weights with where they changed, and a generation after the switch is the new weights' alone: greedy tokens
    equal an engine given those weights directly."""
    ray = pytest.importorskip("ray")
    import time

    import torch

    import kernels
    from pipeline.rollout import Engine, SamplingParams
    from pipeline.rollout.actor import EngineFleet
    from sse_model import SSEConfig, SSEForCausalLM

    kernels.register()
    config = SSEConfig.from_preset("sse-h-tiny", vocab_size=512, hidden_size=512, num_heads=4, head_dim=128,
                                   num_attention_heads=4, intermediate_size=1024, max_position_embeddings=4096)
    torch.manual_seed(0)
    start = SSEForCausalLM(config)
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        fleet = EngineFleet(start, None, num_engines=1, num_gpus=1, max_slots=8, max_model_len=4096, device="cuda",
                            dtype=torch.bfloat16)
        sampled = SamplingParams(n=4, temperature=1.0, max_tokens=3000, seed=3, ignore_eos=True)
        running = fleet.submit([[1, 2, 3, 4], list(range(5, 40))], sampled)
        deadline = time.time() + 120
        while ray.get(fleet.workers[0].get_stats.remote())["generated_tokens"] < 2000 and time.time() < deadline:
            time.sleep(0.01)
        torch.manual_seed(1)
        policy = SSEForCausalLM(config)
        assert fleet.update_weights(policy.state_dict()) == [1]
        outs = fleet.collect(running)
        versions = [c.weight_versions for o in outs for c in o.outputs]
        assert all(v is not None and v[-1][1] == 1 and 0 < v[-1][0] < 3000 for v in versions), versions
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        reference = Engine(policy.cuda(), None, max_slots=4, max_model_len=4096, dtype=torch.bfloat16)
        prompts = [[1, 2, 3, 4], list(range(5, 40))]
        after = fleet.collect(fleet.submit(prompts, greedy))  # on the loop, CUDA graphs replayed with new weights
        assert [o.outputs[0].token_ids for o in after] == \
            [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
        fleet.shutdown()
    finally:
        ray.shutdown()


def test_a_result_is_handed_over_between_steps_on_the_gpu():
    """On CUDA (graphs replayed on the engine's loop thread, each step queued before the last one's tokens are read)
    a short request's result comes back within a few steps of its end while a long one runs on: collecting a batch
    generated ahead used to wait until the next batch had finished too (on 4 H200 the trainer waited a whole batch).
    The CPU twin: tests/test_rollout_engine.py::test_a_result_is_handed_over_between_steps_while_other_requests_run."""
    ray = pytest.importorskip("ray")
    import torch

    import kernels
    from pipeline.rollout import SamplingParams
    from pipeline.rollout.actor import RolloutWorker
    from sse_model import SSEConfig, SSEForCausalLM

    kernels.register()
    config = SSEConfig.from_preset("sse-h-tiny", vocab_size=512, hidden_size=512, num_heads=4, head_dim=128,
                                   num_attention_heads=4, intermediate_size=1024, max_position_embeddings=4096)
    torch.manual_seed(0)
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        worker = ray.remote(num_gpus=1)(RolloutWorker).remote(SSEForCausalLM(config), None, max_slots=8,
                                                              max_model_len=4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            steps = ray.get(worker.get_stats.remote())["decode_steps"]
            # both added at once: the long one must not run steps ahead of the short one's start (it did on the GPU)
            long, short = ray.get(worker.start.remote([list(range(5, 40)), [1, 2, 3, 4]], [
                SamplingParams(max_tokens=3000, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)]))
            assert len(ray.get(worker.result.remote([short]))[0].outputs[0].token_ids) == 4
            stats = ray.get(worker.get_stats.remote())
            assert stats["decode_steps"] - steps <= 8 and stats["running"] == 1, stats
            assert len(ray.get(worker.result.remote([long]))[0].outputs[0].token_ids) == 3000
    finally:
        ray.shutdown()
