"""The pipeline's stages on several GPUs of one machine, as a user runs them (``sse-pipeline ... --gpus N``, one
process tree per run), timed from the stages' own logs.

    python -m benchmarks.pipeline.multi_gpu distill --gpus 1 2 4 --out runs/mgpu            # paper-2b's distillation
    python -m benchmarks.pipeline.multi_gpu distill --gpus 4 --preset sse-h-7b --sharding ddp fsdp --out runs/mgpu
    python -m benchmarks.pipeline.multi_gpu same-steps --gpus 1 2 --out runs/mgpu           # one model on 1 and 2 GPUs
    python -m benchmarks.pipeline.multi_gpu grpo --gpus 1 2 --placement colocated split --out runs/mgpu
    python -m benchmarks.pipeline.multi_gpu eval --gpus 1 2 --out runs/mgpu

``distill``: ``recipes/paper-2b``'s distillation with only its step count shrunk (the dry run's settings,
:data:`scripts.paper_dry_run.DRY_RUN`: random weights of the preset, rows of 32,768 tokens, 16 rows an
optimizer step), for each GPU count and sharding; prints tokens/s over the steps after the first (compilation is
in the first), the ratio to the first row's, and the peak GPU memory in use (``nvidia-smi``, the busiest GPU). A
run that fails (out of memory) is a row saying so.

``same-steps``: ``recipes/gpu-100m``'s distillation shrunk to 10 steps with ``deterministic=true``, on each GPU
count: the per-step loss's largest relative difference from the first count's, and the final weights' largest
difference.

``grpo``: ``recipes/paper-2b``'s GRPO as the dry run shrinks it (8 prompts x 8 rollouts a generation batch, random
weights that rarely stop) with generation batches of ``--new-tokens`` tokens at most (the overlong penalty's
window an eighth of that, as the recipe's 4,096 of 32,768), for each GPU count and placement (``colocated``: a
trainer worker and its engine on every GPU; ``split``: trainers and engines on GPUs of their own) and
``--staleness`` (k: the engines generate k batches ahead while the trainers train, split only; with ``--partial``
they push the new weights into running sequences); ``--trainer-gpus`` splits the GPUs other than the placement's
quarter. Each run has 2k + 3 batches, and the two in the middle are its steady batches (:func:`batch_split`):
their time split (rollout, weight sync, reward, training) and their generated tokens over their wall-clock.

``eval``: ``recipes/paper-2b``'s evaluation (random ``sse-h-2b`` weights) of ``--eval-limit`` AIME24 problems x
``--eval-repeats`` samples (default all 30 x 32, the recipe's avg@32: more sequences than one engine runs at once)
up to ``--new-tokens`` tokens on each GPU count: generated tokens over the slowest worker's generation seconds
(a line per shard in the stage's log; model loading, engine start and graph capture apart, in the stage's seconds)
and the sequences each engine ran at once.

Every planned run's recipe and placement is checked before the first one starts, and runs that start alike
load one starting model the bench built once (``OUT/start-*``) rather than each building its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.metrics import read_metrics
from scripts.paper_dry_run import DRY_RUN, MemoryPoll, write_long_records

# NVLink multicast off in every process the runs start (it can put a shared host's GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_process(command: list[str], log: Path, timeout_s: float, stop_s: float = 60) -> int | str:
    """``command``'s exit status, its output in ``log``; ``"timeout"`` past ``timeout_s``, after it was stopped as
    Ctrl-C stops a run (SIGTERM: the CLI shuts its Ray down, so the next run finds the GPUs free) or, if that
    takes more than ``stop_s``, killed (Ray's reaper then ends its cluster)."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **SAFE_ENV})
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=stop_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            return "timeout"


def run_stage(stage: str, recipe: str, overrides: list[str], gpus: int, log: Path, timeout_s: float) -> dict:
    """``sse-pipeline <stage> <recipe> <overrides> --gpus <gpus>`` in a process of its own; its wall-clock, exit
    status, the last line of its error output and the peak GPU memory in use while it ran."""
    command = [sys.executable, "-m", "pipeline.cli", stage, recipe, *overrides, "--gpus", str(gpus)]
    start = time.time()
    with MemoryPoll() as memory:
        code = run_process(command, log, timeout_s)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if line.startswith("error:")), lines[-1] if lines else "")
    return {"seconds": time.time() - start, "exit": code, "error": error if code != 0 else "",
            "peak_gib": memory.peak_mib / 1024 if memory.peak_mib else None}


