"""``recipes/paper-2b`` with only its counts shrunk, on random ``sse-h-2b`` weights: every stage at the paper's
lengths, its time and peak memory, and a projection of the whole recipe's wall-clock on 1, 8 and 64 GPUs.

    python -m scripts.paper_dry_run --out runs/paper-dry-run             # one GPU (an H200, or an H100)
    python -m scripts.paper_dry_run --out runs/dry grpo.prompts_per_batch=4   # more overrides after DRY_RUN

What changes from the recipe is :data:`DRY_RUN` (printed in the report): the model is ``sse-h-2b`` with random
weights and the offline character tokenizer (the LM head keeps the preset's 151,936 rows); distillation runs 3
optimizer steps of the recipe's 16 packed rows of 32,768 tokens, on records of random text whose lengths follow
OpenR1-Math's traces (:func:`write_long_records`; the recipe's data is a hub name the GPU machine cannot reach);
GRPO runs one generation batch of 8 prompts x 8 rollouts, as long as the recipe lets them (random weights rarely
stop, so nearly every rollout is 32,768 tokens: the worst case), then trains on all of it as the recipe does, in
4 mini-batch updates (16 rollouts each here, 64 in the recipe; micro-batches of 2 rows as in the recipe), so the
measured training cost per rollout is the recipe's; dynamic sampling is off (random weights solve nothing, so
every group would be resampled) and so is the masking of truncated rows (a masked row leaves the padding-free
passes: the first H100 run trained 20% of its tokens); evaluation takes 2 AIME24 problems x 2 samples.

Each stage runs alone (``run_recipe`` with one stage), timed, with the GPU's memory in use polled from
``nvidia-smi`` (trainer and engines together, what decides whether it fits). The projection scales the measured
rates to the full recipe's counts under the assumptions it prints (flags change them). Writes
``OUT/dry_run.md`` and ``OUT/dry_run.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# OpenR1-Math trace lengths: a published 45k-sample of OpenR1-Math-220k (SFT-Math-45k's card) gives the assistant
# turn's characters as median 12,980, mean 16,254, p90 32,888; at ~3.6 characters a token, a lognormal of median
# 3,600 tokens and p90 9,100 (sigma 0.72; mean 4,700).
TRACE_MEDIAN_TOKENS, TRACE_SIGMA = 3600, 0.72

DRY_RUN = [
    "model.path=null", "model.preset=sse-h-2b", "model.tokenizer=char", "model.config_overrides={vocab_size: 151936}",
    "distill.max_steps=3", "distill.logging_steps=1",
    "grpo.steps=4", "grpo.prompts_per_batch=8", "grpo.dynamic_sampling=false",
    "grpo.logging_steps=1",
    "eval.benchmarks=[aime24]", "eval.limit=2", "eval.repeats=2",
]


def eval_problems(recipe) -> int:
    """The problems the recipe's evaluation scores (each ``eval.repeats`` times)."""
    from eval.benchmarks import load_problems

    return sum(len(load_problems(name, limit=recipe.eval.limit)) for name in recipe.eval.benchmarks)


