"""Which sequences run, as vLLM's scheduler decides it: admission of waiting requests and preempted sequences into
free slots and KV blocks, the refill policy, and preemption of the newest work when a decode step lacks blocks.

A request waits until ``n`` slots and the KV blocks of its prompt are free (an engine with work also keeps a
block of room for each of its samples to grow into); preempted sequences go first. While sequences run, waiting
requests are admitted once ``refill_fraction`` of the slots is free (or all that waits fits), so that their prompts
are prefilled together. When a decode step needs blocks that are not free, the most recently admitted sequence or
prefill gives its slots and blocks back and starts again later: the oldest always progresses."""

from __future__ import annotations

from collections import deque

import torch

from .cache import SlotCache
from .options import DEFAULTS
from .request import Request, Sequence


class Scheduler:
    def __init__(self, refill_fraction: float = DEFAULTS.refill_fraction):
        if not 0 <= refill_fraction <= 1:
            raise ValueError(f"refill_fraction must be in [0, 1], got {refill_fraction}")
        self.refill_fraction = refill_fraction
        self.waiting: deque[Request] = deque()
        self.resuming: deque[Sequence] = deque()  # preempted sequences, recomputed before new requests start
        self.prefilling: deque[Request | Sequence] = deque()
        self.running: list[Sequence] = []
        self.promised_blocks = 0  # free blocks promised to the forks of requests being prefilled
        self.preemptions = 0
        self._admissions = 0
        self.cache: SlotCache | None = None

    def use(self, cache: SlotCache, max_slots: int, num_blocks: int, block_size: int) -> None:
        """The cache to schedule into (a new one after every wake), with ``max_slots`` slots of its rows (the last
        row is the graphs' scratch) and ``num_blocks`` KV blocks of ``block_size`` tokens."""
        self.cache, self.max_slots, self.num_blocks, self.block_size = cache, max_slots, num_blocks, block_size
        self.free_slots: deque[int] = deque(range(max_slots))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.resuming or self.prefilling or self.running)

    # -- blocks ------------------------------------------------------------------------------------
    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size) if self.num_blocks else 0

    def blocks_to_admit(self, prompt_len: int, n: int) -> int:
        """The prompt's blocks plus a copy of its partly filled last block for each other sample."""
        return self.blocks_for(prompt_len) + (n - 1) * int(self.num_blocks > 0 and prompt_len % self.block_size > 0)

    def free_blocks(self) -> int:
        return self.cache.blocks.num_free - self.promised_blocks

    def view(self, longest: int) -> None:
        """KV blocks the attention of a step reads per row (the gather path; the paged kernel reads lengths)."""
        self.cache.view_blocks = min(_power_of_two(self.blocks_for(longest)), self.cache.max_blocks_per_slot)

    # -- admission -----------------------------------------------------------------------------------
    def admit(self) -> None:
        """Preempted sequences first, then waiting requests in order, while slots and KV blocks are free."""
        while self.resuming and self.free_slots and \
                self.blocks_for(self.resuming[0].cached_length + 1) <= self.free_blocks():
            seq = self.resuming.popleft()
            seq.slot, seq.prefilled, seq.stamp = self.free_slots.popleft(), 0, self._stamp()
            self.cache.grow([seq.slot], [seq.cached_length])
            self.prefilling.append(seq)
        if self.running and not self.refill_due():
            return
        while not self.resuming and self.waiting and len(self.free_slots) >= self.waiting[0].params.n:
            request = self.waiting[0]
            prompt_len, n = len(request.prompt_ids), request.params.n
            need = self.blocks_to_admit(prompt_len, n)
            busy = bool(self.running or self.prefilling)  # an idle engine admits whatever fits
            if need + (n if self.num_blocks and busy else 0) > self.free_blocks():
                break
            self.waiting.popleft()
            request.slots = [self.free_slots.popleft() for _ in range(n)]
            request.stamp, request.prefilled = self._stamp(), 0
            self.cache.grow(request.slots[:1], [prompt_len])
            request.promised = need - self.blocks_for(prompt_len)
            self.promised_blocks += request.promised
            self.prefilling.append(request)

    def refill_due(self) -> bool:
        """Whether waiting requests are admitted now: nothing runs, or ``refill_fraction`` of the slots (or as many
        as all waiting requests need) are free."""
        if not self.waiting:
            return False
        if not self.running:
            return True
        want, waiting = max(1, int(self.refill_fraction * self.max_slots)), 0
        for request in self.waiting:
            waiting += request.params.n
            if waiting >= want:
                break
        return len(self.free_slots) >= min(want, waiting)

    def stuck(self) -> str | None:
        """Why the engine cannot go on (nothing runs or prefills, yet work waits), or None."""
        if self.running or self.prefilling or not (self.waiting or self.resuming):
            return None
        return (f"the engine is idle but cannot admit what waits ({len(self.waiting)} requests, {len(self.resuming)} "
                f"preempted sequences; {len(self.free_slots)} free slots, {self.free_blocks()} of {self.num_blocks} "
                "KV blocks free)")

    def packable(self, budget: int) -> list[Request]:
        """The new requests at the head of the prefill queue whose whole prompts fit in ``budget`` tokens
        together, when the cache takes packed prefills."""
        if not self.cache.packs_prefill:
            return []
        pack = []
        for job in self.prefilling:
            if isinstance(job, Sequence) or job.prefilled or len(job.prompt_ids) > budget:
                break
            pack.append(job)
            budget -= len(job.prompt_ids)
        return pack

    def started(self, request: Request) -> None:
        """A prefilled request's forks took the blocks promised to them."""
        self.promised_blocks -= request.promised

    # -- running -------------------------------------------------------------------------------------
    def grow_running(self) -> None:
        """Every running sequence gets the blocks its next token needs; while they are short, the newest sequence
        or prefill is preempted."""
        while self.running:
            lengths = [s.cached_length + 1 for s in self.running]
            try:
                self.cache.grow([s.slot for s in self.running], lengths, keep_free=self.promised_blocks)
            except MemoryError:
                self.preempt_newest()
                continue
            self.view(max(lengths))
            return

    def grow_ahead(self, seqs: list[Sequence]) -> bool:
        """Blocks for two more tokens of each of ``seqs`` (a step queued behind an unread one), if free."""
        try:
            self.cache.grow([s.slot for s in seqs], [s.cached_length + 2 for s in seqs], keep_free=self.promised_blocks)
        except MemoryError:
            return False
        self.view(max(s.cached_length + 2 for s in seqs))
        return True

    def release(self, slot: int) -> None:
        self.cache.reset(torch.tensor([slot], device=self.cache.lengths.device))
        self.free_slots.append(slot)

    def preempt_newest(self) -> None:
        """Returns the slots and blocks of the most recently admitted sequence or prefill: it starts again when
        there is room. The oldest sequence is never the newest, so it always progresses."""
        job = max([*self.running, *self.prefilling], key=lambda j: j.stamp)
        if isinstance(job, Request):
            self.prefilling.remove(job)
            for slot in job.slots:
                self.release(slot)
            job.slots = []
            self.promised_blocks -= job.promised
            self.waiting.appendleft(job)
        else:
            (self.running if job in self.running else self.prefilling).remove(job)
            self.release(job.slot)
            job.slot = -1
            self.resuming.appendleft(job)
        self.preemptions += 1

    def _stamp(self) -> int:
        self._admissions += 1
        return self._admissions


def _power_of_two(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size
