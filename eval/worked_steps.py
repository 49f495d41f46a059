"""How far completions get through a problem's worked solution, step by step: a measure that moves where accuracy
sits at the floor.

A worked solution of the synthetic word problems (``pipeline.synthetic``) or of GSM8K states each step as an
equation (``28*4=112``, ``28+112=140``); so do the models' completions. Per completion: the equations it states
(whole numbers and ``+ - * x /``, ``/`` a whole share), the share of them whose arithmetic is right, and the share
of the worked solution's intermediate results it reaches by a right equation (its plan, as far as it got). A model
that learns to reason through such problems reaches more steps with right arithmetic before it answers more of them
right. Given each completion's grade, also the share right by every step: answered right having reached every
intermediate result by a right equation, an accuracy no guess earns (a right answer reached by wrong steps, or
without any, does not count). The evaluation reports them for a benchmark whose every worked solution states an
equation, the word problems (66 of GSM8K test's 1,319 state none; ``eval.runner.score_benchmark``); ``python -m
benchmarks.pipeline.word_problem_steps`` reads them from generations.
"""

from __future__ import annotations

import re

# an expression of whole numbers (not the tail of a decimal or of a longer number) = a whole number
EQUATION = re.compile(r"(?<!\d)(?<!\d\.)(\d+(?:\s*[-+*/x×]\s*\d+)+)\s*=\s*(\d+)(?!\d|\.\d)")


def value(expression: str) -> int | None:
    """A whole-number expression's value, products and shares before sums, a share whole (``57/3`` is 19, ``7/2``
    3); None where it divides by zero."""
    tokens = re.findall(r"\d+|[-+*/x×]", expression)
    terms, signs = [int(tokens[0])], []
    for op, number in zip(tokens[1::2], map(int, tokens[2::2])):
        if op in "+-":
            terms.append(number)
            signs.append(op)
        elif op == "/":
            if number == 0:
                return None
            terms[-1] //= number
        else:
            terms[-1] *= number
    return terms[0] + sum(t if sign == "+" else -t for sign, t in zip(signs, terms[1:]))


def equations(text: str) -> list[tuple[int, bool]]:
    """Each ``expression = result`` in ``text``: its stated result and whether it is right."""
    return [(int(m[2]), value(m[1]) == int(m[2])) for m in EQUATION.finditer(text)]


def completion_steps(completion: str, solution: str) -> dict:
    """One completion against a worked ``solution``: its equations, the right ones, and the share of the
    solution's results it reaches by a right equation."""
    stated = equations(completion)
    plan = [c for c, _ in equations(solution)]
    reached = {c for c, right in stated if right}
    return {"equations": len(stated), "right": sum(r for _, r in stated),
            "reached": sum(c in reached for c in plan) / len(plan) if plan else 0.0}


def written_in_steps(solutions: list[str | None]) -> bool:
    """Whether every worked solution states its steps as equations (the word problems; not MATH's)."""
    return all(s and equations(s) for s in set(solutions))


def worked_steps(completions: list[str], solutions: list[str | None], right: list[bool] | None = None) -> dict | None:
    """The averages over ``completions`` (each beside its problem's worked solution): equations a completion, the
    share of all stated equations that are right, the share of worked steps reached, and with ``right`` (each
    completion's grade) the share right by every step; None when a worked solution states no equation or is missing
    (a benchmark whose solutions are not written in steps)."""
    if not completions or not written_in_steps(solutions):
        return None
    rows = [completion_steps(c, s) for c, s in zip(completions, solutions, strict=True)]
    stated = sum(r["equations"] for r in rows)
    steps = {"equations": stated / len(rows), "arithmetic": sum(r["right"] for r in rows) / stated if stated else 0.0,
             "reached": sum(r["reached"] for r in rows) / len(rows)}
    if right is not None:
        steps["right_by_every_step"] = sum(_every_step(rows, right)) / len(rows)
    return steps


def right_by_every_step(completions: list[str], solutions: list[str], right: list[bool]) -> list[bool]:
    """Per completion (beside its worked solution and its grade): answered right having reached every worked step
    by a right equation; the evaluation keeps each problem's share, for compare's paired changes."""
    return _every_step([completion_steps(c, s) for c, s in zip(completions, solutions, strict=True)], right)


def _every_step(rows: list[dict], right: list[bool]) -> list[bool]:
    """Each completion's :func:`completion_steps` row and grade: right, and every worked step reached."""
    return [ok and r["reached"] == 1.0 for ok, r in zip(right, rows, strict=True)]