def write_long_records(path: Path, count: int, max_tokens: int, seed: int = 0) -> dict:
    """``count`` problem/solution records of random printable text (one character is one token of the character
    tokenizer) with trace lengths drawn from the lognormal above, capped at ``max_tokens``; returns their stats."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-=()\\{}^_$"
    lengths = []
    with path.open("w") as handle:
        for i in range(count):
            n = min(max_tokens, max(16, round(rng.lognormvariate(math.log(TRACE_MEDIAN_TOKENS), TRACE_SIGMA))))
            lengths.append(n)
            solution = "".join(rng.choices(alphabet, k=n - 10)) + " \\boxed{1}"
            handle.write(json.dumps({"id": f"long-{i}", "problem": f"Problem {i}: find x.", "solution": solution,
                                     "answer": "1"}) + "\n")
    lengths.sort()
    return {"records": count, "mean": sum(lengths) / count, "median": lengths[count // 2],
            "p90": lengths[int(0.9 * count)], "max": lengths[-1]}


class MemoryPoll:
    """The largest GPU memory in use (MiB, all processes) seen by ``nvidia-smi`` while the block runs; None without
    one (a CPU machine)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak_mib, self._stop = every_s, None, threading.Event()

    def _read(self) -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        return max(int(x) for x in out.split()) if out.strip() else None

    def _poll(self) -> None:
        while not self._stop.is_set():
            used = self._read()
            if used is not None:
                self.peak_mib = max(self.peak_mib or 0, used)
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread = threading.Thread(target=self._poll, daemon=True) if shutil.which("nvidia-smi") else None
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def measured_rates(out: Path) -> dict:
    """What the stages' own logs say, as rates the projection scales: distillation tokens/s after its first
    step, GRPO's generated tokens/s and trained tokens/s; and the evaluation's generated tokens (the projection
    scores evaluation at GRPO's engine rate: a few samples do not fill an engine)."""
    from common.files import compressed, read_text
    from pipeline.metrics import read_metrics

    found: dict = {}
    distill = [r for r in read_metrics(out / "distill" / "metrics.jsonl") if "num_tokens" in r and "time/step_s" in r]
    if len(distill) >= 2:  # tokens and seconds of the logged steps after the first (compilation in the first)
        tokens = distill[-1]["num_tokens"] - distill[0]["num_tokens"]
        seconds = sum(r["time/step_s"] * (r["step"] - p["step"]) for p, r in zip(distill, distill[1:]))
        found["distill"] = {"tokens_per_s": tokens / seconds, "first_step_s": distill[0]["time/step_s"],
                            "step_s": seconds / (distill[-1]["step"] - distill[0]["step"])}
    grpo = [r for r in read_metrics(out / "grpo" / "metrics.jsonl") if "time/step_s" in r]
    if any("tokens/generated" in r for r in grpo):  # every generation batch and every optimizer step trained on it
        steps = [r["step"] - p for p, r in zip([0] + [r["step"] for r in grpo], grpo)]  # steps a record averages

        def total(key):
            return sum(r.get(key, 0.0) * n for r, n in zip(grpo, steps))

        batches = [r for r in grpo if "tokens/generated" in r]
        generated = sum(r["tokens/generated"] for r in batches)
        rollouts = sum(r["tokens/generated"] / r["completions/mean_length"] for r in batches)
        trained = max(r.get("num_tokens", 0) for r in grpo)  # prompt + completion tokens trained on
        found["grpo"] = {"rollouts": round(rollouts), "generated_tokens": generated,
                         "mean_completion": generated / rollouts, "mean_prompt": (trained - generated) / rollouts,
                         "rollout_s": total("time/rollout_s"), "reward_s": total("time/reward_s"),
                         "weight_sync_s": total("time/weight_sync_s") / len(batches), "train_s": total("time/train_s")}
        found["grpo"]["generated_per_s"] = generated / found["grpo"]["rollout_s"]
        found["grpo"]["trained_per_s"] = trained / found["grpo"]["train_s"]
    summary = out / "eval" / "summary.json"
    if summary.exists() or compressed(summary).exists():  # a kept run's is a gzip
        benchmarks = json.loads(read_text(summary))["benchmarks"]
        found["eval"] = {"generated_tokens": sum(b["problems"] * b["repeats"] * b["mean_length"]
                                                 for b in benchmarks.values())}
    return found


@dataclass
class Scaling:
    """How the one-GPU rates grow with GPUs: each field a measurement or the hardware's limit (the report says
    which), so that the projection divides nothing linearly that was not measured to scale so."""

    # data-parallel training's speedup over one GPU by GPU count, gradient all-reduce included (measured:
    # docs/multi_gpu.md, DDP at the paper's shape on 4 H200); a larger count keeps the largest one's efficiency
    data_parallel: dict = field(default_factory=lambda: {1: 1.0, 2: 1.99, 4: 3.86})
    # one decode step's read of the engine's weights (the part of a step that does not grow with the sequences in
    # flight): the 2B's 3.73 GB at an H100's 3.35 TB/s
    weights_read_s: float = 3.73e9 / 3.35e12
    # the most sequences one engine holds at the projected lengths: the dry run's 64 rollouts of up to 32k tokens
    # fit one H100 beside the trainer (measured); more is not
    max_in_flight: int = 64
    # sampling rounds a generation batch takes (dynamic sampling resamples groups whose rewards all agree)
    sampling_rounds: float = 1.0
    # one weight sync of the 2B to the engines, measured (docs/multi_gpu.md, H200): CUDA IPC 0.023 s to an engine
    # on the trainer's GPU, NCCL broadcast 0.027 s to engines on their own, what grpo.weight_sync: auto takes;
    # None: the dry run's own sync (its object store's 17.8 s on the H100)
    weight_sync_s: float | None = 0.027

    def speedup(self, gpus: int) -> float:
        if gpus in self.data_parallel:
            return self.data_parallel[gpus]
        largest = max(self.data_parallel)
        return gpus * self.data_parallel[largest] / largest

    def engine_rate(self, measured_per_s: float, measured_in_flight: int, in_flight: float) -> float:
        """One engine's generated tokens/s with ``in_flight`` sequences, from its rate measured at
        ``measured_in_flight``: a decode step costs the weights' read plus a part per sequence (its cache and
        state), so fewer sequences an engine make fewer tokens a step, not proportionally less time."""
        step = measured_in_flight / measured_per_s
        per_sequence = max(step - self.weights_read_s, 0.0) / measured_in_flight
        n = min(in_flight, self.max_in_flight)
        return n / (self.weights_read_s + per_sequence * n)


