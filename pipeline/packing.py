"""Padding-free micro-batches for the trainer's log-prob and loss passes (verl's dynamic batch size by tokens).

GRPO's batches are ``[prompt (left-padded) | completion (right-padded)]`` rows; padded, every row costs the
longest row's length, and the padding mask made the softmax layers attend through a dense ``[T, T]`` mask. Here
the real tokens of consecutive rows are concatenated into packed rows of at most ``max_tokens`` tokens (a row
longer than that is a packed row of its own), whose ``cu_seqlens`` reset the SSE states and bound attention
(:mod:`sse_model.ops.attention`). Each packed token knows where its completion log-prob goes in the padded
``[rows, completion_length]`` layout the loss expects, so the loss is unchanged by the packing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # [1, N] the real tokens of some consecutive rows
    position_ids: torch.Tensor  # [1, N] restarting at 0 for each row, as the padded pass numbers them
    cu_seqlens: torch.Tensor  # [rows + 1] int32
    labels: torch.Tensor  # [1, N] the completion tokens, IGNORE elsewhere (so also at every row's first token)
    target: torch.Tensor  # [N] flat index into [rows, completion_length] of each completion token, -1 elsewhere


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int,
              max_tokens: int) -> list[PackedRow]:
    """Consecutive rows of the padded ``input_ids [B, T]`` packed into rows of at most ``max_tokens`` tokens; the
    last ``completion_length`` columns are the completion, scored."""
    B, T = input_ids.shape
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if not 0 < completion_length <= T:
        raise ValueError(f"completion_length must be in [1, {T}], got {completion_length}")
    valid = attention_mask.bool()
    lengths = valid.sum(1).tolist()
    first_completion_column = T - completion_length
    column = torch.arange(T, device=input_ids.device).expand(B, T)
    target = torch.where(column >= first_completion_column,
                         torch.arange(B, device=input_ids.device)[:, None] * completion_length
                         + column - first_completion_column, -1)
    labels = torch.where(column >= first_completion_column, input_ids, IGNORE)

    packed, start = [], 0
    while start < B:
        end, tokens = start + 1, lengths[start]
        while end < B and tokens + lengths[end] <= max_tokens:
            tokens += lengths[end]
            end += 1
        rows = valid[start:end]
        seq = torch.tensor([0] + lengths[start:end], device=input_ids.device).cumsum(0)
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths[start:end]])
        row_labels, row_target = labels[start:end][rows], target[start:end][rows]
        firsts = seq[:-1][seq[:-1] < tokens]  # a row's first token is no prediction of the row before it
        row_labels[firsts], row_target[firsts] = IGNORE, -1
        packed.append(PackedRow(
            input_ids=input_ids[start:end][rows][None],
            position_ids=positions[None],
            cu_seqlens=seq.to(torch.int32),
            labels=row_labels[None],
            target=row_target,
        ))
        start = end
    return packed


def unpack_per_token(values: list[torch.Tensor], packed: list[PackedRow], rows: int,
                     completion_length: int) -> torch.Tensor:
    """Per-token values of the packed rows (``values[i][j]`` belongs to token ``j + 1`` of ``packed[i]``, as a
    causal LM's shifted outputs do) -> ``[rows, completion_length]``, zero where nothing was scored; differentiable
    in ``values``."""
    index, picked = [], []
    for value, row in zip(values, packed):
        target = row.target[1:]
        scored = target >= 0
        index.append(target[scored])
        picked.append(value.reshape(-1)[scored])
    index, picked = torch.cat(index), torch.cat(picked)
    out = picked.new_zeros(rows * completion_length).index_copy(0, index, picked)
    return out.view(rows, completion_length)


def packed_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int,
                 max_tokens: int, autocast=contextlib.nullcontext, entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the completions, ``[rows, completion_length]``, from forwards over
    packed rows of at most ``max_tokens`` tokens (the fused LM head scores the labels without materialising the
    logits); ``autocast``: a context factory around each forward (the trainer's)."""
    packed = pack_rows(input_ids, attention_mask, completion_length, max_tokens)
    logps, entropies = [], []
    for row in packed:
        with autocast():
            out = model(input_ids=row.input_ids, position_ids=row.position_ids, cu_seqlens=row.cu_seqlens,
                        labels=row.labels, fused_lm_head=True)
        logps.append(out.log_probs)
        if entropy:
            entropies.append(out.entropy)
    rows = input_ids.shape[0]
    return (unpack_per_token(logps, packed, rows, completion_length),
            unpack_per_token(entropies, packed, rows, completion_length) if entropy else None)
