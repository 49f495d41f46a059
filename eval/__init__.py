"""Math benchmarks, sampling-based metrics and the resumable evaluation runner."""

from .benchmarks import BENCHMARKS, PAPER_BENCHMARKS, Problem, load_problems
from .generation import Completion, GenerationBackend, HFGenerateBackend, SamplingConfig, build_prompt
from .metrics import avg_at_k, bootstrap_ci, majority_correct, pass_at_k
from .runner import evaluate

__all__ = [
    "BENCHMARKS",
    "PAPER_BENCHMARKS",
    "Completion",
    "GenerationBackend",
    "HFGenerateBackend",
    "Problem",
    "SamplingConfig",
    "avg_at_k",
    "bootstrap_ci",
    "build_prompt",
    "evaluate",
    "load_problems",
    "majority_correct",
    "pass_at_k",
]
