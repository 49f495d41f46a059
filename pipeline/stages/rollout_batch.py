"""Scored rollout batches (the dicts TRL's ``GRPOTrainer._generate_and_score_completions`` returns): which prompt
groups can teach anything, and how groups from several sampling rounds become one batch (DAPO's dynamic sampling).

A batch holds one row per completion, ``num_generations`` consecutive rows per prompt. Prompt tensors are
left-padded, completion tensors right-padded (TRL's layout); ``num_items_in_batch`` is a count over the batch and is
recomputed by the caller.
"""

from __future__ import annotations

import torch

COUNT_KEYS = ("num_items_in_batch",)


def informative_groups(accuracy: list[float | None] | None, advantages: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[groups]`` bool: the groups whose accuracy varies (DAPO's criterion: all right or all wrong teaches nothing,
    whatever the overlong penalty or the format reward add) among their scored rows (None: a row left unscored,
    e.g. a truncated one under ``mask_truncated_completions``, which has no advantage). Without an accuracy reward,
    the groups whose advantages are not all zero."""
    if accuracy is not None:
        values = torch.tensor([float("nan") if a is None else a for a in accuracy]).view(-1, group_size)
        scored = ~values.isnan()
        high = values.masked_fill(~scored, float("-inf")).amax(dim=1)
        low = values.masked_fill(~scored, float("inf")).amin(dim=1)
        return ((scored.sum(dim=1) > 1) & (high - low > 1e-6)).to(advantages.device)
    return (advantages.view(-1, group_size) != 0).any(dim=1)


def select_groups(batch: dict, groups: torch.Tensor, group_size: int) -> dict:
    """The rows of the groups at indices ``groups``."""
    rows = (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).reshape(-1)
    size = len(batch["prompt_ids"])
    return {k: v[rows.to(v.device)] if torch.is_tensor(v) and v.dim() and len(v) == size and k not in COUNT_KEYS else v
            for k, v in batch.items()}


def concat_batches(batches: list[dict], pad_token_id: int) -> dict:
    """One batch from several (same keys); pads prompts on the left and completions on the right to a common width."""
    if len(batches) == 1:
        return dict(batches[0])
    keys = batches[0].keys()
    if any(b.keys() != keys for b in batches):
        raise ValueError(f"rollout batches with different fields: {[sorted(b) for b in batches]}")
    out = {}
    for key in keys:
        values = [b[key] for b in batches]
        if key in COUNT_KEYS or not torch.is_tensor(values[0]) or values[0].dim() == 0:
            out[key] = values[0]
        elif values[0].dim() == 1:
            out[key] = torch.cat(values)
        else:
            width = max(v.shape[1] for v in values)
            value = pad_token_id if key.endswith("_ids") else 0
            left = key.startswith("prompt_")
            padded = []
            for v in values:
                pad = v.new_full((v.shape[0], width - v.shape[1], *v.shape[2:]), value)
                padded.append(torch.cat([pad, v] if left else [v, pad], dim=1))
            out[key] = torch.cat(padded)
    return out


def engine_correction(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                      cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance weights ``pi_trainer / pi_engine`` for rollouts the engine sampled ``[B, T]``.

    ``token_truncate`` (TIS) caps each ratio at ``cap``; ``token_mask`` (MIS) zeroes the tokens whose ratio lies
    outside ``[1 / cap, cap]``. Token level on purpose: a sequence's ratio is a product over up to 32k tokens, and
    bf16 rounding alone puts about half of such sequences outside [1/3, 3]. Padding gets weight 0. Also returns
    the statistics to log (over real tokens): the ratio's mean/min/max, the fraction truncated or masked and the
    mean/max |log-prob difference|."""
    if mode not in ("token_truncate", "token_mask"):
        raise ValueError(f"importance_sampling: {mode!r} is not one of token_truncate, token_mask")
    real = mask.bool()
    diff = (trainer_logps - engine_logps).nan_to_num(0.0)  # a token the engine could not score: no correction
    ratio = diff.clamp(max=50.0).exp()
    if mode == "token_truncate":
        corrected = real & (ratio > cap)
        weights = ratio.clamp(max=cap)
    else:
        corrected = real & ((ratio > cap) | (ratio < 1.0 / cap))
        weights = ratio.masked_fill(corrected, 0.0)
    weights = weights * real
    values, gaps = ratio[real], diff[real].abs()
    if values.numel() == 0:
        values = gaps = torch.zeros(1, device=ratio.device)
    stats = {"ratio/mean": values.mean(), "ratio/min": values.min(), "ratio/max": values.max(),
             "corrected_fraction": corrected.sum() / real.sum().clamp(min=1),
             "logp_difference/mean": gaps.mean(), "logp_difference/max": gaps.max()}
    return weights, stats
