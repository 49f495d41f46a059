"""How far a model's completions get through the synthetic word problems, step by step: read from an evaluation's
generations on CPU, no model needed.

    python -m benchmarks.pipeline.word_problem_steps distilled=runs/wp/a/eval/distill/generations/word_problems_val.jsonl \\
        GRPO=runs/wp/a/eval/generations/word_problems_val.jsonl [--out steps.md]

An answer right or wrong says little where a model solves 1% of the problems. Each word problem's worked solution
(``pipeline.synthetic``) states every step as an equation (``28*4=112``, ``28+112=140``); so do the models' completions.
Per completion: the equations it states (``a op b = c`` over whole numbers), the share of them whose arithmetic is
right, and the share of the worked solution's intermediate results that it reaches by a right equation (its
plan, as far as it got); beside them, the boxed answer's accuracy. A model that learns to reason through these
stories reaches more steps with right arithmetic before it answers more of them right. Labels given twice pool
their files (draws of one arm). Averages over completions; the arithmetic over the equations stated.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from common.files import read_records
from eval.benchmarks import BENCHMARKS, DATA_DIR
from rewards.extract import last_boxed

EQUATION = re.compile(r"(\d+)\s*([-+*/x×])\s*(\d+)\s*=\s*(\d+)")


def value(a: int, op: str, b: int) -> int | None:
    """``a op b`` as the word problems compute it (shares are whole: integer division), None for a division by 0."""
    if op in "*x×":
        return a * b
    if op == "/":
        return a // b if b else None
    return a + b if op == "+" else a - b


def equations(text: str) -> list[tuple[int, bool]]:
    """Each ``a op b = c`` in ``text``: its stated result and whether it is right."""
    found = []
    for m in EQUATION.finditer(text):
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        found.append((c, value(a, op, b) == c))
    return found


def steps(completion: str, solution: str, answer: str) -> dict:
    """One completion against the problem's worked ``solution`` and ``answer``."""
    stated = equations(completion)
    plan = [c for c, _ in equations(solution)]
    reached = {c for c, right in stated if right}
    boxed = last_boxed(completion)
    return {"equations": len(stated), "right": sum(r for _, r in stated),
            "reached": sum(c in reached for c in plan) / len(plan) if plan else 0.0,
            "correct": boxed is not None and boxed.strip() == answer.strip()}


def problems(benchmark: str) -> dict[str, dict]:
    """The word-problem benchmark's records by id, with their worked solutions."""
    if benchmark not in BENCHMARKS or not benchmark.startswith("word_problems"):
        raise ValueError(f"{benchmark}: not a word-problem benchmark (its records hold worked solutions)")
    path = DATA_DIR / BENCHMARKS[benchmark].file
    return {str(r["id"]): r for _, r in read_records(path)}


def measure(files: list[str]) -> dict:
    """The averages over every completion of ``files`` (generation JSONL of one benchmark)."""
    rows, gold = [], {}
    for file in files:
        for place, record in read_records(Path(file)):
            name = record.get("benchmark")
            if name not in gold:
                gold[name] = problems(name)
            problem = gold[name].get(str(record["problem_id"]))
            if problem is None:
                raise ValueError(f"{place}: problem {record['problem_id']!r} is not in {name}")
            rows.append(steps(record["text"], problem["solution"], problem["answer"]))
    if not rows:
        raise ValueError(f"{', '.join(files)}: no completions")
    stated = sum(r["equations"] for r in rows)
    return {"completions": len(rows), "equations": stated / len(rows),
            "arithmetic": sum(r["right"] for r in rows) / stated if stated else 0.0,
            "reached": sum(r["reached"] for r in rows) / len(rows),
            "accuracy": sum(r["correct"] for r in rows) / len(rows)}


def markdown(results: dict[str, dict]) -> str:
    lines = ["| model | completions | equations a completion | arithmetic right | worked steps reached | boxed accuracy |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['completions']} | {r['equations']:.2f} | {100 * r['arithmetic']:.1f}% | "
                     f"{100 * r['reached']:.1f}% | {100 * r['accuracy']:.2f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("generations", nargs="+", metavar="LABEL=FILE",
                        help="an evaluation's generations (eval/[<model>/]generations/<benchmark>.jsonl)")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown) and its numbers beside it")
    args = parser.parse_args(argv)
    files: dict[str, list[str]] = {}
    for item in args.generations:
        label, sep, file = item.partition("=")
        if not sep:
            label, file = Path(item).parent.parent.name, item
        files.setdefault(label, []).append(file)
    results = {label: measure(paths) for label, paths in files.items()}
    table = markdown(results)
    print(table, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
