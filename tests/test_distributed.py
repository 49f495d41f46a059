"""Data-parallel training: several Ray workers in one torch.distributed group (gloo on CPU) train like one
process on the same global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.metrics import read_metrics
from pipeline.recipe import RecipeError, load_recipe


@pytest.fixture(autouse=True)
def _ray_down():
    """Each test starts its own Ray: a run's cluster left up would hand the next test its CPUs (``ray.num_cpus``)."""
    yield
    import ray

    ray.shutdown()


def test_two_data_parallel_workers_train_like_one_process(tmp_path):
    """The distillation stage on 1 and on 2 workers (gloo, each with half the global batch of 8): the same loss
    at every step, the same held-out loss and the same final weights. The balance loss is off: it is a product of
    batch means, so each worker's own differs from the whole batch's (as it does across micro-batches)."""
    from pipeline.run import run_recipe
    from sse_model.checkpoint import load_pretrained

    common = ["distill.data.max_samples=128", "distill.max_steps=4", "distill.batch_size=8", "distill.epochs=1",
              "distill.logging_steps=1", "distill.save_steps=100", "distill.warmup_ratio=0",
              "model.config_overrides.aux_loss_coef=0.0", "ray.num_cpus=2", "distill.eval_steps=2",
              "distill.eval_data={source: 'builtin:arithmetic?terms=2', max_samples: 10, seed: 9}"]
    losses, finals, held_out = {}, {}, {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        recipe = load_recipe("demo", [f"output_dir={out}", f"distill.num_workers={workers}", *common])
        run_recipe(recipe, ("distill",))
        losses[workers] = [r["loss"] for r in read_metrics(out / "distill" / "metrics.jsonl") if "loss" in r]
        held_out[workers] = [r["eval_loss"] for r in read_metrics(out / "distill" / "metrics.jsonl")
                             if "eval_loss" in r]
        finals[workers] = load_pretrained(out / "distill" / "final").state_dict()
    assert len(losses[1]) == 4 and losses[1][0] != losses[1][-1]
    assert losses[2] == pytest.approx(losses[1], rel=1e-4), (losses[1], losses[2])
    # the held-out loss (10 solutions over 2 workers) is the same measure on any number of them
    assert len(held_out[1]) == 2 and held_out[2] == pytest.approx(held_out[1], rel=1e-4), held_out
    # AdamW's normalised step (lr 3e-3) turns the rounding of a near-zero gradient, summed in another order by the
    # all-reduce, into up to a few percent of one step: 7e-5 on 2 of 8,192 weights with torch 2.13 on CPU
    for name, value in finals[1].items():
        torch.testing.assert_close(finals[2][name], value, rtol=1e-4, atol=1.5e-4, msg=name)


def test_workers_must_divide_the_batch():
    with pytest.raises(RecipeError, match="distill.batch_size: 32 rows a step do not divide over 3 workers"):
        load_recipe("demo", ["distill.num_workers=3"])


def test_storage_round_trip_is_complete_or_refused(tmp_path, monkeypatch):
    """A stored directory comes back whole into the node's cache, once; a copy without its marker (an upload
    cut short) is refused."""
    from pipeline.storage import MARKER, materialize, storage_uri, upload

    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "weights.bin").write_bytes(b"x" * 1000)
    uri = upload(src, storage_uri(str(tmp_path / "store"), "run", "final"))
    assert uri.startswith("file://")
    local = materialize(uri)
    assert local.is_relative_to(tmp_path / "cache") and (local / "sub" / "weights.bin").read_bytes() == b"x" * 1000
    assert materialize(uri) == local and materialize(str(src)) == src
    (tmp_path / "store" / "run" / "final" / MARKER).unlink()
    with pytest.raises(FileNotFoundError, match="no complete stored copy"):
        materialize(uri)


