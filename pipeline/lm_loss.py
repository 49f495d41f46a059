"""``sse-pipeline loss``: the assistant-token loss of models on worked solutions, the yardstick of conversion.

Each record of a data source (``problem`` + ``solution``, or ``messages``) is formatted exactly as distillation
formats it (the chat template, the recipe's instruction) and scored with teacher forcing: the mean next-token
cross-entropy over the solution's tokens and the fraction predicted top-1. The same records, template and
tokenizer for every model, so the numbers compare a converted model with the Transformer it came from.

    sse-pipeline loss smollm2-135m runs/smollm2-135m/align/final runs/smollm2-135m/distill/final \\
        --data gsm8k_train --first 24 --recipe smollm2-135m
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


def encode(tokenizer, row: dict) -> tuple[list[int], int]:
    """``(token ids of the whole conversation, number of ids before the solution)``."""
    from .data import chat_ids

    prompt = chat_ids(tokenizer, row["prompt"], add_generation_prompt=True)
    ids = chat_ids(tokenizer, row["prompt"] + row["completion"])
    if ids[:len(prompt)] != prompt:
        raise ValueError("the chat template does not extend the prompt with the completion; cannot locate the solution")
    return ids, len(prompt)


@torch.no_grad()
def completion_loss(model, tokenizer, dataset, device: torch.device, name: str = "model") -> LossResult:
    """Teacher-forced loss and top-1 accuracy over the completions of ``dataset`` (one record per forward)."""
    model.eval().to(device)
    total, correct, count = 0.0, 0, 0
    for row in dataset:
        ids, start = encode(tokenizer, row)
        x = torch.tensor([ids], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x, use_cache=False).logits[0, start - 1:-1].float()
        target = x[0, start:]
        total += F.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(-1) == target).sum())
        count += target.numel()
    return LossResult(name, total / max(count, 1), correct / max(count, 1), count, len(dataset))


def markdown(results: list[LossResult], reference: float | None = None) -> str:
    head = "| model | loss (nats/token) | top-1 accuracy | tokens | records |" + (" x first |" if reference else "")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in results:
        ratio = f" {r.loss / reference:.2f} |" if reference else ""
        lines.append(f"| {r.model} | {r.loss:.3f} | {r.accuracy:.3f} | {r.tokens} | {r.records} |{ratio}")
    return "\n".join(lines)


def main(models: list[str], data: str, first: int, recipe_name: str | None, device: str, out: str | None) -> str:
    from .data import sft_dataset
    from .models import load_tokenizer, local_model, resolve_device
    from .recipe import DataSpec, Recipe, load_recipe
    from sse_model.checkpoint import load_pretrained

    recipe = load_recipe(recipe_name) if recipe_name else Recipe()
    dataset = sft_dataset(DataSpec(source=data), recipe.prompt_instruction)
    dataset = dataset.select(range(min(first, len(dataset))))
    if first < 1:
        raise ValueError(f"--first {first}: score at least one record")
    where = resolve_device(device)
    results, vocabularies = [], set()
    for name in models:
        path = local_model(name)
        tokenizer = load_tokenizer(None, path)  # each model its own: another's ids would be noise to it
        vocabularies.add(hash(frozenset(tokenizer.get_vocab().items())))
        model = load_pretrained(path, torch.float32)
        results.append(completion_loss(model, tokenizer, dataset, where, name))
        del model
    # losses per token compare only over one tokenizer's tokens
    comparable = len(results) > 1 and len(vocabularies) == 1 and math.isfinite(results[0].loss)
    table = markdown(results, results[0].loss if comparable else None)
    text = f"Assistant-token loss on the first {len(dataset)} records of `{data}` (device {where}):\n\n{table}\n"
    if len(vocabularies) > 1:
        text += "\nThe models' tokenizers differ: each loss is per token of its own tokenizer, not comparable.\n"
    if out:
        Path(out).write_text(text)
    return text
