"""Where every stage runs: the recipe fixes what one optimizer step is (rows per step), the GPUs a run is given
decide how many workers share it. :func:`plan` turns a recipe and a cluster's GPUs and CPUs into a :class:`Plan`,
printed when a run starts and checked before any stage does; the stages read their share from it.

- distillation: one data-parallel worker per GPU (``distill.num_workers`` to use fewer), each taking
  ``micro_batch_size`` rows a forward and accumulating until the workers together have ``batch_size`` rows;
- alignment: one process (attention transfer runs the model's layers outside its forward, which DDP does not see);
- GRPO, ``colocated`` (``auto``'s choice): a trainer worker on every GPU, its engine beside it (sleeping while the
  trainer trains; one engine, which batches every request: more on one GPU would only divide its memory);
  ``split``: a quarter of the GPUs train (at least one), the others each hold an engine (NCCL weight broadcast
  possible, nothing sleeps); rollouts take most of a step at long generations (the paper-2b dry run: 422 s of
  rollout against 45 s of training a batch), so most GPUs generate;
- evaluation: one generation worker per GPU, each a shard of every benchmark.

GRPO's trainers and engines are reserved together in one Ray placement group (all or nothing), so that an
engine meant to share a trainer's GPU lands on it. Without GPUs everything shares the cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .batching import Batching, align_batching, distill_batching, grpo_batching
from .batching import count as _count
from .errors import RecipeError
from .recipe import Recipe

SPLIT_TRAINER_SHARE = 4  # split: one trainer GPU in this many (see the module docstring)


@dataclass
class GRPOPlacement:
    mode: str  # "colocated" | "split" | "cpu"
    trainer: dict  # Ray resources of each trainer worker
    engine: dict  # Ray resources of each engine
    bundles: list[dict] = field(default_factory=list)  # the placement group's bundles (empty: no group)
    trainer_bundles: list[int] = field(default_factory=list)  # bundle of each trainer worker
    engine_bundles: list[list[int]] = field(default_factory=list)  # bundles of each worker's engines
    workers: int = 1
    engines: int = 1  # per trainer worker

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    def trainer_options(self, group, rank: int) -> dict:
        """Ray options of trainer worker ``rank`` (in its bundle when there is a group)."""
        if group is None:
            return dict(self.trainer)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(group, self.trainer_bundles[rank])
        return {**self.trainer, "scheduling_strategy": strategy}


def plan_grpo(mode: str, gpus: int, cpus: int, num_engines: int | None = None,
              num_workers: int | None = None) -> GRPOPlacement:
    """The placement of a GRPO stage on a cluster of ``gpus`` GPUs and ``cpus`` cores (pure: no Ray calls).
    ``num_workers`` trainer workers and ``num_engines`` engines each; None: as many as use every GPU."""
    if gpus == 0:
        if mode != "auto":
            raise RecipeError(f"grpo.placement: {mode} places GPUs; this cluster has none (use auto)")
        W, E = num_workers or 1, num_engines or 1
        if W * (1 + E) > cpus:  # Ray would wait for them forever, printing nothing
            raise RecipeError(f"grpo.num_workers={W} with grpo.num_engines={E} each needs {W * (1 + E)} CPUs on a "
                              f"cluster without GPUs (a core per trainer worker and per engine); it has {cpus} "
                              "(ray.num_cpus)")
        return GRPOPlacement("cpu", {"num_cpus": max(1, (cpus - W * E) // W), "num_gpus": 0},
                             {"num_cpus": 1, "num_gpus": 0}, workers=W, engines=E)
    if mode == "auto":
        mode = "colocated" if num_workers in (None, gpus) else "split"
    if mode == "colocated":
        W, E = num_workers or gpus, num_engines or 1
        if E > 1:  # each would plan its memory from what the others leave
            raise RecipeError(f"grpo.num_engines={E}: colocated engines share their trainer's GPU, where one engine "
                              "batches every request and more would only divide its memory; use 1, or "
                              "grpo.placement: split for engines on GPUs of their own")
        if W > gpus:
            raise RecipeError(f"grpo.placement colocated with grpo.num_workers={W} needs {W} GPUs; the cluster has "
                              f"{gpus}")
        return GRPOPlacement("colocated", {"num_cpus": 1, "num_gpus": 0.5}, {"num_cpus": 1, "num_gpus": 0.5},
                             bundles=[{"GPU": 1, "CPU": 2}] * W, trainer_bundles=list(range(W)),
                             engine_bundles=[[r] for r in range(W)], workers=W, engines=1)
    if mode != "split":
        raise RecipeError(f"grpo.placement must be auto, colocated or split, got {mode!r}")
    if gpus < 2:
        raise RecipeError(f"grpo.placement split gives the trainer and the engines GPUs of their own: it needs 2 GPUs "
                          f"at least; the cluster has {gpus}")
    W = num_workers or max(1, gpus // SPLIT_TRAINER_SHARE)
    E = num_engines or max(1, (gpus - W) // W)
    if W * (1 + E) > gpus:
        raise RecipeError(f"grpo.placement split with grpo.num_workers={W} and grpo.num_engines={E} needs "
                          f"{W * (1 + E)} GPUs (a trainer worker and its engines each on their own); the cluster "
                          f"has {gpus}")
    return GRPOPlacement("split", {"num_cpus": 1, "num_gpus": 1}, {"num_cpus": 1, "num_gpus": 1},
                         bundles=[{"GPU": 1, "CPU": 1}] * (W * (1 + E)), trainer_bundles=list(range(W)),
                         engine_bundles=[[W + r * E + j for j in range(E)] for r in range(W)], workers=W, engines=E)


@dataclass
class Plan:
    """Where and how each stage of a recipe runs on a given cluster."""

    gpus: int
    cpus: int
    stages: tuple[str, ...]  # the stages planned (another stage's settings may not fit this cluster)
    distill: Batching
    align: Batching
    grpo: GRPOPlacement | None
    grpo_batching: Batching | None
    eval_workers: int

    @property
    def whole(self) -> dict:
        """Ray resources of a stage's single process (alignment, one-worker distillation or evaluation)."""
        return {"num_cpus": self.cpus if self.gpus == 0 else 1, "num_gpus": min(self.gpus, 1)}

    @property
    def train_worker(self) -> dict:
        """Ray resources of one data-parallel training worker: a GPU each, or an equal share of the cores."""
        if self.gpus:
            return {"num_cpus": 1, "num_gpus": 1}
        return {"num_cpus": max(1, self.cpus // self.distill.workers), "num_gpus": 0}

    @property
    def eval_gpus(self) -> int:
        return 1 if self.gpus else 0

    def describe(self) -> str:
        stages = self.stages
        where = _count(self.gpus, "GPU") if self.gpus else f"{_count(self.cpus, 'CPU')}, no GPU"
        lines = [f"plan on {where}:"]
        if "align" in stages:
            lines.append(f"  align:   1 process; {self.align.describe('packed rows')}")
        if "distill" in stages:
            lines.append(f"  distill: {_count(self.distill.workers, 'data-parallel worker')}"
                         f"{', a GPU each' if self.gpus else ''}; {self.distill.describe()}")
        if "grpo" in stages:
            g = self.grpo
            layout = {"colocated": f"{_count(g.workers, 'trainer worker')}, each with its engine on its GPU",
                      "split": f"{_count(g.workers, 'trainer GPU')}, " + _count(g.workers * g.engines, "engine GPU"),
                      "cpu": f"{_count(g.workers, 'trainer worker')} with {_count(g.engines, 'engine')} each, "
                             "on the cores"}[g.mode]
            idle = self.gpus - len(g.bundles) if g.bundles else 0
            idle_text = f" ({_count(idle, 'GPU')} idle)" if idle else ""
            lines.append(f"  grpo:    {g.mode}: {layout}{idle_text}; "
                         f"{self.grpo_batching.describe('rollouts')}")
        if "eval" in stages:
            lines.append(f"  eval:    {_count(self.eval_workers, 'generation worker')}"
                         f"{', a GPU each' if self.gpus else ''}")
        return "\n".join(lines)


def plan(recipe: Recipe, gpus: int, cpus: int, stages: tuple[str, ...] = ("align", "distill", "grpo", "eval")) -> Plan:
    """The plan of ``stages`` of ``recipe`` on ``gpus`` GPUs (0: CPU only) and ``cpus`` cores; refuses, naming the
    recipe's keys and the GPUs, what cannot run there (a batch that does not divide over the workers, too few
    devices)."""
    where = f"{gpus} GPUs" if gpus else f"{cpus} CPUs"
    workers = recipe.distill.num_workers or max(gpus, 1)
    if gpus and workers > gpus:
        raise RecipeError(f"distill.num_workers={workers} needs {workers} GPUs (one per worker); the cluster has "
                          f"{gpus}")
    if not gpus and workers > cpus:  # Ray would wait for the cores forever, printing nothing
        raise RecipeError(f"distill.num_workers={workers} needs {workers} CPUs (one per worker) on a cluster without "
                          f"GPUs; it has {cpus} (ray.num_cpus)")
    g = recipe.grpo
    grpo = plan_grpo(g.placement, gpus, cpus, g.num_engines, g.num_workers) if "grpo" in stages else None
    return Plan(gpus, cpus, tuple(stages), distill_batching(recipe, workers, where), align_batching(recipe), grpo,
                grpo_batching(recipe, grpo.workers, where) if grpo else None, recipe.eval.num_workers or max(gpus, 1))


def cluster_plan(recipe: Recipe, stages: tuple[str, ...]) -> Plan:
    """:func:`plan` of ``stages`` on the cluster Ray is connected to (its GPUs unless the recipe runs on the CPU)."""
    import ray

    from .models import resolve_device

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0)) if resolve_device(recipe.device).type == "cuda" else 0
    return plan(recipe, gpus, max(1, int(resources.get("CPU", 1))), stages)


def reserve(plan: GRPOPlacement, timeout_s: float = 600.0):
    """Creates the plan's placement group and waits until its GPUs are reserved; None without bundles."""
    import ray

    if not plan.bundles:
        return None
    group = ray.util.placement_group(plan.bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"grpo: could not reserve {plan.bundles} ({plan.mode}) in {timeout_s:.0f} s; "
                           f"cluster resources: {ray.cluster_resources()}")
    return group