def distill_rate(run_dir: Path) -> dict:
    """Tokens/s and seconds a step over the logged steps after the first (TRL's ``num_tokens`` counts every
    worker's tokens)."""
    rows = [r for r in read_metrics(run_dir / "distill" / "metrics.jsonl") if "num_tokens" in r and "time/step_s" in r]
    if len(rows) < 2:
        return {}
    tokens = rows[-1]["num_tokens"] - rows[0]["num_tokens"]
    seconds = sum(r["time/step_s"] * (r["step"] - p["step"]) for p, r in zip(rows, rows[1:]))
    return {"tokens_per_s": tokens / seconds, "step_s": seconds / (rows[-1]["step"] - rows[0]["step"]),
            "first_step_s": rows[0]["time/step_s"], "steps": rows[-1]["step"]}


def check_plans(args, stage: str, recipe: str, plans: list[tuple[str, int, list[str], dict]]) -> list:
    """Every planned run's recipe and placement resolved before the first one starts, so that a bad override
    stops the bench in seconds, naming the run, rather than after the runs before it took the GPUs' time."""
    from pipeline.placement import plan
    from pipeline.recipe import RecipeError, load_recipe

    resolved = []
    for name, gpus, overrides, _ in plans:
        try:
            resolved.append(load_recipe(recipe, [*overrides, *args.overrides, f"ray.num_gpus={gpus}"]))
            plan(resolved[-1], gpus, os.cpu_count() or 1, (stage,))
        except RecipeError as error:
            raise SystemExit(f"{name}: {error}") from None
    return resolved


def shared_starts(out: Path, recipes: list) -> list[list[str]]:
    """Each run's starting model built once for all the runs that start alike (a preset's random weights at the
    same seed), in ``out``; returns each run's overrides that load it: a run would otherwise build and save its
    own (half a minute of CPU at 2B) before its stage starts."""
    import hashlib

    from pipeline.stages.base import initial_checkpoint, initial_settings

    starts = []
    for recipe in recipes:
        if recipe.model.path is not None:  # a checkpoint already
            starts.append([])
            continue
        settings = json.dumps(initial_settings(recipe), sort_keys=True)
        folder = out / f"start-{hashlib.sha1(settings.encode()).hexdigest()[:10]}"
        path = initial_checkpoint(recipe, folder)  # (built by the function each run would build it with)
        starts.append([f"model.path={path}", "model.preset=null", "model.convert_from=null",
                       "model.config_overrides={}"])
    return starts


def run_all(args, stage: str, recipe: str, plans: list[tuple[str, int, list[str], dict]], measure) -> list[dict]:
    """Each planned run ``(name, GPUs, overrides, fields of its row)`` in turn, in ``args.out``, once all are
    checked (:func:`check_plans`) and their starting models built (:func:`shared_starts`): its row is the fields,
    how it ran (:func:`run_stage`) and ``measure(its folder, its log)``, printed as it ends."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    starts = shared_starts(out, check_plans(args, stage, recipe, plans))
    results = []
    for (name, gpus, overrides, fields), start in zip(plans, starts):
        print(f"{name}: running", flush=True)
        log = out / f"{name}.log"
        run = run_stage(stage, recipe, [*overrides, f"output_dir={out / name}", *args.overrides, *start], gpus,
                        log, args.timeout)
        results.append({"name": name, "gpus": gpus, **fields, **run, **measure(out / name, log)})
        print(json.dumps(results[-1]), flush=True)
    return results


def bench_distill(args, write_data: bool = True):
    """A bench's runs: ``(stage, recipe, [(name, GPUs, overrides, fields of its row)], measure)``."""
    data = Path(args.out) / "long_records.jsonl"
    if write_data and not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        write_long_records(data, 2000, 32768 - 256)
    plans = [(f"distill-{args.preset}-{sharding}-{gpus}gpu", gpus,
              [*DRY_RUN, f"model.preset={args.preset}", f"distill.data.source={data}",
               f"distill.max_steps={args.steps}", f"sharding={sharding}"], {"sharding": sharding})
             for sharding in args.sharding for gpus in args.gpus]
    return "distill", "paper-2b", plans, lambda folder, log: distill_rate(folder)