def test_storage_tells_contents_apart_not_only_sizes(tmp_path, monkeypatch):
    """Model B of model A's architecture (same file names and sizes, other weights) stored where A was replaces A,
    and every node then materialises B; a stored file damaged in place is refused, naming it. (Compared by size,
    B's evaluation scored A again.)"""
    from pipeline.storage import materialize, storage_uri, upload

    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(tmp_path / "cache"))
    uri = storage_uri(str(tmp_path / "store"), "run", "eval-model")
    for name, byte in (("a", b"a"), ("b", b"b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(byte * 1000)
        upload(tmp_path / name, uri)
        assert (materialize(uri) / "model.safetensors").read_bytes() == byte * 1000
    stored = tmp_path / "store" / "run" / "eval-model" / "model.safetensors"
    stored.write_bytes(b"c" * 1000)  # same size, other bytes
    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(tmp_path / "another-node"))
    with pytest.raises(OSError, match="model.safetensors does not match the size and SHA-256.*damaged"):
        materialize(uri)


def test_storage_keeps_runs_of_other_settings_apart():
    """Two runs of one recipe sharing a storage location: the same stage settings from another output folder (another
    node) find the same entries; other settings never do (B fetched A's checkpoint, trained on and replaced A's
    final); how a stage runs (workers) does not count; a run_id shares on purpose."""
    def at(*overrides, stage="distill"):
        return load_recipe("demo", ["storage=/tmp/store", *overrides]).stored_at(stage, "checkpoints")

    base = at("output_dir=runs/a")
    assert base == at("output_dir=/elsewhere/b") == at("output_dir=runs/a", "distill.num_workers=2")
    assert base != at("output_dir=runs/b", "distill.learning_rate=0.0001")
    assert at("grpo.learning_rate=1e-5", stage="distill") == base  # another stage's settings
    assert at("grpo.learning_rate=1e-5", stage="grpo") != at(stage="grpo")
    assert at("run_id=exp1").endswith("/demo/distill@exp1/checkpoints") and at("run_id=exp1", "seed=3") == at("run_id=exp1")
    with pytest.raises(RecipeError, match="run_id"):
        load_recipe("demo", ["run_id=a/b"])


def test_grpo_runs_its_engine_on_another_node_through_storage(tmp_path, monkeypatch):
    """Two Ray nodes on this machine, each with its own cache folder (where it puts the models it fetches) and no
    output path in common: GRPO's trainer on the head, its rollout engine on the second node (asked for with
    grpo.engine_resources), the model reaching the engine only through the recipe's storage location and the
    weights of every step by broadcast (gloo) from the trainer; then evaluation on two workers whose shards meet
    in storage."""
    import json

    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from pipeline.run import run_recipe
    from pipeline.storage import MARKER

    if ray.is_initialized():
        ray.shutdown()
    head_cache, engine_cache, store = tmp_path / "head-node", tmp_path / "engine-node", tmp_path / "store"
    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(head_cache))  # a node's processes inherit it at its start
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(engine_cache))
    cluster.add_node(num_cpus=1, resources={"engine_node": 1})
    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(head_cache))
    try:
        recipe = load_recipe("demo", [f"output_dir={tmp_path / 'out'}", f"storage={store}", "grpo.steps=2",
                                      "grpo.save_steps=1", "grpo.engine_resources={engine_node: 1}",
                                      "grpo.weight_sync=broadcast", "eval.num_workers=2", "eval.limit=4",
                                      "eval.repeats=1", "eval.benchmarks=[arithmetic]"])
        run_recipe(recipe, ("grpo", "eval"), address=cluster.address)
        engine_node = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get("engine_node"))
        (engine,) = json.loads((tmp_path / "out" / "grpo" / "engines.json").read_text())
        assert engine["node"] == engine_node
        assert engine["source"] == recipe.stored_at("grpo", "start")
        # each node read the stored model into its own cache: the engine's node and the trainer's
        assert list((engine_cache / "storage").glob("*/config.json"))
        assert list((head_cache / "storage").glob("*/config.json"))
        stored_final = recipe.stored_at("grpo", "final")
        assert (Path(stored_final.removeprefix("file://")) / MARKER).exists()
        rows = [r for r in read_metrics(tmp_path / "out" / "grpo" / "metrics.jsonl") if "reward" in r]
        assert len(rows) == 2 and all(r["time/weight_sync_s"] > 0 for r in rows)
        # evaluation's two workers stored their shards, and the GRPO model they scored is named by its stored URI
        (shards,) = Path(recipe.stored_at("eval", "generations").removeprefix("file://")).iterdir()  # one model
        stored = sorted(p.name for p in shards.iterdir())
        assert stored == ["arithmetic.settings.json", "arithmetic.shard0of2.jsonl", "arithmetic.shard1of2.jsonl"]
        summary = json.loads((tmp_path / "out" / "eval" / "summary.json").read_text())
        assert summary["model"].startswith(stored_final)

        @ray.remote(resources={"engine_node": 0.01})
        def shipped():
            return ray.get_runtime_context().runtime_env.get("py_modules", [])

        # the job ships the project's packages to the nodes (ray.ship_project): one uploaded package each
        assert len(ray.get(shipped.remote())) == 6
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_rerun_elsewhere_resumes_from_stored_checkpoints(tmp_path):
    """Distillation with a storage location stores each finished checkpoint; a run of the same run_id from another
    output folder (another node's) fetches the newest and resumes from it, here to train longer; --redo sets the
    stored ones aside. (Without a run_id only a run of the same settings shares them.)"""
    from pipeline.checkpoints import DONE
    from pipeline.run import prepare_stage, run_recipe

    store = tmp_path / "store"
    common = [f"storage={store}", "run_id=shared", "distill.data.max_samples=64", "distill.batch_size=8",
              "distill.save_steps=1", "distill.save_total_limit=2", "distill.logging_steps=1", "ray.num_cpus=2"]
    run_recipe(load_recipe("demo", [f"output_dir={tmp_path / 'a'}", "distill.max_steps=2", *common]), ("distill",))
    stored = store / "demo" / "distill@shared" / "checkpoints"
    assert sorted(p.name for p in stored.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    elsewhere = load_recipe("demo", [f"output_dir={tmp_path / 'b'}", "distill.max_steps=3", *common])
    run_recipe(elsewhere, ("distill",))
    import json

    # it trained step 3 only: steps 1-2 came with the fetched checkpoint
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "distill" / "metrics.jsonl") if "loss" in r] == [3]
    assert json.loads((tmp_path / "b" / "distill" / "final" / DONE).read_text())["global_step"] == 3
    assert sorted(p.name for p in stored.iterdir()) == ["checkpoint-2", "checkpoint-3"]  # save_total_limit
    prepare_stage(elsewhere, "distill", tmp_path / "b" / "distill", redo=True)
    assert not (store / "demo" / "distill@shared").exists()
    assert [p.name.startswith("distill@shared.replaced-") for p in (store / "demo").iterdir()].count(True) == 1


