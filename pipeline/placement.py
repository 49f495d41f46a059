"""Where GRPO's trainer workers and rollout engines run: one Ray placement group per stage, so the GPUs are
reserved together (all or nothing) and a trainer and the engines meant to share its GPU land on the same one.

- ``colocated``: a bundle, one GPU, per trainer worker; the worker takes half of it, its engines share the
  other half and free their memory while it trains (``grpo.engine.sleep``);
- ``split``: a bundle per process, a GPU each: the trainer workers', then ``num_engines`` per worker (NCCL
  weight broadcast possible, no sleeping).

``grpo.placement: auto`` is colocated when there is one GPU per trainer worker and split when there are more.
Each trainer worker owns its engines (``grpo.num_engines`` of them) and syncs them itself; the workers'
weights are equal under data parallelism. Without GPUs there is no group: everything shares the cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray


@dataclass
class GRPOPlacement:
    mode: str  # "colocated" | "split" | "cpu"
    trainer: dict  # Ray resources of each trainer worker
    engine: dict  # Ray resources of each engine
    bundles: list[dict] = field(default_factory=list)  # the placement group's bundles (empty: no group)
    trainer_bundles: list[int] = field(default_factory=list)  # bundle of each trainer worker
    engine_bundles: list[list[int]] = field(default_factory=list)  # bundles of each worker's engines

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    def trainer_options(self, group, rank: int) -> dict:
        """Ray options of trainer worker ``rank`` (in its bundle when there is a group)."""
        if group is None:
            return dict(self.trainer)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {**self.trainer, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, self.trainer_bundles[rank])}


def plan_grpo(mode: str, gpus: int, cpus: int, num_engines: int, num_workers: int = 1) -> GRPOPlacement:
    """The placement of a GRPO stage on a cluster of ``gpus`` GPUs and ``cpus`` cores (pure: no Ray calls)."""
    W, E = num_workers, num_engines
    if gpus == 0:
        if mode != "auto":
            raise ValueError(f"grpo.placement: {mode} places GPUs; this cluster has none (use auto)")
        if W * (1 + E) > cpus:  # Ray would wait for them forever, printing nothing
            raise ValueError(f"grpo.num_workers={W} with grpo.num_engines={E} each needs {W * (1 + E)} CPUs on a "
                             f"cluster without GPUs (a core per trainer worker and per engine); it has {cpus} "
                             "(ray.num_cpus)")
        return GRPOPlacement("cpu", {"num_cpus": max(1, (cpus - W * E) // W), "num_gpus": 0},
                             {"num_cpus": 1, "num_gpus": 0})
    mode = ("colocated" if gpus == W else "split") if mode == "auto" else mode
    if mode == "colocated":
        if W > gpus:
            raise ValueError(f"grpo.placement colocated with grpo.num_workers={W} needs {W} GPUs; the cluster has {gpus}")
        return GRPOPlacement("colocated", {"num_cpus": 1, "num_gpus": 0.5}, {"num_cpus": 1, "num_gpus": 0.5 / E},
                             bundles=[{"GPU": 1, "CPU": 1 + E}] * W, trainer_bundles=list(range(W)),
                             engine_bundles=[[r] * E for r in range(W)])
    if mode != "split":
        raise ValueError(f"grpo.placement must be auto, colocated or split, got {mode!r}")
    if W * (1 + E) > gpus:
        raise ValueError(f"grpo.placement split with grpo.num_workers={W} and grpo.num_engines={E} needs "
                         f"{W * (1 + E)} GPUs (a trainer worker and its engines each on their own); the cluster "
                         f"has {gpus}")
    return GRPOPlacement("split", {"num_cpus": 1, "num_gpus": 1}, {"num_cpus": 1, "num_gpus": 1},
                         bundles=[{"GPU": 1, "CPU": 1}] * (W * (1 + E)), trainer_bundles=list(range(W)),
                         engine_bundles=[[W + r * E + j for j in range(E)] for r in range(W)])


def reserve(plan: GRPOPlacement, timeout_s: float = 600.0):
    """Creates the plan's placement group and waits until its GPUs are reserved; None without bundles."""
    if not plan.bundles:
        return None
    group = ray.util.placement_group(plan.bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"grpo: could not reserve {plan.bundles} ({plan.mode}) in {timeout_s:.0f} s; "
                           f"cluster resources: {ray.cluster_resources()}")
    return group
