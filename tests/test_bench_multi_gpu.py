"""The multi-GPU bench's plans (``benchmarks/pipeline/multi_gpu.py``): every run it would start resolves as a recipe
and a placement before the first one takes a GPU, and the evaluation's rate is read from its workers' own lines."""

import pytest

from benchmarks.pipeline.multi_gpu import (bench_distill, bench_eval, bench_grpo, bench_same_steps, check_plans,
                                           parse_args, shard_rates)


@pytest.mark.parametrize("argv", [
    ["distill", "--gpus", "1", "2", "4", "--sharding", "ddp", "fsdp"],
    ["same-steps", "--gpus", "1", "2"],
    ["grpo", "--gpus", "1", "2", "4", "--staleness", "0", "1", "--partial"],
    ["grpo", "--gpus", "4", "--placement", "split", "--staleness", "1", "--partial", "--trainer-gpus", "1", "2"],
    ["grpo", "--gpus", "2", "--staleness", "0", "1", "--new-tokens", "2048"],  # under the recipe's overlong window
    ["grpo", "--gpus", "2", "--new-tokens", "1024", "--placement", "split"],
    ["eval", "--gpus", "1", "2", "4"],
])
def test_every_planned_run_resolves_before_any_starts(argv, tmp_path):
    args = parse_args([*argv, "--out", str(tmp_path)])
    bench = {"distill": lambda a: bench_distill(a, write_data=False), "same-steps": bench_same_steps,
             "grpo": bench_grpo, "eval": bench_eval}[args.what]
    stage, recipe, plans, _ = bench(args)
    assert plans
    check_plans(args, stage, recipe, plans)


def test_split_rows_take_the_trainer_gpus_asked_and_generating_ahead_takes_partial_rollouts(tmp_path, capsys):
    args = parse_args(["grpo", "--gpus", "1", "4", "--staleness", "0", "1", "--partial", "--trainer-gpus", "1", "2",
                       "3", "--out", str(tmp_path)])
    _, _, plans, _ = bench_grpo(args)
    assert [name for name, *_ in plans] == [
        "grpo-sse-h-2b-colocated-1gpu", "grpo-sse-h-2b-colocated-4gpu", "grpo-sse-h-2b-split1+3-4gpu",
        "grpo-sse-h-2b-split2+2-4gpu", "grpo-sse-h-2b-split1+3-4gpu-ahead1-partial",
        "grpo-sse-h-2b-split2+2-4gpu-ahead1-partial"]
    assert "3 trainer GPUs leave 1" in capsys.readouterr().out
    overrides = dict(o.split("=", 1) for o in plans[-1][2])
    assert (overrides["grpo.num_workers"], overrides["grpo.num_engines"], overrides["grpo.partial_rollouts"],
            overrides["grpo.max_staleness"]) == ("2", "1", "true", "1")
    assert plans[-1][3] == {"placement": "split 2+2", "staleness": "1 partial"}
    assert dict(o.split("=", 1) for o in plans[2][2])["grpo.partial_rollouts"] == "false"


def test_a_run_that_cannot_resolve_stops_the_bench_naming_it(tmp_path):
    args = parse_args(["grpo", "--gpus", "2", "--placement", "split", "--out", str(tmp_path),
                       "grpo.prompts_per_batch=3"])  # 3 x 8 rollouts do not divide into 4 mini-batches
    stage, recipe, plans, _ = bench_grpo(args)
    with pytest.raises(SystemExit, match="grpo-sse-h-2b-split-2gpu: .*grpo"):
        check_plans(args, stage, recipe, plans)


def test_the_evaluation_rate_is_every_shards_tokens_over_the_slowest_shard():
    log = ("eval: shard 2 of 2: 3000 tokens generated in 30.0 s (100 tok/s, 60 sequences at once of 256 slots)\n"
           "noise\neval: shard 1 of 2: 1000 tokens generated in 10.0 s (100 tok/s, 20 sequences at once of 256 slots)\n")
    rates = shard_rates(log)
    assert rates["generated"] == 4000 and rates["generate_s"] == 30.0 and rates["generated_per_s"] == 4000 / 30
    assert rates["shard_s"] == [10.0, 30.0] and rates["at_once"] == 40
    assert shard_rates(log.splitlines()[0]) == {}  # a shard missing: no rate rather than half of one