def test_grpo_placement_reserves_the_gpus_together():
    """On a cluster of 3 (logical) GPUs: colocated puts a trainer and its engine on one GPU, split gives each its
    own; the placement group reserves them before anything starts; impossible plans are refused."""
    ray = pytest.importorskip("ray")
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pipeline.placement import plan_grpo, reserve

    with pytest.raises(RecipeError, match="needs 3 GPUs"):
        plan_grpo("split", gpus=2, cpus=4, num_engines=2)
    with pytest.raises(RecipeError, match="this cluster has none"):
        plan_grpo("colocated", gpus=0, cpus=4, num_engines=1)
    # on CPUs, workers that cannot all be placed hung with no output: refused, naming what is needed and what exists
    with pytest.raises(RecipeError, match=r"grpo.num_workers=2 with grpo.num_engines=1 each needs 4 CPUs.*it has 2"):
        plan_grpo("auto", gpus=0, cpus=2, num_engines=1, num_workers=2)
    # two engines on one GPU each planned their memory from what the other left
    with pytest.raises(RecipeError, match="grpo.num_engines=2: colocated engines share their trainer's GPU"):
        plan_grpo("auto", gpus=1, cpus=4, num_engines=2)
    assert plan_grpo("auto", gpus=0, cpus=4, num_engines=1, num_workers=2).mode == "cpu"
    assert plan_grpo("auto", gpus=4, cpus=4).mode == "colocated"  # every GPU: a trainer and its engine on each
    assert plan_grpo("auto", gpus=4, cpus=4, num_workers=1).mode == "split"
    two = plan_grpo("split", gpus=6, cpus=8, num_engines=2, num_workers=2)  # trainers first, then their engines
    assert two.trainer_bundles == [0, 1] and two.engine_bundles == [[2, 3], [4, 5]]
    assert plan_grpo("auto", gpus=2, cpus=8).engine_bundles == [[0], [1]]

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, num_gpus=3, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Probe:
            def gpus(self):
                return ray.get_gpu_ids()

        for mode, workers in (("colocated", 1), ("split", 1)):
            plan = plan_grpo(mode, gpus=3, cpus=4, num_workers=workers)
            group = reserve(plan)
            trainer = Probe.options(**plan.trainer_options(group, 0)).remote()
            engines = [Probe.options(**plan.engine, scheduling_strategy=PlacementGroupSchedulingStrategy(group, b))
                       .remote() for b in plan.engine_bundles[0]]
            ids = [tuple(ray.get(p.gpus.remote())) for p in (trainer, *engines)]
            assert all(len(i) == 1 for i in ids), ids
            assert len(set(ids)) == (1 if mode == "colocated" else 3), (mode, ids)
            assert len(engines) == (1 if mode == "colocated" else 2)
            for p in (trainer, *engines):
                ray.kill(p)
            ray.util.remove_placement_group(group)
    finally:
        ray.shutdown()


