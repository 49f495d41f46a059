"""The pipeline on CPU: recipes, packed distillation without cross-sample leakage, GRPO that learns, and
resume after SIGKILL. One tiny model is distilled once per module and shared."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.metrics import read_metrics
from pipeline.models import engine_options
from pipeline.recipe import RecipeError, load_recipe
from pipeline.stages.distill import run_distill

ROOT = Path(__file__).resolve().parent.parent


def test_recipes_validate_and_name_bad_keys(tmp_path):
    paper = load_recipe("paper-2b")
    assert (paper.grpo.steps // paper.grpo.mini_batches, paper.grpo.num_generations) == (230, 8)
    assert paper.grpo.max_completion_length == 32768
    assert paper.distill.epochs == 5 and paper.eval.repeats == 32 and paper.eval.top_p == 0.7
    assert sorted(paper.eval.benchmarks) == ["aime24", "aime25", "amc23", "math500", "olympiadbench"]
    assert load_recipe("demo", ["grpo.steps=3"]).grpo.steps == 3
    quiet = load_recipe("demo", ["grpo.engine.overlap=false"])
    assert engine_options(quiet, quiet.grpo.engine, 512)["overlap"] is False  # reaches the engine's constructor
    gpu = load_recipe("gpu-100m")
    assert gpu.device == "cuda" and gpu.grpo.engine.dtype == "bfloat16" and gpu.grpo.engine.sleep is False
    assert gpu.eval.benchmarks == ["word_problems_val", "gsm8k"]
    with pytest.raises(RecipeError, match=r"grpo.engine.dtype: .bf16. is not one of .*did you mean bfloat16"):
        load_recipe("demo", ["grpo.engine.dtype=bf16"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {preset: sse-h-tiny}\ngrpo:\n  num_generaitons: 8\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: grpo.num_generaitons: unknown key \(did you mean num_generations"):
        load_recipe(str(bad))
    with pytest.raises(RecipeError, match="grpo.steps: expected int"):
        load_recipe("demo", ["grpo.steps=many"])


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """The demo's distillation, shortened: a tiny SSE-H that answers sums in either format."""
    out = tmp_path_factory.mktemp("distill")
    recipe = load_recipe("demo", [f"output_dir={out}", "distill.data.max_samples=800", "distill.epochs=3"])
    return recipe, run_distill(recipe, out / "distill")


def _grpo_overrides(out: Path, steps: int) -> list[str]:
    return [f"output_dir={out}", f"grpo.steps={steps}", "grpo.rewards.accuracy=0.0", "grpo.rewards.format=1.0",
            "grpo.save_steps=2", "ray.num_cpus=2"]


def test_grpo_learns_the_answer_format(distilled, tmp_path):
    """Reward: a boxed answer (the distilled model writes one about half of the time). Fixed seeds."""
    from pipeline.run import run_recipe

    _, checkpoint = distilled
    recipe = load_recipe("demo", [*_grpo_overrides(tmp_path, 16), "grpo.prompts_per_batch=4"])
    run_recipe(recipe, ("grpo",), checkpoint=str(checkpoint))
    rewards = [r["reward"] for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "reward" in r]
    assert len(rewards) == 16
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.15, f"reward did not rise: {[round(r, 2) for r in rewards]}"
    print("GRPO format reward per step:", [round(r, 2) for r in rewards])
    assert (tmp_path / "grpo" / "reward_curve.png").exists()
    from pipeline.stages.base import model_id

    started = json.loads((tmp_path / "grpo" / "started_from.json").read_text())["model"]
    assert started == model_id(str(checkpoint)), "named as its evaluation names it, for sse-pipeline compare"
    row = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "reward" in r][-1]
    for key in ("time/rollout_s", "time/reward_s", "time/train_s", "entropy", "completions/mean_length",
                "balance_loss"):
        assert key in row, key
    assert any(r.get("balance_loss", 0) > 0 for r in read_metrics(Path(checkpoint).parent / "metrics.jsonl"))
    assert row["importance_sampling/logp_difference/mean"] < 1e-3  # the engine samples from the policy
    assert 0.99 < row["importance_sampling/ratio/mean"] < 1.01 and row["importance_sampling/corrected_fraction"] < 0.01
    engines = json.loads((tmp_path / "grpo" / "engines.json").read_text())
    assert [e["device"] for e in engines] == ["cpu"]
    # the counters at the end of training (at the start both were 0)
    assert engines[0]["weights_version"] > 0 and engines[0]["generated_tokens"] > 0
    _assert_ray_resources_released()


def _assert_ray_resources_released():
    """The stage's engines are gone when it returns: the next stage (evaluation) needs their CPUs / GPUs."""
    import ray

    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.time() < deadline, f"resources still held: {ray.available_resources()}"
        time.sleep(0.5)


def test_mini_batches_make_the_clip_act(distilled, tmp_path):
    """One optimizer step per generation batch leaves the PPO ratio at 1 (clip fractions 0); with 4 mini-batches
    the later ones train on rollouts of an older policy and the clip engages."""
    from pipeline.run import run_recipe

    _, checkpoint = distilled
    recipe = load_recipe("demo", [*_grpo_overrides(tmp_path, 8), "grpo.mini_batches=4", "grpo.save_steps=8"])
    run_recipe(recipe, ("grpo",), checkpoint=str(checkpoint))
    rows = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "clip_ratio/region_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["step"] for r in rows if "reward" in r] == [1, 5], "one generation batch per 4 optimizer steps"
    clipped = [r["clip_ratio/region_mean"] for r in rows]
    assert clipped[0] == clipped[4] == 0.0, "the first mini-batch of a generation batch is on-policy"
    assert max(clipped) > 0.0, clipped
    print("clip fraction per optimizer step:", clipped)


def test_dynamic_sampling_resamples_until_groups_disagree(distilled, tmp_path):
    """Accuracy reward: groups whose samples are all right or all wrong are dropped and fresh prompts drawn, for at
    most max_sampling_rounds rounds; a batch is short of informative groups only when the rounds ran out."""
    from pipeline.run import run_recipe

    _, checkpoint = distilled
    recipe = load_recipe("demo", [f"output_dir={tmp_path}", "grpo.steps=3", "grpo.save_steps=3", "ray.num_cpus=2",
                                  "grpo.max_sampling_rounds=3"])
    run_recipe(recipe, ("grpo",), checkpoint=str(checkpoint))
    rows = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "reward" in r]
    assert len(rows) == 3
    for row in rows:
        rounds, fraction = row["dynamic_sampling/rounds"], row["dynamic_sampling/informative_fraction"]
        dropped = row["dynamic_sampling/groups_dropped"]
        assert 1 <= rounds <= 3 and 0 <= fraction <= 1
        assert fraction == 1.0 or rounds == 3, row
        assert dropped == rounds * 8 - round(fraction * 8) or (fraction == 1.0 and dropped <= rounds * 8 - 8), row
    print("rounds, informative fraction, dropped:",
          [(r["dynamic_sampling/rounds"], r["dynamic_sampling/informative_fraction"],
            r["dynamic_sampling/groups_dropped"]) for r in rows])
    assert any(r["dynamic_sampling/rounds"] > 1 for r in rows), "the distilled model's groups never all agree?"


