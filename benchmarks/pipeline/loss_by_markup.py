"""Where a model's loss on GSM8K's published solutions goes: per calculator annotation, from two scorings of the same
records (``sse-pipeline loss --out``, as published and ``--as-trained``); CPU, no model needed.

    python -m benchmarks.pipeline.loss_by_markup docs/runs/2026-11-29b-conversion-test/loss_gsm8k.json.gz \\
        docs/runs/2026-11-29b-conversion-test/loss_gsm8k_trained.json.gz

The two forms of a solution differ by its annotations (``16 - 3 - 4 = <<16-3-4=9>>9``: the expression just written and
its result, written again) and its closing line. Per record, the nats the published form costs beyond the trained one
are regressed on the record's number of annotations: the slope is what an annotation costs a model (its tokens
mostly copies of the text just before them), the intercept what the closing line does. Each arm's draws averaged.
"""

from __future__ import annotations

import argparse
import gzip
import json

import numpy as np

from pipeline.data import GSM8K_ANNOTATION, PACKAGED


def per_record(path: str) -> tuple[dict, dict]:
    """``({arm: summed loss of each record, mean over its draws}, the saved header)``."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        saved = json.load(f)
    draws: dict[str, list] = {}
    for m in saved["models"]:
        draws.setdefault(m["label"] or m["model"], []).append(m["record_losses"])
    return {arm: np.mean(losses, axis=0) for arm, losses in draws.items()}, saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("published", help="the loss command's .json(.gz) of the solutions as published")
    parser.add_argument("trained", help="the same records scored --as-trained")
    args = parser.parse_args(argv)
    (published, a), (trained, b) = per_record(args.published), per_record(args.trained)
    if (a["data"], a["records"], a.get("as_trained"), b.get("as_trained")) != (b["data"], b["records"], False, True):
        raise ValueError(f"{args.published}, {args.trained}: not one set's records as published and as trained")
    records = [json.loads(line) for line in PACKAGED[a["data"]].open()][:a["records"]]
    counts = np.array([len(GSM8K_ANNOTATION.findall(r["solution"])) for r in records])
    arms = [arm for arm in published if arm in trained]
    reference = arms[0]
    print(f"{a['records']} records of {a['data']}, {counts.mean():.1f} annotations a record; nats a record the published "
          f"form costs beyond the trained one, regressed on its annotations:\n")
    print(f"| model | extra nats a record | per annotation | intercept | per annotation, x {reference} | "
          f"correlation of the excess over {reference} with annotations |")
    print("|---|---:|---:|---:|---:|---:|")
    base = published[reference] - trained[reference]
    base_slope = np.polyfit(counts, base, 1)[0]
    for arm in arms:
        extra = published[arm] - trained[arm]
        slope, intercept = np.polyfit(counts, extra, 1)
        excess = "" if arm == reference else f"{np.corrcoef(counts, extra - base)[0, 1]:.3f}"
        print(f"| {arm} | {extra.mean():.1f} | {slope:.1f} | {intercept:.1f} | {slope / base_slope:.2f} | {excess} |")


if __name__ == "__main__":
    main()
