"""What only several GPUs of one machine show: each data-parallel worker on its own GPU (the model and a
converted model's teacher), CUDA IPC from trainer workers whose GPU index differs in the engine's process, weight
sync timed to completion, FSDP's gathered weights in the engines and the final model, and workers killed on GPUs
(a trainer worker: the stage stops at once, not after NCCL's timeout, and a re-run resumes; an engine: replaced).
``pytest -s tests/gpu/test_multi_gpu.py`` on a machine of 2 GPUs or more (ray, trl, datasets and math-verify on the
path; NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 in the environment)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.metrics import read_metrics
from pipeline.recipe import load_recipe
from pipeline.run import run_recipe

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

SMALL = ["model.config_overrides={hidden_size: 256, num_heads: 2, num_attention_heads: 4}", "ray.num_gpus=2"]


@pytest.fixture(autouse=True)
def _ray_down():
    yield
    import ray

    ray.shutdown()


def test_teacher_kl_distillation_on_two_gpus(tmp_path):
    """A converted model distilled with its teacher's logits on 2 workers: each worker's student and teacher on its
    own GPU (both used to start on GPU 0, and the teacher stayed there: a device mismatch on worker 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024, tie_word_embeddings=False))
    llama.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    recipe = load_recipe("demo", [f"output_dir={tmp_path / 'run'}", "device=cuda", "model.preset=null",
                                  f"model.convert_from={tmp_path / 'llama'}", "model.tokenizer=char",
                                  "distill.teacher_kl=0.5", "distill.max_steps=4", "distill.logging_steps=1",
                                  "distill.save_steps=2", "distill.data.max_samples=256", "ray.num_gpus=2"])
    run_recipe(recipe, ("distill",))
    rows = [r for r in read_metrics(tmp_path / "run" / "distill" / "metrics.jsonl") if "teacher_kl" in r]
    assert len(rows) == 4 and all(r["teacher_kl"] > 0 for r in rows)
    # every worker's RNG state is in each checkpoint (gathered before it is marked complete)
    assert {p.name for p in (tmp_path / "run" / "distill" / "checkpoints" / "checkpoint-4").glob("rng_state_*")} == \
        {"rng_state_0.pth", "rng_state_1.pth"}


def test_colocated_grpo_on_two_gpus_shares_weights_by_cuda_ipc(tmp_path):
    """GRPO colocated on 2 GPUs (a trainer worker and its engine on each) with weight_sync cuda_ipc: worker 1's
    trainer sees both GPUs and its weights on its index 1, its engine sees one GPU (index 0); the handle is opened
    on the engine's index of the same GPU (it failed, and fell back to the object store for the rest of the run)."""
    recipe = load_recipe("gpu-100m", [f"output_dir={tmp_path}", *SMALL, "grpo.steps=2", "grpo.prompts_per_batch=4",
                                      "grpo.save_steps=100", "grpo.weight_sync=cuda_ipc"])
    run_recipe(recipe, ("grpo",))
    rows = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "time/weight_sync_s" in r]
    assert len(rows) == 2
    for name in ("engines.json", "engines-worker1.json"):
        (engine,) = json.loads((tmp_path / "grpo" / name).read_text())
        assert engine["device"].startswith("cuda") and engine["weights_version"] == 2, (name, engine)