def test_grpo_resumes_after_sigkill(distilled, tmp_path):
    """Kill the whole process group mid-run; the re-run continues the step counter and the optimizer."""
    _, checkpoint = distilled
    steps = 4  # killed after checkpoint 2, resumed to 4
    cmd = [sys.executable, "-m", "pipeline.cli", "grpo", "demo", *_grpo_overrides(tmp_path, steps),
           "grpo.prompts_per_batch=2", "grpo.num_generations=4", "grpo.max_completion_length=24",
           "--checkpoint", str(checkpoint)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ckpt_dir = tmp_path / "grpo" / "checkpoints"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (ckpt_dir / "checkpoint-2" / "trainer_state.json").exists():
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.time() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray workers and engines
    proc.wait()
    assert not (tmp_path / "grpo" / "final").exists()

    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    final_state = json.loads((ckpt_dir / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    assert final_state["global_step"] == steps
    import torch

    optimizer = torch.load(ckpt_dir / f"checkpoint-{steps}" / "optimizer.pt", weights_only=False)
    adam_steps = {float(s["step"]) for s in optimizer["state"].values()}
    assert adam_steps == {float(steps)}, "Adam's step count continues across the kill"
    logged = [r["step"] for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "reward" in r]
    assert logged[-1] == steps and set(range(1, steps + 1)) <= set(logged)
    assert logged.count(1) == 1 and logged.count(2) == 1, f"steps 1-2 were checkpointed, never redone: {logged}"
    assert json.loads((tmp_path / "grpo" / "final" / "stage_done.json").read_text())["global_step"] == steps


def test_a_torn_metrics_line_hides_nothing_after_it(tmp_path, caplog):
    """A killed run leaves a torn line; the resumed run's records after it must still be read, and a resumed
    writer must not fuse its first record with the torn tail."""
    from pipeline.metrics import MetricsLogger, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 4.7}\n{"step": 2, "lo')  # killed mid-write
    MetricsLogger(path)  # the resumed run's logger repairs the tail
    with path.open("a") as f:
        f.write('{"step": 3, "loss": 1.9}\n')
    assert [r["step"] for r in read_metrics(path)] == [1, 3]
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n{"step": 60, "loss": 0.97}\n')  # torn mid-file
    with caplog.at_level("WARNING"):
        rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 3, 60]
    assert "metrics.jsonl:2" in caplog.text


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """A run killed after logging step 5 but checkpointed at step 3 logs steps 4 and 5 again when it resumes: the
    logger drops their first records when training begins, so reports and curves count each step once."""
    from transformers import TrainerState

    from pipeline.metrics import MetricsLogger, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(1, 6)))
    logger = MetricsLogger(path)
    logger.on_train_begin(None, TrainerState(global_step=3), None)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    logger.on_train_begin(None, TrainerState(global_step=0), None)  # a fresh run (another stage's file) as well
    assert read_metrics(path) == []


def test_every_record_carries_the_gpu_memory_high_water_marks(tmp_path, monkeypatch):
    """Three SmolLM2 runs on one H200 ran out of memory beside a 135M model's distillation holding 72-84 GiB, and
    nothing logged said whether tensors or the allocator's reserve held it. On CPU no record carries memory."""
    import torch
    from transformers import TrainerState

    from pipeline.metrics import MetricsLogger, read_metrics

    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path)
    logger.on_log(None, TrainerState(global_step=1), None, logs={"loss": 1.0})
    assert not any(k.startswith("memory/") for k in read_metrics(path)[0])
    for name, value in (("is_available", True), ("is_initialized", True), ("max_memory_allocated", 3 * 2**30),
                        ("max_memory_reserved", 5 * 2**30)):
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    logger.on_log(None, TrainerState(global_step=2), None, logs={"loss": 0.5})
    last = read_metrics(path)[-1]
    assert last["memory/max_allocated_gib"] == 3.0 and last["memory/max_reserved_gib"] == 5.0


def test_an_empty_lock_file_is_named_not_misread(tmp_path):
    from pipeline.lock import LOCK_NAME, RunLock, RunLockedError

    (tmp_path / LOCK_NAME).write_text("")
    with pytest.raises(RunLockedError, match=f"{LOCK_NAME} exists but names no run.*remove"):
        with RunLock(tmp_path):
            pass


def test_grpo_data_with_an_empty_answer_is_refused(tmp_path):
    """Evaluation refuses a record with an empty answer; GRPO took it and scored every completion wrong."""
    from pipeline.data import prompt_dataset
    from pipeline.recipe import DataSpec

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": "  "}\n')
    with pytest.raises(ValueError, match="record 1: field 'answer' is empty"):
        prompt_dataset(DataSpec(source=str(data)))


def test_a_data_mix_adds_each_sources_rows_with_its_own_fields(tmp_path):
    """``data.mix`` joins datasets, each read with its own field map and sample count; a bad key in a mixed
    dataset is named with its place in the list."""
    from pipeline.data import prompt_dataset, sft_dataset
    from pipeline.recipe import RecipeError, load_recipe

    data = tmp_path / "qa.jsonl"
    data.write_text('{"q": "1+1?", "a": "2", "s": "1+1=2"}\n{"q": "2+2?", "a": "4", "s": "2+2=4"}\n')
    recipe = load_recipe("demo", ["distill.data.source=builtin:arithmetic", "distill.data.max_samples=3",
                                  f"distill.data.mix=[{{source: {data}, fields: {{problem: q, answer: a, solution: s}}}},"
                                  " {source: 'builtin:word_problems?steps=1', max_samples: 2, seed: 5}]"])
    spec = recipe.distill.data
    sft, prompts = sft_dataset(spec, "Go."), prompt_dataset(spec, "Go.")
    assert len(sft) == len(prompts) == 3 + 2 + 2
    assert sft[3]["completion"][0]["content"] == "1+1=2" and prompts[4]["answer"] == "4"
    assert prompts[5]["prompt"][0]["content"].endswith("now?\nGo.")
    with pytest.raises(RecipeError, match=r"distill\.data\.mix\[1\]\.max_sample: unknown key"):
        load_recipe("demo", ["distill.data.mix=[{source: a}, {source: b, max_sample: 2}]"])
    # align.data is unset (it reads distill.data): a key of it alone once made a new dataset of the default source,
    # synthetic sums, without a word
    with pytest.raises(RecipeError, match=r"align\.data: a dataset without its source \(keys given: mix\)"):
        load_recipe("smollm2-135m", [f"align.data.mix=[{{source: {data}}}]"])
    with pytest.raises(RecipeError, match=r"distill\.data\.mix\[0\]: a dataset without its source"):
        load_recipe("demo", ["distill.data.mix=[{max_samples: 2}]"])


