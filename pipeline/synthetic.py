"""Synthetic problems with worked solutions, generated in code: tasks small models can learn offline.

- ``arithmetic``: sums of single digits ("3+4=?"), for the tiny CPU demo and the tests;
- ``word_problems``: GSM8K-style multi-step word problems (a person, a count of things, a few events that
  add, remove, multiply or share them), each solved step by step in GSM8K's style, one equation per step,
  ending in the final answer. They keep GSM8K's shape (reading a story, chaining 2-4 operations) at a scale
  where a ~100M model trained for minutes on one GPU has something to learn in GRPO.

In both, a fraction ``boxed`` of the solutions end in ``\\boxed{}`` and the others in "Answer: X": a model
distilled on the mix writes either, and a strict boxed-answer reward has a format to learn besides the
answer.
"""

from __future__ import annotations

import random
from collections import Counter

NAMES = ["Mia", "Liam", "Ava", "Noah", "Emma", "Omar", "Sofia", "Ken", "Lena", "Ravi", "Zoe", "Ben"]
THINGS = ["apples", "marbles", "stickers", "books", "cookies", "pencils", "shells", "cards", "coins", "eggs"]
CONTAINERS = ["bags", "boxes", "packs", "jars", "baskets"]
FRIENDS = ["a friend", "her brother", "his sister", "a neighbour", "the teacher"]


def _final(answer: int | str, boxed: float, rng: random.Random) -> str:
    return f"\\boxed{{{answer}}}" if boxed >= 1 or rng.random() < boxed else f"Answer: {answer}"


def arithmetic_records(n: int, seed: int = 0, terms: int = 3, boxed: float = 1.0) -> list[dict]:
    """Sums of ``terms`` single digits with a short worked solution."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        xs = [rng.randint(0, 9) for _ in range(terms)]
        partial, steps = xs[0], []
        for x in xs[1:]:
            steps.append(f"{partial}+{x}={partial + x}")
            partial += x
        records.append({"id": f"arith-{seed}-{i}", "problem": "+".join(map(str, xs)) + "=?",
                        "answer": str(partial), "solution": ", ".join(steps) + f". {_final(partial, boxed, rng)}"})
    return records


def _event(rng: random.Random, name: str, count: int, thing: str) -> tuple[str, str, int]:
    """One event of a story: (sentence of the problem, step of the solution, new count)."""
    divisors = [d for d in range(2, 7) if count % d == 0]
    kinds = ["buy", "pack", "find"] + (["give", "use"] if count > 1 else []) + (["share"] if divisors else [])
    kind = rng.choice(kinds)
    if kind == "buy":
        x = rng.randint(2, 20)
        return (f"{name} buys {x} more {thing}.", f"After buying {x} more, {name} has {count}+{x}={count + x}.",
                count + x)
    if kind == "find":
        x = rng.randint(2, 9)
        return (f"{name} finds {x} times as many {thing} as {name} already has and keeps them all.",
                f"{name} finds {count}*{x}={count * x}, so {name} has {count}+{count * x}={count + count * x}.",
                count + count * x)
    if kind == "pack":
        a, b = rng.randint(2, 6), rng.randint(2, 9)
        container = rng.choice(CONTAINERS)
        return (f"{name} gets {a} {container} with {b} {thing} in each.",
                f"The {container} hold {a}*{b}={a * b}, so {name} has {count}+{a * b}={count + a * b}.",
                count + a * b)
    if kind in ("give", "use"):
        x = rng.randint(1, count - 1)
        verb = f"gives {x} {thing} to {rng.choice(FRIENDS)}" if kind == "give" else f"uses up {x} {thing}"
        return f"{name} {verb}.", f"Then {name} has {count}-{x}={count - x}.", count - x
    d = rng.choice(divisors)
    return (f"{name} shares them equally among {d} people, {name} included, and keeps one share.",
            f"One share is {count}/{d}={count // d}.", count // d)


def word_problem_records(n: int, seed: int = 0, steps: int = 3, max_steps: int | None = None,
                         boxed: float = 1.0, spread: float = 1.0) -> list[dict]:
    """GSM8K-style problems with ``steps`` events after the starting count (a number drawn from
    ``steps..max_steps`` per problem when ``max_steps`` is given); answers stay below 1,000. ``spread``: the largest
    share of the ``n`` problems one answer may take (a problem whose answer has it already is drawn again), so that no
    constant answer scores more than that on the set, nor earns more than that share of a reward in training."""
    max_steps = steps if max_steps is None else max_steps
    if not 1 <= steps <= max_steps:
        raise ValueError(f"word problems need 1 <= steps <= max_steps, got steps={steps}, max_steps={max_steps}")
    if not 0 < spread <= 1:
        raise ValueError(f"word problems need 0 < spread <= 1, got spread={spread}")
    cap = max(1, int(spread * n))
    rng = random.Random(seed)
    records, answers = [], Counter()
    while len(records) < n:
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        count = rng.randint(2, 30)
        story, solution = [f"{name} has {count} {thing}."], []
        for _ in range(rng.randint(steps, max_steps)):
            sentence, step, count = _event(rng, name, count, thing)
            story.append(sentence)
            solution.append(step)
        if count >= 1000 or answers[count] >= cap:
            continue
        answers[count] += 1
        story.append(f"How many {thing} does {name} have now?")
        solution.append(f"{name} has {count} {thing} now. {_final(count, boxed, rng)}")
        records.append({"id": f"word-{seed}-{len(records)}", "problem": " ".join(story),
                        "answer": str(count), "solution": " ".join(solution)})
    return records


BUILTINS = {
    "arithmetic": (arithmetic_records, {"n": int, "terms": int, "boxed": float}),
    "word_problems": (word_problem_records, {"n": int, "steps": int, "max_steps": int, "boxed": float,
                                             "spread": float}),
}
