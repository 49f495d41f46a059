"""The stages of a recipe, in order, each behind one interface (:class:`~pipeline.stages.base.Stage`): attention
transfer for converted models, distillation, GRPO, evaluation.

``STAGES`` loads on first use (PEP 562): a Ray worker that runs one stage's task (evaluation's generation or
scoring) imports that stage's module, not every trainer's."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Stage


@cache
def _stages() -> dict[str, Stage]:
    from .align import AlignStage
    from .distill import DistillStage
    from .evaluate import EvalStage
    from .grpo import GRPOStage

    return {s.name: s for s in (AlignStage(), DistillStage(), GRPOStage(), EvalStage())}


def __getattr__(name: str):
    if name == "STAGES":
        return _stages()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stage_runs(recipe, name: str) -> bool:
    """Whether ``recipe`` runs the stage ``name``."""
    return _stages()[name].enabled(recipe)
