"""Stage 1, distill: supervised fine-tuning on chat-formatted reasoning traces with TRL's ``SFTTrainer``.

Loss on the assistant turns only; padding-free batches (with packing), which the SSE layers receive as
``cu_seqlens`` so that no state crosses from one sample into the next. Checkpoints every ``save_steps``;
re-running continues from the last complete one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from trl import SFTConfig, SFTTrainer

from ..balance import BalanceLossMixin
from ..data import drop_overlong, sft_dataset
from ..distributed import world
from ..models import (TRAINING_DTYPE, fsdp_precision, load_model, load_teacher, trainer_options, training_device,
                      uses_fsdp)
from ..batching import distill_batching
from ..recipe import Recipe, RecipeError
from .base import (Stage, callbacks, check_data_source, done, finish, fit, hand_on, loss_highlight, record_start,
                   stored, task_setup)

logger = logging.getLogger(__name__)


def sft_config(recipe: Recipe, out_dir: Path, device, fsdp: bool = False) -> SFTConfig:
    cfg = recipe.distill
    args = SFTConfig(**{
        **trainer_options(recipe, cfg, SFTConfig, out_dir, device, distill_batching(recipe, world()[1]), fsdp),
        "max_length": cfg.max_length if cfg.packing else None,  # TRL truncates only when packing (drop_overlong)
        "padding_free": True,
        "completion_only_loss": True,  # the dataset is prompt-completion (pipeline.data.sft_dataset)
        # the held-out loss when these steps are reached (HeldOutLossMixin.evaluate scores it)
        **({"eval_strategy": "steps", "eval_steps": cfg.eval_steps or cfg.save_steps, "prediction_loss_only": True}
           if cfg.eval_data else {}),
    })
    fsdp_precision(args)
    return args


KL_CHUNK = 2048  # scored positions whose float32 logits (student's and teacher's) exist at once


def _sums(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, T: float):
    student, teacher = student.float(), teacher.float()
    ce = F.cross_entropy(student, target, reduction="sum")
    kl = F.kl_div(F.log_softmax(student / T, -1), F.log_softmax(teacher / T, -1), log_target=True, reduction="sum")
    return ce, kl * T * T


def distillation_sums(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, T: float,
                      chunk: int = KL_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and ``T^2 * KL(teacher_T || student_T)`` over rows of logits (``[positions, vocab]``),
    in float32, ``chunk`` positions at a time, each chunk recomputed in the backward pass (checkpointed): only the
    logits as the models returned them outlive the loss, where the computation over all positions at once kept
    three float32 copies of them for the backward pass and built more on the way (a 16k-token micro-batch of a 49k
    vocabulary: 3.2 GB each)."""
    from torch.utils.checkpoint import checkpoint

    ce = kl = student.new_zeros((), dtype=torch.float32)
    for s, t, y in zip(student.split(chunk), teacher.split(chunk), target.split(chunk)):
        c, k = checkpoint(_sums, s, t, y, T, use_reentrant=False) if s.requires_grad else _sums(s, t, y, T)
        ce, kl = ce + c, kl + k
    return ce, kl


