"""Verifiable rewards for math reasoning: answer extraction, math-verify in a killable worker pool, and
reward functions in TRL's ``reward_funcs`` format."""

from .extract import extract_answer, last_boxed
from .functions import AccuracyReward, FormatReward, OverlongPenalty, completion_text
from .verify import MathVerifier, VerifierPool, VerifyStats, answers_match, default_verifier

__all__ = [
    "AccuracyReward",
    "FormatReward",
    "MathVerifier",
    "OverlongPenalty",
    "VerifierPool",
    "VerifyStats",
    "answers_match",
    "completion_text",
    "default_verifier",
    "extract_answer",
    "last_boxed",
]
