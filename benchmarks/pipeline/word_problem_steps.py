"""How far a model's completions get through a benchmark's worked solutions (``eval/worked_steps.py``), read from
an evaluation's generations on CPU, no model needed: for runs evaluated before the evaluation reported it, or
several runs pooled.

    python -m benchmarks.pipeline.word_problem_steps distilled=runs/wp/a/eval/distill/generations/word_problems_val.jsonl \\
        GRPO=runs/wp/a/eval/generations/word_problems_val.jsonl [--out steps.md]

Labels given twice pool their files (draws of one arm). Averages over completions; the arithmetic over the
equations stated; right by every step graded as the evaluation's headline is (the last box).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.files import read_records
from eval.benchmarks import load_problems
from eval.worked_steps import worked_steps, written_in_steps
from rewards import MathVerifier


def measure(files: list[str]) -> dict:
    """:func:`eval.worked_steps.worked_steps` over every completion of ``files`` (generation JSONL)."""
    completions, solutions, answers, problems = [], [], [], {}
    for file in files:
        for place, record in read_records(Path(file)):
            name = record.get("benchmark")
            if name not in problems:
                problems[name] = {p.id: p for p in load_problems(name)}
            problem = problems[name].get(str(record["problem_id"]))
            if problem is None:
                raise ValueError(f"{place}: problem {record['problem_id']!r} is not in {name}")
            completions.append(record["text"])
            solutions.append(problem.solution)
            answers.append(problem.answer)
    if not completions:
        raise ValueError(f"{', '.join(files)}: no completions")
    if not written_in_steps(solutions):
        raise ValueError(f"{', '.join(sorted(problems))}: not every worked solution states its steps as equations")
    verifier = MathVerifier(strict=True)  # the headline's reading: the last box
    try:
        right = [bool(s) for s in verifier.score(completions, answers)[0]]
    finally:
        verifier.close()
    return {"completions": len(completions), **worked_steps(completions, solutions, right)}


def markdown(results: dict[str, dict]) -> str:
    lines = ["| model | completions | equations a completion | arithmetic right | worked steps reached "
             "| right by every step |", "|---|---:|---:|---:|---:|---:|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['completions']} | {r['equations']:.2f} | {100 * r['arithmetic']:.1f}% | "
                     f"{100 * r['reached']:.1f}% | {100 * r['right_by_every_step']:.1f}% |")
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