@pytest.mark.parametrize("override, key", [
    ("eval.limit=-1", "eval.limit"),
    ("eval.repeats=0", "eval.repeats"),
    ("eval.repeats=-2", "eval.repeats"),
    ("distill.epochs=0", "distill.epochs"),
    ("distill.max_steps=0", "distill.max_steps"),
    ("grpo.rewards.timeout=0", "grpo.rewards.timeout"),
    ("grpo.num_engines=0", "grpo.num_engines"),
    ("distill.lr_scheduler=cosin", "distill.lr_scheduler"),
    ("distill.batch_size=0", "distill.batch_size"),
    ("grpo.learning_rate=-1e-6", "grpo.learning_rate"),
    ("eval.benchmarks=[math5000]", "eval.benchmarks"),
    ("grpo.loss_type=ppo", "grpo.loss_type"),
    ("model.dtype=fp8", "model.dtype"),
    ("grpo.top_p=1.5", "grpo.top_p"),
    ("grpo.epsilon_high=0.1", "grpo.epsilon_high"),
    ("model.preset=sse-h-3b", "model.preset"),
    ("eval.models=[distil]", "eval.models"),
    ("eval.models=[align]", "eval.models"),  # the demo converts nothing: no align stage
    ("grpo.rewards.overlong=1.0", "grpo.rewards.overlong_cache"),  # the default 4096 ramp over 40 tokens
    ("eval.models=[last,last]", "eval.models"),
    ("distill.teacher_kl=0.5", "distill.teacher_kl"),  # no converted Transformer to learn from
    ("align.lr_scheduler=cosin", "align.lr_scheduler"),
    ("align.train=none", "align.train"),
    ("output_dir=", "output_dir"),  # the working directory: --redo eval moved the checkout's eval/ package aside
    ("output_dir=.", "output_dir"),
    ("storage=", "storage"),  # models stored under the working directory
    ("eval.models=[]", "eval.models"),  # nothing scored, "done"
    ("grpo.rewards.timeout=1e-9", "grpo.rewards.timeout"),  # every answer timed out and scored 0
    ("grpo.temperature=.inf", "grpo.temperature"),  # sampled uniformly
    ("distill.epochs=.inf", "distill.epochs"),  # an OverflowError after loading
])
def test_values_that_cannot_work_are_refused_when_the_recipe_loads(override, key):
    """Checked before anything runs, with the file and the key in the message (each of these used to be
    accepted and then misused: an untrained model marked done, every answer scored 0, 199 of 200 problems...)."""
    import re

    with pytest.raises(RecipeError, match="demo.yaml.*" + re.escape(key)):
        load_recipe("demo", [override])


def test_the_overlong_penalty_beside_masked_truncated_completions_is_refused():
    """Masked, a completion cut at the limit is unscored and out of the loss while one that ends in the penalty's
    ramp is punished: never ending escapes it (a 135M model's cut completions rose from 14% to 47% of its batches
    under it, docs/real_model.md). Each alone is accepted."""
    with pytest.raises(RecipeError, match=r"demo.yaml.*grpo.mask_truncated_completions: true beside grpo.rewards"):
        load_recipe("demo", ["grpo.mask_truncated_completions=true", "grpo.rewards.overlong=1.0",
                             "grpo.rewards.overlong_cache=16"])
    load_recipe("demo", ["grpo.mask_truncated_completions=true"])
    load_recipe("demo", ["grpo.mask_truncated_completions=false", "grpo.rewards.overlong=1.0",
                         "grpo.rewards.overlong_cache=16"])


def test_cuda_ipc_weight_sync_is_refused_for_vllm_and_for_engines_off_the_trainers_gpu(tmp_path):
    """CUDA IPC hands tensors to our engine on the trainer's GPU: vLLM's engine core (another process) would be
    given handles it never opens, and engines elsewhere (here: on CPU) cannot open them; both refused before any
    stage runs."""
    with pytest.raises(RecipeError, match="grpo.weight_sync: cuda_ipc .*object_store"):
        load_recipe("demo", ["grpo.weight_sync=cuda_ipc", "grpo.engine.backend=vllm"])
    from pipeline.run import run_recipe

    recipe = load_recipe("demo", ["grpo.weight_sync=cuda_ipc", f"output_dir={tmp_path}", "device=cpu"])
    with pytest.raises(RecipeError, match="cuda_ipc .*colocated.*places them cpu"):
        run_recipe(recipe)
    assert not (tmp_path / "distill").exists()


def test_auto_weight_sync_takes_the_fastest_way_the_placement_serves():
    """``grpo.weight_sync: auto`` (the default): CUDA IPC to our engines on the trainer's GPU, NCCL broadcast to
    engines on GPUs of their own, the object store for vLLM, a sharded colocated trainer and CPU runs. The object
    store was the default on every placement: 17.6 s a sync of the 2B on one H200 against 0.02 s by CUDA IPC."""
    from pipeline.placement import plan
    from pipeline.stages.grpo import weight_sync_method

    def method(recipe_name, overrides, gpus, sharded=False):
        recipe = load_recipe(recipe_name, overrides)
        return weight_sync_method(recipe, plan(recipe, gpus, cpus=64).grpo, sharded)

    assert load_recipe("paper-2b").grpo.weight_sync == "auto"
    assert method("paper-2b", [], 1) == method("paper-2b", [], 4) == "cuda_ipc"
    assert method("paper-2b", [], 4, sharded=True) == "object_store"
    assert method("paper-2b", ["grpo.placement=split"], 4) == "nccl"
    assert method("paper-2b", ["grpo.placement=split"], 4, sharded=True) == "nccl"  # gathered a tensor at a time
    assert method("paper-2b", ["grpo.engine.backend=vllm"], 4) == "object_store"
    assert method("demo", [], 0) == "object_store"
    assert method("paper-2b", ["grpo.placement=split", "grpo.weight_sync=object_store"], 4) == "object_store"


def test_a_residual_dtype_or_bf16_states_for_vllm_are_refused():
    """``engine.residual_dtype`` and ``engine.state_cache_dtype`` are our engine's options; vLLM would take them and
    run as before without a word."""
    for stage in ("grpo", "eval"):
        with pytest.raises(RecipeError, match=f"demo.yaml.*{stage}.engine.residual_dtype.*backend: sse"):
            load_recipe("demo", [f"{stage}.engine.backend=vllm", f"{stage}.engine.residual_dtype=float32"])
        with pytest.raises(RecipeError, match=f"demo.yaml.*{stage}.engine.state_cache_dtype.*backend: sse"):
            load_recipe("demo", [f"{stage}.engine.backend=vllm", f"{stage}.engine.state_cache_dtype=bfloat16"])
    assert load_recipe("demo", ["eval.engine.residual_dtype=float32"]).eval.engine.residual_dtype == "float32"
    assert load_recipe("demo", ["grpo.engine.state_cache_dtype=bfloat16"]).grpo.engine.state_cache_dtype == "bfloat16"


def test_one_run_per_output_folder(tmp_path):
    """A second run fails at once naming the first; a lock left by a killed run is taken over."""
    from pipeline.lock import LOCK_NAME, RunLock, RunLockedError

    with RunLock(tmp_path):
        with pytest.raises(RunLockedError, match=rf"in use by another run \(pid {os.getpid()} on "):
            with RunLock(tmp_path):
                pass
    assert not (tmp_path / LOCK_NAME).exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    with RunLock(tmp_path) as lock:  # the killed run's lock is stale
        assert lock.held