def distill_table(results: list[dict]) -> str:
    base = next((r["tokens_per_s"] for r in results if r.get("tokens_per_s")), None)
    lines = ["| run | GPUs | sharding | tokens/s | x first row | s/step | first step s | peak GiB (busiest GPU) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r.get("tokens_per_s"):
            lines.append(f"| {r['name']} | {r['gpus']} | {r['sharding']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['tokens_per_s'] / base:.2f} | {r['step_s']:.2f} | {r['first_step_s']:.1f} | "
                         f"{r['peak_gib'] or 0:.1f} |")
        else:
            lines.append(f"| {r['name']} | {r['gpus']} | {r['sharding']} | failed (exit {r['exit']}): "
                         f"{r['error'][:160]} | | | | {r['peak_gib'] or 0:.1f} |")
    return "\n".join(lines)


def bench_same_steps(args):
    """The same 10 deterministic steps on each GPU count."""
    from pipeline.checkpoints import is_done

    def measure(folder: Path, log: Path) -> dict:
        final = folder / "distill" / "final"
        return {"losses": [r["loss"] for r in read_metrics(folder / "distill" / "metrics.jsonl") if "loss" in r],
                "final": str(final) if is_done(final) else None}

    plans = [(f"same-steps-{gpus}gpu", gpus, ["distill.max_steps=10", "distill.logging_steps=1",
                                              "distill.save_steps=100", "deterministic=true"], {})
             for gpus in args.gpus]
    return "distill", "gpu-100m", plans, measure


def same_steps_table(results: list[dict]) -> str:

    from sse_model.checkpoint import load_pretrained

    base = results[0]
    reference = load_pretrained(base["final"]).state_dict() if base["final"] else None
    lines = ["| GPUs | steps | loss first -> last | max relative loss difference to the first row | "
             "max weight difference |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        if not r["losses"]:
            lines.append(f"| {r['gpus']} | failed (exit {r['exit']}): {r['error'][:160]} | | | |")
            continue
        n = min(len(r["losses"]), len(base["losses"]))
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], base["losses"][:n]))
        weights = ""
        if reference is not None and r["final"]:
            other = load_pretrained(r["final"]).state_dict()
            weights = f"{max(float((other[k].float() - v.float()).abs().max()) for k, v in reference.items()):.2e}"
        lines.append(f"| {r['gpus']} | {len(r['losses'])} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | "
                     f"{rel:.2e} | {weights} |")
    return "\n".join(lines)


def batch_split(run_dir: Path, ahead: int = 0) -> dict:
    """A GRPO run's steady generation batch: the mean over its batches but the first ``ahead + 1`` (the first
    compiles; generating ``ahead`` batches ahead, those start together at the run's start) and the last ``ahead``
    (they generate with fewer batches beside them, and the last never waits). Its seconds, their split into
    rollout (the trainer waiting), weight sync, reward and training (the rest), its generated tokens (every
    worker's) over its wall-clock, and the share of the time since a sync that the engines generated (logged where
    engines run apart)."""
    rows = [r for r in read_metrics(run_dir / "grpo" / "metrics.jsonl") if "time/step_s" in r]
    starts = [i for i, r in enumerate(rows) if "tokens/generated" in r] + [len(rows)]
    batches = [range(a, b) for a, b in zip(starts[ahead + 1:], starts[ahead + 2:len(starts) - ahead])]
    if not batches:
        return {}
    steps = [r["step"] - (rows[i - 1]["step"] if i else 0) for i, r in enumerate(rows)]  # (rows logged every k steps)

    def mean(of) -> float:
        return sum(of(b) for b in batches) / len(batches)

    wall = mean(lambda b: sum(rows[i]["time/step_s"] * steps[i] for i in b))
    split = {name: mean(lambda b: rows[b[0]].get(f"time/{name}_s", 0.0) * steps[b[0]])
             for name in ("rollout", "weight_sync", "reward")}
    generated = mean(lambda b: rows[b[0]]["tokens/generated"])
    busy = [rows[b[0]]["engines/busy_fraction"] for b in batches if "engines/busy_fraction" in rows[b[0]]]
    return {"batch_s": wall, **{f"{k}_s": v for k, v in split.items()}, "train_s": wall - sum(split.values()),
            "batches": len(batches), "generated": generated,
            "mean_length": mean(lambda b: rows[b[0]].get("completions/mean_length", 0.0)),
            "generated_per_s": generated / wall, "engines_busy": sum(busy) / len(busy) if busy else None}


