"""Gradient checkpointing that keeps what is costly to rebuild instead of computing it twice.

A checkpointed block runs its forward once without keeping activations and again in the backward to rebuild
them. Most of a block is cheap to rebuild on the GPU (projections, norms, elementwise glue), but two things
are not: the chunk kernels' forward (for SSE twice GLA's; it produces the output and the chunk states that
its backward reads), and the host's work of building the chunk plan (the routing's counting sort and the chunk
tables: dozens of small operators per layer, while an SSE-H step is close to bound by the host).
:class:`KeptOutputs` gives ``torch.utils.checkpoint`` (non-reentrant) a pair of contexts through its
``context_fn``: while the forward runs, every :func:`kept_outputs` call computes and records its result;
while the backward rebuilds the block, the same calls, in the same order, return the recorded results instead
of computing them. Plans are small and always kept; ``large`` results (the chunk kernels' outputs and states)
only when asked for. The record lives as long as the checkpoint's saved state.

Unlike ``torch.utils.checkpoint``'s selective policies, nothing intercepts the other operators of the block:
a dispatch mode that sees every operator cost more host time per step than the kernels it saved.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable

# per thread (the backward, and so the rebuild, of CUDA tensors runs on autograd's device thread): the
# (record, replaying?) of the checkpoints being run, innermost last
_local = threading.local()


def _active() -> list[tuple["KeptOutputs", bool]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class KeptOutputs:
    """The results of one checkpointed block's :func:`kept_outputs` calls, in call order; ``keep_large``:
    whether calls marked ``large`` are kept too (else they are computed again when the block is rebuilt)."""

    def __init__(self, keep_large: bool = True):
        self.keep_large = keep_large
        self.results: list = []
        self.cursor = 0

    @contextmanager
    def recording(self):
        self.results.clear()
        _active().append((self, False))
        try:
            yield
        finally:
            _active().pop()

    @contextmanager
    def replaying(self):
        self.cursor = 0  # every backward pass that rebuilds the block replays from the start
        _active().append((self, True))
        try:
            yield
        finally:
            _active().pop()

    def contexts(self):
        """``(forward context, recomputation context)``: what ``context_fn`` returns."""
        return self.recording(), self.replaying()


def kept_outputs(compute: Callable[[], Any], large: bool = False) -> Any:
    """``compute()``, recorded in a checkpoint's forward and taken from the record in its recomputation."""
    stack = _active()
    if not stack:
        return compute()
    record, replaying = stack[-1]
    if large and not record.keep_large:
        return compute()
    if not replaying:
        result = compute()
        record.results.append(result)
        return result
    if record.cursor >= len(record.results):
        raise RuntimeError("a checkpointed block made more kept calls when rebuilt than in its forward")
    result = record.results[record.cursor]
    record.cursor += 1
    return result
