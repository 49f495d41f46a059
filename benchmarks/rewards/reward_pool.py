"""Reward throughput on CPU: items/s for long completions (default 1,024 of ~4k tokens each).

    python -m benchmarks.rewards.reward_pool [--items 1024] [--tokens 4096] [--workers N]

Completions are synthetic chains of reasoning (~4 characters per token) that end in a boxed answer; the
ground truths are MATH500's, and a quarter of the answers are wrong, a few are written differently from
the reference (fractions as decimals, commas) and a few have no box, so every path of the reward runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from rewards.functions import AccuracyReward
from rewards.verify import MathVerifier, VerifierPool

FILLER = ("We expand the expression and collect like terms. Substituting $x = {a}$ gives ${a}^2 + {b} = {c}$, "
          "so the constraint holds. Next we check the boundary case, where \\frac{{{a}}}{{{b}}} < 1. ")


def synthetic_completions(golds: list[str], tokens: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    completions = []
    for i, gold in enumerate(golds):
        body = []
        while sum(map(len, body)) < tokens * 4:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            body.append(FILLER.format(a=a, b=b, c=a * a + b))
        kind = i % 8
        if kind < 5:
            answer = gold
        elif kind == 5:
            answer = f"{gold} + 1"
        elif kind == 6:
            answer = str(rng.randint(0, 999))
        else:
            completions.append("".join(body))
            continue
        completions.append("".join(body) + f" Therefore the answer is $\\boxed{{{answer}}}$.")
    return completions


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--peer", action="store_true", help="also time bare math-verify (parse + verify) on the same items")
    args = parser.parse_args(argv)
    data = Path(__file__).resolve().parent.parent / "eval" / "data" / "math500.jsonl"
    golds = [json.loads(line)["answer"] for line in data.read_text().splitlines()]
    golds = [golds[i % len(golds)] for i in range(args.items)]
    completions = synthetic_completions(golds, args.tokens)
    reward = AccuracyReward(MathVerifier(pool=VerifierPool(num_workers=args.workers, timeout=args.timeout)))
    start = time.perf_counter()
    scores = reward(completions=completions, answer=golds)
    seconds = time.perf_counter() - start
    stats = reward.last_stats
    reward.verifier.close()
    result = {"items": args.items, "tokens_per_item": args.tokens, "workers": args.workers, "seconds": round(seconds, 2),
              "items_per_s": round(args.items / seconds, 1), "mean_reward": round(sum(scores) / len(scores), 3),
              "unique_pairs": stats.unique_pairs, "timeouts": stats.timeouts, "no_answer": stats.no_answer}
    print("| items | tokens/item | workers | seconds | items/s | mean reward | unique pairs | timeouts | no answer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("| " + " | ".join(str(result[k]) for k in ("items", "tokens_per_item", "workers", "seconds", "items_per_s",
                                                       "mean_reward", "unique_pairs", "timeouts", "no_answer")) + " |")
    if args.peer:
        from concurrent.futures import ProcessPoolExecutor

        from .graders import _bare

        with ProcessPoolExecutor(args.workers) as executor:
            list(executor.map(_bare, [("1", "1")] * args.workers))
            start = time.perf_counter()
            bare = list(executor.map(_bare, list(zip(golds, completions)), chunksize=8))
            peer_seconds = time.perf_counter() - start
        result["peer_items_per_s"] = round(args.items / peer_seconds, 1)
        print(f"\nbare math-verify (parse + verify, {args.workers} processes, no timeout) on the same items: "
              f"{peer_seconds:.2f} s, {result['peer_items_per_s']} items/s, mean reward {sum(bare) / len(bare):.3f}")
    return result


if __name__ == "__main__":
    main()
