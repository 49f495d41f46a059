"""Generation backends for evaluation: one interface, ``model.generate`` and the rollout engine behind it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


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
    """The tokenizer's chat template around ``problem`` + the boxed-answer instruction."""
    content = f"{problem}\n{instruction}" if instruction else problem
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return content + "\n"


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
        eos = tok.eos_token_id
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start:start + self.batch_size]
            enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            torch.manual_seed(seeds[start])
            kwargs = dict(do_sample=sampling.temperature > 0, max_new_tokens=sampling.max_new_tokens,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos, eos_token_id=eos)
            if sampling.temperature > 0:
                kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
            out = self.model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1]:]
            for i, row in enumerate(out.tolist()):
                stop = eos in row
                ids = row[:row.index(eos)] if stop else row
                yield start + i, Completion(tok.decode(ids, skip_special_tokens=True), len(ids) + int(stop),
                                            "stop" if stop else "length")


class EngineBackend:
    """The rollout engine behind the evaluation interface. Consecutive samples of one prompt with
    consecutive seeds become one request with ``n`` samples (prefilled once, forked); completions stream
    out as requests finish."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, sampling, seeds):
        from pipeline.rollout import SamplingParams

        groups: list[list[int]] = []
        for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
            last = groups[-1] if groups else None
            if last and prompts[last[0]] == prompt and seeds[last[-1]] + 1 == seed and len(last) < self.engine.max_slots:
                last.append(i)
            else:
                groups.append([i])
        pending = {}
        for group in groups:
            params = SamplingParams(n=len(group), temperature=sampling.temperature, top_p=sampling.top_p,
                                    top_k=sampling.top_k, max_tokens=sampling.max_new_tokens, seed=seeds[group[0]],
                                    logprobs=False)
            pending[self.engine.add_request(prompts[group[0]], params)] = group
        while self.engine.has_unfinished():
            for out in self.engine.step():
                for index, completion in zip(pending.pop(out.request_id), out.outputs):
                    yield index, Completion(completion.text, len(completion.token_ids), completion.finish_reason)