def test_a_run_past_its_limit_is_stopped_as_ctrl_c_stops_it(tmp_path):
    """SIGTERM first (the CLI then shuts its Ray down and the GPUs are free for the next run), a kill only if the
    run does not stop."""
    import sys

    from benchmarks.pipeline.multi_gpu import run_process

    stopped = tmp_path / "stopped"
    polite = ("import signal, sys, time\n"
              f"signal.signal(signal.SIGTERM, lambda *_: (open({str(stopped)!r}, 'w').close(), sys.exit(130)))\n"
              "print('running', flush=True)\ntime.sleep(60)\n")
    assert run_process([sys.executable, "-c", polite], tmp_path / "a.log", timeout_s=3) == "timeout"
    assert stopped.exists() and "running" in (tmp_path / "a.log").read_text()
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    assert run_process([sys.executable, "-c", stubborn], tmp_path / "b.log", timeout_s=2, stop_s=1) == "timeout"
    assert run_process([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "c.log", timeout_s=30) == 3


def test_runs_that_start_alike_share_one_starting_model_built_as_each_would_build_it(tmp_path):
    """The bench builds a preset's random weights once for every run with the same model settings and seed (a run
    would build and save its own first: half a minute at 2B); each run then loads that model, the very weights
    its own build would have made."""
    import torch

    from benchmarks.pipeline.multi_gpu import shared_starts
    from pipeline.recipe import load_recipe
    from pipeline.stages.base import initial_checkpoint
    from sse_model.checkpoint import load_pretrained

    runs = [load_recipe("demo", [f"output_dir={tmp_path / name}", *more]) for name, more in
            [("a", ["distill.learning_rate=1e-3"]), ("b", ["ray.num_gpus=2"]), ("c", ["seed=1"])]]
    starts = shared_starts(tmp_path / "bench", runs)
    assert starts[0] == starts[1] != starts[2] and len(list((tmp_path / "bench").glob("start-*"))) == 2
    for recipe, start in zip(runs, starts):
        shared = load_recipe("demo", [f"output_dir={recipe.output_dir}", f"seed={recipe.seed}", *start])
        own = load_pretrained(initial_checkpoint(recipe, tmp_path / f"own-{recipe.seed}")).state_dict()
        loaded = load_pretrained(shared.model.path).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in own.items())


def test_a_grpo_batch_is_the_mean_of_the_steady_batches(tmp_path):
    """A run that generated one batch ahead (5 batches of 4 optimizer steps, the first step of each generated or
    collected it): the first two batches start together at the run's start (and the first compiles), the last one
    generates with nothing beside it and never waits; the steady batches are the middle ones, their mean's
    wall-clock their steps' seconds, rollout the trainer's wait, training the rest, the engines' busy share its
    column. Synchronous, every batch but the first is steady; with none steady there is nothing to report."""
    import json

    from benchmarks.pipeline.multi_gpu import batch_split, grpo_table

    def batch(first, rollout, sync, generated, busy=None):
        head = {"time/step_s": first, "time/rollout_s": rollout, "time/weight_sync_s": sync, "time/reward_s": 0.0,
                "tokens/generated": generated, "completions/mean_length": generated / 64}
        return [{**head, **({"engines/busy_fraction": busy} if busy is not None else {})},
                {"time/step_s": 2.2}, {"time/step_s": 2.2}, {"time/step_s": 2.2}]

    def write(rows):
        (tmp_path / "grpo").mkdir(exist_ok=True)
        (tmp_path / "grpo" / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, **r}) + "\n" for i, r in enumerate(rows)) + '{"step": 99}\n')

    rows = batch(46.9, 42.1, 0.65, 497072) + batch(2.3, 0.1, 0.03, 516211, busy=0.99) + \
        batch(31.9, 29.6, 0.03, 516211, busy=0.79) + batch(32.3, 29.9, 0.04, 515106, busy=0.77) + \
        batch(2.6, 0.05, 0.04, 519339, busy=0.77)
    write(rows[:12])
    assert batch_split(tmp_path, ahead=1) == {}
    write(rows[:8])
    assert batch_split(tmp_path)["batch_s"] == pytest.approx(2.3 + 6.6)
    write(rows)
    split = batch_split(tmp_path, ahead=1)
    assert split["batches"] == 2
    assert split["batch_s"] == pytest.approx((31.9 + 32.3) / 2 + 3 * 2.2)
    assert split["rollout_s"] == pytest.approx(29.75) and split["weight_sync_s"] == pytest.approx(0.035)
    assert split["train_s"] == pytest.approx(split["batch_s"] - 29.75 - 0.035)
    assert split["generated_per_s"] == pytest.approx((516211 + 515106) / 2 / split["batch_s"])
    assert split["engines_busy"] == pytest.approx(0.78)
    assert batch_split(tmp_path)["batches"] == 4  # synchronous: all but the first
    table = grpo_table([{"name": "ahead", "gpus": 4, "placement": "split", "staleness": "1 partial", "peak_gib": 62.6,
                         **split}, {"name": "bad", "gpus": 4, "placement": "split", "staleness": "0", "exit": 1,
                                    "error": "error: out of memory"}])
    assert "| ahead | 4 | split | 1 partial | 38.7 | 29.8 | 0.04 | 0.00 | 8.9 | 78% | 8,057 | 13,325 | 1.00 | 62.6 |" in table
    assert all(line.count("|") == table.splitlines()[0].count("|") for line in table.splitlines())
