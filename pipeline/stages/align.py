"""Stage 0, align: attention transfer for a converted model (:mod:`sse_model.align`), before distillation.

A converted model's SSE layers start with fresh decay gates, output gate and norm: their outputs are noise to the
rest of the network and the model predicts near-uniformly (SmolLM2-135M: 1.55 -> 10.9 nats). This stage teaches each
SSE layer to compute what its attention layer computed, from the source Transformer's own hidden states, on packed
rows of the distillation data; everything else stays frozen. It runs through transformers' ``Trainer`` (optimizer,
schedule, bf16 autocast, checkpoints, resume) with the loss replaced by the per-layer alignment losses.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from sse_model.align import AttentionTransfer, freeze_all_but_aligned

from ..data import chat_ids, sft_dataset
from ..metrics import read_metrics
from ..models import TRAINING_DTYPE, load_model, load_teacher, trainer_options, training_device
from ..batching import align_batching
from ..recipe import Recipe
from .base import (Stage, callbacks, check_data_source, done, finish, fit, hand_on, loss_highlight, record_start,
                   stored, task_setup)

logger = logging.getLogger(__name__)


def packed_rows(dataset, tokenizer, max_length: int) -> list[dict]:
    """The conversations of ``dataset`` (chat template applied), laid end to end in rows of at most ``max_length``
    tokens: ``{"input_ids", "lengths"}`` (a conversation longer than a row is cut into pieces, each a sequence)."""
    rows, ids, lengths = [], [], []
    for prompt, completion in zip(dataset["prompt"], dataset["completion"]):
        tokens = chat_ids(tokenizer, prompt + completion)
        while tokens:
            room = max_length - len(ids)
            piece, tokens = tokens[:room], tokens[room:]
            ids += piece
            lengths.append(len(piece))
            if len(ids) == max_length:
                rows.append({"input_ids": ids, "lengths": lengths})
                ids, lengths = [], []
    if ids:
        rows.append({"input_ids": ids, "lengths": lengths})
    return rows


def collate_packed(rows: list[dict]) -> dict:
    """A micro-batch as one packed row: ``input_ids [1, N]`` and the sequences' ``cu_seqlens``."""
    ids = [t for row in rows for t in row["input_ids"]]
    lengths = torch.tensor([n for row in rows for n in row["lengths"]])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return {"input_ids": torch.tensor([ids]), "cu_seqlens": cu}


class AlignmentTrainer(Trainer):
    """``Trainer`` whose loss is the mean of the per-layer alignment losses; each layer's is logged as
    ``align/layer_<i>`` (averaged over the steps between two logs)."""

    def __init__(self, *args, teacher, **kwargs):
        super().__init__(*args, **kwargs)
        self.transfer = AttentionTransfer(self.model, teacher)
        self._layer_losses: dict[str, list[torch.Tensor]] = defaultdict(list)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # the Trainer's mixed precision wraps only ``model.forward``, which alignment never calls: without this the
        # teacher and the SSE layers run in float32 (on a GPU: no bf16 tensor cores, and attention in SDPA's
        # per-sequence float32 path instead of the flash varlen kernel)
        with self.accelerator.autocast():
            losses = self.transfer(**inputs)
        for i, loss in losses.items():
            self._layer_losses[f"align/layer_{i}"].append(loss.detach())
        loss = torch.stack(list(losses.values())).mean()
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if self._layer_losses:  # one device read for every layer
            names = list(self._layer_losses)
            means = torch.stack([torch.stack(self._layer_losses[n]).mean() for n in names]).tolist()
            logs = {**logs, **dict(zip(names, means))}
            self._layer_losses.clear()
        super().log(logs, start_time)