def test_a_finished_stage_starts_no_worker_on_a_rerun(tmp_path, monkeypatch):
    """A rerun of a finished stage hands its final model on from the folder: a Ray worker started only to find the
    stage done cost every rerun seconds of imports (``sse-pipeline eval`` after ``run``, a sweep run again). With a
    storage location the stage's task still runs: it hands on the stored copy."""
    from pipeline.checkpoints import DONE
    from pipeline.recipe import recipe_to_dict
    from pipeline.run import run_recipe
    from pipeline.stages import STAGES
    from pipeline.stages.base import finished

    recipe = load_recipe("demo", [f"output_dir={tmp_path}", "grpo.enabled=false", "eval.enabled=false"])
    final = tmp_path / "distill" / "final"
    final.mkdir(parents=True)
    (tmp_path / "distill" / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    (final / DONE).write_text("{}")

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a finished stage")

    monkeypatch.setattr(STAGES["distill"], "run", no_worker)
    report = run_recipe(recipe, ("distill",))
    assert f"`{final}`" in report.read_text()
    assert finished(recipe, "distill", tmp_path / "distill") == str(final)
    assert finished(recipe, "grpo", tmp_path / "grpo") is None  # not run yet
    stored = load_recipe("demo", [f"output_dir={tmp_path}", f"storage={tmp_path / 'store'}"])
    assert finished(stored, "distill", tmp_path / "distill") is None


def test_a_rerun_with_changed_settings_is_refused_or_redone(tmp_path, caplog):
    """Each stage keeps the recipe it ran with; a re-run that changes its settings is refused before anything
    starts, naming the keys; --redo moves the old outputs (and those of later stages) aside and reruns."""
    from pipeline.recipe import recipe_to_dict
    from pipeline.run import StageSettingsChanged, prepare_stage, run_recipe

    recipe = load_recipe("demo", [f"output_dir={tmp_path}"])
    with caplog.at_level("INFO"):
        assert not prepare_stage(recipe, "distill", tmp_path / "distill", redo=False)
    assert "distill: starting" in caplog.text
    assert (tmp_path / "distill" / "recipe.yaml").exists()
    (tmp_path / "distill" / "checkpoints" / "checkpoint-7").mkdir(parents=True)
    (tmp_path / "distill" / "checkpoints" / "checkpoint-7" / "trainer_state.json").write_text("{}")
    with caplog.at_level("INFO"):
        prepare_stage(recipe, "distill", tmp_path / "distill", redo=False)
    assert "distill: resuming from checkpoint-7" in caplog.text
    from pipeline.run import changed_settings

    before = recipe_to_dict(recipe)
    operational = recipe_to_dict(load_recipe("demo", [f"output_dir={tmp_path}", "grpo.max_engine_restarts=0"]))
    del before["grpo"]["max_engine_restarts"]  # a run recorded before the key existed
    assert changed_settings("grpo", before, operational) == []  # how a stage runs, not what it computes
    # an engine's capacity is the GPU's (an evaluation resumed on a smaller one); its backend and dtype are not
    smaller = recipe_to_dict(load_recipe("demo", [f"output_dir={tmp_path}", "eval.engine.max_slots=8",
                                                  "eval.engine.memory_budget_gb=2", "grpo.engine.prefill_chunk_size=64"]))
    assert changed_settings("eval", recipe_to_dict(recipe), smaller) == []
    assert changed_settings("grpo", recipe_to_dict(recipe), smaller) == []
    other = recipe_to_dict(load_recipe("demo", [f"output_dir={tmp_path}", "eval.engine.dtype=float32"]))
    assert changed_settings("eval", recipe_to_dict(recipe), other) == ["eval.engine.dtype: None -> 'float32'"]

    changed = load_recipe("demo", [f"output_dir={tmp_path}", "distill.learning_rate=0.5", "seed=3"])
    with pytest.raises(StageSettingsChanged, match=r"distill: settings changed.*distill.learning_rate: .* -> 0.5"
                                                   r".*seed: 0 -> 3.*--redo distill"):
        run_recipe(changed, ("distill", "grpo"))
    assert recipe_to_dict(recipe)["distill"]["learning_rate"] != 0.5  # nothing was rewritten
    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe)))
    assert prepare_stage(changed, "distill", tmp_path / "distill", redo=True)
    moved = [p.name for p in tmp_path.iterdir() if p.name.startswith("distill.replaced-")]
    assert moved and (tmp_path / moved[0] / "checkpoints" / "checkpoint-7").exists()  # kept, not deleted
    assert prepare_stage(changed, "grpo", tmp_path / "grpo", redo=True)  # a later stage follows a redone one


def test_overlong_distillation_records_are_dropped_and_counted(caplog):
    from datasets import Dataset

    from pipeline.data import drop_overlong
    from pipeline.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "completion": [{"role": "assistant", "content": text}]}
            for text in ("2", "x" * 300_000, "the answer is 2")]
    with caplog.at_level("WARNING"):
        kept, dropped = drop_overlong(Dataset.from_list(rows), tokenizer, max_length=512)
    assert dropped == 1 and len(kept) == 2
    assert "dropped 1 of 3 records longer than max_length=512" in caplog.text
    with pytest.raises(ValueError, match="every record is longer than distill.max_length=4"):
        drop_overlong(Dataset.from_list(rows), tokenizer, max_length=4)


def test_resume_skips_a_checkpoint_with_truncated_weights(tmp_path, caplog):
    """A checkpoint whose weights were cut short (trainer_state.json present) must not block resuming: the one
    before it is used, and the bad file is named; nothing is deleted."""
    import torch
    from safetensors.torch import save_file

    from pipeline.checkpoints import latest_complete_checkpoint

    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        save_file({"w": torch.randn(64, 64)}, folder / "model.safetensors")
        torch.save({"step": step}, folder / "optimizer.pt")
        (folder / "trainer_state.json").write_text("{}")
    weights = tmp_path / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with caplog.at_level("WARNING"):
        assert latest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert "checkpoint-4/model.safetensors (cut short)" in caplog.text
    assert (tmp_path / "incomplete-checkpoint-4" / "optimizer.pt").exists()


