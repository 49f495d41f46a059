"""Gradient checkpointing that keeps the chunked linear-attention forward instead of running it twice.

A checkpointed block runs its forward once without keeping activations and again in the backward to rebuild
them. Most of a block is cheap to rebuild (projections, norms, elementwise glue), but the chunk kernels'
forward is not: for SSE it is twice GLA's, and it produces the very tensors its backward reads (the output
and the chunk states). :class:`KeptOutputs` gives ``torch.utils.checkpoint`` (non-reentrant) a pair of
contexts through its ``context_fn``: while the forward runs, every :func:`kept_outputs` call computes and
records its result; while the backward rebuilds the block, the same calls, in the same order, return the
recorded results instead of computing them. The record lives as long as the checkpoint's saved state.

Unlike ``torch.utils.checkpoint``'s selective policies, nothing intercepts the other operators of the block:
a dispatch mode that sees every operator cost more host time per step than the kernels it saved.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

_active: list[tuple["KeptOutputs", bool]] = []  # (record, replaying?) of the checkpoint being run, innermost last


class KeptOutputs:
    """The results of one checkpointed block's :func:`kept_outputs` calls, in call order."""

    def __init__(self):
        self.results: list[tuple] = []
        self.cursor = 0

    @contextmanager
    def recording(self):
        self.results.clear()
        _active.append((self, False))
        try:
            yield
        finally:
            _active.pop()

    @contextmanager
    def replaying(self):
        self.cursor = 0  # every backward pass that rebuilds the block replays from the start
        _active.append((self, True))
        try:
            yield
        finally:
            _active.pop()

    def contexts(self):
        """``(forward context, recomputation context)``: what ``context_fn`` returns."""
        return self.recording(), self.replaying()


def kept_outputs(compute: Callable[[], tuple]) -> tuple:
    """``compute()``, recorded in a checkpoint's forward and taken from the record in its recomputation."""
    if not _active:
        return compute()
    record, replaying = _active[-1]
    if not replaying:
        result = compute()
        record.results.append(result)
        return result
    if record.cursor >= len(record.results):
        raise RuntimeError("a checkpointed block made more kept calls when rebuilt than in its forward")
    result = record.results[record.cursor]
    record.cursor += 1
    return result