def test_a_failed_training_worker_fails_the_stage_with_a_resume_hint():
    ray = pytest.importorskip("ray")
    from pipeline.distributed import run_data_parallel

    def _fails_on_rank_one() -> int:  # local: Ray ships it by value
        import os

        if os.environ["RANK"] == "1":
            raise OSError("disk full")
        return int(os.environ["WORLD_SIZE"])

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)distill: a data-parallel training worker failed .* resume from its "
                                               r"last complete checkpoint.*disk full"):
            run_data_parallel(_fails_on_rank_one, (), [{"num_cpus": 1}] * 2, "distill")
    finally:
        ray.shutdown()


def test_grpo_trains_on_two_data_parallel_workers_each_with_its_engine(tmp_path):
    """grpo.num_workers=2: two trainer processes in one gloo group, each rolling out its half of the groups on
    its own engine and syncing it; rank 0 writes the stage's files."""
    from pipeline.run import run_recipe

    recipe = load_recipe("demo", [f"output_dir={tmp_path}", "grpo.steps=2", "grpo.num_workers=2", "ray.num_cpus=4",
                                  "grpo.max_completion_length=16", "grpo.save_steps=100",
                                  "grpo.dynamic_sampling=false"])  # (one round: each batch's tokens generated once)
    run_recipe(recipe, ("grpo",))
    rows = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # the tokens generated are both workers' (each generated half the batch; rank 0's alone were logged before)
    generated = [r for r in rows if "tokens/generated" in r]
    rollouts = recipe.grpo.prompts_per_batch * recipe.grpo.num_generations
    assert generated and all(r["tokens/generated"] == pytest.approx(r["completions/mean_length"] * rollouts)
                             for r in generated), generated
    assert (tmp_path / "grpo" / "engines.json").exists() and (tmp_path / "grpo" / "engines-worker1.json").exists()
    assert (tmp_path / "grpo" / "final" / "config.json").exists()
    with pytest.raises(RecipeError, match="grpo.prompts_per_batch: 8 prompts do not divide over 3 trainer workers"):
        load_recipe("demo", ["grpo.num_workers=3"])


