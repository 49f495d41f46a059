"""The SSE partition-balance loss inside TRL's trainers.

TRL's SFT and GRPO trainers compute their loss through a fused LM head that calls the backbone and projects the
hidden states themselves, so the model's own ``loss = lm_loss + aux_loss_coef * aux_loss`` never runs and the
balance loss (coefficient 0.01 in the SSE paper) would silently vanish. This mixin collects the backbone's
``aux_loss`` during ``compute_loss`` (a forward hook), adds ``aux_loss_coef`` times its mean to the trainer's loss,
scaled for gradient accumulation exactly as the trainer scales its own loss, and logs it as ``balance_loss``.
"""

from __future__ import annotations

import torch


class BalanceLossMixin:
    """Put first in the bases: ``class SSESFTTrainer(BalanceLossMixin, SFTTrainer)``. ``balance_loss_coef``: the
    weight of the balance loss in this trainer's loss; None: the model's ``aux_loss_coef``."""

    def __init__(self, *args, balance_loss_coef: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        if balance_loss_coef is None:
            balance_loss_coef = getattr(model.config, "aux_loss_coef", 0.0) or 0.0
        self.balance_loss_coef = float(balance_loss_coef)
        self._balance_losses: list[torch.Tensor] | None = None  # a list only while compute_loss runs
        model.get_submodule(model.base_model_prefix).register_forward_hook(self._keep_balance_loss)

    def _keep_balance_loss(self, module, args, output) -> None:
        aux = getattr(output, "aux_loss", None)
        if self._balance_losses is not None and aux is not None:
            self._balance_losses.append(aux)

    def _loss_is_scaled_for_accumulation(self, num_items_in_batch) -> bool:
        """Mirrors ``Trainer.training_step``: a loss it will not divide by the accumulation steps is already scaled."""
        if getattr(self, "loss_is_scaled_for_ga", None) is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._balance_losses = []
        try:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
            collected = self._balance_losses
        finally:
            self._balance_losses = None
        if not collected or not self.model.training:
            return result
        balance = torch.stack([x.float() for x in collected]).mean()
        scale = self.balance_loss_coef
        if self._loss_is_scaled_for_accumulation(num_items_in_batch):
            scale /= self.current_gradient_accumulation_steps
        loss = result[0] if return_outputs else result
        loss = loss + scale * balance.to(loss.device)
        logged = self.accelerator.gather_for_metrics(balance.detach()).mean().item()
        self._metrics["train"]["balance_loss"].append(logged)
        return (loss, result[1]) if return_outputs else loss
