"""Stage 1, distill: supervised fine-tuning on chat-formatted reasoning traces with TRL's ``SFTTrainer``.

Loss on the assistant turns only; padding-free batches (with packing), which the SSE layers receive as
``cu_seqlens`` so that no state crosses from one sample into the next. Checkpoints every ``save_steps``;
re-running continues from the last complete one.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trl import SFTConfig, SFTTrainer

from ..balance import BalanceLossMixin
from ..checkpoints import CheckpointMarker, is_done, resume_point, save_final, writing
from ..data import drop_overlong, sft_dataset
from ..distributed import is_main_process, world
from ..metrics import MetricsLogger, plot_curves
from ..models import TRAINING_DTYPE, load_model, resolve_device, trainer_options
from ..recipe import Recipe

logger = logging.getLogger(__name__)


def sft_config(recipe: Recipe, out_dir: Path, device) -> SFTConfig:
    cfg = recipe.distill
    return SFTConfig(
        **trainer_options(recipe, cfg, out_dir, device),
        num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size // world()[1],  # batch_size is the global batch
        lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_ratio,  # a float in [0, 1) is a fraction of the steps
        weight_decay=cfg.weight_decay,
        max_length=cfg.max_length if cfg.packing else None,  # TRL truncates only when packing (see drop_overlong)
        packing=cfg.packing,
        padding_free=True,
        completion_only_loss=True,  # the dataset is prompt-completion (pipeline.data.sft_dataset)
    )


class SSESFTTrainer(BalanceLossMixin, SFTTrainer):
    """TRL's SFT with the SSE partition-balance loss added (see :mod:`pipeline.balance`)."""


def run_distill(recipe: Recipe, out_dir: Path, start_from: Path | None = None) -> Path:
    """Trains and returns the directory of the final model (``<out_dir>/final``)."""

    out_dir = Path(out_dir)
    final = out_dir / "final"
    if is_done(final):
        logger.info("distill: already done (%s)", final)
        return final
    device = resolve_device(recipe.device)
    model, tokenizer = load_model(recipe.model, start_from, seed=recipe.seed, dtype=TRAINING_DTYPE)
    dataset, dropped = drop_overlong(sft_dataset(recipe.distill.data, recipe.prompt_instruction), tokenizer,
                                     recipe.distill.max_length)
    store = recipe.stored_at("distill", "checkpoints")
    resume = resume_point(store, out_dir)
    trainer = SSESFTTrainer(
        model=model.to(device),
        args=sft_config(recipe, out_dir, device),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[MetricsLogger(out_dir / "metrics.jsonl"), CheckpointMarker(store)] if is_main_process() else [],
    )
    if resume is not None:
        logger.info("distill: resuming from %s", resume)
    with writing(out_dir / "checkpoints"):  # a checkpoint that could not be written: where, and the room left
        result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if not is_main_process():  # rank 0 writes the stage's files
        return final
    plot_curves(out_dir / "metrics.jsonl", out_dir / "loss.png", ["loss", "balance_loss", "learning_rate", "grad_norm"], "distill")
    return save_final(trainer.model, tokenizer, final,
                      {"stage": "distill", "global_step": trainer.state.global_step,
                       "train_loss": result.training_loss, "samples": len(dataset), "dropped_overlong": dropped})