def test_fsdp_distillation_and_grpo_on_two_gpus(tmp_path):
    """sharding=fsdp: distillation and GRPO's trainer on 2 workers under FSDP2 (accelerate), the distillation
    scoring held-out solutions on both; the engines get the gathered weights (their greedy tokens are the final
    model's) and the final model loads on one GPU."""
    from pipeline.rollout import Engine, SamplingParams
    from sse_model.checkpoint import load_pretrained

    recipe = load_recipe("gpu-100m", [f"output_dir={tmp_path}", *SMALL, "sharding=fsdp", "distill.max_steps=4",
                                      "distill.logging_steps=1", "distill.save_steps=2", "grpo.steps=2",
                                      "grpo.prompts_per_batch=4", "grpo.save_steps=1", "eval.enabled=false",
                                      "distill.eval_steps=2", "distill.eval_data={source: "
                                      "'builtin:word_problems?steps=1', max_samples: 9, seed: 9}"])
    run_recipe(recipe, ("distill", "grpo"))
    losses = [r["loss"] for r in read_metrics(tmp_path / "distill" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    held_out = [r for r in read_metrics(tmp_path / "distill" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in held_out] == [2, 4] and held_out[1]["eval_loss"] < held_out[0]["eval_loss"], held_out
    final = load_pretrained(tmp_path / "grpo" / "final")
    assert final.model.embeddings.weight.shape[1] == 256  # whole, not a shard
    engine = Engine(final.cuda(), None, max_slots=2, max_model_len=64)
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def _ray_processes(title: str) -> list[int]:
    """The processes whose title is Ray's ``ray::<title>...`` (Ray names an actor's process by its class)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(f"ray::{title}".encode()):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


def _start(stage: str, overrides: list[str], log: Path) -> subprocess.Popen:
    """``sse-pipeline <stage> gpu-100m ...`` as a user starts it, in a process of its own."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", stage, "gpu-100m", *overrides],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _wait_for_step(run: subprocess.Popen, metrics: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert run.poll() is None, f"the run ended (exit {run.returncode}) before step {step}"
        if any(r.get("step", 0) >= step for r in read_metrics(metrics)):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {metrics} after {timeout_s} s")


def test_a_killed_trainer_worker_stops_distillation_at_once_and_a_rerun_resumes(tmp_path):
    """A data-parallel worker SIGKILLed mid-run on 2 GPUs: its peer waits in an NCCL collective, yet the stage ends
    within a minute (not the process group's 10-minute timeout) naming the command that resumes it; that command,
    given one GPU, resumes from the last complete checkpoint (the same batch, twice the accumulation) and
    finishes."""
    overrides = [f"output_dir={tmp_path / 'run'}", *SMALL, "distill.max_steps=60", "distill.save_steps=4",
                 "distill.logging_steps=1", "eval.enabled=false"]
    metrics = tmp_path / "run" / "distill" / "metrics.jsonl"
    run = _start("distill", overrides, tmp_path / "first.log")
    try:
        _wait_for_step(run, metrics, 6)
        (victim, *_) = sorted(_ray_processes("TrainWorker"), reverse=True)
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        run.wait(timeout=120)
    finally:
        run.kill()
    stopped_s = time.time() - killed
    print(f"distillation stopped {stopped_s:.1f} s after its worker was killed")
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert run.returncode != 0 and stopped_s < 60, log[-3000:]
    assert "a data-parallel training worker failed" in log and "again to resume" in log, log[-3000:]
    again = _start("distill", [*overrides, "ray.num_gpus=1"], tmp_path / "second.log")
    assert again.wait(timeout=600) == 0, (tmp_path / "second.log").read_text(errors="replace")[-3000:]
    assert "distill: resuming from" in (tmp_path / "second.log").read_text(errors="replace")
    steps = [r["step"] for r in read_metrics(metrics) if "loss" in r]
    assert steps == list(range(1, 61)), steps  # each step once: the resumed run's records replace the killed one's


def test_a_killed_engine_is_replaced_and_grpo_goes_on(tmp_path):
    """GRPO split on 2 GPUs (a trainer GPU, an engine GPU, weights by NCCL broadcast): the engine's process
    SIGKILLed while it generates; the fleet starts a replacement on the freed GPU, gives it the weights (the
    broadcast group formed anew) and resubmits its requests; the run finishes."""
    overrides = [f"output_dir={tmp_path}", *SMALL, "grpo.placement=split", "grpo.steps=6", "grpo.prompts_per_batch=4",
                 "grpo.save_steps=100", "grpo.max_completion_length=192"]
    run = _start("grpo", overrides, tmp_path / "grpo.log")
    try:
        _wait_for_step(run, tmp_path / "grpo" / "metrics.jsonl", 2)
        (victim,) = _ray_processes("RolloutWorker")
        os.kill(victim, signal.SIGKILL)
        assert run.wait(timeout=600) == 0, (tmp_path / "grpo.log").read_text(errors="replace")[-3000:]
    finally:
        run.kill()
    log = (tmp_path / "grpo.log").read_text(errors="replace")
    assert "rollout engine 0 died" in log and "replacing it (1 of at most 3)" in log, log[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "reward" in r] == list(range(1, 7))
