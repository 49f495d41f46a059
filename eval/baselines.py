"""What a benchmark gives away without reading: answers that need no reasoning, scored like a model's, so that every
accuracy stands beside the best of them; and the answer-size strata a guess could exploit.

- ``commonest answer``: the set's most frequent gold answer, given to every problem (the best constant guess,
  chosen knowing the answers: an upper bound on what any constant scores);
- ``last number`` / ``first number``: the last / first number written in the question.

A model that does not beat the best of these (its interval's lower bound above it) shows no reasoning on that set.
"""

from __future__ import annotations

import re
from collections import Counter

NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")
SMALL = 10  # answers up to this are the "small" stratum: where constants and copied numbers land most often


def _plain(answer: str) -> str:
    return "".join(answer.split()).strip("$")


def numbers(text: str) -> list[str]:
    """The numbers a problem writes, in order (thousands separators dropped)."""
    return [m.group().replace(",", "") for m in NUMBER.finditer(text)]


def guesses(problems) -> dict[str, list[str | None]]:
    """Each baseline's answer to every problem (None: it has none to give)."""
    commonest = Counter(_plain(p.answer) for p in problems).most_common(1)[0][0]
    found = [numbers(p.problem) for p in problems]
    return {"commonest answer": [commonest] * len(problems),
            "last number": [n[-1] if n else None for n in found],
            "first number": [n[0] if n else None for n in found]}


def score_baselines(problems, verifier) -> dict:
    """``{baseline: {"accuracy", "per_problem", ("answer")}, "best": name}``, each guess graded by ``verifier`` as a
    boxed answer (the reading a model's boxed answer gets)."""
    golds = [p.answer for p in problems]
    result: dict = {}
    for name, answers in guesses(problems).items():
        texts = [f"\\boxed{{{a}}}" if a is not None else "" for a in answers]
        scores, _, _ = verifier.score(texts, golds)
        per_problem = [float(bool(s)) for s in scores]
        result[name] = {"accuracy": sum(per_problem) / len(per_problem), "per_problem": per_problem}
        if name == "commonest answer":
            result[name]["answer"] = answers[0]
    result["best"] = max((k for k in result), key=lambda k: result[k]["accuracy"])
    return result


def answer_size(answer: str) -> str:
    """The stratum of a gold answer: ``<= 10``, ``> 10`` (numbers) or ``other`` (expressions, sets, text)."""
    plain = _plain(answer).replace(",", "")
    try:
        value = float(plain)
    except ValueError:
        return "other"
    return f"<= {SMALL}" if abs(value) <= SMALL else f"> {SMALL}"


def by_answer_size(problems, columns: dict[str, list[float]]) -> dict:
    """Each stratum's problems and the mean of every per-problem ``columns`` entry (accuracies) over them."""
    strata: dict[str, list[int]] = {}
    for i, p in enumerate(problems):
        strata.setdefault(answer_size(p.answer), []).append(i)
    return {name: {"problems": len(rows), **{k: sum(v[i] for i in rows) / len(rows) for k, v in columns.items()}}
            for name, rows in sorted(strata.items())}
