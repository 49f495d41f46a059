"""``sse-pipeline loss``: the assistant-token loss of models on worked solutions, the yardstick of conversion.

Each record of a data source (``problem`` + ``solution``, or ``messages``) is formatted exactly as distillation
formats it (the chat template, the recipe's instruction) and scored with teacher forcing: the mean next-token
cross-entropy over the solution's tokens and the fraction predicted top-1. The same records, template and
tokenizer for every model, so the numbers compare a converted model with the Transformer it came from.

A model given as ``LABEL=PATH`` joins the arm ``LABEL``; several paths under one label are independent draws of it
(runs of other seeds). Each arm is a row, its loss the mean over its draws, and its ratio to the first arm comes
with a 95% interval that resamples each arm's draws and the records (``eval.metrics.hierarchical_bootstrap``).
``--scored`` pools what earlier ``--out`` runs wrote (their ``.json``: every record's loss) with the models scored
now, so the draws of an arm may come from several sessions or machines.
``--unigram`` adds the row of a model that reads nothing (:func:`unigram_loss`: the frequencies of the tokens in
``--recipe``'s distillation rows), the table's trivial baseline.
``--as-trained`` scores GSM8K solutions as distillation's rows have them (``pipeline.data.gsm8k_as_trained``): the
same text without the calculator markup that no training row shows.

    sse-pipeline loss Transformer=runs/t0/distill/final Transformer=runs/t1/distill/final \\
        SSE-H=runs/s0/distill/final SSE-H=runs/s1/distill/final --data gsm8k_test --first 1319 --out loss.md
    sse-pipeline loss SSE-H=runs/s2/distill/final --data gsm8k_test --first 1319 --scored loss.json --out loss2.md
    sse-pipeline loss smollm2-135m runs/smollm2-135m/align/final runs/smollm2-135m/distill/final \\
        --data gsm8k_train --first 24 --recipe smollm2-135m
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class LossResult:
    model: str
    loss: float
    accuracy: float
    tokens: int
    records: int
    record_losses: list[float] = field(default_factory=list)  # each record's summed loss: what intervals resample
    record_tokens: list[int] = field(default_factory=list)  # and its scored tokens
    label: str = ""  # the arm this model is a draw of (its name when given alone)
    vocabulary: str = ""  # a digest of the tokenizer's vocabulary: losses per token compare within one


def vocabulary_digest(tokenizer) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


def load_scored(path: str, data: str, split: str, as_trained: bool, records: int,
                solution_field: str = "solution") -> list[LossResult]:
    """The results an earlier ``--out`` wrote beside its table (``.json``), as draws to pool with models scored now:
    draws of one arm from other sessions or machines need no GPU again. Refused unless they scored the same
    records (source, split, field, format, count)."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--scored {path}: {err}") from None
    expected = {"data": data, "split": split, "solution_field": solution_field, "as_trained": as_trained,
                "records": records}
    for key, value in expected.items():
        found = saved.get(key, "solution" if key == "solution_field" else None)  # files before the field: solution
        if found != value:
            raise ValueError(f"--scored {path}: {key} is {found!r}, this table's is {value!r}; only scorings of the "
                             f"same records pool")
    fields = set(LossResult.__dataclass_fields__)
    return [LossResult(**{k: v for k, v in m.items() if k in fields}) for m in saved.get("models", [])]


@dataclass
class Arm:
    """The draws of one setting (one label): rows of the table, resampled together."""
    label: str
    draws: list[LossResult]

    @property
    def loss(self) -> float:
        return sum(d.loss for d in self.draws) / len(self.draws)

    @property
    def accuracy(self) -> float:
        return sum(d.accuracy for d in self.draws) / len(self.draws)


