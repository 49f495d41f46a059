"""Data-parallel training: several Ray workers in one torch.distributed group (gloo on CPU) train like one
process on the same global batch."""

from __future__ import annotations

import pytest
import torch

from pipeline.metrics import read_metrics
from pipeline.recipe import RecipeError, load_recipe


def test_two_data_parallel_workers_train_like_one_process(tmp_path):
    """The distillation stage on 1 and on 2 workers (gloo, each with half the global batch of 8): the same loss
    at every step and the same final weights. The balance loss is off: it is a product of batch means, so each
    worker's own differs from the whole batch's (as it does across micro-batches)."""
    from pipeline.run import run_recipe
    from sse_model.checkpoint import load_pretrained

    common = ["distill.data.max_samples=128", "distill.max_steps=4", "distill.batch_size=8", "distill.epochs=1",
              "distill.logging_steps=1", "distill.save_steps=100", "distill.warmup_ratio=0",
              "model.config_overrides.aux_loss_coef=0.0", "ray.num_cpus=2"]
    losses, finals = {}, {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        recipe = load_recipe("demo", [f"output_dir={out}", f"distill.num_workers={workers}", *common])
        run_recipe(recipe, ("distill",))
        losses[workers] = [r["loss"] for r in read_metrics(out / "distill" / "metrics.jsonl") if "loss" in r]
        finals[workers] = load_pretrained(out / "distill" / "final").state_dict()
    assert len(losses[1]) == 4 and losses[1][0] != losses[1][-1]
    assert losses[2] == pytest.approx(losses[1], rel=1e-4), (losses[1], losses[2])
    for name, value in finals[1].items():
        torch.testing.assert_close(finals[2][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_workers_must_divide_the_batch():
    with pytest.raises(RecipeError, match="distill.num_workers: 3 workers do not divide distill.batch_size=32"):
        load_recipe("demo", ["distill.num_workers=3"])