def test_every_eval_shards_rate_is_printed_by_the_process_that_waited_for_them(tmp_path, capsys):
    """Each shard's tokens and seconds reach the caller, which prints a line per shard: printed by the workers, Ray
    folded lines that differ only in numbers (``[repeated 3x across cluster]``), and a 4-GPU evaluation's rate
    could not be read from its log."""
    import re

    from pipeline.run import init_ray
    from pipeline.stages.base import initial_checkpoint
    from pipeline.stages.evaluate import generate_all

    recipe = load_recipe("demo", [f"output_dir={tmp_path}", "ray.num_cpus=2", "eval.benchmarks=[arithmetic]",
                                  "eval.limit=2", "eval.repeats=1", "eval.max_new_tokens=4"])
    checkpoint = initial_checkpoint(recipe, tmp_path)
    init_ray(recipe)
    generate_all(recipe, tmp_path / "eval", checkpoint, workers=2)
    lines = re.findall(r"^eval: shard (\d) of 2: (\d+) tokens generated in .* (\d+) sequences at once of (\d+) slots",
                       capsys.readouterr().out, re.M)
    assert [k for k, *_ in lines] == ["1", "2"]
    assert all(int(tokens) > 0 and 1 <= int(at_once) <= int(slots) for _, tokens, at_once, slots in lines), lines


def test_grpo_generating_ahead_on_two_trainer_workers(tmp_path):
    """grpo.max_staleness=1 with two trainer workers (each its engine and its share of every batch): the first
    batch is generated by the policy that trains on it, every later one by the weights one batch older; the
    engines' busy share and the weight version of each batch are logged. Refused where it cannot overlap."""
    from pipeline.placement import plan
    from pipeline.run import run_recipe
    from pipeline.stages.grpo import GRPOStage

    recipe = load_recipe("demo", [f"output_dir={tmp_path}", "grpo.steps=6", "grpo.mini_batches=2", "grpo.num_workers=2",
                                  "ray.num_cpus=4", "grpo.max_completion_length=16", "grpo.save_steps=100",
                                  "grpo.max_staleness=1", "grpo.dynamic_sampling=false"])
    run_recipe(recipe, ("grpo",))
    rows = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "async/staleness" in r]
    assert [(r["step"], r["async/staleness"], r["async/weights_version"]) for r in rows] == \
        [(1, 0.0, 1), (3, 1.0, 1), (5, 1.0, 2)]
    assert 0 < rows[1]["engines/busy_fraction"] <= 1 and "tokens/generated_per_s" not in rows[1]
    assert (tmp_path / "grpo" / "final" / "config.json").exists()
    with pytest.raises(RecipeError, match="grpo.max_staleness: dynamic sampling"):
        load_recipe("demo", ["grpo.max_staleness=1"])
    with pytest.raises(RecipeError, match="grpo.max_staleness: 2 needs grpo.partial_rollouts"):
        load_recipe("demo", ["grpo.max_staleness=2", "grpo.dynamic_sampling=false"])
    colocated = load_recipe("paper-2b", ["grpo.max_staleness=1", "grpo.dynamic_sampling=false"])
    with pytest.raises(RecipeError, match="use grpo.placement: split"):
        GRPOStage().check_plan(colocated, plan(colocated, 4, cpus=64))


def test_grpo_with_partial_rollouts_runs_and_logs_the_off_policy_share(tmp_path):
    """grpo.partial_rollouts: the weights reach the engines while a batch runs and the next two batches
    (max_staleness 2) start before this one is collected; the run finishes and logs, per batch, how stale it was
    when collected and the share of tokens made by older weights."""
    from pipeline.run import run_recipe

    recipe = load_recipe("demo", [f"output_dir={tmp_path}", "grpo.steps=3", "grpo.max_completion_length=48",
                                  "grpo.save_steps=100", "grpo.max_staleness=2", "grpo.partial_rollouts=true",
                                  "grpo.dynamic_sampling=false"])
    run_recipe(recipe, ("grpo",))
    rows = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "async/off_policy_tokens" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 2.0]
    assert rows[0]["async/off_policy_tokens"] == 0.0  # the first batch: generated and trained by one policy
    assert all(0.0 <= r["async/off_policy_tokens"] <= 1.0 for r in rows)
    assert (tmp_path / "grpo" / "final" / "config.json").exists()