def projection(rates: dict, recipe, gpus: int, trace_tokens: float, generated_tokens: float,
               scaling: Scaling | None = None) -> dict:
    """Hours of each stage of the full recipe on ``gpus`` GPUs from the measured rates and ``scaling`` (see the
    report's assumptions): distillation data-parallel over every GPU; GRPO's generation batches in the best layout
    (colocated on every GPU, or a split of the GPUs into engines and trainers), each engine at its rate for the
    sequences it holds; evaluation's samples over every GPU's engine."""
    scaling = scaling or Scaling()
    d, g = rates["distill"], rates["grpo"]
    samples = recipe.distill.data.max_samples
    distill_h = samples * recipe.distill.epochs * trace_tokens / (d["tokens_per_s"] * scaling.speedup(gpus)) / 3600
    cfg = recipe.grpo
    rollouts = cfg.prompts_per_batch * cfg.num_generations * scaling.sampling_rounds

    def generate_s(engines: int, samples: float) -> float:  # each engine its share, at its rate for that share
        share = samples / engines
        return share * generated_tokens / scaling.engine_rate(g["generated_per_s"], g["rollouts"], share)

    train_s = rollouts / scaling.sampling_rounds * (g["mean_prompt"] + generated_tokens) / g["trained_per_s"] * \
        cfg.num_iterations  # (only the last round's groups are trained on)
    sync_s = g["weight_sync_s"] if scaling.weight_sync_s is None else scaling.weight_sync_s
    fixed_s = sync_s + g["reward_s"] * rollouts / g["rollouts"]  # weight sync: per generation batch
    # colocated (an engine and a trainer worker on every GPU, taking turns), or split into engines and trainers
    layouts = [("colocated", generate_s(gpus, rollouts) + train_s / scaling.speedup(gpus) + fixed_s)]
    layouts += [((e, gpus - e), generate_s(e, rollouts) + train_s / scaling.speedup(gpus - e) + fixed_s)
                for e in range(1, gpus)]
    split, batch_s = min(layouts, key=lambda x: x[1])
    # generating ahead (grpo.max_staleness: 1, split layouts; it needs dynamic sampling off, so one round): the
    # engines generate the next batch while the trainers train on this one, a batch takes the slower of the two
    one_round = rollouts / scaling.sampling_rounds
    ahead = [((e, gpus - e), max(generate_s(e, one_round), train_s / scaling.speedup(gpus - e)) + fixed_s)
             for e in range(1, gpus)]
    ahead_split, ahead_s = min(ahead, key=lambda x: x[1]) if ahead else (None, None)
    generation_batches = math.ceil(cfg.steps / (cfg.mini_batches * cfg.num_iterations))
    grpo_h = generation_batches * batch_s / 3600
    eval_h = generate_s(gpus, eval_problems(recipe) * recipe.eval.repeats) / 3600
    return {"gpus": gpus, "distill_h": distill_h, "grpo_h": grpo_h, "grpo_split": split, "grpo_batch_s": batch_s,
            "grpo_ahead_split": ahead_split, "grpo_ahead_batch_s": ahead_s,
            "grpo_ahead_h": generation_batches * ahead_s / 3600 if ahead else None,
            "eval_h": eval_h, "total_h": distill_h + grpo_h + eval_h}


