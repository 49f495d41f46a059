"""Builds ``grader_cases.jsonl``: labelled (completion, gold, expected verdict) cases taken from public grader
test suites, each with its source, for ``python -m benchmarks.rewards.graders``.

    git clone https://github.com/huggingface/Math-Verify /tmp/Math-Verify
    git clone https://github.com/NVIDIA/NeMo-Skills /tmp/NeMo-Skills
    python scripts/build_grader_cases.py /tmp/Math-Verify /tmp/NeMo-Skills > rewards/data/grader_cases.jsonl

Sources:
- Math-Verify's regression tests (MIT License, Copyright (c) 2024 The HuggingFace Team), which collect model
  outputs that graders got wrong. Kept: the parametrized cases whose test compares with math-verify's default
  behaviour (LaTeX and/or expression extraction, default precision, no relation/set or strictness overrides);
  each case's kind is its test's name.
- NeMo-Skills' ``math_equal`` tests (Apache License 2.0, Copyright (c) 2024 NVIDIA CORPORATION): answer pairs
  that must (or must not) be equal, in both orders; the prediction is given as a boxed completion.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

FILES = ["tests/test_all.py", "tests/test_boxed.py", "tests/test_numina_cases.py", "tests/test_open_thoughts.py",
         "tests/test_yujianll.py"]
SKIP = {"test_number_extraction",  # expression-only extraction
        "test_complex_math_expressions", "test_float_precision", "test_sqrt_precision", "test_symbols",  # precision
        "test_set_rel_assymetry"}  # relation/set comparison flags


def cases(repo: Path):
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for name in FILES:
        tree = ast.parse((repo / name).read_text())
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            if fn.name in SKIP:
                continue
            for dec in fn.decorator_list:
                if not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize"):
                    continue
                fields = [f.strip() for f in ast.literal_eval(dec.args[0]).split(",")]
                try:
                    rows = ast.literal_eval(dec.args[1])
                except ValueError:
                    continue
                for row in rows:
                    item = dict(zip(fields, row))
                    expected = item.get("expected", item.get("result"))
                    if "gold" not in item or "pred" not in item or expected not in (0, 1, True, False):
                        continue
                    yield {"kind": fn.name.removeprefix("test_"), "completion": item["pred"], "gold": item["gold"],
                           "expected": bool(expected), "source": f"huggingface/Math-Verify@{commit[:8]}:{name}::{fn.name}"}


def nemo_cases(repo: Path):
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    name = "tests/test_math_equal.py"
    tree = ast.parse((repo / name).read_text())
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        expected = {"test_correct_examples": True, "test_incorrect_examples": False}.get(fn.name)
        for dec in fn.decorator_list:
            if expected is None or not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize"):
                continue
            for pair in dec.args[1].elts:
                try:
                    a, b = ast.literal_eval(pair)
                except ValueError:  # e.g. 5 / 2: an expression, not a literal
                    a, b = eval(compile(ast.Expression(pair), name, "eval"), {})  # noqa: S307 - numbers only
                if a is None or b is None:
                    continue
                for pred, gold in ((a, b), (b, a)):
                    yield {"kind": "nemo_skills_math_equal", "completion": f"\\boxed{{{pred}}}", "gold": str(gold),
                           "expected": expected, "source": f"NVIDIA/NeMo-Skills@{commit[:8]}:{name}::{fn.name}"}


if __name__ == "__main__":
    for case in cases(Path(sys.argv[1])):
        print(json.dumps(case, ensure_ascii=False))
    if len(sys.argv) > 2:
        for case in nemo_cases(Path(sys.argv[2])):
            print(json.dumps(case, ensure_ascii=False))
