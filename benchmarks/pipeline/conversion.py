"""Conversion measured end to end: what each step of a converted recipe buys, on the GPU, in one command.

    python -m benchmarks.pipeline.conversion --recipe smollm2-135m --out runs/conversion

1. The ablation (``--ablation-steps`` > 0): the recipe's align stage alone, short, for each start of the new parts
   (``model.convert_start``) and each choice of what trains (``align.train``).
2. The recipe's align and distill stages as the recipe says (its GRPO and evaluation off).
3. The assistant-token loss (:mod:`pipeline.lm_loss`) of the source Transformer, the converted models before
   training, every aligned model and the distilled one, on the recipe's distillation data and on GSM8K test
   solutions; wall-clock per stage. Written to ``<out>/report.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

from pipeline.lm_loss import completion_loss, group, markdown, packed_reader
from pipeline.metrics import read_metrics
from pipeline.recipe import DataSpec, load_recipe
from pipeline.run import run_recipe, stage_runs
from pipeline.stages.base import initial_checkpoint

logger = logging.getLogger(__name__)
OFF = ["grpo.enabled=false", "eval.enabled=false"]


def _timed(recipe, stages) -> float:
    start = time.time()
    run_recipe(recipe, stages)
    return time.time() - start


def _last(metrics: Path, key: str):
    values = [r[key] for r in read_metrics(metrics) if key in r]
    return values[-1] if values else float("nan")


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="smollm2-135m")
    parser.add_argument("--out", default="runs/conversion")
    parser.add_argument("--ablation-steps", type=int, default=100)
    parser.add_argument("--first", type=int, default=24, help="records of each loss set")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models: list[tuple[str, str]] = []
    rows = []
    own_start = load_recipe(args.recipe, args.overrides).model.convert_start  # its converted model is scored below
    if args.ablation_steps:
        for start in ("fresh", "attention_like"):
            for train in ("new", "all"):
                name = f"ablation-{start}-{train}"
                recipe = load_recipe(args.recipe, [*args.overrides, *OFF, f"output_dir={out / name}",
                                                   f"model.convert_start={start}", f"align.train={train}",
                                                   f"align.steps={args.ablation_steps}", "distill.enabled=false"])
                seconds = _timed(recipe, ("align",))
                if train == "new" and start != own_start:
                    before = initial_checkpoint(recipe, out / name)
                    models.append((f"converted, {start} start (before training)", str(before)))
                models.append((f"aligned {args.ablation_steps} steps: {start} start, trains {train}",
                               str(out / name / "align" / "final")))
                rows.append(f"| {start} | {train} | {args.ablation_steps} | "
                            f"{_last(out / name / 'align' / 'metrics.jsonl', 'loss'):.4f} | {seconds:.0f} |")
    recipe = load_recipe(args.recipe, [*args.overrides, *OFF, f"output_dir={out / 'main'}"])
    if not stage_runs(recipe, "align"):
        raise SystemExit(f"{args.recipe}: converts no model into SSE layers (model.convert_from): nothing to measure")
    timings = {}
    for stage in ("align", "distill"):
        timings[stage] = _timed(recipe, (stage,))
    initial = initial_checkpoint(recipe, out / "main")
    models = [("source Transformer", recipe.model.convert_from),
              (f"converted, {recipe.model.convert_start} start (the recipe's)", str(initial)), *models,
              (f"aligned ({recipe.align.steps} steps, the recipe's)", str(out / "main" / "align" / "final")),
              ("aligned + distilled (the recipe's)", str(out / "main" / "distill" / "final"))]
    lines = [f"# Conversion of {recipe.model.convert_from} ({args.recipe})", ""]
    if rows:
        lines += ["## Ablation: alignment alone", "",
                  "| start | trains | steps | final align loss | seconds |", "| --- | --- | --- | --- | --- |", *rows, ""]
    lines += ["## The recipe's stages", "", "| stage | seconds | tokens | last loss |", "| --- | --- | --- | --- |"]
    for stage, seconds in timings.items():
        metrics = out / "main" / stage / "metrics.jsonl"
        done = json.loads((out / "main" / stage / "final" / "stage_done.json").read_text())
        tokens = done.get("tokens") or _last(metrics, "num_tokens")
        loss = _last(metrics, "loss")
        loss = done.get("train_loss", loss) if math.isnan(loss) else loss  # nothing logged: the run's mean loss
        lines.append(f"| {stage} | {seconds:.0f} | {tokens:,.0f} | {loss:.4f} |")
    lines.append("")
    import torch

    from sse_model.checkpoint import load_pretrained

    from pipeline.data import sft_dataset
    from pipeline.known_models import resolve
    from pipeline.models import load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(None, resolve(recipe.model.convert_from))
    for source in (recipe.distill.data.source, "gsm8k_test"):
        data = sft_dataset(DataSpec(source=source), recipe.prompt_instruction)
        data = data.select(range(min(args.first, len(data))))
        results = []
        for label, path in models:
            model = packed_reader(load_pretrained(resolve(path), torch.float32)).to(device)
            results.append(completion_loss(model, tokenizer, data, device, label))
            del model
        lines += [f"## Assistant-token loss, first {len(data)} records of `{source}`", "",
                  markdown(group(results), ratios=True), ""]
        print("\n".join(lines[-4:]), flush=True)
    report = out / "report.md"
    report.write_text("\n".join(lines))
    print(report.read_text(), flush=True)
    return report


if __name__ == "__main__":
    main()