def group(results: list[LossResult]) -> list[Arm]:
    """Results by label, in the order each label first appears. Draws of an arm must score the same tokens (one
    tokenizer), or their mean would mix units."""
    arms: dict[str, Arm] = {}
    for r in results:
        arm = arms.setdefault(r.label or r.model, Arm(r.label or r.model, []))
        if arm.draws and arm.draws[0].tokens != r.tokens:
            raise ValueError(f"{r.model}: {r.tokens} tokens against {arm.draws[0].tokens} for {arm.draws[0].model}, "
                             f"a draw of the same label {arm.label!r}: the draws of a label need one tokenizer")
        arm.draws.append(r)
    return list(arms.values())


def ratio_interval(reference: Arm, arm: Arm, iterations: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% interval of ``arm``'s loss over ``reference``'s, resampling each arm's draws and the records both
    scored. Over one tokenizer every model scores the same tokens of each record, so the ratio of mean summed record
    losses is the ratio of losses per token."""
    from eval.metrics import hierarchical_bootstrap, percentile_interval

    tables = [[dict(enumerate(d.record_losses)) for d in a.draws] for a in (reference, arm)]
    means = hierarchical_bootstrap(tables, iterations=iterations, seed=seed)
    return percentile_interval([b / a for a, b in means])


def encode(tokenizer, row: dict) -> tuple[list[int], int]:
    """``(token ids of the whole conversation, number of ids before the solution)``."""
    from .data import chat_ids

    prompt = chat_ids(tokenizer, row["prompt"], add_generation_prompt=True)
    ids = chat_ids(tokenizer, row["prompt"] + row["completion"])
    if ids[:len(prompt)] != prompt:
        raise ValueError("the chat template does not extend the prompt with the completion; cannot locate the solution")
    return ids, len(prompt)


def packed_reader(model):
    """A transformers Llama/Qwen2 as an all-attention model of this package, which computes what it computes
    (``sse_model.convert``, as distillation's teacher) and reads packed records; any other model as it is."""
    from sse_model import SSEForCausalLM
    from sse_model.convert import convert_to_sse

    if isinstance(model, SSEForCausalLM):
        return model
    try:
        return convert_to_sse(model, mixer_types=["attn"] * model.config.num_hidden_layers)
    except (AttributeError, KeyError, ValueError):  # an architecture conversion does not read: one record a forward
        return model


PACK_TOKENS = 8192  # tokens of records scored in one forward of an SSE model (its logits kept only where scored)


def packs(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive records grouped up to ``budget`` tokens a group (a longer record alone)."""
    groups, size = [], 0
    for i, n in enumerate(lengths):
        if not groups or size + n > budget:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


@torch.no_grad()
def completion_loss(model, tokenizer, dataset, device: torch.device, name: str = "model",
                    pack_tokens: int = PACK_TOKENS, progress: bool = True) -> LossResult:
    """Teacher-forced loss and top-1 accuracy over the completions of ``dataset``, on ``model`` where it is (on
    ``device``). An SSE model reads records packed into rows of up to ``pack_tokens`` (position ids restarting at
    each record: no state or attention crosses one), as distillation reads them; another model (a transformers
    Llama) one record a forward."""
    from tqdm.auto import tqdm

    from sse_model import SSEForCausalLM

    model.eval()
    encoded = [encode(tokenizer, row) for row in dataset]
    budget = pack_tokens if isinstance(model, SSEForCausalLM) else 1
    sums, tokens, correct = [], [], 0
    bar = tqdm(total=len(encoded), desc=f"loss {name}", unit="record", dynamic_ncols=True, mininterval=10,
               disable=not progress)
    for group in packs([len(ids) for ids, _ in encoded], budget):
        records = [encoded[i] for i in group]
        x = torch.tensor([[t for ids, _ in records for t in ids]], device=device)
        positions = torch.tensor([[p for ids, _ in records for p in range(len(ids))]], device=device)
        keep, offset = [], 0  # the positions that predict a solution token; where the record starts in the row
        for ids, start in records:
            keep.append(torch.arange(offset + start - 1, offset + len(ids) - 1, device=device))
            offset += len(ids)
        keep = torch.cat(keep)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if len(records) > 1:
                logits = model(input_ids=x, position_ids=positions, use_cache=False, logits_to_keep=keep).logits[0]
            else:
                logits = model(input_ids=x, use_cache=False).logits[0, keep]
        target = x[0, keep + 1]
        losses = F.cross_entropy(logits.float(), target, reduction="none")
        counts = [len(ids) - start for ids, start in records]
        sums += [part.sum().item() for part in losses.split(counts)]
        tokens += counts
        correct += int((logits.argmax(-1) == target).sum())
        bar.update(len(records))
    bar.close()
    count = sum(tokens)
    return LossResult(name, sum(sums) / max(count, 1), correct / max(count, 1), count, len(dataset), sums, tokens)


def unigram_loss(tokenizer, train, dataset, name: str = "unigram") -> LossResult:
    """The loss of a model that reads nothing: every solution token predicted from the frequencies of the tokens in
    ``train``'s solutions (add-one smoothed over the vocabulary), formatted as ``dataset``'s are; the trivial
    baseline of a loss table. Its top-1 prediction is the commonest token."""
    counts = torch.zeros(len(tokenizer), dtype=torch.float64)
    for ids, start in (encode(tokenizer, row) for row in train):
        counts += torch.bincount(torch.tensor(ids[start:]), minlength=len(counts)).double()
    log_p = ((counts + 1) / (counts.sum() + len(counts))).log()
    top = int(counts.argmax())
    sums, tokens, correct = [], [], 0
    for ids, start in (encode(tokenizer, row) for row in dataset):
        target = torch.tensor(ids[start:])
        sums.append(-float(log_p[target].sum()))
        tokens.append(len(target))
        correct += int((target == top).sum())
    count = sum(tokens)
    return LossResult(name, sum(sums) / max(count, 1), correct / max(count, 1), count, len(dataset), sums, tokens)


def markdown(arms: list[Arm], ratios: bool) -> str:
    """A row per arm; with ``ratios`` (one tokenizer, a finite reference) each arm's loss over the first arm's."""
    head = "| model | draws | loss (nats/token) | top-1 accuracy | tokens | records |" + (
        " x first (95% interval) |" if ratios else "")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for arm in arms:
        first = arm.draws[0]
        ratio = ""
        if ratios:
            ratio = " 1.00 |" if arm is arms[0] else " {:.3f} ({:.3f}-{:.3f}) |".format(
                arm.loss / arms[0].loss, *ratio_interval(arms[0], arm))
        lines.append(f"| {arm.label} | {len(arm.draws)} | {arm.loss:.3f} | {arm.accuracy:.3f} | {first.tokens} | "
                     f"{first.records} |{ratio}")
    return "\n".join(lines)


def plot(arms: list[Arm], title: str, png_path: Path) -> Path:
    """Each arm's loss (bar: the mean over its draws; dots: each draw), a row per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(arms)))
    rows = range(len(arms))[::-1]  # the first arm on top, as in the table
    ax.barh(list(rows), [a.loss for a in arms], color="#9ecae1")
    for row, arm in zip(rows, arms):
        ax.plot([d.loss for d in arm.draws], [row] * len(arm.draws), "o", color="#08519c", markersize=4)
    ax.set_yticks(list(rows), [a.label for a in arms], fontsize=8)
    ax.set_xlabel("assistant-token loss (nats/token); dots: each draw")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def parse_model(argument: str) -> tuple[str, str]:
    """``LABEL=PATH`` or ``PATH`` (its own label)."""
    label, sep, path = argument.partition("=")
    if not sep:
        return argument, argument
    if not label or not path:
        raise ValueError(f"{argument!r}: a model is PATH or LABEL=PATH")
    return label, path


def main(models: list[str], data: str, first: int, recipe_name: str | None, device: str, out: str | None,
         split: str = "train", as_trained: bool = False, scored_files: list[str] = (),
         solution_field: str = "solution", unigram: bool = False) -> str:
    from .data import gsm8k_as_trained, sft_dataset
    from .models import load_tokenizer, local_model, resolve_device
    from .recipe import DataSpec, Recipe, load_recipe
    from sse_model.checkpoint import load_pretrained

    recipe = load_recipe(recipe_name) if recipe_name else Recipe()
    fields = {} if solution_field == "solution" else {"solution": solution_field}
    dataset = sft_dataset(DataSpec(source=data, split=split, fields=fields), recipe.prompt_instruction)
    if first < 1:
        raise ValueError(f"--first {first}: score at least one record")
    dataset = dataset.select(range(min(first, len(dataset))))
    if as_trained:  # the same solutions in distillation's format: what a model learned of it, not of GSM8K's markup
        def rewritten(row, i):
            try:
                return {"completion": [{**row["completion"][0],
                                        "content": gsm8k_as_trained(row["completion"][0]["content"])}]}
            except ValueError as err:
                raise ValueError(f"--as-trained: {data}, record {i}: {err}") from None

        dataset = dataset.map(rewritten, with_indices=True)
    # the earlier scorings first (in the order given), each checked before any model loads
    results = [r for path in scored_files
               for r in load_scored(path, data, split, as_trained, len(dataset), solution_field)]
    if unigram and not recipe_name:
        raise ValueError("--unigram counts the tokens of a recipe's distillation rows: name the recipe (--recipe)")
    if not results and not models and not unigram:
        raise ValueError("no model to score and no --scored results")
    where = resolve_device(device)
    named = [(label, name, local_model(name)) for label, name in map(parse_model, models)]  # all before loading
    for _, name, path in named:
        if not Path(path).exists():
            raise ValueError(f"{name}: no such model folder, file or cached known model")
    for label, name, path in named:
        tokenizer = load_tokenizer(None, path)  # each model its own: another's ids would be noise to it
        model = packed_reader(load_pretrained(path, torch.float32)).to(where)
        result = completion_loss(model, tokenizer, dataset, where, name)
        result.label, result.vocabulary = label, vocabulary_digest(tokenizer)
        results.append(result)
        del model
    if unigram:  # read with the recipe's tokenizer, the rows formatted as the scored records are
        spec = recipe.distill.data
        tokenizer = load_tokenizer(recipe.model.tokenizer, recipe.model.convert_from or recipe.model.path)
        result = unigram_loss(tokenizer, sft_dataset(spec, recipe.prompt_instruction), dataset,
                              f"unigram of {recipe.name}'s distillation rows")
        result.label, result.vocabulary = "tokens' frequencies (no reading)", vocabulary_digest(tokenizer)
        results.append(result)
    arms = group(results)
    # losses per token compare only over one tokenizer's tokens (a result saved before digests were kept: its
    # token count, which group() holds equal within an arm, stands for it)
    vocabularies = {r.vocabulary for r in results if r.vocabulary}
    comparable = (len(arms) > 1 and len(vocabularies) <= 1 and len({r.tokens for r in results}) == 1
                  and math.isfinite(arms[0].loss))
    part = ("" if split == "train" else f", split `{split}`") + (", solutions as distillation's rows have them"
                                                                 if as_trained else "")
    part += "" if solution_field == "solution" else f", solutions from field `{solution_field}`"
    scored = f"{len(dataset)} records of `{data}`{part}"
    text = (f"Assistant-token loss on the first {scored} (device {where}):\n\n"
            f"{markdown(arms, comparable)}\n")
    if len(vocabularies) > 1 or len({r.tokens for r in results}) > 1:
        text += "\nThe models' tokenizers differ: each loss is per token of its own tokenizer, not comparable.\n"
    if out:
        from common.files import atomic_write

        atomic_write(Path(out), text)
        # every record's loss beside the table: intervals over other groupings need no GPU again
        atomic_write(Path(out).with_suffix(".json"), json.dumps({"data": data, "split": split,
                                                                 "solution_field": solution_field,
                                                                 "as_trained": as_trained, "records": len(dataset),
                                                                 "models": [asdict(r) for r in results]}))
        plot(arms, scored.replace("`", ""), Path(out).with_suffix(".png"))
    return text
