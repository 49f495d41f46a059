"""``python -m scripts.sweep``: recipe variants side by side from one shared start."""

from __future__ import annotations

import json
import sys

import pytest

from scripts.sweep import Variant, _run_all, collect, commands, main, markdown, parse_variant


def test_variants_start_from_the_shared_align_stage(tmp_path):
    """The shared run is the align stage alone; each variant turns align off and starts from its model, scoring its
    own last model, its overrides after the common ones (so a variant can change what all share)."""
    first, runs = commands("smollm2-135m", tmp_path, ["grpo.enabled=false"],
                           [Variant("base"), Variant("kl", ["distill.teacher_kl=0.9"])], "align")
    run = [sys.executable, "-m", "pipeline.cli", "run", "smollm2-135m"]
    assert first == [*run, f"output_dir={tmp_path / 'shared'}", "grpo.enabled=false", "distill.enabled=false",
                     "grpo.enabled=false", "eval.enabled=false"]
    assert runs["kl"] == [*run, f"output_dir={tmp_path / 'kl'}", "eval.models=[last]", "grpo.enabled=false",
                          "distill.teacher_kl=0.9", "align.enabled=false", "--checkpoint",
                          str(tmp_path / "shared" / "align" / "final")]
    # variants of GRPO: align and distillation shared
    first, runs = commands("smollm2-135m", tmp_path, [], [Variant("a")], "distill")
    assert first[5:] == [f"output_dir={tmp_path / 'shared'}", "grpo.enabled=false", "eval.enabled=false"]
    assert runs["a"][-4:] == ["align.enabled=false", "distill.enabled=false", "--checkpoint",
                              str(tmp_path / "shared" / "distill" / "final")]
    # a whole run scores the models its recipe names: GRPO's change needs the distilled model scored beside it (a
    # sweep of both arms once scored only the GRPO models, and the runs' gains could not be read)
    first, runs = commands("demo", tmp_path, ["seed=1"], [Variant("a", ["grpo.steps=2"])], None)
    assert first is None and runs["a"][4:] == ["demo", f"output_dir={tmp_path / 'a'}", "seed=1", "grpo.steps=2"]


def test_a_variant_of_another_recipe_runs_that_recipe(tmp_path):
    """Both arms side by side in one sweep: a second word without ``=`` names the variant's own recipe; it cannot
    start from another recipe's shared stage."""
    arm = parse_variant(["transformer-seed1", "smollm2-135m-transformer", "seed=1"])
    assert arm == Variant("transformer-seed1", ["seed=1"], "smollm2-135m-transformer")
    _, runs = commands("smollm2-135m", tmp_path, [], [Variant("sse-h"), arm], None)
    assert runs["sse-h"][4:6] == ["smollm2-135m", f"output_dir={tmp_path / 'sse-h'}"]
    assert runs["transformer-seed1"][4:6] == ["smollm2-135m-transformer",
                                              f"output_dir={tmp_path / 'transformer-seed1'}"]
    assert runs["transformer-seed1"][-1] == "seed=1"
    with pytest.raises(SystemExit):
        main(["smollm2-135m", "--out", str(tmp_path), "--shared", "align", "--variant", "a",
              "--variant", "b", "smollm2-135m-transformer"])


def test_a_bad_variant_is_named():
    assert parse_variant(["lr", "distill.learning_rate=1e-4"]) == Variant("lr", ["distill.learning_rate=1e-4"])
    with pytest.raises(ValueError, match="first word names the variant"):
        parse_variant(["distill.learning_rate=1e-4"])
    with pytest.raises(ValueError, match="'fast' is no override .* and no recipe: recipe 'fast' not found"):
        parse_variant(["lr", "fast"])
    with pytest.raises(ValueError, match="'fast' is no override"):  # a recipe is the second word only
        parse_variant(["lr", "seed=1", "fast"])
    with pytest.raises(SystemExit):  # the Transformer arm converts nothing: no align stage to share
        main(["smollm2-135m-transformer", "--out", "x", "--shared", "align", "--variant", "a"])


