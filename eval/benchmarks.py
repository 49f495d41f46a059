"""The benchmark registry and problem loading (packaged JSONL, local JSONL/JSON/parquet, or a hub dataset)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.files import read_records

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Benchmark:
    name: str
    file: str
    repeats: int  # default number of samples per problem (avg@repeats)
    description: str
    source: str
    answer_field: str = "answer"
    problem_field: str = "problem"
    id_field: str = "id"


# Sources and licenses: eval/data/README.md. Repeats: 32 where the sets are small and the variance large
# (the SSE paper's AIME setting, avg@32); 4 for the larger MATH500 and OlympiadBench. Recipes override them.
BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("aime24", "aime24.jsonl", 32, "AIME 2024 I and II (30)", "QwenLM/Qwen2.5-Math"),
        Benchmark("aime25", "aime25.jsonl", 32, "AIME 2025 I and II (30)", "Zhuofeng-Li/math-evaluation-harness"),
        Benchmark("math500", "math500.jsonl", 4, "MATH500 subset of the MATH test set (500)", "agentica-project/rllm"),
        Benchmark("amc23", "amc23.jsonl", 32, "AMC 2023 (40)", "QwenLM/Qwen2.5-Math"),
        Benchmark("olympiadbench", "olympiadbench.jsonl", 4, "OlympiadBench, English text-only math (675)",
                  "QwenLM/Qwen2.5-Math"),
        Benchmark("gsm8k", "gsm8k_test.jsonl", 1, "GSM8K test (1319)", "QwenLM/Qwen2.5-Math"),
        Benchmark("arithmetic", "arithmetic.jsonl", 4, "synthetic a+b sums for the CPU demo (200)",
                  "pipeline.synthetic.arithmetic_records(200, seed=12345, terms=2)"),
        Benchmark("word_problems", "word_problems.jsonl", 4, "synthetic GSM8K-style word problems (300; its templates "
                  "are the training generator's and 26 answers are 1: superseded by word_problems_test)",
                  "pipeline.synthetic.word_problem_records(300, seed=12345, steps=2, max_steps=3)"),
        # four events a story, which no recipe trains on (1-3), no answer above 1% of the set: a held-out structure
        # that a constant guess cannot game; the validation set chooses settings, the test set scores frozen recipes
        Benchmark("word_problems_val", "word_problems_val.jsonl", 4, "synthetic word problems of 4 steps, validation "
                  "(500)", "pipeline.synthetic.word_problem_records(500, seed=20261129, steps=4, spread=0.01)"),
        Benchmark("word_problems_test", "word_problems_test.jsonl", 4, "synthetic word problems of 4 steps, test "
                  "(1000)", "pipeline.synthetic.word_problem_records(1000, seed=20261128, steps=4, spread=0.01)"),
    )
}
PAPER_BENCHMARKS = ("aime24", "aime25", "math500", "amc23", "olympiadbench")


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str
    solution: str | None = None  # a worked solution where the set has one (eval.worked_steps reads its steps)


def _to_problems(records, problem_field: str, answer_field: str, id_field: str | None) -> list[Problem]:
    """``records``: ``(place, record)`` pairs. A missing or empty problem or answer is an error naming its place:
    an empty gold answer would score every completion wrong without a word."""
    problems = []
    for i, (place, record) in enumerate(records):
        for field in (problem_field, answer_field):
            if field not in record or record[field] is None:
                raise ValueError(f"{place}: no field {field!r} (fields: {sorted(record)})")
            if not str(record[field]).strip():
                raise ValueError(f"{place}: field {field!r} is empty")
        pid = str(record.get(id_field, i)) if id_field else str(i)
        solution = record.get("solution")
        problems.append(Problem(pid, str(record[problem_field]), str(record[answer_field]),
                                solution if isinstance(solution, str) else None))
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        where = records[0][0].rsplit(":", 1)[0] if records else "records"
        raise ValueError(f"{where}: problem ids are not unique")
    return problems


def load_problems(
    name_or_path: str,
    field_map: dict[str, str] | None = None,
    limit: int | None = None,
    split: str = "test",
) -> list[Problem]:
    """Problems of a registered benchmark, a local JSONL/JSON/parquet file, or a Hugging Face hub dataset.

    ``field_map`` maps ``problem``/``answer``/``id`` to the source's field names, e.g.
    ``{"problem": "question", "answer": "final_answer"}``."""
    fields = {"problem": "problem", "answer": "answer", "id": "id", **(field_map or {})}
    if name_or_path in BENCHMARKS:
        bench = BENCHMARKS[name_or_path]
        path = DATA_DIR / bench.file
        problems = _to_problems(read_records(path), bench.problem_field, bench.answer_field, bench.id_field)
    elif Path(name_or_path).exists():
        path = Path(name_or_path)
        problems = _to_problems(read_records(path), fields["problem"], fields["answer"], fields["id"])
    else:
        try:
            import datasets

            dataset = datasets.load_dataset(name_or_path, split=split)
        except Exception as err:  # noqa: BLE001 - report what was tried
            raise ValueError(
                f"{name_or_path!r} is not a registered benchmark ({sorted(BENCHMARKS)}), not a local file, and "
                f"could not be loaded from the Hugging Face hub: {err}"
            ) from err
        id_field = fields["id"] if fields["id"] in dataset.column_names else None
        problems = _to_problems([(f"{name_or_path}: row {i}", r) for i, r in enumerate(dataset)],
                                fields["problem"], fields["answer"], id_field)
    if not problems:
        raise ValueError(f"{name_or_path}: no problems in it")
    return problems[:limit] if limit is not None else problems


def default_repeats(name: str) -> int:
    return BENCHMARKS[name].repeats if name in BENCHMARKS else 1
