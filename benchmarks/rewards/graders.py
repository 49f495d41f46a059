"""Agreement of our grader with labelled verdicts from public grader test suites, against bare math-verify.

    python -m benchmarks.rewards.graders [--cases rewards/data/grader_cases.jsonl] [--workers 2]

For each case (a completion, its gold answer, the expected verdict, the kind and source of the case; see
``scripts/build_grader_cases.py``): our verifier in its default mode (evaluation and the default reward)
and in strict mode (boxed answers only), and bare math-verify as its users call it, ``verify(parse(gold),
parse(completion))``, each in ``--workers`` processes. Prints agreement per kind and overall, and items/s.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rewards.verify import MathVerifier, VerifierPool

DEFAULT_CASES = Path(__file__).parent / "data" / "grader_cases.jsonl"


def _bare(pair: tuple[str, str]) -> bool:
    from math_verify import parse, verify

    gold, completion = pair
    try:
        return bool(verify(parse(gold), parse(completion)))
    except Exception:  # noqa: BLE001 - a crash is a "no"
        return False


def load_cases(path: Path) -> list[dict]:
    cases = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    cases.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not a JSON object ({e})") from e
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    cases = load_cases(args.cases)
    golds = [c["gold"] for c in cases]
    completions = [c["completion"] for c in cases]
    verdicts, speed = {}, {}
    with VerifierPool(num_workers=args.workers, timeout=5.0) as pool:
        for mode, strict in (("default", False), ("strict", True)):
            start = time.perf_counter()
            scores, _, _ = MathVerifier(pool=pool, strict=strict).score(completions, golds)
            speed[mode] = len(cases) / (time.perf_counter() - start)
            verdicts[mode] = [bool(s) for s in scores]
    with ProcessPoolExecutor(args.workers) as executor:
        list(executor.map(_bare, [("1", "1")] * args.workers))  # workers up and math-verify imported
        start = time.perf_counter()
        verdicts["math_verify"] = list(executor.map(_bare, list(zip(golds, completions)), chunksize=4))
        speed["math_verify"] = len(cases) / (time.perf_counter() - start)

    modes = ["default", "strict", "math_verify"]
    by_kind = defaultdict(list)
    for i, case in enumerate(cases):
        by_kind[case["kind"]].append(i)
    sources = sorted({c["source"].split("::")[0] for c in cases})
    print(f"\n### Grader agreement with labelled verdicts ({len(cases)} cases; sources: {', '.join(sources)})\n")
    print("| kind | cases | ours, default | ours, strict | bare math_verify |")
    print("|---|---|---|---|---|")

    def agreement(mode, idx):
        return sum(verdicts[mode][i] == cases[i]["expected"] for i in idx) / len(idx)

    for kind, idx in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        print(f"| {kind} | {len(idx)} | " + " | ".join(f"{100 * agreement(m, idx):.1f}%" for m in modes) + " |")
    every = list(range(len(cases)))
    print(f"| **all** | {len(cases)} | " + " | ".join(f"**{100 * agreement(m, every):.1f}%**" for m in modes) + " |")
    print(f"| items/s ({args.workers} workers) | | " + " | ".join(f"{speed[m]:.0f}" for m in modes) + " |")
    differ = [(i, cases[i]) for i in every if verdicts["default"][i] != cases[i]["expected"]]
    if differ:
        print(f"\nOur default mode disagrees with the label on {len(differ)} cases:")
        for i, case in differ:
            print(f"  {case['source'].split('::')[-1]}: gold {case['gold'][:60]!r}, expected {case['expected']}, "
                  f"completion ...{case['completion'][-80:]!r}")


if __name__ == "__main__":
    main()
