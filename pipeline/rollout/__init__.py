"""The SSE-aware rollout engine: continuous batching over state slots, prefix forking, seeded sampling."""

from .engine import CompletionOutput, Engine, RequestOutput
from .sampling import SamplingParams, sample

__all__ = ["CompletionOutput", "Engine", "RequestOutput", "SamplingParams", "sample"]
