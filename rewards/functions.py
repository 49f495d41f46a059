"""Reward functions with the signature TRL's ``GRPOTrainer`` expects for ``reward_funcs``:
``f(prompts, completions, **columns) -> list[float]`` (dataset columns such as ``answer`` arrive as keyword
lists; ``completion_ids`` too). Each keeps ``last_stats`` of its latest call for logging."""

from __future__ import annotations

import time

from .extract import clean_text, last_boxed
from .verify import MathVerifier, VerifyStats, default_verifier


def completion_text(completion) -> str:
    """Plain text of a completion in TRL's standard (str) or conversational (list of messages) format."""
    if isinstance(completion, list):
        return "".join(clean_text(m.get("content", "")) for m in completion if isinstance(m, dict))
    return clean_text(completion)


class AccuracyReward:
    """1.0 if the completion's final answer equals the ground truth (math-verify), else 0.0."""

    __name__ = "accuracy"

    def __init__(self, verifier: MathVerifier | None = None, answer_field: str = "answer"):
        self.verifier = verifier
        self.answer_field = answer_field
        self.last_stats = VerifyStats()

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        if self.answer_field not in kwargs:
            raise KeyError(f"accuracy reward needs the dataset column {self.answer_field!r}; got {sorted(kwargs)}")
        verifier = self.verifier or default_verifier()
        texts = [completion_text(c) for c in completions]
        scores, self.last_stats, _ = verifier.score(texts, [str(a) for a in kwargs[self.answer_field]])
        return scores


class FormatReward:
    """1.0 if the completion reasons before a final boxed answer: at least ``min_reasoning_chars``
    non-space characters before the last ``\\boxed{}`` (and, with ``think_tag``, a closed ``</think>``
    block before it); else 0.0."""

    __name__ = "format"

    def __init__(self, min_reasoning_chars: int = 20, think_tag: str | None = None):
        self.min_reasoning_chars = min_reasoning_chars
        self.think_tag = think_tag
        self.last_stats = {}

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        start = time.perf_counter()
        scores = []
        for completion in completions:
            text = completion_text(completion)
            box = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
            ok = box >= 0 and last_boxed(text) not in (None, "")
            ok = ok and len("".join(text[:box].split())) >= self.min_reasoning_chars
            if ok and self.think_tag:
                close = text.rfind(f"</{self.think_tag}>", 0, box)
                ok = close >= 0 and text.find(f"<{self.think_tag}>") < close
            scores.append(1.0 if ok else 0.0)
        self.last_stats = {"seconds": time.perf_counter() - start, "items": len(scores)}
        return scores


class OverlongPenalty:
    """DAPO's soft overlong punishment: 0 up to ``max_length - cache_length`` completion tokens, then a
    linear ramp to -1 at ``max_length``, and -1 beyond."""

    __name__ = "overlong"

    def __init__(self, max_length: int, cache_length: int):
        if not 0 < cache_length <= max_length:
            raise ValueError(f"need 0 < cache_length ({cache_length}) <= max_length ({max_length})")
        self.max_length = max_length
        self.cache_length = cache_length
        self.last_stats = {}

    def penalty(self, length: int) -> float:
        free = self.max_length - self.cache_length
        if length <= free:
            return 0.0
        if length <= self.max_length:
            return (free - length) / self.cache_length
        return -1.0

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
        if completion_ids is None:
            raise ValueError("the overlong penalty needs completion_ids (token counts), which TRL passes")
        scores = [self.penalty(len(ids)) for ids in completion_ids]
        self.last_stats = {"penalised": sum(s < 0 for s in scores), "items": len(scores)}
        return scores