class TeacherKLMixin:
    """Logit distillation for converted models: the loss is ``(1 - w) * CE + w * T^2 * KL(teacher_T || student_T)``
    over the completion tokens, ``teacher_T`` the source Transformer's next-token distribution at temperature T (the
    forward KL of Hinton et al.; T^2 keeps the gradient's scale across temperatures). Without a teacher, TRL's loss
    (its chunked LM head never builds the logits).

    Why not TRL's ``DistillationTrainer``: it pads prompt-completion rows and generates on-policy; our batches are
    packed and padding-free (``cu_seqlens``), with the balance loss, so the loss lives here on SFT's batches. Only
    the scored positions' logits are built (``logits_to_keep``), in the student and in the teacher, and the loss
    over them is taken in chunks (:func:`distillation_sums`)."""

    def __init__(self, *args, teacher=None, teacher_kl: float = 0.0, kd_temperature: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher, self.teacher_kl, self.kd_temperature = teacher, teacher_kl, kd_temperature

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.teacher is None or not self.teacher_kl or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        from sse_model.ops.varlen import cu_seqlens_from_position_ids

        inputs = {**inputs, "use_cache": False}
        labels = inputs.pop("labels")
        if labels.shape[0] != 1:
            raise ValueError("teacher_kl needs padding-free batches (one packed row per micro-batch)")
        target = F.pad(labels, (0, 1), value=-100)[0, 1:].clone()  # the next token of each position
        cu = inputs.get("cu_seq_lens_q", cu_seqlens_from_position_ids(inputs.get("position_ids")))
        if cu is not None and cu.numel() > 2:  # a sequence's last token does not predict the next sequence
            target[cu[1:-1].long() - 1] = -100
        keep = (target != -100).nonzero().squeeze(-1)
        target = target[keep]
        student = model(**inputs, logits_to_keep=keep).logits[0]
        with torch.no_grad(), self.accelerator.autocast():  # the student's precision (the Trainer wraps its forward
            # alone): in float32 the teacher's attention takes SDPA's per-sequence path, not the flash varlen kernel
            teacher = self.teacher(**inputs, logits_to_keep=keep).logits[0]
        T, w = self.kd_temperature, self.teacher_kl
        ce, kl = distillation_sums(student, teacher, target, T)
        count = keep.numel() if num_items_in_batch is None else num_items_in_batch
        loss = ((1 - w) * ce + w * kl) / torch.as_tensor(count).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:  # as TRL's own loss
            loss = loss * self.accelerator.num_processes
        n = max(keep.numel(), 1)
        metrics = self._metrics["train"]
        gather = self.accelerator.gather_for_metrics
        metrics["ce"].append(gather(ce.detach() / n).mean().item())
        metrics["teacher_kl"].append(gather(kl.detach() / n).mean().item())
        metrics["mean_token_accuracy"].append(gather((student.argmax(-1) == target).float().mean()).mean().item())
        self._total_train_tokens += gather(torch.tensor(labels.shape[1], device=labels.device)).sum().item()
        metrics["num_tokens"] = [self._total_train_tokens]
        return (loss, None) if return_outputs else loss


class HeldOutLossMixin:
    """``eval_loss`` on ``held_out`` (prompt-completion rows): the mean over solutions of each one's teacher-forced
    loss per token, scored as ``sse-pipeline loss`` scores them (:func:`pipeline.lm_loss.completion_loss`: records
    packed into rows, no state or attention crossing one), in a few forwards where the Trainer's loop took one a
    record. Every worker scores every record: the same number on any worker count, and FSDP's ranks run the same
    forwards."""

    def __init__(self, *args, held_out=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.held_out = held_out

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        if self.held_out is None or eval_dataset is not None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        import time

        from ..lm_loss import completion_loss

        start = time.perf_counter()
        scored = completion_loss(self.model, self.processing_class, self.held_out, self.args.device, "held-out",
                                 progress=False)
        per_record = [loss / max(n, 1) for loss, n in zip(scored.record_losses, scored.record_tokens)]
        metrics = {f"{metric_key_prefix}_loss": sum(per_record) / max(len(per_record), 1),
                   f"{metric_key_prefix}_records": len(per_record),
                   f"{metric_key_prefix}_runtime": round(time.perf_counter() - start, 4)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


class SSESFTTrainer(BalanceLossMixin, TeacherKLMixin, HeldOutLossMixin, SFTTrainer):
    """TRL's SFT with the SSE partition-balance loss added (see :mod:`pipeline.balance`), for converted models the
    teacher's logits as a second target (:class:`TeacherKLMixin`), and the held-out loss scored packed
    (:class:`HeldOutLossMixin`)."""


def run_distill(recipe: Recipe, out_dir: Path, start_from: Path | None = None, extra_callbacks: Sequence = ()) -> Path:
    """Trains and returns the directory of the final model (``<out_dir>/final``); ``extra_callbacks``: more
    ``TrainerCallback``s (the step profiler's, :mod:`benchmarks.pipeline.stage_profile`)."""
    out_dir = Path(out_dir)
    if (final := done("distill", out_dir)) is not None:
        return final
    cfg = recipe.distill
    device = training_device(recipe)
    model, tokenizer = load_model(recipe.model, start_from, seed=recipe.seed, dtype=TRAINING_DTYPE)
    if cfg.train == "sse":
        from sse_model.align import freeze_all_but_aligned

        if not freeze_all_but_aligned(model, "all"):
            raise RecipeError("distill.train: sse: the model has no SSE layer (every layer is softmax attention); "
                              "train: all")
    dataset, dropped = drop_overlong(sft_dataset(cfg.data, recipe.prompt_instruction), tokenizer, cfg.max_length)
    held_out = None
    if cfg.eval_data is not None:
        held_out, _ = drop_overlong(sft_dataset(cfg.eval_data, recipe.prompt_instruction), tokenizer, cfg.max_length)
    teacher = load_teacher(recipe.model, TRAINING_DTYPE).to(device) if cfg.teacher_kl else None
    fsdp = uses_fsdp(recipe, model, device, world()[1])
    trainer = SSESFTTrainer(
        model=model if fsdp else model.to(device),  # FSDP places each shard itself
        teacher=teacher, teacher_kl=cfg.teacher_kl, kd_temperature=cfg.kd_temperature,
        args=sft_config(recipe, out_dir, device, fsdp),
        train_dataset=dataset,
        eval_dataset=held_out,
        held_out=held_out,
        processing_class=tokenizer,
        callbacks=[*callbacks(recipe, "distill", out_dir), *extra_callbacks],
    )
    result, weights = fit("distill", recipe, out_dir, trainer)
    return finish("distill", out_dir, trainer, tokenizer, weights,
                  ["loss", "ce", "teacher_kl", "eval_loss", "balance_loss", "learning_rate", "grad_norm"],
                  {"train_loss": result.training_loss, "samples": len(dataset), "dropped_overlong": dropped})


def _distill_task(recipe: Recipe, out_dir: str, start_from: str | None) -> str:
    from ..storage import materialize

    task_setup()
    return hand_on(recipe, "distill",
                   run_distill(recipe, Path(out_dir), materialize(start_from) if start_from else None))


class DistillStage(Stage):
    """Supervised distillation, data-parallel over the plan's workers (one per GPU)."""

    name = "distill"

    def preflight(self, recipe: Recipe) -> None:
        check_data_source("distill.data", recipe.distill.data)
        if recipe.distill.eval_data is not None:
            check_data_source("distill.eval_data", recipe.distill.eval_data)

    def run(self, recipe: Recipe, stage_dir: Path, start: str | None, plan) -> str:
        import ray

        from ..distributed import run_data_parallel

        start = stored(recipe, start, "distill") if start else None
        record_start(stage_dir, start)
        args = (recipe, str(stage_dir), start)
        if plan.distill.workers > 1:
            return run_data_parallel(_distill_task, args, [plan.train_worker] * plan.distill.workers, "distill")
        return ray.get(ray.remote(**plan.whole)(_distill_task).remote(*args))

    def highlight(self, recipe: Recipe, stage_dir: Path) -> str:
        return loss_highlight(stage_dir)
