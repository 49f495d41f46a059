"""The evaluation runner: generate (resumably), score, summarise, report.

Every finished generation is appended to ``<output_dir>/generations/<benchmark>.jsonl`` at once, so an
interrupted run resumes where it stopped: finished (problem, sample) pairs are never generated again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

from common.files import read_jsonl, repair_tail
from common.generation import INSTRUCTION, request_seed
from rewards.extract import last_boxed
from rewards.verify import MathVerifier

from .baselines import answer_size, by_answer_size, score_baselines
from .benchmarks import PAPER_BENCHMARKS, Problem, default_repeats, load_problems
from .generation import GenerationBackend, HFGenerateBackend, SamplingConfig, build_prompt
from .metrics import cluster_answers, summarize
from .report import write_reports
from .worked_steps import right_by_every_step, worked_steps

BOXED = "\\boxed"  # an instruction that names it asks for boxed answers: their accuracy is the headline


class GenerationSettingsChanged(ValueError):
    pass


def model_identity(model) -> str:
    """What produced a set of generations: a checkpoint directory with a fingerprint of its weight files (so a
    retrained or replaced checkpoint at the same path counts as another model), a hub name, or the name an
    in-memory model was loaded from."""
    if isinstance(model, (str, Path)):
        path = Path(model)
        if not path.exists():
            return str(model)
        path = path.resolve()
        patterns = ("*.safetensors", "*.bin", "*.gguf", "config.json")
        files = [path] if path.is_file() else sorted(f for pattern in patterns for f in path.glob(pattern))
        stamp = ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
        return f"{path} [{hashlib.sha1(stamp.encode()).hexdigest()[:12]}]"
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or "in-memory model"
    return f"{name} (in memory)"


def problem_key(problem: Problem, instruction: str) -> str:
    """A record answers this problem only if the text it was asked is the same."""
    return hashlib.sha1(f"{instruction}\n{problem.problem}".encode()).hexdigest()[:16]


def _settings_path(log_path: Path) -> Path:
    name = log_path.name.split(".shard")[0].removesuffix(".jsonl")
    return log_path.with_name(f"{name}.settings.json")


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two model names (``path [fingerprint]``, :func:`model_identity`) name one model: the same fingerprint
    of weights, wherever the folder lies now (a finished run moved to another folder is the same run). Stored
    models (``uri [stored ...]``) are the same only as the same upload."""
    if a == b:
        return True
    if not a or not b or " [" not in a or " [" not in b or "[stored " in a or "[stored " in b:
        return False
    return a.rsplit(" [", 1)[1] == b.rsplit(" [", 1)[1]


def check_settings(log_path: Path, settings: dict, fresh: bool = False) -> None:
    """Generations in ``log_path`` (and its shards) must come from ``settings``; a mismatch is refused naming
    what differs, or with ``fresh`` the old files are moved aside (never deleted) and generation starts over."""
    path = _settings_path(log_path)
    if path.exists():
        before = json.loads(path.read_text())
        if before.get("model") != settings.get("model") and same_model(before.get("model"), settings.get("model")):
            before["model"] = settings["model"]  # the run moved to another folder: its generations are the model's
            from common.files import atomic_write

            atomic_write(path, json.dumps(before, indent=2))
        diffs = [f"{k}: {before.get(k)!r} -> {settings.get(k)!r}" for k in sorted(set(before) | set(settings))
                 if before.get(k) != settings.get(k)]
        if diffs and not fresh:
            raise GenerationSettingsChanged(
                f"{log_path.parent}: the {settings.get('benchmark')} generations there were made with other settings: "
                + "; ".join(diffs)
                + ". Use another output folder, or regenerate (fresh=True; sse-pipeline: --redo eval)")
        if diffs:
            aside = log_path.parent / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir(parents=True, exist_ok=True)
            stem = path.name.removesuffix(".settings.json")
            olds = list(log_path.parent.glob(f"{stem}.jsonl")) + list(log_path.parent.glob(f"{stem}.shard*.jsonl"))
            for old in olds + [path]:
                old.rename(aside / old.name)
    if not path.exists():
        from common.files import atomic_write

        atomic_write(path, json.dumps(settings, indent=2))


GENERATION_FIELDS = ("problem_id", "sample", "text", "num_tokens", "finish_reason")