def report(stages: dict, rates: dict, records: dict, projections: list[dict], args, recipe) -> str:
    lines = ["# paper-2b dry run", "", f"Device: {stages.get('device', 'CPU')}.", "",
             "Overrides of `recipes/paper-2b` (`python -m scripts.paper_dry_run`): "
             + " ".join(f"`{o}`" for o in DRY_RUN + args.overrides) + ".", "",
             f"Distillation records: {records['records']:,} of random text, trace lengths median "
             f"{records['median']:,}, mean {records['mean']:,.0f}, p90 {records['p90']:,}, max {records['max']:,} "
             "tokens (OpenR1-Math's, see `write_long_records`).", "",
             "| stage | wall s | GPU memory in use, peak GiB | what ran |", "| --- | --- | --- | --- |"]
    for name, s in stages["stages"].items():
        peak = f"{s['peak_mib'] / 1024:.1f}" if s.get("peak_mib") else "n/a"
        ran = s["what"] + (f" (stopped: {s['error']})" if s.get("error") else "")
        lines.append(f"| {name} | {s['wall_s']:.0f} | {peak} | {ran} |")
    lines += ["", "Measured rates:", "", "```", json.dumps(rates, indent=1), "```", ""]
    if projections:
        lines += [f"Projection of the full recipe ({recipe.distill.data.max_samples:,} samples x "
                  f"{recipe.distill.epochs:g} epochs, "
                  f"{math.ceil(recipe.grpo.steps / (recipe.grpo.mini_batches * recipe.grpo.num_iterations))} "
                  f"generation batches of {recipe.grpo.prompts_per_batch} x {recipe.grpo.num_generations}, "
                  f"{eval_problems(recipe):,} problems x "
                  f"{recipe.eval.repeats}), hours:", "",
                  "| generated tokens per sample | GPUs | distill | GRPO (engines + trainers) | eval | total | "
                  "GRPO generating ahead, one batch stale (engines + trainers) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for p in projections:
            split = p["grpo_split"] if isinstance(p["grpo_split"], str) else "{} + {}".format(*p["grpo_split"])
            ahead = (f"{p['grpo_ahead_h']:.1f} ({p['grpo_ahead_split'][0]} + {p['grpo_ahead_split'][1]})"
                     if p.get("grpo_ahead_h") is not None else "needs 2 GPUs")
            lines.append(f"| {p['generated_tokens']:,} | {p['gpus']} | {p['distill_h']:.1f} | {p['grpo_h']:.1f} "
                         f"({split}) | {p['eval_h']:.1f} | {p['total_h']:.1f} | {ahead} |")
        scaling = args.scaling
        measured = ", ".join(f"{k}: {v:.2f}x" for k, v in sorted(scaling.data_parallel.items()))
        lines += ["", f"Assumptions: distillation traces of the mean length above ({args.trace_tokens:,.0f} tokens); "
                  f"data-parallel training (distillation, GRPO's trainers) at the measured speedups ({measured}; "
                  "gradient all-reduce included; a larger count keeps the largest's efficiency, one node's, not "
                  "measured across nodes); GRPO at the dry run's engine and trainer rates, each engine at its rate "
                  f"for the sequences it holds (a step: the weights' read, {scaling.weights_read_s * 1e3:.2f} ms at "
                  "the card's bandwidth, plus a measured part per sequence; at most "
                  f"{scaling.max_in_flight} at once), {scaling.sampling_rounds:g} sampling round(s) per generation "
                  f"batch (dynamic sampling can take up to {recipe.grpo.max_sampling_rounds}), rollout and training "
                  "taking turns (the recipe's synchronous GRPO); "
                  + ("the dry run's own weight sync" if scaling.weight_sync_s is None else
                     f"a weight sync of {scaling.weight_sync_s:g} s (CUDA IPC or NCCL broadcast, measured)")
                  + " per generation batch; generating ahead (`grpo.max_staleness: 1`, a recipe change: it needs "
                  "dynamic sampling off, so one round) takes the slower of rollout and training (assumed: on 4 H200 at "
                  "8k tokens it has not yet been measured to overlap them, docs/multi_gpu.md); "
                  "evaluation on every GPU's engine at the same rates; rows of 32,768 generated tokens are what "
                  "random weights produce (the worst case).", ""]
    return "\n".join(lines)


def projections(rates: dict, full, args) -> list[dict]:
    """The projection for every ``--generated-tokens`` and ``--gpus``, once both stages' rates are measured."""
    if "distill" not in rates or "grpo" not in rates:
        return []
    return [{**projection(rates, full, gpus, args.trace_tokens, generated, args.scaling), "generated_tokens": generated}
            for generated in args.generated_tokens for gpus in args.gpus]


def project_kept(args, full, out: Path) -> None:
    """The report of kept dry runs (each stage may come from another run: their rates are merged), re-projected
    under this command's assumptions, without a GPU."""
    from common.files import read_text

    kept = [json.loads(read_text(Path(f))) for f in args.rates]
    rates = {k: v for run in kept for k, v in run["rates"].items()}
    stages = {"stages": {k: v for run in kept for k, v in run["stages"]["stages"].items() if k in rates},
              "device": " / ".join(dict.fromkeys(run["stages"].get("device", "CPU") for run in kept))}
    records = kept[0]["records"]
    args.trace_tokens = args.trace_tokens or records["mean"]
    text = report(stages, rates, records, projections(rates, full, args), args, full)
    (out / "projection.md").write_text(text)
    print(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied after DRY_RUN")
    parser.add_argument("--out", default="runs/paper-dry-run")
    parser.add_argument("--recipe", default="paper-2b")
    parser.add_argument("--records", type=int, default=2000, help="distillation records written")
    parser.add_argument("--stages", nargs="+", default=["distill", "grpo", "eval"], choices=["distill", "grpo", "eval"],
                        help="(overrides go before it: it takes every word after it)")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 64], help="GPU counts projected")
    parser.add_argument("--trace-tokens", type=float, default=None,
                        help="mean distillation sample in tokens (default: the records' mean)")
    parser.add_argument("--generated-tokens", type=int, nargs="+", default=[8192, 32768],
                        help="mean tokens per rollout / evaluation sample, projected")
    parser.add_argument("--rates", nargs="+", default=None, metavar="DRY_RUN_JSON",
                        help="project from the rates of kept dry runs (their dry_run.json) instead of running")
    parser.add_argument("--data-parallel", nargs="+", default=None, metavar="GPUS:SPEEDUP",
                        help="measured data-parallel speedups over one GPU (default: docs/multi_gpu.md's 4 H200)")
    parser.add_argument("--sampling-rounds", type=float, default=1.0, help="mean sampling rounds a generation batch")
    parser.add_argument("--dry-run-sync", action="store_true",
                        help="project with the dry run's own weight sync, not the measured CUDA IPC / NCCL one")
    args = parser.parse_args(argv)
    from pipeline.recipe import load_recipe

    args.scaling = Scaling(sampling_rounds=args.sampling_rounds,
                           weight_sync_s=None if args.dry_run_sync else Scaling.weight_sync_s)
    if args.data_parallel:
        args.scaling.data_parallel = {int(k): float(v) for k, v in (x.split(":") for x in args.data_parallel)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    full = load_recipe(args.recipe)  # the counts projected
    if args.rates:
        return project_kept(args, full, out)
    from pipeline.run import run_recipe

    data = out / "long_records.jsonl"
    recipe = load_recipe(args.recipe, DRY_RUN + [f"distill.data.source={data}", f"output_dir={out / 'run'}"]
                         + args.overrides)
    room = recipe.distill.max_length - min(256, recipe.distill.max_length // 2)  # for the prompt and chat template
    records = write_long_records(data, args.records, room)  # (a longer record distillation would drop)
    args.trace_tokens = args.trace_tokens or records["mean"]
    what = {"distill": f"{recipe.distill.max_steps} steps x {recipe.distill.batch_size} rows x "
                       f"{recipe.distill.max_length:,} tokens",
            "grpo": f"{recipe.grpo.prompts_per_batch} prompts x {recipe.grpo.num_generations} rollouts up to "
                    f"{recipe.grpo.max_completion_length:,} tokens, {recipe.grpo.steps} optimizer steps over them",
            "eval": f"{recipe.eval.limit} problems x {recipe.eval.repeats} samples of "
                    f"{', '.join(recipe.eval.benchmarks)} up to {recipe.eval.max_new_tokens:,} tokens"}
    import torch

    stages: dict = {"stages": {}}
    if torch.cuda.is_available():
        stages["device"] = torch.cuda.get_device_name()
    for stage in args.stages:
        start, error = time.time(), None
        with MemoryPoll() as memory:
            try:
                run_recipe(recipe, stages=(stage,))
            except Exception as exc:  # a dry run reports what does not fit and goes on to the next stage
                traceback.print_exc()
                first_line = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()[:1]  # Ray colours it
                error = f"{type(exc).__name__}: {' '.join(first_line)}"[:300]
        stages["stages"][stage] = {"wall_s": time.time() - start, "peak_mib": memory.peak_mib, "what": what[stage]}
        if error:
            stages["stages"][stage]["error"] = error
        print(f"{stage}: {stages['stages'][stage]}", flush=True)
    rates = measured_rates(Path(recipe.output_dir))
    projected = projections(rates, full, args)
    text = report(stages, rates, records, projected, args, full)
    (out / "dry_run.md").write_text(text)
    (out / "dry_run.json").write_text(json.dumps({"stages": stages, "rates": rates, "records": records,
                                                  "projections": projected}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
