"""How the models' loss ratio grows with how much of a solution repeats earlier text: solutions grouped by the share
of their characters inside a run of ``--chars`` or more that appeared before (in the problem or earlier in the
solution), each group's loss per token for every arm and its ratio to the first; from a loss command's scoring
(``sse-pipeline loss --out``); CPU, no model needed.

    python -m benchmarks.pipeline.loss_by_copying docs/runs/2026-11-29b-conversion-test/loss_aime.json.gz

Repeating earlier text is what softmax attention does by looking back and what a fixed-size recurrent state holds
only in part: a converted model that reads the rest as well as its Transformer but copies worse shows a ratio that
rises across the groups (``benchmarks.pipeline.loss_by_markup`` measures the same for GSM8K's calculator notes).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.pipeline.loss_by_markup import per_record


def copied_share(problem: str, solution: str, chars: int) -> float:
    """The share of ``solution``'s characters inside a run of at least ``chars`` that occurred before it."""
    inside = np.zeros(len(solution), bool)
    for j in range(len(solution) - chars + 1):
        if solution[j:j + chars] in problem or solution[j:j + chars] in solution[:j]:
            inside[j:j + chars] = True
    return float(inside.mean()) if len(solution) else 0.0


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scored", help="the loss command's .json(.gz)")
    parser.add_argument("--chars", type=int, default=12, help="the shortest run that counts as a repeat")
    parser.add_argument("--groups", type=int, default=4, help="groups of equal size, by copied share")
    args = parser.parse_args(argv)
    losses, saved = per_record(args.scored)
    if saved.get("as_trained") or saved.get("solution_field", "solution") != "solution":
        raise ValueError(f"{args.scored}: scored another form of the solutions than the data file holds")
    from pipeline.data import PACKAGED

    records = [json.loads(line) for line in PACKAGED[saved["data"]].open()][:saved["records"]]
    share = np.array([copied_share(r["problem"], r["solution"], args.chars) for r in records])
    tokens = np.array(saved["models"][0]["record_tokens"])
    edges = np.quantile(share, np.linspace(0, 1, args.groups + 1)[1:-1])
    group = np.digitize(share, edges)
    arms = list(losses)
    reference = arms[0]
    lines = [f"{saved['records']} records of {saved['data']}, by the share of each solution repeating earlier text "
             f"(runs of {args.chars}+ characters); loss per token, and x {reference}:", "",
             "| copied share | records | " + " | ".join(arms) + " | " + " | ".join(f"{a} x" for a in arms[1:]) + " |",
             "|---|---:|" + "---:|" * (2 * len(arms) - 1)]
    for g in range(args.groups):
        chosen = group == g
        per_token = {a: losses[a][chosen].sum() / tokens[chosen].sum() for a in arms}
        lines.append(f"| {share[chosen].min():.2f}-{share[chosen].max():.2f} | {chosen.sum()} | "
                     + " | ".join(f"{per_token[a]:.3f}" for a in arms) + " | "
                     + " | ".join(f"{per_token[a] / per_token[reference]:.2f}" for a in arms[1:]) + " |")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