def read_generations(path: Path) -> list[dict]:
    """Records of a generations file (see :mod:`common.files`); a record without a field the scoring reads is an
    error naming the file and the field (a KeyError out of the scoring before)."""
    records = read_jsonl(path)
    for i, record in enumerate(records):
        missing = [f for f in GENERATION_FIELDS if f not in record]
        if missing:
            raise ValueError(f"{path}: record {i + 1} has no {', '.join(missing)}; move the file aside and "
                             "generate again (the stage resumes from the records that remain)")
    return records


class GenerationLog:
    """Append-only JSONL of generations, flushed and fsynced as it grows."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        repair_tail(path)
        self.records = read_generations(path)
        self._handle = path.open("a", encoding="utf-8")
        self._last_sync = time.monotonic()

    def append(self, record: dict) -> None:
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()
        if time.monotonic() - self._last_sync > 5:
            os.fsync(self._handle.fileno())
            self._last_sync = time.monotonic()
        self.records.append(record)

    def close(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()


def _current(records: list[dict], problems: list[Problem], instruction: str) -> list[dict]:
    """The records that answer a problem of ``problems`` as it is asked now (same id, same text)."""
    keys = {p.id: problem_key(p, instruction) for p in problems}
    return [r for r in records if r.get("problem_key") is not None
            and r.get("problem_key") == keys.get(r["problem_id"])]


def progress_bar(progress, total: int, desc: str):
    """``progress``: True (a tqdm bar), False (none), or a bar class such as Ray's ``tqdm_ray.tqdm``, whose bars
    refresh in place when the generation runs inside Ray workers."""
    if progress is True or progress is False:
        return tqdm(total=total, desc=desc, unit="gen", disable=not progress, dynamic_ncols=True)
    return progress(total=total, desc=desc, unit="gen")


def fit_prompt(tokenizer, problem: str, instruction: str, max_tokens: int | None) -> tuple[str | None, bool]:
    """The prompt of ``problem`` within ``max_tokens`` tokens: as is, or with the problem text shortened
    (template and instruction kept); ``(None, True)`` if even an empty problem does not fit."""
    prompt = build_prompt(tokenizer, problem, instruction)
    if max_tokens is None:
        return prompt, False
    over = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) - max_tokens
    if over <= 0:
        return prompt, False
    ids = tokenizer(problem, add_special_tokens=False)["input_ids"]
    while over > 0 and ids:
        ids = ids[:max(0, len(ids) - over - 8)]
        prompt = build_prompt(tokenizer, tokenizer.decode(ids), instruction)
        over = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) - max_tokens
    return (prompt, True) if over <= 0 else (None, True)


def generate_benchmark(name: str, problems: list[Problem], repeats: int, backend: GenerationBackend, tokenizer,
                       sampling: SamplingConfig, log: GenerationLog, progress: bool = True,
                       instruction: str = INSTRUCTION, shard: tuple[int, int] = (0, 1),
                       max_prompt_tokens: int | None = None, long_prompts: str = "skip") -> int:
    """Generates every (problem, sample) of this shard that the log does not hold yet for the same problem
    text (a record of a problem whose text changed does not count); returns the tokens it generated. A prompt
    over ``max_prompt_tokens`` is not generated (``long_prompts="skip"``: recorded with finish reason
    ``prompt_too_long``, scored wrong) or has its problem text shortened (``"truncate"``, finish reason of the
    generation kept, ``prompt_truncated``)."""
    if long_prompts not in ("skip", "truncate"):
        raise ValueError(f"long_prompts must be 'skip' or 'truncate', got {long_prompts!r}")
    index, count = shard
    done = {(r["problem_id"], r["sample"]) for r in _current(log.records, problems, instruction)}
    todo, prompts, cut = [], [], set()
    for i, p in enumerate(problems):
        samples = [s for s in range(repeats) if (i * repeats + s) % count == index and (p.id, s) not in done]
        if not samples:
            continue
        prompt, shortened = fit_prompt(tokenizer, p.problem, instruction, max_prompt_tokens)
        if shortened and (long_prompts == "skip" or prompt is None):
            for s in samples:
                log.append({"benchmark": name, "problem_id": p.id, "sample": s, "text": "", "num_tokens": 0,
                            "finish_reason": "prompt_too_long", "problem_key": problem_key(p, instruction)})
            continue
        if shortened:
            cut.add(p.id)
        todo += [(i, p, s) for s in samples]
        prompts += [prompt] * len(samples)
    if not todo:
        return 0
    seeds = [request_seed(sampling.seed, i, s) for i, _, s in todo]
    bar = progress_bar(progress, len(todo), name)
    tokens, start = 0, time.perf_counter()
    for index, completion in backend.generate(prompts, sampling, seeds):
        _, problem, sample = todo[index]
        log.append({"benchmark": name, "problem_id": problem.id, "sample": sample, "text": completion.text,
                    "num_tokens": completion.num_tokens, "finish_reason": completion.finish_reason,
                    "problem_key": problem_key(problem, instruction), "prompt_truncated": problem.id in cut})
        tokens += completion.num_tokens
        bar.update(1)
        rate = f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}"
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(tok_s=rate)
        else:
            bar.set_description(f"{name} ({rate} tok/s)")
    bar.close()
    return tokens


def score_benchmark(problems: list[Problem], records: list[dict], repeats: int, verifier: MathVerifier,
                    seed: int = 0, missing_votes: bool = False, instruction: str | None = None) -> dict:
    """Metrics of one benchmark's generations; ``missing_votes``: see :func:`~eval.metrics.cluster_answers`.
    With ``instruction``, only records of the same problem text count."""
    if instruction is not None:
        records = _current(records, problems, instruction)
    by_key = {(r["problem_id"], r["sample"]): r for r in records}
    missing = [(p.id, s) for p in problems for s in range(repeats) if (p.id, s) not in by_key]
    if missing:
        raise RuntimeError(f"{len(missing)} generations missing, e.g. {missing[:3]}")
    ordered = [by_key[(p.id, s)] for p in problems for s in range(repeats)]
    golds = [p.answer for p in problems for _ in range(repeats)]
    texts = [r["text"] for r in ordered]
    scores, stats, answers = verifier.score(texts, golds)
    # the boxed reading: the last box's answer (as the strict reward reads it), whatever is stated after it
    boxed_scores, _, _ = MathVerifier(pool=verifier.pool, strict=True,
                                      max_answer_chars=verifier.max_answer_chars).score(texts, golds)

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
            "boxed": [last_boxed(r["text"]) is not None for r in ordered[sl]],
            "boxed_correct": [bool(s) for s in boxed_scores[sl]],
        })
    summary = summarize(rows, seed=seed)
    # the headline: where the prompt asks for \boxed{}, the boxed answers alone (the lenient reading beside it)
    asks_boxed = instruction is None or BOXED in instruction
    solutions = [p.solution for p in problems for _ in range(repeats)]
    right = [bool(s) for s in (boxed_scores if asks_boxed else scores)]  # graded as the headline is
    steps = worked_steps(texts, solutions, right)
    if steps is not None:  # every problem's worked solution states its equations: the word problems
        summary["worked_steps"] = steps
        every = right_by_every_step(texts, solutions, right)
    summary["reward_stats"] = stats.as_dict()
    summary["prompts_too_long"] = len({r["problem_id"] for r in ordered if r["finish_reason"] == "prompt_too_long"})
    summary["prompts_truncated"] = len({r["problem_id"] for r in ordered if r.get("prompt_truncated")})
    summary["headline"] = f"{'boxed_' if asks_boxed else ''}avg@{repeats}"
    boxed = summary.pop("per_problem_boxed_accuracy")  # each problem's strict reading, for paired comparisons
    lenient = summary.pop("per_problem_accuracy")
    baselines = score_baselines(problems, verifier)
    best = baselines["best"]
    summary["baselines"] = {**{k: {f: x for f, x in v.items() if f != "per_problem"} for k, v in baselines.items()
                               if k != "best"}, "best": best}
    low = summary[f"{summary['headline']}_ci95"][0]
    summary["beats_baseline"] = low > baselines[best]["accuracy"]  # shown to, at 95%: not a point estimate's lead
    headline = boxed if summary["headline"].startswith("boxed_") else lenient
    summary["by_answer_size"] = by_answer_size(problems, {"accuracy": headline, "lenient_accuracy": lenient,
                                                          "best_baseline": baselines[best]["per_problem"]})
    summary["per_problem"] = [{"id": p.id, "accuracy": lenient[i], "boxed_accuracy": boxed[i],
                               "answer_size": answer_size(p.answer),
                               "baselines": {k: baselines[k]["per_problem"][i] for k in summary["baselines"]
                                             if k != "best"},
                               "answers": answers[i * repeats:(i + 1) * repeats]}
                              for i, p in enumerate(problems)]
    if steps is not None:
        for i, p in enumerate(summary["per_problem"]):
            p["right_by_every_step"] = sum(every[i * repeats:(i + 1) * repeats]) / repeats
    return summary


def _repeats(name: str, repeats) -> int:
    """Samples per problem of a benchmark: one number, a per-benchmark dict, or None for its default."""
    if isinstance(repeats, dict):
        return repeats.get(name, default_repeats(name))
    return repeats or default_repeats(name)


def _log_path(output_dir: Path, name: str, shard: tuple[int, int]) -> Path:
    stem = Path(name).stem
    name = f"{stem}.jsonl" if shard[1] == 1 else f"{stem}.shard{shard[0]}of{shard[1]}.jsonl"
    return output_dir / "generations" / name


def _load_model(model, tokenizer):
    if isinstance(model, (str, Path)):
        from transformers import AutoTokenizer

        from sse_model.checkpoint import load_pretrained

        path = model
        model = load_pretrained(path)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    if tokenizer is None:
        raise ValueError("pass the tokenizer with an in-memory model")
    return model, tokenizer


def generate(
    model,
    tokenizer=None,
    benchmarks=PAPER_BENCHMARKS,
    repeats: int | dict[str, int] | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    output_dir: str | Path = "eval_results",
    backend: GenerationBackend | None = None,
    limit: int | None = None,
    field_map: dict[str, str] | None = None,
    instruction: str = INSTRUCTION,
    shard: tuple[int, int] = (0, 1),
    progress=True,
    model_id: str | None = None,
    fresh: bool = False,
    max_prompt_tokens: int | None = None,
    long_prompts: str = "skip",
) -> int:
    """Generation only, for one shard of the (problem, sample) pairs; resumable; returns the tokens generated.
    Generations already in ``output_dir`` are reused only if the same model (``model_id``, default
    :func:`model_identity`) made them with the same sampling settings and instruction; see :func:`check_settings`."""
    output_dir = Path(output_dir)
    model_id = model_id or model_identity(model)
    model, tokenizer = _load_model(model, tokenizer)
    backend = backend or HFGenerateBackend(model.eval(), tokenizer)
    tokens = 0
    for name in benchmarks:
        problems = load_problems(name, field_map=field_map, limit=limit)
        path = _log_path(output_dir, name, shard)
        check_settings(path, {"benchmark": name, "model": model_id, "sampling": vars(sampling),
                              "instruction": instruction}, fresh=fresh and shard[0] == 0)
        log = GenerationLog(path)
        try:
            tokens += generate_benchmark(name, problems, _repeats(name, repeats), backend, tokenizer, sampling, log,
                                         progress, instruction, shard, max_prompt_tokens, long_prompts)
        finally:
            log.close()
    return tokens


def score(
    output_dir: str | Path,
    benchmarks=PAPER_BENCHMARKS,
    repeats: int | dict[str, int] | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    limit: int | None = None,
    verifier: MathVerifier | None = None,
    field_map: dict[str, str] | None = None,
    instruction: str = INSTRUCTION,
) -> dict:
    """Scores every generation file (all shards) and writes summary.json, results.md and results.png; the
    summary names the model that made the generations."""
    output_dir = Path(output_dir)
    own_verifier = verifier is None
    verifier = verifier or MathVerifier()
    summary: dict = {"sampling": vars(sampling), "benchmarks": {}}
    models = {json.loads(p.read_text()).get("model") for p in (output_dir / "generations").glob("*.settings.json")}
    summary["model"] = ", ".join(sorted(m for m in models if m)) or None
    try:
        for name in benchmarks:
            stem = Path(name).stem
            records = [r for path in sorted((output_dir / "generations").glob(f"{stem}*.jsonl"))
                       for r in read_generations(path)]
            problems = load_problems(name, field_map=field_map, limit=limit)
            summary["benchmarks"][name] = score_benchmark(problems, records, _repeats(name, repeats), verifier,
                                                          sampling.seed, instruction=instruction)
    finally:
        if own_verifier:
            verifier.close()
    write_reports(summary, output_dir)
    return summary


def evaluate(
    model,
    tokenizer=None,
    benchmarks: list[str] | tuple[str, ...] = PAPER_BENCHMARKS,
    repeats: int | dict[str, int] | None = None,
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

    ``repeats``: samples per problem (one number, a per-benchmark dict, or None for each benchmark's default).
    Writes ``generations/*.jsonl``, ``summary.json``, ``results.md`` and ``results.png`` to ``output_dir``
    and returns the summary."""
    generate(model, tokenizer, benchmarks, repeats, sampling, output_dir, backend, limit, field_map, instruction,
             progress=progress)
    return score(output_dir, benchmarks, repeats, sampling, limit, verifier, field_map, instruction)
