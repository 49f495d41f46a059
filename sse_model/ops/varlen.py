"""Helpers for packed variable-length batches described by ``cu_seqlens``.

A packed batch has shape ``[1, total_tokens, ...]`` and ``cu_seqlens = [0, len_0, len_0 + len_1, ...]``.
The PyTorch reference ops run on a dense ``[num_seqs, padded_len, ...]`` layout instead: padding at the
end of a sequence is neutral for every recurrence here (zero key, zero value, zero log-decay, zero beta),
so padding, running dense, and gathering back is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary


# cu_seqlens tensors already checked, with the version and token count they were checked at: a forward passes one
# tensor to every layer, and each check reads it on the host (a device sync per layer call, ~3 before this)
_CHECKED = WeakIdKeyDictionary()


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch_size: int, total: int) -> None:
    """Errors for a malformed packed batch. The values are read on the host once per tensor (one sync): later calls
    with the same, unmodified tensor and token count pass without reading it. Inference tensors keep no version to
    tell a change by, so each of their calls reads them."""
    if batch_size != 1:
        raise ValueError(f"packed inputs with cu_seqlens must have batch size 1, got {batch_size}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [num_seqs + 1], got shape {tuple(cu_seqlens.shape)}")
    seen = None if cu_seqlens.is_inference() else (cu_seqlens._version, total)
    if seen is not None and _CHECKED.get(cu_seqlens) == seen:
        return
    decreasing = (cu_seqlens[1:] < cu_seqlens[:-1]).any()
    first, last, decreasing = torch.stack([cu_seqlens[0], cu_seqlens[-1], decreasing.to(cu_seqlens.dtype)]).tolist()
    if first != 0 or last != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at the number of tokens ({total}), got {first}..{last}")
    if decreasing:
        raise ValueError("cu_seqlens must be non-decreasing")
    if seen is not None:
        _CHECKED[cu_seqlens] = seen


@dataclass
class PaddedLayout:
    """Where each packed token lives in the dense ``[num_seqs * padded_len]`` layout."""

    index: torch.Tensor  # [total] flat position of each token in the dense layout
    num_seqs: int
    padded_len: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, multiple: int = 1) -> "PaddedLayout":
        cu_seqlens = cu_seqlens.long()
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        num_seqs = lengths.numel()
        max_len = int(lengths.max()) if num_seqs > 0 else 0
        padded_len = max(multiple, -(-max_len // multiple) * multiple)
        total = int(cu_seqlens[-1])
        token = torch.arange(total, device=cu_seqlens.device)
        seq_id = torch.repeat_interleave(torch.arange(num_seqs, device=cu_seqlens.device), lengths)
        pos = token - cu_seqlens[seq_id]
        return cls(seq_id * padded_len + pos, num_seqs, padded_len)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, total, *rest]`` -> ``[num_seqs, padded_len, *rest]`` with zeros in the padding."""
        flat = x[0]
        out = flat.new_zeros((self.num_seqs * self.padded_len, *flat.shape[1:]))
        out = out.index_copy(0, self.index, flat)
        return out.view(self.num_seqs, self.padded_len, *flat.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_seqs, padded_len, *rest]`` -> ``[1, total, *rest]``."""
        flat = x.reshape(self.num_seqs * self.padded_len, *x.shape[2:])
        return flat.index_select(0, self.index).unsqueeze(0)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulate in float64 for float64 inputs (tests), float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Sequence boundaries of a packed ``[1, T]`` batch whose position ids restart at 0 for each sample."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    pos = position_ids[0]
    starts = torch.nonzero(pos == 0, as_tuple=True)[0]
    if starts.numel() <= 1:
        return None
    if int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    total = torch.tensor([pos.numel()], device=pos.device, dtype=starts.dtype)
    return torch.cat([starts, total]).to(torch.int32)


class ChunkLayout:
    """Packs sequences chunk-aligned: each sequence is padded only up to a multiple of ``chunk_size``.

    Chunks of all sequences are computed in parallel; the recurrence over chunk states then walks chunk
    index ``j = 0, 1, ...`` and advances, at each step, only the sequences that have a ``j``-th chunk. Work
    and memory are proportional to the real tokens, which is what makes the varlen SSE path pay off.
    """

    def __init__(self, cu_seqlens: torch.Tensor, chunk_size: int):
        cu_seqlens = cu_seqlens.long()
        device = cu_seqlens.device
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        self.chunk_size = C = chunk_size
        self.num_seqs = lengths.numel()
        n_chunks = (lengths + C - 1) // C
        chunk_start = torch.cumsum(n_chunks, 0) - n_chunks
        self.num_chunks = int(n_chunks.sum())
        total = int(cu_seqlens[-1])
        token = torch.arange(total, device=device)
        seq_id = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), lengths)
        pos = token - cu_seqlens[seq_id]
        self.index = (chunk_start[seq_id] + pos // C) * C + pos % C
        self.identity = self.num_chunks * C == total and bool((self.index == token).all())
        self.steps = []
        n_host = n_chunks.tolist()
        for j in range(max(n_host, default=0)):
            seqs = [s for s, n in enumerate(n_host) if n > j]
            seq_idx = torch.tensor(seqs, device=device, dtype=torch.long)
            full = len(seqs) == self.num_seqs
            self.steps.append((None if full else seq_idx, chunk_start[seq_idx] + j))

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, total, *rest]`` -> ``[num_chunks, chunk_size, *rest]`` (zeros in the padding)."""
        flat = x[0]
        if not self.identity:
            out = flat.new_zeros((self.num_chunks * self.chunk_size, *flat.shape[1:]))
            flat = out.index_copy(0, self.index, flat)
        return flat.reshape(self.num_chunks, self.chunk_size, *flat.shape[1:])

    def from_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_chunks, chunk_size, *rest]`` -> ``[1, total, *rest]``."""
        flat = x.reshape(self.num_chunks * self.chunk_size, *x.shape[2:])
        if not self.identity:
            flat = flat.index_select(0, self.index)
        return flat.unsqueeze(0)


def dense_cu_seqlens(batch_size: int, seq_len: int, device) -> torch.Tensor:
    return torch.arange(0, (batch_size + 1) * seq_len, seq_len, device=device, dtype=torch.long)


def scan_chunks(layout: ChunkLayout, state: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs ``out_j, state = step(chunk_ids, state_of_those_seqs)`` along the chunk order of ``layout``.

    Returns the per-chunk outputs gathered into chunk order and the final per-sequence state.
    """
    ids, outs = [], []
    for seqs, chunk_ids in layout.steps:
        current = state if seqs is None else state.index_select(0, seqs)
        out, new = step(chunk_ids, current)
        state = new if seqs is None else state.index_copy(0, seqs, new)
        ids.append(chunk_ids)
        outs.append(out)
    if not outs:
        return state.new_zeros(0), state
    order = torch.cat(ids)
    stacked = torch.cat(outs)
    result = stacked.new_zeros(stacked.shape).index_copy(0, order, stacked)
    return result, state