def test_resume_skips_a_checkpoint_damaged_in_place_or_with_a_state_that_is_not_json(tmp_path):
    """Flipped bytes of the same size in a marked checkpoint's weights, and a trainer_state.json that is not JSON
    (every re-run failed the same, naming no file): both are set aside, named, and the one before is used."""
    from pipeline.checkpoints import CheckpointMarker, latest_complete_checkpoint

    class Args:
        output_dir, save_total_limit = str(tmp_path), None

    class State:
        is_world_process_zero = True

    for step in (1, 2, 3):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 8)
        (folder / "trainer_state.json").write_text('{"global_step": %d}' % step)
        State.global_step = step
        CheckpointMarker().on_save(Args, State, None)
    weights = tmp_path / "checkpoint-3" / "model.safetensors"
    weights.write_bytes(bytes(reversed(range(256))) * 8)  # same size, other bytes
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{not json")
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    assert (tmp_path / "incomplete-checkpoint-3").exists() and (tmp_path / "incomplete-checkpoint-2").exists()


def test_a_recipe_folder_without_recipe_yaml_is_a_clear_error(tmp_path):
    with pytest.raises(RecipeError, match="a folder without recipe.yaml"):
        load_recipe(str(tmp_path))


def test_cli_version_config_and_recipes(capsys):
    from pipeline.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert "sse-pipeline" in capsys.readouterr().out
    assert main(["recipes"]) == 0
    assert {"demo", "gpu-100m", "paper-2b"} <= {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert main(["config", "demo", "grpo.steps=7"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["grpo"]["steps"] == 7
    assert main(["config", "demo", "grpo.steps=0"]) == 2
    assert "grpo.steps: must be >= 1" in capsys.readouterr().err


def test_what_can_be_checked_is_refused_before_ray_starts(tmp_path, capsys):
    """Each of these used to fail after Ray started (a missing --checkpoint after 28-59 s, leaving a record of the bad
    path; a missing data file or a malformed benchmark file after training); an override after --checkpoint was
    refused by argparse; a wrong recipe name got no suggestion."""
    from pipeline.cli import main

    out = f"output_dir={tmp_path / 'run'}"
    assert main(["eval", "demo", "--checkpoint", str(tmp_path / "none"), out, "eval.limit=2"]) == 2  # override after
    assert "--checkpoint" in capsys.readouterr().err and not (tmp_path / "run" / "eval").exists()
    assert main(["distill", "demo", out, "distill.data.source=missing.jsonl"]) == 2
    assert "distill.data.source: 'missing.jsonl' is no file" in capsys.readouterr().err
    bad = tmp_path / "bench.jsonl"
    bad.write_text('{"id": "a", "problem": "1+1"}\n')
    assert main(["eval", "demo", out, f"eval.benchmarks=[{bad}]"]) == 2
    assert "no field 'answer'" in capsys.readouterr().err
    twin = tmp_path / "x" / "gsm8k.jsonl"  # filed under the same name as the registered gsm8k's generations
    twin.parent.mkdir()
    twin.write_text('{"id": "a", "problem": "1+1", "answer": "2"}\n')
    assert main(["eval", "demo", out, f"eval.benchmarks=[{twin}, gsm8k]"]) == 2
    assert "share the name 'gsm8k'" in capsys.readouterr().err
    assert main(["run", "paper2b"]) == 2 and "did you mean paper-2b" in capsys.readouterr().err


def test_reward_curve_has_a_panel_per_reward_and_a_moving_average(tmp_path):
    from pipeline.metrics import moving_average, plot_curves

    assert moving_average([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 20, "rewards/accuracy/mean": s / 40,
                                        "rewards/format/mean": 0.5, "rewards/accuracy/std": 0.1}) + "\n"
                            for s in range(1, 21)))
    import matplotlib.image

    png = plot_curves(path, tmp_path / "curve.png", ["reward", "rewards/*"], "GRPO")
    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 3 * 400  # three panels: reward, accuracy, format (std is not a reward curve)


def test_results_plot_when_every_score_is_zero(tmp_path):
    from eval.metrics import summarize
    from eval.report import write_reports

    rows = [{"correct": [False] * 4, "clusters": [0, 0, 1, 1], "lengths": [5] * 4, "truncated": [False] * 4}] * 3
    write_reports({"sampling": {}, "benchmarks": {"a": summarize(rows), "b": summarize(rows)}}, tmp_path)
    assert (tmp_path / "results.png").stat().st_size > 1000
    assert "| a | 3 | 4 | 0.0 (0.0-0.0)" in (tmp_path / "results.md").read_text()


def test_training_keeps_float32_master_weights():
    """A recipe whose model is stored in bf16 (paper-2b) still trains float32 weights: at lr 1e-6 one AdamW step
    changes essentially every parameter that has a gradient (with bf16 weights about 2% would change)."""
    import torch

    from pipeline.models import TRAINING_DTYPE, autocast_bf16, load_model

    recipe = load_recipe("demo", ["model.dtype=bfloat16", "precision=auto"])
    model, _ = load_model(recipe.model, None, seed=0, dtype=TRAINING_DTYPE)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randint(1, 20, (2, 24))
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0).step()
    moved = [bool((p.detach() != before[n]).any()) for n, p in model.named_parameters()
             if p.grad is not None and bool(p.grad.abs().sum() > 0)]
    assert sum(moved) / len(moved) > 0.99
    assert autocast_bf16(recipe, torch.device("cuda")) and not autocast_bf16(recipe, torch.device("cpu"))
    assert not autocast_bf16(load_recipe("demo", ["precision=fp32"]), torch.device("cuda"))


def test_distillation_loss_includes_the_sse_balance_loss(tmp_path):
    """TRL's fused LM head never runs the model's own loss, so the partition-balance term must be added by the
    trainer: its loss = the fused LM loss + aux_loss_coef * the backbone's balance loss, and it is logged."""
    import torch

    from pipeline.data import sft_dataset
    from pipeline.models import TRAINING_DTYPE, load_model, resolve_device
    from pipeline.stages.distill import SSESFTTrainer, sft_config

    recipe = load_recipe("demo", ["distill.data.max_samples=16", "distill.batch_size=4"])
    model, tokenizer = load_model(recipe.model, None, seed=0, dtype=TRAINING_DTYPE)
    assert model.config.aux_loss_coef == 0.01
    trainer = SSESFTTrainer(model=model, args=sft_config(recipe, tmp_path, resolve_device("cpu")),
                                   train_dataset=sft_dataset(recipe.distill.data, recipe.prompt_instruction),
                                   processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    with torch.no_grad():
        lm = model(**batch, fused_lm_head=True).loss
        balance = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).aux_loss
        loss = trainer.compute_loss(model, dict(batch))
    assert balance > 0 and torch.allclose(loss, lm + 0.01 * balance, rtol=1e-5), (loss, lm, balance)
    assert trainer._metrics["train"]["balance_loss"] == [pytest.approx(balance.item(), rel=1e-5)]


def test_grpo_weighs_the_balance_loss_as_its_recipe_says(tmp_path):
    """``grpo.balance_loss_coef``: the partition-balance loss's weight in GRPO's loss (None: the model's 0.01). At 0
    the loss is the policy loss alone; the balance loss is still logged."""
    import torch
    from datasets import Dataset

    from pipeline.models import TRAINING_DTYPE, load_model, resolve_device
    from pipeline.stages.grpo import SSEGRPOTrainer, grpo_config

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    losses = {}
    for coef in (None, 0.0):
        overrides = ["grpo.prompts_per_batch=2", "grpo.num_generations=2"]
        recipe = load_recipe("demo", overrides + ([] if coef is None else [f"grpo.balance_loss_coef={coef}"]))
        assert recipe.grpo.balance_loss_coef == coef
        model, tokenizer = load_model(recipe.model, None, seed=0, dtype=TRAINING_DTYPE)
        trainer = SSEGRPOTrainer(model=model, reward_funcs=[zero], train_dataset=Dataset.from_list([{"prompt": "1"}]),
                                 args=grpo_config(recipe, tmp_path, resolve_device("cpu")), processing_class=tokenizer,
                                 fleet=None, balance_loss_coef=recipe.grpo.balance_loss_coef)
        assert trainer.balance_loss_coef == (0.01 if coef is None else coef)
        ids = torch.randint(5, 60, (2, 8), generator=torch.Generator().manual_seed(0))
        inputs = {"prompt_ids": ids[:, :4], "prompt_mask": torch.ones(2, 4, dtype=torch.long),
                  "completion_ids": ids[:, 4:], "completion_mask": torch.ones(2, 4, dtype=torch.long),
                  "advantages": torch.tensor([1.0, -1.0]), "num_items_in_batch": torch.tensor(8)}
        trainer.current_gradient_accumulation_steps = 1
        model.train()
        with torch.no_grad():
            losses[coef] = trainer.compute_loss(model, inputs)
        balance = trainer._metrics["train"]["balance_loss"][-1]
        assert balance > 0
    # same weights (seed 0): the two losses differ by exactly the balance term the default adds
    assert torch.allclose(losses[None] - losses[0.0], torch.tensor(0.01 * balance), rtol=1e-4)


def test_padding_free_grpo_loss_and_gradients_equal_the_padded_pass(tmp_path):
    """GRPO's loss pass on packed rows of real tokens (SSE layers reset per row, attention per row) gives the loss,
    the log-probs and every gradient of TRL's padded pass, for rows whose prompts and completions differ in length,
    also when a token budget splits them over several forwards."""
    import torch
    from datasets import Dataset

    from pipeline.models import TRAINING_DTYPE, load_model, resolve_device
    from pipeline.packing import pack_rows
    from pipeline.stages.grpo import SSEGRPOTrainer, grpo_config

    recipe = load_recipe("demo", ["grpo.prompts_per_batch=2", "grpo.num_generations=3"])
    model, tokenizer = load_model(recipe.model, None, seed=0, dtype=TRAINING_DTYPE)
    assert "attn" in model.config.mixer_types and "sse" in model.config.mixer_types

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = SSEGRPOTrainer(model=model, reward_funcs=[zero], args=grpo_config(recipe, tmp_path, resolve_device("cpu")),
                             train_dataset=Dataset.from_list([{"prompt": "1+2=?"}]), processing_class=tokenizer,
                             fleet=None)
    g = torch.Generator().manual_seed(0)
    prompt_lengths, completion_lengths = [5, 9, 3, 7, 9, 4], [6, 2, 11, 8, 1, 11]
    P, C = max(prompt_lengths), max(completion_lengths)
    prompt_ids = torch.full((6, P), tokenizer.pad_token_id)
    prompt_mask = torch.zeros(6, P, dtype=torch.long)
    completion_ids = torch.full((6, C), tokenizer.pad_token_id)
    completion_mask = torch.zeros(6, C, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_ids[i, P - p:], prompt_mask[i, P - p:] = torch.randint(5, 60, (p,), generator=g), 1
        completion_ids[i, :c], completion_mask[i, :c] = torch.randint(5, 60, (c,), generator=g), 1
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.randn(6, generator=g),
              "num_items_in_batch": completion_mask.sum()}
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    model.train()

    def loss_and_grads(padding_free: bool, budget: int | None):
        trainer.args.padding_free, trainer.args.max_tokens_per_microbatch = padding_free, budget
        model.zero_grad()
        ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, compute_entropy=True)
        loss = trainer.compute_loss(model, dict(inputs))
        loss.backward()
        keep = completion_mask.bool()
        return loss.detach(), logps[keep].detach(), entropy[keep].detach(), \
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def assert_equal(packed, padded):
        torch.testing.assert_close(packed[1], padded[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[2], padded[2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)
        assert packed[3].keys() == padded[3].keys() and len(padded[3]) > 10
        for name in padded[3]:
            torch.testing.assert_close(packed[3][name], padded[3][name], rtol=1e-4, atol=1e-6, msg=name)

    assert_equal(loss_and_grads(True, None), loss_and_grads(False, None))  # one forward, balance loss included
    # 25 tokens: each forward holds one or two rows. The balance loss is then the mean of each forward's own (as over
    # TRL's micro-batches), so the policy loss is compared alone.
    trainer.balance_loss_coef = 0.0
    assert_equal(loss_and_grads(True, 25), loss_and_grads(False, None))
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    sizes = [row.input_ids.shape[1] for row in pack_rows(ids, mask, C, 25)]
    assert sizes == [22, 14, 25, 15], sizes  # rows of 11, 11, 14, 15, 10 and 15 tokens


def test_the_initial_model_is_built_again_when_its_settings_change(tmp_path):
    """``initial/`` keeps the model settings it was built with; a changed width builds it again (GRPO trained the
    old 128-wide model while grpo/recipe.yaml said 256)."""
    from sse_model.checkpoint import load_pretrained

    from pipeline.stages.base import initial_checkpoint

    first = initial_checkpoint(load_recipe("demo"), tmp_path)
    assert initial_checkpoint(load_recipe("demo"), tmp_path) == first  # built once
    wider = initial_checkpoint(load_recipe("demo", ["model.config_overrides={intermediate_size: 256}"]), tmp_path)
    assert load_pretrained(wider).config.intermediate_size == 256
    assert len(list(tmp_path.glob("initial.replaced-*"))) == 1


def test_a_stage_run_alone_starts_from_the_last_finished_stage(tmp_path):
    """``sse-pipeline eval`` on a finished run scores its GRPO model (it scored a fresh random initial one); GRPO
    alone starts from distillation's model; a disabled stage's model is not used."""
    from pipeline.checkpoints import DONE
    from pipeline.run import starting_model

    recipe = load_recipe("demo")
    assert starting_model(recipe, tmp_path, ("eval",)) is None
    for stage in ("distill", "grpo"):
        (tmp_path / stage / "final").mkdir(parents=True)
        (tmp_path / stage / "final" / DONE).write_text("{}")
    assert starting_model(recipe, tmp_path, ("eval",)) == str(tmp_path / "grpo" / "final")
    assert starting_model(recipe, tmp_path, ("grpo", "eval")) == str(tmp_path / "distill" / "final")
    assert starting_model(recipe, tmp_path, ("distill", "grpo", "eval")) is None
    assert starting_model(load_recipe("demo", ["grpo.enabled=false"]), tmp_path, ("eval",)) == \
        str(tmp_path / "distill" / "final")
    assert starting_model(load_recipe("demo", ["distill.enabled=false"]), tmp_path, ("grpo",)) is None


def test_generations_are_reused_only_for_the_very_model_that_made_them(tmp_path):
    """A re-run generates nothing for a model whose summary names it (its fingerprint); the same path retrained,
    another model, no summary or half of one, and it generates again."""
    import json
    import os

    from pipeline.stages.base import model_id
    from pipeline.stages.evaluate import generated_already

    model, out = tmp_path / "distill" / "final", tmp_path / "eval" / "distill"
    model.mkdir(parents=True), out.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    assert not generated_already(out, str(model))  # nothing scored yet
    (out / "summary.json").write_text(json.dumps({"model": model_id(str(model)), "benchmarks": {"gsm8k": {}}}))
    assert generated_already(out, str(model)) and generated_already(out, str(model), ["gsm8k"])
    assert not generated_already(out, str(model), ["gsm8k", "math500"])  # a benchmark added since
    other = tmp_path / "grpo" / "final"
    other.mkdir(parents=True)
    (other / "model.safetensors").write_bytes(b"weights")
    assert not generated_already(out, str(other))
    stat = (model / "model.safetensors").stat()  # retrained at the same path: the fingerprint moves
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert not generated_already(out, str(model))
    (out / "summary.json").write_text('{"model": ')
    assert not generated_already(out, str(model))


def test_what_the_machine_must_offer_is_checked_before_anything_starts(tmp_path, monkeypatch):
    """Each of these failed only after training: no reward to learn from, vLLM named but not installed, an
    evaluation file that is not there (taken for a hub name, then retried), a storage location that is a file."""
    import importlib.util

    from pipeline.run import preflight

    with pytest.raises(RecipeError, match="grpo.rewards: every reward weight"):
        load_recipe("demo", ["grpo.rewards.accuracy=0", "grpo.rewards.format=0"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    with pytest.raises(RecipeError, match="grpo.engine.backend: vllm needs vLLM"):
        preflight(load_recipe("demo", ["grpo.engine.backend=vllm"]), ("grpo", "eval"))
    preflight(load_recipe("demo", ["grpo.engine.backend=vllm"]), ("eval",))  # not the stages run here
    with pytest.raises(RecipeError, match="eval.benchmarks: 'data/mine.jsonl' is no file"):
        preflight(load_recipe("demo", ["eval.benchmarks=[data/mine.jsonl]"]), ("eval",))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="storage: cannot write to"):
        preflight(load_recipe("demo", [f"storage={tmp_path / 'a-file'}"]), ("eval",))
    preflight(load_recipe("demo", [f"storage={tmp_path / 'store'}"]), ("eval",))
    assert list((tmp_path / "store").iterdir()) == []  # the probe is gone


def test_a_hub_dataset_out_of_reach_is_refused_before_anything_starts(monkeypatch):
    """A hub name with no network to the hub: ``datasets`` retried for a minute, after the stages before had run."""
    from pipeline.run import preflight
    from pipeline.stages import base

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(base, "HUB", ("127.0.0.1", 9))  # nothing listens there: refused at once
    with pytest.raises(RecipeError, match="eval.benchmarks: 'someone/problems' names a hub dataset"):
        preflight(load_recipe("demo", ["eval.benchmarks=[someone/problems]"]), ("eval",))
    with pytest.raises(RecipeError, match=r"grpo.data.source: 'someone/prompts' names a hub dataset"):
        preflight(load_recipe("demo", ["grpo.data.source=someone/prompts"]), ("grpo",))
    preflight(load_recipe("demo", ["grpo.data.source=someone/prompts"]), ("eval",))  # not a stage run here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache answers for it when it loads
    preflight(load_recipe("demo", ["eval.benchmarks=[someone/problems]"]), ("eval",))


def test_a_failed_stage_keeps_our_words_in_its_one_line_error(tmp_path):
    """``grpo.max_engine_restarts=0``: the one-line error kept Ray's last line and dropped "rollout engine 0 died";
    a --redo of a stage the command does not run was ignored after "done, skipping"."""
    from pipeline.cli import one_line
    from pipeline.run import run_recipe

    ray_text = "rollout engine 0 died and the fleet has already replaced 0 (max_restarts=0): The actor died\n" \
               "  File \"worker.py\", line 3\nray.exceptions.ActorDiedError: The actor died unexpectedly"
    line = one_line(RuntimeError(ray_text))
    assert line.startswith("RuntimeError: rollout engine 0 died") and line.endswith("died unexpectedly")
    assert one_line(ValueError("plain")) == "ValueError: plain"
    with pytest.raises(RecipeError, match="--redo distill: this command runs eval only"):
        run_recipe(load_recipe("demo", [f"output_dir={tmp_path}"]), ("eval",), redo=("distill",))


def test_the_stage_error_is_the_one_reported(tmp_path, monkeypatch):
    """A folder made read-only mid-run: the lock cannot be removed, but the stage's own error is what ends the run;
    a model that cannot be written (a full disk) names where and how much room is left."""
    from pathlib import Path

    from pipeline.checkpoints import save_final
    from pipeline.lock import RunLock

    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name.startswith(".run"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    with pytest.raises(ValueError, match="the stage's own error"):
        with RunLock(tmp_path) as lock:
            monkeypatch.setattr(Path, "unlink", unlink)
            raise ValueError("the stage's own error")
    assert not lock.held

    class Full:
        def save_pretrained(self, path):
            Path(path).mkdir()
            raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file")

    with pytest.raises(OSError, match=r"could not write the model to .*final.tmp \(.* GiB free there"):
        save_final(Full(), None, tmp_path / "final", {})
    assert not (tmp_path / "final.tmp").exists()
    # the same words for a checkpoint the trainer could not write (the stages wrap trainer.train)
    from pipeline.checkpoints import is_write_error

    assert is_write_error(RuntimeError("[enforce fail at inline_container.cc:664] PytorchStreamWriter failed"))
    assert is_write_error(OSError(28, "No space left on device")) and not is_write_error(ValueError("bad value"))


def test_deterministic_recipes_train_with_deterministic_algorithms(tmp_path):
    """``deterministic: true`` reaches the trainers as transformers' ``full_determinism``: building one turns on
    PyTorch's deterministic algorithms (flash attention's backward among them, not deterministic by default on
    GPUs). It changes no stage's settings, so a re-run may flip it, and it is off unless asked."""
    import os

    import torch

    from pipeline.data import sft_dataset
    from pipeline.models import TRAINING_DTYPE, load_model, resolve_device
    from pipeline.recipe import recipe_to_dict, stage_settings
    from pipeline.stages.distill import SSESFTTrainer, sft_config
    from pipeline.stages.grpo import grpo_config

    plain = load_recipe("demo", ["distill.data.max_samples=8", "distill.batch_size=4"])
    recipe = load_recipe("demo", ["distill.data.max_samples=8", "distill.batch_size=4", "deterministic=true"])
    assert not plain.deterministic and recipe.deterministic
    for stage in ("align", "distill", "grpo"):
        assert stage_settings(recipe_to_dict(recipe), stage) == stage_settings(recipe_to_dict(plain), stage)
    cpu = resolve_device("cpu")
    assert not sft_config(plain, tmp_path, cpu).full_determinism
    assert sft_config(recipe, tmp_path, cpu).full_determinism and grpo_config(recipe, tmp_path, cpu).full_determinism
    environment = dict(os.environ)
    try:
        torch.use_deterministic_algorithms(False)
        model, tokenizer = load_model(recipe.model, None, seed=0, dtype=TRAINING_DTYPE)
        SSESFTTrainer(model=model, args=sft_config(recipe, tmp_path, cpu), processing_class=tokenizer,
                      train_dataset=sft_dataset(recipe.distill.data, recipe.prompt_instruction))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        os.environ.clear()
        os.environ.update(environment)


def test_a_stage_resumed_from_its_last_checkpoint_trains_no_step_past_the_end(tmp_path):
    """Killed after saving its last checkpoint (here: its final model removed), a re-run finishes from that checkpoint
    with the steps asked for (transformers trained one more: 3 of max_steps=2); and a GRPO whose data is smaller than
    one generation batch is refused (it trained nothing and was marked done)."""
    import json
    import shutil

    from pipeline.checkpoints import DONE
    from pipeline.run import run_recipe

    recipe = load_recipe("demo", [f"output_dir={tmp_path}", "distill.max_steps=2", "distill.save_steps=2",
                                  "distill.data.max_samples=64", "distill.batch_size=8"])
    run_recipe(recipe, ("distill",))
    shutil.rmtree(tmp_path / "distill" / "final")
    run_recipe(recipe, ("distill",))
    assert json.loads((tmp_path / "distill" / "final" / DONE).read_text())["global_step"] == 2
    small = load_recipe("demo", [f"output_dir={tmp_path / 'g'}", "grpo.data.max_samples=3", "grpo.steps=2"])
    with pytest.raises(Exception, match=r"grpo.data: 3 prompts, fewer than one generation batch"):
        run_recipe(small, ("grpo",))


def test_progress_is_one_short_line_a_step_with_rate_and_eta():
    """Inside Ray workers the trainer's bars are off and its log was a dict of ~40 metrics a step; a step prints one
    line instead, GRPO's with its reward and rollout rate."""
    from types import SimpleNamespace

    from pipeline.metrics import progress_line

    state = SimpleNamespace(global_step=40, max_steps=120)
    line = progress_line("grpo", state, {"time/step_s": 2.0, "reward": 0.4567, "tokens/generated_per_s": 12345.6,
                                        "completions/mean_length": 88.0})
    assert line == "grpo: step 40/120 (33%), 2.00 s/step, ETA 00:02:40, reward 0.457, generated tok/s 12,346"


def test_a_file_split_is_sliced_as_datasets_slices_a_hub_split(tmp_path):
    """``split: train[:-8]`` and ``train[-8:]`` part one file into training and held-out records, as the
    ``datasets`` library reads ``train[:90%]`` of a hub dataset; anything else is refused before a stage starts."""
    from pipeline.data import split_slice, sft_dataset
    from pipeline.recipe import DataSpec, RecipeError
    from pipeline.stages.distill import DistillStage

    assert split_slice("train", 40) == slice(None, None) and split_slice("train[:-8]", 40) == slice(None, -8)
    assert split_slice("train[10%:]", 40) == slice(4, None) and split_slice("train[ 2:5 ]", 40) == slice(2, 5)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1?", "solution": f"{i}+1={i + 1}"}) + "\n" for i in range(40)))
    train = sft_dataset(DataSpec(source=str(data), split="train[:-8]"))
    held_out = sft_dataset(DataSpec(source=str(data), split="train[-8:]"))
    assert len(train) == 32 and len(held_out) == 8
    assert {r["prompt"][0]["content"] for r in train}.isdisjoint(r["prompt"][0]["content"] for r in held_out)
    for split in ("test", "train[a:]", "train[:-8"):
        recipe = load_recipe("demo", [f"distill.data={{source: {data}, split: '{split}'}}"])
        with pytest.raises(RecipeError, match=r"distill.data.split: .*one split, 'train'"):
            DistillStage().preflight(recipe)
    recipe = load_recipe("demo", ["distill.eval_data={source: 'builtin:arithmetic', split: 'train[:5]'}"])
    with pytest.raises(RecipeError, match=r"distill.eval_data.split: .*no splits"):
        DistillStage().preflight(recipe)
    with pytest.raises(RecipeError, match="distill.eval_steps: no distill.eval_data"):
        load_recipe("demo", ["distill.eval_steps=5"])


def test_distillation_scores_held_out_solutions_as_the_loss_command_does(tmp_path):
    """``distill.eval_data``: the held-out solutions' teacher-forced loss in metrics.jsonl every ``eval_steps`` and
    for the final model: the mean over solutions of each one's loss per token, as ``sse-pipeline loss`` scores
    that model's records, and as one record a forward scores them."""
    import torch

    from pipeline.data import sft_dataset
    from pipeline.lm_loss import completion_loss
    from pipeline.recipe import DataSpec
    from sse_model.checkpoint import load_pretrained
    from transformers import AutoTokenizer

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i % 7}?", "solution": f"{i}+{i % 7}={i + i % 7}" + " so"
                                        * (i % 5) + f" \\boxed{{{i + i % 7}}}"}) + "\n" for i in range(48)))
    recipe = load_recipe("demo", [f"output_dir={tmp_path / 'run'}",
                                  f"distill.data={{source: {data}, split: 'train[:-8]'}}",
                                  f"distill.eval_data={{source: {data}, split: 'train[-8:]'}}", "distill.eval_steps=2",
                                  "distill.max_steps=3", "distill.batch_size=8", "distill.logging_steps=1",
                                  "distill.packing=true"])  # as the SmolLM2 recipes train: held-out rows not packed
    final = run_distill(recipe, tmp_path / "run" / "distill")
    rows = [json.loads(line) for line in (tmp_path / "run" / "distill" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in rows if "eval_loss" in r]
    scored = {r["step"]: r["eval_loss"] for r in evaluations}
    assert [r["step"] for r in evaluations] == [2, 3], rows  # every eval_steps and the last step, once each
    assert all(r["eval_records"] == 8 for r in evaluations), evaluations
    held_out = sft_dataset(DataSpec(source=str(data), split="train[-8:]"), recipe.prompt_instruction)
    model = load_pretrained(str(final), torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    for pack_tokens in (8192, 1):  # packed as distillation scored them; one record a forward
        expected = completion_loss(model, tokenizer, held_out, torch.device("cpu"), pack_tokens=pack_tokens)
        per_record = [loss / n for loss, n in zip(expected.record_losses, expected.record_tokens)]
        assert scored[3] == pytest.approx(sum(per_record) / len(per_record), rel=1e-4), (pack_tokens, scored)
    assert scored[2] != pytest.approx(scored[3], rel=1e-6)  # the model of step 2, not the final one, at step 2


def test_distilling_only_the_sse_layers_leaves_the_rest_of_the_model_as_it_was(tmp_path):
    """``distill.train: sse``: the SSE layers' token mixers train, every other weight (embeddings, MLPs, norms, the
    softmax attention layers) stays the starting model's; a model without SSE layers is refused."""
    import torch

    from pipeline.models import TRAINING_DTYPE, load_model
    from sse_model.checkpoint import load_pretrained

    overrides = ["distill.data.max_samples=16", "distill.batch_size=8", "distill.max_steps=2", "distill.train=sse"]
    recipe = load_recipe("demo", [f"output_dir={tmp_path / 'a'}", *overrides])
    model = load_model(recipe.model, None, seed=recipe.seed, dtype=TRAINING_DTYPE)[0]
    start, kinds = model.state_dict(), model.config.mixer_types
    final = load_pretrained(str(run_distill(recipe, tmp_path / "a" / "distill")), torch.float32).state_dict()
    trained = tuple(f"model.layers.{i}.attn." for i, kind in enumerate(kinds) if kind == "sse")
    changed = {name for name, value in final.items() if not torch.equal(value, start[name])}
    assert trained and changed and all(name.startswith(trained) for name in changed), changed
    assert any(".q_proj." in name for name in changed) and any(".o_proj." in name for name in changed)
    attention = load_recipe("demo", [f"output_dir={tmp_path / 'b'}", *overrides,
                                     f"model.config_overrides.mixer_types=[{', '.join(['attn'] * len(kinds))}]"])
    with pytest.raises(RecipeError, match="distill.train: sse: the model has no SSE layer"):
        run_distill(attention, tmp_path / "b" / "distill")
