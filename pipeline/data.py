"""Datasets of the stages: chat-formatted reasoning traces (distill) and prompts with answers (GRPO).

Sources (a :class:`~pipeline.recipe.DataSpec`): ``builtin:arithmetic`` or ``builtin:word_problems``
(synthetic problems with worked solutions, :mod:`pipeline.synthetic`), a packaged set (``pipeline/train_data``: ``math_train``,
``gsm8k_train``; ``eval/data``: ``aime_1983_2023``, ``gsm8k_test``, ...), a local JSONL/JSON/parquet file, or a Hugging Face hub name
(e.g. ``open-r1/OpenR1-Math-220k``) where the hub is reachable.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

from datasets import Dataset

from common.files import read_records
from common.generation import INSTRUCTION, user_message
from eval.benchmarks import DATA_DIR

from .recipe import DataSpec
from .synthetic import BUILTINS

logger = logging.getLogger(__name__)
TRAIN_DATA = Path(__file__).resolve().parent / "train_data"
# the packaged sets by name: the training sets and the benchmarks (a benchmark may serve as training data too)
PACKAGED = {p.stem: p for folder in (DATA_DIR, TRAIN_DATA) for p in folder.glob("*.jsonl")}


def builtin_records(source: str, spec: DataSpec) -> list[dict]:
    """``builtin:arithmetic?terms=2&boxed=0.5&n=1000`` or ``builtin:word_problems?steps=2&max_steps=4``
    (all parameters optional; see :mod:`pipeline.synthetic`)."""
    kind, _, query = source[len("builtin:"):].partition("?")
    if kind not in BUILTINS:
        raise ValueError(f"data source {source!r}: unknown builtin {kind!r} (available: {', '.join(BUILTINS)})")
    make, known = BUILTINS[kind]
    params = {}
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key not in known:
            raise ValueError(f"data source {source!r}: unknown parameter {key!r} (known: {sorted(known)})")
        try:
            params[key] = known[key](value)
        except ValueError:
            raise ValueError(f"data source {source!r}: {key}={value!r} is not a valid {known[key].__name__}")
    n = params.pop("n", spec.max_samples or 2000)
    try:
        return make(n, seed=spec.seed, **params)
    except ValueError as err:
        raise ValueError(f"data source {source!r}: {err}") from err


SPLIT = re.compile(r"(\w+)(?:\[(-?\d*)(%?):(-?\d*)(%?)\])?")


def split_slice(split: str, size: int) -> slice:
    """Which of a file's ``size`` records a split names, as the ``datasets`` library reads a hub dataset's
    (``train``, ``train[:-500]``, ``train[-500:]``, ``train[:90%]``): a file holds one split, ``train``, and a
    slice of it keeps a validation part apart from the training part."""
    match = SPLIT.fullmatch(split.replace(" ", ""))
    if match is None or match.group(1) != "train":
        raise ValueError(f"split {split!r}: a file holds one split, 'train'; take a part of it as 'train[:-500]', "
                         f"'train[-500:]' or 'train[:90%]'")
    _, start, start_pct, stop, stop_pct = match.groups()

    def bound(value: str, pct: str) -> int | None:
        if not value:
            return None
        return round(int(value) * size / 100) if pct else int(value)

    return slice(bound(start, start_pct), bound(stop, stop_pct))


def check_split(spec: DataSpec) -> None:
    """A generator's or a file's split as :func:`_load_records` reads it (a hub dataset's splits are its own)."""
    if spec.source.startswith("builtin:"):
        if spec.split != "train":
            raise ValueError(f"split {spec.split!r}: a builtin generator has no splits (another seed draws other "
                             f"problems)")
    elif spec.source in PACKAGED or Path(spec.source).exists():
        split_slice(spec.split, 1)


def _load_records(spec: DataSpec) -> list[dict]:
    source = spec.source
    try:
        check_split(spec)
    except ValueError as err:
        raise ValueError(f"data source {source!r}: {err}") from None
    if source.startswith("builtin:"):
        return builtin_records(source, spec)
    if source in PACKAGED or Path(source).exists():
        records = [record for _, record in read_records(PACKAGED.get(source) or Path(source))]
        return records[split_slice(spec.split, len(records))]
    try:
        import datasets

        return list(datasets.load_dataset(source, split=spec.split))
    except Exception as err:  # noqa: BLE001 - name what was tried
        raise ValueError(f"data source {source!r}: not builtin, not packaged ({sorted(PACKAGED)}), not a local "
                         f"file, and not loadable from the Hugging Face hub: {err}") from err


def _field(record: dict, spec: DataSpec, name: str, index: int):
    """``record``'s field ``name`` (mapped by ``data.fields``); missing or blank is an error naming the record: an
    empty answer would score every completion wrong without a word (evaluation refuses it too)."""
    key = spec.fields.get(name, name)
    if key not in record or record[key] is None:
        raise ValueError(f"data source {spec.source!r}: record {index} has no field {key!r} "
                         f"(fields: {sorted(record)}); map it with data.fields.{name}")
    if not str(record[key]).strip():
        raise ValueError(f"data source {spec.source!r}: record {index}: field {key!r} is empty")
    return record[key]


def _subsample(records: list[dict], spec: DataSpec) -> list[dict]:
    if spec.max_samples is not None and len(records) > spec.max_samples:
        records = random.Random(spec.seed).sample(records, spec.max_samples)
    return records


GSM8K_ANNOTATION = re.compile(r"<<[^>]*>>")  # a GSM8K calculator annotation, <<16-3-4=9>>
GSM8K_CLOSING = re.compile(r"\n?####\s*(.+?)\s*$")  # its closing answer line, #### 18


def gsm8k_as_trained(solution: str, answer: str | None = None) -> str:
    """A GSM8K worked solution as distillation's rows have it (``gsm8k_train``): calculator annotations removed, the
    closing ``#### N`` as ``The answer is \\boxed{N}.``, N the closing's number without thousands separators unless
    ``answer`` is given."""
    closing = GSM8K_CLOSING.search(solution)
    if closing is None:
        raise ValueError(f"not a GSM8K solution (no closing '#### N' line): {solution[-80:]!r}")
    answer = closing.group(1).replace(",", "") if answer is None else answer
    body = GSM8K_CLOSING.sub("", GSM8K_ANNOTATION.sub("", solution)).rstrip()
    return f"{body}\nThe answer is \\boxed{{{answer}}}."


def sft_dataset(spec: DataSpec, instruction: str = INSTRUCTION) -> Dataset:
    """A conversational prompt-completion dataset: ``prompt`` (user problem + instruction) and ``completion``
    (the assistant's solution), so the loss covers the completion whatever the tokenizer's chat template (TRL's
    assistant-only loss needs ``{% generation %}`` markers that real templates lack). Records that hold
    ``messages`` are split before their last message, which must be the assistant's. ``spec.mix`` adds rows."""
    return Dataset.from_list(_mixed(spec, _sft_rows, instruction))


def _mixed(spec: DataSpec, rows_of, instruction: str) -> list[dict]:
    """``rows_of(spec)`` followed by the rows of every dataset ``spec.mix`` names (each read with its own spec)."""
    return rows_of(spec, instruction) + [row for m in spec.mix for row in _mixed(m, rows_of, instruction)]


def _sft_rows(spec: DataSpec, instruction: str) -> list[dict]:
    records = _subsample(_load_records(spec), spec)
    rows = []
    for i, record in enumerate(records):
        key = spec.fields.get("messages", "messages")
        if key in record:
            messages = record[key]
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError(f"data source {spec.source!r}, record {i}: {key!r} must end with an assistant message")
            rows.append({"prompt": messages[:-1], "completion": messages[-1:]})
            continue
        problem = _field(record, spec, "problem", i)
        solution = _field(record, spec, "solution", i)
        rows.append({"prompt": [user_message(str(problem), instruction)],
                     "completion": [{"role": "assistant", "content": str(solution)}]})
    if not rows:
        raise ValueError(f"data source {spec.source!r} is empty")
    return rows


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` through the chat template, as distillation tokenises a conversation."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def drop_overlong(dataset: Dataset, tokenizer, max_length: int) -> tuple[Dataset, int]:
    """The conversations that fit ``max_length`` tokens (chat template applied), and how many were dropped.

    TRL truncates only when packing (and then cuts a reasoning trace before its answer); an over-long
    record in a padding-free batch would otherwise reach the model whole (one 300 KB record took a worker past
    9 GB). Dropped in every mode, and counted."""
    def length(batch):
        texts = [tokenizer.apply_chat_template(p + c, tokenize=False)
                 for p, c in zip(batch["prompt"], batch["completion"])]
        return {"num_tokens": [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]}

    sized = dataset.map(length, batched=True, desc="measuring lengths")
    keep = [i for i, n in enumerate(sized["num_tokens"]) if n <= max_length]
    dropped = len(dataset) - len(keep)
    if dropped:
        longest = max(sized["num_tokens"])
        logger.warning("distill: dropped %d of %d records longer than max_length=%d tokens (longest %d)",
                       dropped, len(dataset), max_length, longest)
    if not keep:
        raise ValueError(f"every record is longer than distill.max_length={max_length} tokens")
    return dataset.select(keep), dropped


def prompt_dataset(spec: DataSpec, instruction: str = INSTRUCTION) -> Dataset:
    """A GRPO dataset: conversational ``prompt`` and the ground-truth ``answer`` (``spec.mix`` adds rows)."""
    return Dataset.from_list(_mixed(spec, _prompt_rows, instruction))


def _prompt_rows(spec: DataSpec, instruction: str) -> list[dict]:
    records = _subsample(_load_records(spec), spec)
    rows = [{"prompt": [user_message(str(_field(r, spec, "problem", i)), instruction)],
             "answer": str(_field(r, spec, "answer", i))} for i, r in enumerate(records)]
    if not rows:
        raise ValueError(f"data source {spec.source!r} is empty")
    return rows
