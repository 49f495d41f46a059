"""How data-parallel workers make one optimizer step: a recipe fixes the rows of a step and the rows one worker
runs through a forward; the number of workers (where the run is, :mod:`pipeline.placement`) decides the
accumulation. One place for the arithmetic, used when a recipe loads, when a run plans and inside each trainer."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RecipeError


def count(n: int, thing: str) -> str:
    return f"{n} {thing}{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class Batching:
    """How ``workers`` data-parallel processes make one optimizer step of ``rows`` rows: ``micro`` rows a forward on
    each, ``accumulation`` forwards before each step (``rows = micro * accumulation * workers``)."""

    rows: int
    workers: int
    micro: int
    accumulation: int

    def describe(self, what: str = "rows") -> str:
        return (f"{self.rows} {what} a step = {self.micro} a forward x {self.accumulation} accumulated x "
                f"{count(self.workers, 'worker')}")


def batching(rows: int, micro: int | None, workers: int, keys: tuple[str, str], gpus_text: str) -> Batching:
    """The split of an optimizer step of ``rows`` rows over ``workers`` workers of at most ``micro`` rows a forward
    (None: all of a worker's share in one forward); refused, naming the recipe's ``keys`` (rows, micro), when they do
    not divide."""
    rows_key, micro_key = keys
    if rows % workers:
        raise RecipeError(f"{rows_key}: {rows} rows a step do not divide over {workers} workers ({gpus_text}); "
                          f"make it a multiple of {workers}, or set the workers' count")
    micro = min(micro or rows, rows // workers)  # a memory cap: a worker's share may be smaller
    if (rows // workers) % micro:
        raise RecipeError(f"{micro_key}: {micro} rows a forward do not divide a worker's {rows // workers} rows of "
                          f"{rows_key}={rows} over {workers} workers ({gpus_text})")
    return Batching(rows, workers, micro, rows // workers // micro)


def distill_batching(recipe, workers: int, where: str = "") -> Batching:
    d = recipe.distill
    return batching(d.batch_size, d.micro_batch_size, workers, ("distill.batch_size", "distill.micro_batch_size"),
                    where or f"{workers} workers")


def align_batching(recipe) -> Batching:
    a = recipe.align
    return batching(a.batch_size, a.micro_batch_size, 1, ("align.batch_size", "align.micro_batch_size"), "one process")


def grpo_batching(recipe, workers: int, where: str = "") -> Batching:
    """The rollouts of one optimizer step (a mini-batch of the generation batch) over ``workers`` trainer workers."""
    g = recipe.grpo
    where = where or f"{workers} trainer workers"
    if g.prompts_per_batch % workers:
        raise RecipeError(f"grpo.prompts_per_batch: {g.prompts_per_batch} prompts do not divide over {workers} "
                          f"trainer workers ({where}; each generates whole groups)")
    rows = g.prompts_per_batch // g.mini_batches * g.num_generations
    return batching(rows, g.micro_batch_size, workers,
                    ("grpo.prompts_per_batch / grpo.mini_batches x grpo.num_generations", "grpo.micro_batch_size"),
                    where)