def bench_grpo(args):
    plans, ahead = [], {}  # (the batches each run generates ahead, by name: its steady batches depend on them)
    for staleness in args.staleness:
        partial = bool(staleness) and args.partial
        for placement in args.placement:
            for gpus in args.gpus:
                if placement == "split" and gpus < 2 or staleness and placement == "colocated":
                    continue  # (generating ahead needs engines of their own)
                for trainers in (args.trainer_gpus or [None]) if placement == "split" else [None]:
                    split = split_overrides(gpus, trainers)
                    if split is None:
                        print(f"grpo: {trainers} trainer GPUs leave {gpus - trainers} that do not divide into "
                              f"engines for each; no such row on {gpus} GPUs")
                        continue
                    layout = placement if trainers is None else f"split{trainers}+{gpus - trainers}"
                    name = f"grpo-{args.preset}-{layout}-{gpus}gpu" + (f"-ahead{staleness}" if staleness else "") + \
                        ("-partial" if partial else "")
                    batches = 2 * staleness + 3  # two steady ones (batch_split)
                    overrides = [*DRY_RUN, f"model.preset={args.preset}", f"grpo.steps={4 * batches}",
                                 "grpo.mini_batches=4",
                                 f"grpo.max_completion_length={args.new_tokens}",
                                 f"grpo.rewards.overlong_cache={args.new_tokens // 8}", f"grpo.placement={placement}",
                                 f"grpo.max_staleness={staleness}", f"grpo.partial_rollouts={str(partial).lower()}",
                                 "grpo.save_steps=100", *split]
                    plans.append((name, gpus, overrides, {"placement": layout.replace("split", "split "),
                                                          "staleness": f"{staleness}{' partial' if partial else ''}"}))
                    ahead[name] = staleness
    return "grpo", "paper-2b", plans, lambda folder, log: batch_split(folder, ahead[folder.name])


def split_overrides(gpus: int, trainers: int | None) -> list[str] | None:
    """The overrides that give a split layout ``trainers`` trainer GPUs of ``gpus``, each trainer worker with an
    equal share of the rest as its engines (none: the placement's own split); None where they do not divide."""
    if trainers is None:
        return []
    if not 0 < trainers < gpus or (gpus - trainers) % trainers:
        return None
    return [f"grpo.num_workers={trainers}", f"grpo.num_engines={(gpus - trainers) // trainers}"]


def grpo_table(results: list[dict]) -> str:
    base = next((r["generated_per_s"] for r in results if r.get("generated_per_s")), None)
    lines = ["| run | GPUs | placement | ahead | batch s | rollout (trainer waits) s | weight sync s | reward s | "
             "train s | engines busy | mean length | generated tok/s (whole batch) | x first row | peak GiB |",
             "| --- " * 14 + "|"]
    for r in results:
        if r.get("generated_per_s"):
            busy = f"{100 * r['engines_busy']:.0f}%" if r.get("engines_busy") is not None else ""
            lines.append(f"| {r['name']} | {r['gpus']} | {r['placement']} | {r['staleness']} | {r['batch_s']:.1f} | "
                         f"{r['rollout_s']:.1f} "
                         f"| {r['weight_sync_s']:.2f} | {r['reward_s']:.2f} | {r['train_s']:.1f} | {busy} | "
                         f"{r['mean_length'] or 0:,.0f} | {r['generated_per_s']:,.0f} | "
                         f"{r['generated_per_s'] / base:.2f} | {r['peak_gib'] or 0:.1f} |")
        else:
            lines.append(f"| {r['name']} | {r['gpus']} | {r['placement']} | {r['staleness']} | failed (exit "
                         f"{r['exit']}): {r['error'][:160]} |" + " |" * 9)
    return "\n".join(lines)