def plot_layers(metrics_path: Path, png_path: Path) -> Path | None:
    """Every layer's alignment loss against the step, on one log-scale figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    keys = sorted({k for r in rows for k in r if k.startswith("align/layer_")}, key=lambda k: int(k.split("_")[-1]))
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.get_cmap("viridis")
    for n, key in enumerate(keys):
        points = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*points), color=colors(n / max(1, len(keys) - 1)), linewidth=1.2,
                label=key.split("_")[-1] if n in (0, len(keys) - 1) or n % 5 == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE / mean square of the attention output")
    ax.set_title("attention transfer, per layer (1.0 = an output of zeros)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="layer", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)


def run_align(recipe: Recipe, out_dir: Path, start_from: Path | None = None, extra_callbacks: Sequence = ()) -> Path:
    """Aligns the converted model (``start_from``, else the recipe's model) and returns ``<out_dir>/final``;
    ``extra_callbacks``: more ``TrainerCallback``s (the step profiler's, :mod:`benchmarks.pipeline.stage_profile`)."""
    out_dir = Path(out_dir)
    if (final := done("align", out_dir)) is not None:
        return final
    cfg = recipe.align
    device = training_device(recipe)
    model, tokenizer = load_model(recipe.model, start_from, seed=recipe.seed, dtype=TRAINING_DTYPE)
    teacher = load_teacher(recipe.model, TRAINING_DTYPE).to(device)
    trained = freeze_all_but_aligned(model, cfg.train)
    data = sft_dataset(cfg.data or recipe.distill.data, recipe.prompt_instruction)
    rows = packed_rows(data, tokenizer, cfg.max_length)
    tokens = cfg.steps * cfg.batch_size * cfg.max_length
    logger.info("align: %s values train (%s); %d packed rows of %d tokens; %d steps, %.1fM tokens at most",
                f"{trained:,}", cfg.train, len(rows), cfg.max_length, cfg.steps, tokens / 1e6)
    args = TrainingArguments(**trainer_options(recipe, cfg, TrainingArguments, out_dir, device, align_batching(recipe)),
                             remove_unused_columns=False)
    trainer = AlignmentTrainer(model=model.to(device), args=args, train_dataset=rows, data_collator=collate_packed,
                               teacher=teacher,
                               callbacks=[*callbacks(recipe, "align", out_dir), *extra_callbacks])
    result, weights = fit("align", recipe, out_dir, trainer)
    plot_layers(out_dir / "metrics.jsonl", out_dir / "layers.png")
    model.requires_grad_(True)
    # tokens: every row is full but the data's last one, so this is exact unless the steps reached that row
    return finish("align", out_dir, trainer, tokenizer, weights, ["loss", "learning_rate", "grad_norm"],
                  {"train_loss": result.training_loss, "trained": cfg.train,
                   "tokens": trainer.state.global_step * tokens // cfg.steps})


def _align_task(recipe: Recipe, out_dir: str, start_from: str | None) -> str:
    from ..storage import materialize

    task_setup()
    return hand_on(recipe, "align", run_align(recipe, Path(out_dir), materialize(start_from) if start_from else None))


class AlignStage(Stage):
    """Attention transfer, for a converted model: one process (see :mod:`pipeline.placement`)."""

    name = "align"

    def preflight(self, recipe: Recipe) -> None:
        key = "align.data" if recipe.align.data else "distill.data"  # alignment reads distillation's by default
        check_data_source(key, recipe.align.data or recipe.distill.data)

    def enabled(self, recipe: Recipe) -> bool:
        """A model converted into some SSE layers (a model built otherwise, or converted with every layer kept as
        attention, has nothing to align)."""
        return recipe.align.enabled and recipe.model.converts_layers()

    def run(self, recipe: Recipe, stage_dir: Path, start: str | None, plan) -> str:
        import ray

        start = stored(recipe, start, "align") if start else None
        record_start(stage_dir, start)
        return ray.get(ray.remote(**plan.whole)(_align_task).remote(recipe, str(stage_dir), start))

    def highlight(self, recipe: Recipe, stage_dir: Path) -> str:
        return loss_highlight(stage_dir)
