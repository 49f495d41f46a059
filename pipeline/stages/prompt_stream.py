"""The prompts of every generation batch, known before the trainer asks for them: asynchronous GRPO
(``grpo.max_staleness: k``) starts the engines on batches ``j + 1 .. j + k`` while the trainers train on batch
``j``, so it cannot wait for TRL's sampler to hand them over."""

from __future__ import annotations

import torch


class PromptStream:
    """Batch ``j`` is rows ``[j * P, (j + 1) * P)`` of the data set's seeded permutations laid end to end (one
    permutation an epoch, as TRL's sampler shuffles); data-parallel worker ``rank`` of ``world`` takes the ``rank``-th
    share of its prompts. The same ``j`` gives the same rows after a resume."""

    def __init__(self, size: int, prompts_per_batch: int, seed: int, rank: int = 0, world: int = 1):
        if prompts_per_batch % world:
            raise ValueError(f"{prompts_per_batch} prompts a batch do not divide over {world} workers")
        self.size, self.per_batch, self.seed, self.rank, self.world = size, prompts_per_batch, seed, rank, world
        self._epochs: dict[int, list[int]] = {}

    def _epoch(self, e: int) -> list[int]:
        if e not in self._epochs:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + e)
            self._epochs[e] = torch.randperm(self.size, generator=generator).tolist()
        return self._epochs[e]

    def rows(self, j: int) -> list[int]:
        """This worker's data-set rows of generation batch ``j``."""
        share = self.per_batch // self.world
        first = j * self.per_batch + self.rank * share
        return [self._epoch(i // self.size)[i % self.size] for i in range(first, first + share)]
