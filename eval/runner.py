"""The evaluation runner: generate (resumably), score, summarise, report.

Every finished generation is appended to ``<output_dir>/generations/<benchmark>.jsonl`` at once, so an
interrupted run resumes where it stopped: finished (problem, sample) pairs are never generated again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

from rewards.verify import MathVerifier

from .benchmarks import PAPER_BENCHMARKS, Problem, default_repeats, load_problems
from .generation import INSTRUCTION, GenerationBackend, HFGenerateBackend, SamplingConfig, build_prompt
from .jsonl import read_jsonl, repair_tail
from .metrics import cluster_answers, summarize
from .report import write_reports


def read_generations(path: Path) -> list[dict]:
    """Records of a generations file (see :mod:`eval.jsonl`)."""
    return read_jsonl(path)


class GenerationLog:
    """Append-only JSONL of generations, flushed and fsynced as it grows."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        repair_tail(path)
        self.records = read_generations(path)
        self.done = {(r["problem_id"], r["sample"]) for r in self.records}
        self._handle = path.open("a", encoding="utf-8")
        self._last_sync = time.monotonic()

    def append(self, record: dict) -> None:
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()
        if time.monotonic() - self._last_sync > 5:
            os.fsync(self._handle.fileno())
            self._last_sync = time.monotonic()
        self.records.append(record)
        self.done.add((record["problem_id"], record["sample"]))

    def close(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()


def request_seed(seed: int, problem_index: int, sample: int) -> int:
    """Consecutive samples of a problem get consecutive seeds (so an engine can fork them)."""
    return (seed * 1_000_003 + problem_index * 100_003 + sample) % (2**31 - 1)


def generate_benchmark(name: str, problems: list[Problem], repeats: int, backend: GenerationBackend, tokenizer,
                       sampling: SamplingConfig, log: GenerationLog, progress: bool = True,
                       instruction: str = INSTRUCTION, shard: tuple[int, int] = (0, 1)) -> None:
    """Generates every (problem, sample) of this shard that the log does not hold yet."""
    index, count = shard
    todo = [(i, p, s) for i, p in enumerate(problems) for s in range(repeats)
            if (i * repeats + s) % count == index and (p.id, s) not in log.done]
    if not todo:
        return
    prompts = [build_prompt(tokenizer, p.problem, instruction) for _, p, _ in todo]
    seeds = [request_seed(sampling.seed, i, s) for i, _, s in todo]
    bar = tqdm(total=len(todo), desc=f"{name}", unit="gen", disable=not progress, dynamic_ncols=True)
    tokens, start = 0, time.perf_counter()
    for index, completion in backend.generate(prompts, sampling, seeds):
        _, problem, sample = todo[index]
        log.append({"benchmark": name, "problem_id": problem.id, "sample": sample, "text": completion.text,
                    "num_tokens": completion.num_tokens, "finish_reason": completion.finish_reason})
        tokens += completion.num_tokens
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    bar.close()


def score_benchmark(problems: list[Problem], records: list[dict], repeats: int, verifier: MathVerifier,
                    seed: int = 0, missing_votes: bool = False) -> dict:
    """Metrics of one benchmark's generations; ``missing_votes``: see :func:`~eval.metrics.cluster_answers`."""
    by_key = {(r["problem_id"], r["sample"]): r for r in records}
    missing = [(p.id, s) for p in problems for s in range(repeats) if (p.id, s) not in by_key]
    if missing:
        raise RuntimeError(f"{len(missing)} generations missing, e.g. {missing[:3]}")
    ordered = [by_key[(p.id, s)] for p in problems for s in range(repeats)]
    golds = [p.answer for p in problems for _ in range(repeats)]
    scores, stats, answers = verifier.score([r["text"] for r in ordered], golds)

    # maj@k clusters: distinct answers of one problem merged when math-verify calls them equal
    pairs, per_problem = [], []
    for i in range(len(problems)):
        chunk = answers[i * repeats:(i + 1) * repeats]
        distinct = list(dict.fromkeys("".join(a.split()) for a in chunk if a))
        per_problem.append((chunk, distinct))
        pairs += [(a, b) for j, a in enumerate(distinct) for b in distinct[:j]]
    verdicts = dict(zip(pairs, verifier.pool.map(pairs))) if pairs else {}
    rows = []
    for i, (chunk, distinct) in enumerate(per_problem):
        def equivalent(a, b):
            key = ("".join(a.split()), "".join(b.split()))
            verdict = verdicts.get(key) or verdicts.get(key[::-1])
            return bool(verdict and verdict.correct)
        sl = slice(i * repeats, (i + 1) * repeats)
        rows.append({
            "correct": [bool(s) for s in scores[sl]],
            "clusters": cluster_answers(chunk, equivalent, missing_votes),
            "lengths": [r["num_tokens"] for r in ordered[sl]],
            "truncated": [r["finish_reason"] == "length" for r in ordered[sl]],
        })
    summary = summarize(rows, seed=seed)
    summary["reward_stats"] = stats.as_dict()
    summary["per_problem"] = [{"id": p.id, "accuracy": acc, "answers": answers[i * repeats:(i + 1) * repeats]}
                              for i, (p, acc) in enumerate(zip(problems, summary.pop("per_problem_accuracy")))]
    return summary


def _repeats(name: str, n) -> int:
    return n.get(name, default_repeats(name)) if isinstance(n, dict) else (n or default_repeats(name))


def _log_path(output_dir: Path, name: str, shard: tuple[int, int]) -> Path:
    stem = Path(name).stem
    return output_dir / "generations" / (f"{stem}.jsonl" if shard[1] == 1 else f"{stem}.shard{shard[0]}of{shard[1]}.jsonl")


def _load_model(model, tokenizer):
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import sse_model  # noqa: F401 - registers the SSE architectures with the Auto classes

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
        model = AutoModelForCausalLM.from_pretrained(model)
    if tokenizer is None:
        raise ValueError("pass the tokenizer with an in-memory model")
    return model, tokenizer


def generate(
    model,
    tokenizer=None,
    benchmarks=PAPER_BENCHMARKS,
    n: int | dict[str, int] | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    output_dir: str | Path = "eval_results",
    backend: GenerationBackend | None = None,
    limit: int | None = None,
    field_map: dict[str, str] | None = None,
    instruction: str = INSTRUCTION,
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
) -> None:
    """Generation only, for one shard of the (problem, sample) pairs; resumable."""
    output_dir = Path(output_dir)
    model, tokenizer = _load_model(model, tokenizer)
    backend = backend or HFGenerateBackend(model.eval(), tokenizer)
    for name in benchmarks:
        problems = load_problems(name, field_map=field_map, limit=limit)
        log = GenerationLog(_log_path(output_dir, name, shard))
        try:
            generate_benchmark(name, problems, _repeats(name, n), backend, tokenizer, sampling, log, progress,
                               instruction, shard)
        finally:
            log.close()


def score(
    output_dir: str | Path,
    benchmarks=PAPER_BENCHMARKS,
    n: int | dict[str, int] | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    limit: int | None = None,
    verifier: MathVerifier | None = None,
    field_map: dict[str, str] | None = None,
) -> dict:
    """Scores every generation file (all shards) and writes summary.json, results.md and results.png."""
    output_dir = Path(output_dir)
    own_verifier = verifier is None
    verifier = verifier or MathVerifier()
    summary: dict = {"sampling": vars(sampling), "benchmarks": {}}
    try:
        for name in benchmarks:
            stem = Path(name).stem
            records = [r for path in sorted((output_dir / "generations").glob(f"{stem}*.jsonl"))
                       for r in read_generations(path)]
            problems = load_problems(name, field_map=field_map, limit=limit)
            summary["benchmarks"][name] = score_benchmark(problems, records, _repeats(name, n), verifier, sampling.seed)
    finally:
        if own_verifier:
            verifier.close()
    write_reports(summary, output_dir)
    return summary


def evaluate(
    model,
    tokenizer=None,
    benchmarks: list[str] | tuple[str, ...] = PAPER_BENCHMARKS,
    n: int | dict[str, int] | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    output_dir: str | Path = "eval_results",
    backend: GenerationBackend | None = None,
    limit: int | None = None,
    verifier: MathVerifier | None = None,
    field_map: dict[str, str] | None = None,
    progress: bool = True,
    instruction: str = INSTRUCTION,
) -> dict:
    """Evaluates ``model`` (a model object or a local path / hub name) on ``benchmarks``.

    ``n``: samples per problem (one number, a per-benchmark dict, or None for each benchmark's default).
    Writes ``generations/*.jsonl``, ``summary.json``, ``results.md`` and ``results.png`` to ``output_dir``
    and returns the summary."""
    generate(model, tokenizer, benchmarks, n, sampling, output_dir, backend, limit, field_map, instruction,
             progress=progress)
    return score(output_dir, benchmarks, n, sampling, limit, verifier, field_map)