def shard_rates(log_text: str) -> dict:
    """The generation of an evaluation from its shards' lines (``eval: shard k of n: T tokens generated in S s``):
    every shard's tokens over the slowest shard's seconds (the workers generate at once), model loading and
    engine start left out, and the mean of the shards' sequences at once."""
    import re

    shards, at_once = {}, []
    for line in log_text.splitlines():
        found = re.search(r"eval: shard (\d+) of (\d+): (\d+) tokens generated in ([\d.]+) s", line)
        if found:
            k, n, tokens, seconds = found.groups()
            shards[int(k)] = (int(n), int(tokens), float(seconds))
            at_once += [int(m) for m in re.findall(r"(\d+) sequences at once", line)]
    if not shards or len(shards) != next(iter(shards.values()))[0]:
        return {}
    generated = sum(t for _, t, _ in shards.values())
    seconds = max(s for _, _, s in shards.values())
    return {"generate_s": seconds, "shard_s": sorted(s for _, _, s in shards.values()), "generated": generated,
            "generated_per_s": generated / seconds, "at_once": sum(at_once) / len(at_once) if at_once else None}


def bench_eval(args):
    plans = [(f"eval-{args.preset}-{gpus}gpu", gpus,
              [*DRY_RUN, f"model.preset={args.preset}", f"eval.limit={args.eval_limit}",
               f"eval.repeats={args.eval_repeats}", f"eval.max_new_tokens={args.new_tokens}"], {})
             for gpus in args.gpus]
    return "eval", "paper-2b", plans, lambda folder, log: shard_rates(log.read_text(errors="replace"))


def eval_table(results: list[dict]) -> str:
    base = next((r["generated_per_s"] for r in results if r.get("generated_per_s")), None)
    lines = ["| run | GPUs | generation s (slowest shard) | fastest shard s | generated tokens | tok/s | x first row | "
             "sequences at once (an engine's mean) | stage s | peak GiB |", "| --- " * 10 + "|"]
    for r in results:
        if r.get("generated_per_s"):
            lines.append(f"| {r['name']} | {r['gpus']} | {r['generate_s']:.0f} | {r['shard_s'][0]:.0f} | "
                         f"{r['generated']:,.0f} | {r['generated_per_s']:,.0f} | {r['generated_per_s'] / base:.2f} | "
                         f"{r['at_once'] or 0:.0f} | {r['seconds']:.0f} | {r['peak_gib'] or 0:.1f} |")
        else:
            lines.append(f"| {r['name']} | {r['gpus']} | failed (exit {r['exit']}): {r['error'][:160]} |" + " |" * 7)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("distill", "same-steps", "grpo", "eval"))
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--preset", default="sse-h-2b")
    parser.add_argument("--sharding", nargs="+", default=["auto"], choices=("auto", "ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=3, help="distill: optimizer steps a run (the first is not timed)")
    parser.add_argument("--placement", nargs="+", default=["colocated", "split"], choices=("colocated", "split"))
    parser.add_argument("--staleness", type=int, nargs="+", default=[0], choices=range(5),
                        help="grpo: grpo.max_staleness values (k: the engines generate k batches ahead; split only)")
    parser.add_argument("--partial", action="store_true",
                        help="grpo: generating ahead with partial rollouts (the weights pushed into running sequences)")
    parser.add_argument("--trainer-gpus", type=int, nargs="+",
                        help="grpo: split rows with these many trainer GPUs each (default: the placement's quarter)")
    parser.add_argument("--new-tokens", type=int, default=4096, help="grpo, eval: tokens a completion may take")
    parser.add_argument("--eval-limit", type=int, default=30, help="eval: AIME24 problems (30: all of them)")
    parser.add_argument("--eval-repeats", type=int, default=32, help="eval: samples a problem (32: avg@32)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    parser.add_argument("--out", default="runs/multi-gpu")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides of every run")
    return parser.parse_intermixed_args(argv)


def main() -> None:
    args = parse_args()
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    bench, table_of = {"distill": (bench_distill, distill_table), "same-steps": (bench_same_steps, same_steps_table),
                       "grpo": (bench_grpo, grpo_table), "eval": (bench_eval, eval_table)}[args.what]
    table = table_of(run_all(args, *bench(args)))
    text = f"{args.what} on {device} ({' '.join(sys.argv[1:])})\n\n{table}\n"
    print(text)
    (Path(args.out) / f"{args.what}.md").write_text(text)


if __name__ == "__main__":
    main()
