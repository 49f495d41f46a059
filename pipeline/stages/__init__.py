"""The stages of a recipe, in order, each behind one interface (:class:`~pipeline.stages.base.Stage`): attention
transfer for converted models, distillation, GRPO, evaluation."""

from __future__ import annotations

from .align import AlignStage
from .base import Stage
from .distill import DistillStage
from .evaluate import EvalStage
from .grpo import GRPOStage

STAGES: dict[str, Stage] = {s.name: s for s in (AlignStage(), DistillStage(), GRPOStage(), EvalStage())}


def stage_runs(recipe, name: str) -> bool:
    """Whether ``recipe`` runs the stage ``name``."""
    return STAGES[name].enabled(recipe)