def test_two_variants_of_the_demo_run_at_once_and_are_tabled(tmp_path, capsys):
    """Two distillations of the demo (learning rates far apart) run side by side on the CPU, each scored; the table
    holds each one's distillation metrics and accuracy, read from its own folder."""
    common = ["distill.data.max_samples=32", "distill.epochs=1", "distill.batch_size=8", "distill.logging_steps=1",
              "grpo.steps=1", "grpo.save_steps=1", "grpo.prompts_per_batch=2", "grpo.num_generations=2",
              "grpo.max_completion_length=32", "eval.models=[last,distill]", "eval.benchmarks=[arithmetic]",
              "eval.limit=2", "eval.repeats=1"]
    code = main(["demo", "--out", str(tmp_path), "--set", *common, "--variant", "slow", "distill.learning_rate=1e-5",
                 "--variant", "fast", "--parallel", "2"])
    assert code == 0, [p.read_text()[-2000:] for p in tmp_path.glob("*.log")]
    result = json.loads((tmp_path / "sweep.json").read_text())["variants"]
    assert result["slow"]["overrides"] == ["distill.learning_rate=1e-5"] and result["fast"]["overrides"] == []
    for name in ("slow", "fast"):  # the GRPO model and, as --set asks, the distilled one
        assert result[name]["returncode"] == 0 and set(result[name]["eval"]) == {"last", "distill"}
        assert set(result[name]["eval"]["distill"]) == {"arithmetic"}
        assert set(result[name]["grpo"]) == {"reward", "completion tokens", "clipped"}
    # the lower learning rate leaves the loss higher: each row is its own run's
    assert result["slow"]["distill"]["loss"] > result["fast"]["distill"]["loss"]
    table = (tmp_path / "sweep.md").read_text()
    assert "| slow | `distill.learning_rate=1e-5` |" in table and "| fast | (the recipe's) |" in table
    assert "| fast | distill | " in table and "| slow | last | " in table
    assert " lenient)" in table  # each cell as the compare table writes it (the boxed reading first)
    assert table in capsys.readouterr().out
    # a variant's command again (after the machine's end): every finished stage is skipped, and its row is the same
    # run's again
    assert main(["demo", "--out", str(tmp_path), "--set", *common, "--variant", "fast"]) == 0
    log = (tmp_path / "fast.log").read_text().rsplit("### sweep ", 1)[-1]  # this run's part (appended)
    assert all(f"{stage}: done, skipping" in log for stage in ("distill", "grpo", "eval")), log[-2000:]
    assert all(f"eval: {m}: every generation of this model is in" in log for m in ("last", "distill"))
    assert "generations in" not in log  # no model loaded, no engine started
    again = json.loads((tmp_path / "sweep.json").read_text())["variants"]

    def scores(rows):  # what was scored, without the scoring's own timing
        return {n: (v["distill"], {m: {b: {k: x for k, x in s.items() if k != "reward_stats"} for b, s in e.items()}
                                   for m, e in v["eval"].items()}) for n, v in rows.items()}

    assert scores(again) == scores({"fast": result["fast"]})


@pytest.mark.parametrize("parallel", [1, 3])
def test_no_more_variants_run_at_once_than_asked(tmp_path, parallel):
    """Each command records when it slept (1.5 s: longer than a loaded machine takes to start the next Python)."""
    probe = ("import sys, time; t = time.time(); time.sleep(1.5); "
             "open(sys.argv[1], 'a').write(f'{t} {time.time()}\\n')")
    spans = tmp_path / "spans"
    runs = {f"v{i}": [sys.executable, "-c", probe, str(spans)] for i in range(3)}
    results = _run_all(runs, tmp_path, parallel)
    assert all(r["returncode"] == 0 for r in results.values()) and (tmp_path / "v2.log").exists()
    times = [tuple(map(float, line.split())) for line in spans.read_text().splitlines()]
    most = max(sum(a < end and start < b for a, b in times) for start, end in times)
    assert most == parallel


def test_a_variant_goes_to_the_least_busy_gpu():
    from scripts.sweep import least_busy

    assert least_busy(["0", "1", "2"], ["0", "2"]) == "1" and least_busy(["0", "1"], ["0", "1"]) == "0"


def test_each_variant_runs_on_the_gpu_it_was_given(tmp_path):
    """With ``gpus`` each run sees one GPU (``CUDA_VISIBLE_DEVICES``), the least busy: four at once on two GPUs
    share them two and two."""
    probe = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    runs = {f"v{i}": [sys.executable, "-c", probe] for i in range(4)}
    results = _run_all(runs, tmp_path, 4, gpus=["0", "3"])
    logged = [(tmp_path / f"{name}.log").read_text().strip().splitlines()[-1] for name in runs]  # after its header
    assert logged == [results[name]["gpu"] for name in runs]
    assert sorted(logged) == ["0", "0", "3", "3"]
    results = _run_all({"a": runs["v0"], "b": runs["v1"]}, tmp_path, 2, gpus=["0+1", "2+3"])  # a pair each
    assert [(tmp_path / f"{n}.log").read_text().strip().splitlines()[-1] for n in "ab"] == ["0,1", "2,3"]


def test_a_parallel_below_one_is_refused_and_logs_are_appended(tmp_path, capsys):
    """``--parallel -1`` started nothing and waited forever; a re-run of the sweep (resuming) wrote over the logs."""
    with pytest.raises(SystemExit):
        main(["demo", "--out", str(tmp_path), "--variant", "a", "distill.max_steps=1", "--parallel", "-1"])
    assert "--parallel -1: at least 1" in capsys.readouterr().err
    runs = {"x": [sys.executable, "-c", "print('run')"]}
    for _ in range(2):
        _run_all(runs, tmp_path, 1)
    assert (tmp_path / "x.log").read_text().count("run\n") == 2