def test_the_paper_recipe_is_one_experiment_on_any_number_of_gpus():
    """recipes/paper-2b fixes an optimizer step (16 packed rows; 64 rollouts); the GPUs decide how many workers share
    it, every GPU used by default (it refused a second GPU for distillation); what cannot divide is refused naming
    the key and the GPUs."""
    from pipeline.placement import plan

    recipe = load_recipe("paper-2b")
    for gpus in (1, 2, 4, 8):
        where = plan(recipe, gpus, cpus=64)
        d, g = where.distill, where.grpo_batching
        assert (d.rows, d.micro, d.workers, d.micro * d.accumulation * d.workers) == (16, 1, gpus, 16)
        assert (g.rows, g.micro, g.workers, g.micro * g.accumulation * g.workers) == (64, 2, gpus, 64)
        assert where.grpo.mode == "colocated" and len(where.grpo.bundles) == gpus and where.eval_workers == gpus
    split = plan(load_recipe("paper-2b", ["grpo.placement=split"]), 4, cpus=64).grpo
    assert (split.workers, split.engines, len(split.bundles)) == (1, 3, 4)  # a trainer GPU, three engine GPUs
    with pytest.raises(RecipeError, match=r"distill.batch_size: 16 rows a step do not divide over 3 workers \(3 GPUs\)"):
        plan(recipe, 3, cpus=64)
    # a micro-batch is a memory cap: a worker's share smaller than it is taken whole
    assert plan(load_recipe("demo", ["distill.micro_batch_size=32"]), 4, cpus=8).distill.micro == 8


def test_config_prints_the_plan_and_removed_keys_name_their_replacement(capsys):
    from pipeline.cli import main

    assert main(["config", "paper-2b", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "# plan on 4 GPUs:" in out and "16 rows a step = 1 a forward x 4 accumulated x 4 workers" in out
    assert "align" not in out.split("# plan")[1]  # paper-2b converts nothing
    with pytest.raises(RecipeError, match="distill.gradient_accumulation_steps: not a recipe key.*micro_batch_size"):
        load_recipe("paper-2b", ["distill.gradient_accumulation_steps=4"])
    with pytest.raises(RecipeError, match="grpo.weight_sync: broadcast hands the weights to this package's engine"):
        load_recipe("demo", ["grpo.weight_sync=broadcast", "grpo.engine.backend=vllm"])


def test_a_failed_worker_stops_the_stage_at_once_not_after_the_groups_timeout():
    """Worker 1 fails while worker 0 waits for it (to join the group, with a timeout of 600 s; on GPUs, in an NCCL
    collective): the stage fails within seconds, naming the command that resumes it (it waited for worker 0)."""
    import time

    ray = pytest.importorskip("ray")
    from pipeline.distributed import run_data_parallel

    def _waits_for_its_peer_unless_it_fails() -> int:  # local: Ray ships it by value
        import datetime
        import os

        import torch.distributed as dist

        if os.environ["RANK"] == "1":
            raise OSError("worker 1 is gone")  # before it joins: worker 0 waits for it, as NCCL waits for a dead peer
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        return 0

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        start = time.time()
        with pytest.raises(RuntimeError, match=r"(?s)distill: a data-parallel training worker failed.*Run `.*` again "
                                               r"to resume.*worker 1 is gone"):
            run_data_parallel(_waits_for_its_peer_unless_it_fails, (), [{"num_cpus": 1}] * 2, "distill")
        assert time.time() - start < 60
    finally:
        ray.shutdown()


def _save_and_collect(rank: int, world: int, port: int, folders: list[str]) -> None:
    import datetime
    import os

    import torch.distributed as dist

    from pipeline.checkpoints import collect_worker_files

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    folder = Path(folders[rank])
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (folder / "model.safetensors").write_bytes(b"weights")
    (folder / f"rng_state_{rank}.pth").write_bytes(f"rng {rank}".encode())
    collect_worker_files(folder)
    dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False])
