"""Generation for evaluation: the interface evaluation takes (:class:`GenerationBackend`), prompts, seeds, and
``model.generate`` behind the interface. The pipeline hands evaluation its rollout engine through the same
interface (``pipeline.rollout.backend.EngineBackend``); this package never imports the pipeline."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from common.generation import INSTRUCTION, end_of_sequence_ids, user_message


@dataclass(frozen=True)
class SamplingConfig:
    """The paper's evaluation sampling: temperature 1.0, top-p 0.7, up to 32k new tokens."""

    temperature: float = 1.0
    top_p: float = 0.7
    top_k: int = 0
    max_new_tokens: int = 32768
    seed: int = 0


@dataclass
class Completion:
    text: str
    num_tokens: int
    finish_reason: str  # "stop" | "length"


class GenerationBackend(Protocol):
    def generate(self, prompts: list[str], sampling: SamplingConfig, seeds: list[int]) -> Iterator[tuple[int, Completion]]:
        """Yields ``(index into prompts, completion)`` as completions finish, each prompt exactly once."""


def build_prompt(tokenizer, problem: str, instruction: str = INSTRUCTION) -> str:
    """The tokenizer's chat template around :func:`user_message` (the bare text without a template)."""
    message = user_message(problem, instruction)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    return message["content"] + "\n"


class HFGenerateBackend:
    """Batches of left-padded prompts through ``model.generate``. Each batch is seeded by its first
    request's seed; the engine backend seeds every request on its own."""

    def __init__(self, model, tokenizer, batch_size: int = 16):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

    @torch.no_grad()
    def generate(self, prompts, sampling, seeds):
        tok = self.tokenizer
        tok.padding_side = "left"
        device = next(self.model.parameters()).device
        stops = end_of_sequence_ids(self.model, tok)
        eos = tok.eos_token_id if tok.eos_token_id is not None else min(stops, default=None)
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start:start + self.batch_size]
            enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            torch.manual_seed(seeds[start])
            kwargs = dict(do_sample=sampling.temperature > 0, max_new_tokens=sampling.max_new_tokens,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos,
                          eos_token_id=sorted(stops) or None)
            if sampling.temperature > 0:
                kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
            out = self.model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1]:]
            for i, row in enumerate(out.tolist()):
                end = next((j for j, t in enumerate(row) if t in stops), None)
                stop = end is not None
                ids = row[:end] if stop else row
                yield start + i, Completion(tok.decode(ids, skip_special_tokens=True), len(ids) + int(stop),
                                            "stop" if stop else "length")