def test_the_table_holds_the_held_out_loss_each_distillation_logged_last(tmp_path):
    """``distill.eval_data``'s ``eval_loss`` (logged in records of its own) is a column: where conversion's settings
    are chosen."""
    (tmp_path / "a" / "distill").mkdir(parents=True)
    rows = [{"step": 10, "loss": 1.0, "ce": 0.9}, {"step": 10, "eval_loss": 1.5}, {"step": 20, "loss": 0.8},
            {"step": 20, "eval_loss": 1.4}]
    (tmp_path / "a" / "distill" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = collect(tmp_path / "a")
    assert row["distill"] == {"loss": 0.8, "ce": 0.9, "eval_loss": 1.4}
    table = markdown({"a": {**row, "wall_s": 5.0, "returncode": 0}}, [Variant("a")], [], None)
    header, _, line = table.splitlines()[:3]
    assert dict(zip(header.split(" | "), line.split(" | ")))["held-out loss"] == "1.400"


def test_a_grpo_step_that_logged_no_reward_is_skipped_by_the_table_and_the_report(tmp_path):
    """A step whose every completion went unscored logs ``reward: null`` (seen with every completion cut at the
    length limit); the sweep's table and the run's report read the curve without it instead of failing."""
    from pipeline.stages.grpo import GRPOStage

    (tmp_path / "a" / "grpo").mkdir(parents=True)
    rows = [{"step": 1, "reward": None, "completions/mean_length": 16.0}, {"step": 2, "reward": 0.25},
            {"step": 3, "reward": 0.75, "completions/mean_length": 20.0}]
    (tmp_path / "a" / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = collect(tmp_path / "a")
    assert row["grpo"]["reward"] == (0.5, 0.5)  # the first and last 8 logged: both rewards
    assert "0.250 -> 0.750" in GRPOStage().highlight(None, tmp_path / "a" / "grpo")


def test_a_run_out_of_gpu_memory_beside_others_runs_again_next_and_fewer_run_at_once(tmp_path):
    """Six SmolLM2 runs three at a time on one H200: three ran out of memory at their start and waited to run alone
    after the rest, one after another. Now the run goes again next and the sweep runs as many at a time as fitted
    beside it; one alone that runs out is not repeated, nor is a run that failed otherwise."""
    oom = ("import sys, time, pathlib; mark = pathlib.Path(sys.argv[1]); first = not mark.exists(); mark.touch(); "
           "open(sys.argv[2], 'a').write(f'{time.time()}\\n'); "
           "first and time.sleep(float(sys.argv[3])); "
           "first and sys.exit('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.34 GiB')")
    timed = ("import sys, time; start = time.time(); time.sleep(float(sys.argv[2])); "
             "open(sys.argv[1], 'w').write(f'{start} {time.time()}')")
    runs = {"crowded": [sys.executable, "-c", oom, str(tmp_path / "mark"), str(tmp_path / "starts"), "2"],
            "busy": [sys.executable, "-c", timed, str(tmp_path / "busy"), "2.5"],  # still running when crowded fails
            "later": [sys.executable, "-c", timed, str(tmp_path / "later"), "0.5"]}
    results = _run_all(runs, tmp_path, 2)
    assert results["crowded"] == {**results["crowded"], "returncode": 0, "retried": True}
    assert results["busy"]["returncode"] == results["later"]["returncode"] == 0
    starts = [float(t) for t in (tmp_path / "starts").read_text().split()]
    busy_end = float((tmp_path / "busy").read_text().split()[1])
    later_start = float((tmp_path / "later").read_text().split()[0])
    # one at a time after the first run out of memory: crowded again once busy ended, before the run that waited
    assert len(starts) == 2 and busy_end <= starts[1] <= later_start
    assert results["crowded"]["wall_s"] >= 2  # its first attempt counts too (the second alone takes about 1 s)
    broken = {"broken": [sys.executable, "-c", "import sys; sys.exit('KeyError: nothing to do with memory')"],
              "busy": runs["busy"]}
    failed = _run_all(broken, tmp_path, 2)["broken"]
    assert failed["returncode"] == 1 and "retried" not in failed
    (tmp_path / "mark").unlink()
    runs["crowded"][-1] = "0"  # (no wait: nothing else runs)
    alone = _run_all({"crowded": runs["crowded"]}, tmp_path, 3)
    assert alone["crowded"]["returncode"] == 1 and "retried" not in alone["crowded"]
    (tmp_path / "mark").unlink()  # alone on its GPU, others on theirs: not crowded either
    apart = _run_all({"busy": runs["busy"], "crowded": runs["crowded"]}, tmp_path, 2, gpus=["0", "1"])
    assert apart["crowded"]["returncode"] == 1 and "retried" not in apart["crowded"]