def test_every_workers_checkpoint_files_reach_the_first_workers_folder(tmp_path, shared):
    """Each worker writes its RNG state into its own copy of the checkpoint folder (another node's, or one folder
    on a shared filesystem); before the first worker marks and stores the checkpoint, every file is in its folder
    (a stored checkpoint lacked worker 1's RNG state)."""
    import torch.multiprocessing as mp

    from pipeline.distributed import free_port

    folders = [str(tmp_path / ("ckpt" if shared else f"node{r}")) for r in range(2)]
    mp.spawn(_save_and_collect, args=(2, free_port(), folders), nprocs=2)
    first = Path(folders[0])
    assert sorted(p.name for p in first.iterdir()) == ["model.safetensors", "rng_state_0.pth", "rng_state_1.pth"]
    assert (first / "rng_state_1.pth").read_bytes() == b"rng 1"


def test_only_the_first_worker_sets_an_incomplete_checkpoint_aside(tmp_path):
    """Workers of one node read one checkpoints folder: each renamed a broken checkpoint, and the second rename
    failed. Now a worker other than the first skips it, leaving the move to the first."""
    from pipeline.checkpoints import latest_complete_checkpoint

    for step in (1, 2):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()  # killed while saving
    assert latest_complete_checkpoint(tmp_path, set_aside=False) == tmp_path / "checkpoint-1"
    assert (tmp_path / "checkpoint-2").exists()
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    assert not (tmp_path / "checkpoint-2").exists() and (tmp_path / "incomplete-checkpoint-2").exists()


def _materialize_and_read(uri: str, cache: str, queue) -> None:
    import os

    os.environ["SSE_PIPELINE_CACHE"] = cache
    from pipeline.storage import materialize

    local = materialize(uri)
    queue.put((str(local), (local / "weights.bin").read_bytes()[:4].decode()))


def test_workers_of_one_node_materialize_one_stored_copy_without_racing(tmp_path, monkeypatch):
    """Four processes of one node materialise the same stored model at once: one fetches, the others wait for it
    (each used to replace the folder the others were reading)."""
    import multiprocessing

    from pipeline.storage import storage_uri, upload

    src = tmp_path / "model"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"abcd" * 2_000_000)
    uri = upload(src, storage_uri(str(tmp_path / "store"), "run", "final"))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_materialize_and_read, args=(uri, str(tmp_path / "cache"), queue))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len({path for path, _ in results}) == 1 and {head for _, head in results} == {"abcd"}
    assert not list((tmp_path / "cache" / "storage").glob("*.partial-*"))


def _gather_sharded(rank: int, world: int, port: int, out: str) -> None:
    import datetime
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pipeline.rollout.actor import gathered
    from sse_model import SSEConfig, SSEForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = SSEForCausalLM(SSEConfig.from_preset("sse-h-tiny"))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    whole = gathered(model.state_dict(), {"lm_head.weight": torch.bfloat16})
    if rank == 0:
        torch.save(whole, out)
    dist.destroy_process_group()


def test_sharded_weights_reach_the_engines_whole(tmp_path):
    """FSDP2's state dict holds each worker's shard (DTensors); the fleet gathers it one tensor at a time into
    host memory in the engines' dtypes, equal to the unsharded model's weights."""
    import torch.multiprocessing as mp

    from pipeline.distributed import free_port
    from sse_model import SSEConfig, SSEForCausalLM

    mp.spawn(_gather_sharded, args=(2, free_port(), str(tmp_path / "whole.pt")), nprocs=2)
    whole = torch.load(tmp_path / "whole.pt")
    torch.manual_seed(0)
    reference = SSEForCausalLM(SSEConfig.from_preset("sse-h-tiny")).state_dict()
    assert set(whole) == set(reference)
    for name, value in reference.items():
        dtype = torch.bfloat16 if name == "lm_head.weight" else value.dtype
        assert whole[name].device.type == "cpu" and whole[name].dtype == dtype
        torch.testing.assert_close(whole[name], value.to(dtype), rtol=0, atol=0, msg=name)
