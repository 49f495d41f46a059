"""Where GRPO's trainer and rollout engines run: one Ray placement group per stage, so the GPUs are reserved
together (all or nothing) and a trainer and the engines meant to share its GPU land on the same one.

- ``colocated``: one bundle, one GPU; the trainer takes half of it, the engines share the other half and free
  their memory while the trainer trains (``grpo.engine.sleep``);
- ``split``: a bundle per process, a GPU each: the trainer's, then one per engine (NCCL weight broadcast
  possible, no sleeping).

``grpo.placement: auto`` is colocated on one GPU and split on more. Without GPUs there is no group: the
trainer and the engines share the cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray


@dataclass
class GRPOPlacement:
    mode: str  # "colocated" | "split" | "cpu"
    trainer: dict  # Ray options of the trainer task
    engine: dict  # Ray resources of each engine (num_gpus, num_cpus)
    bundles: list[dict] = field(default_factory=list)  # the placement group's bundles (empty: no group)
    engine_bundles: list[int] = field(default_factory=list)  # bundle of each engine

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"


def plan_grpo(mode: str, gpus: int, cpus: int, num_engines: int) -> GRPOPlacement:
    """The placement of a GRPO stage on a cluster of ``gpus`` GPUs and ``cpus`` cores (pure: no Ray calls)."""
    if gpus == 0:
        if mode != "auto":
            raise ValueError(f"grpo.placement: {mode} places GPUs; this cluster has none (use auto)")
        return GRPOPlacement("cpu", {"num_cpus": max(1, cpus - num_engines), "num_gpus": 0},
                             {"num_cpus": 1, "num_gpus": 0})
    mode = ("colocated" if gpus == 1 else "split") if mode == "auto" else mode
    if mode == "colocated":
        return GRPOPlacement("colocated", {"num_cpus": 1, "num_gpus": 0.5},
                             {"num_cpus": 1, "num_gpus": 0.5 / num_engines},
                             bundles=[{"GPU": 1, "CPU": 1 + num_engines}], engine_bundles=[0] * num_engines)
    if mode != "split":
        raise ValueError(f"grpo.placement must be auto, colocated or split, got {mode!r}")
    if num_engines + 1 > gpus:
        raise ValueError(f"grpo.placement split with grpo.num_engines={num_engines} needs {num_engines + 1} GPUs "
                         f"(one for the trainer); the cluster has {gpus}")
    return GRPOPlacement("split", {"num_cpus": 1, "num_gpus": 1}, {"num_cpus": 1, "num_gpus": 1},
                         bundles=[{"GPU": 1, "CPU": 1}] * (1 + num_engines),
                         engine_bundles=list(range(1, 1 + num_engines)))


def reserve(plan: GRPOPlacement, timeout_s: float = 600.0):
    """Creates the plan's placement group and waits until its GPUs are reserved; returns it (None without
    bundles) with the trainer's options pointed at bundle 0."""
    if not plan.bundles:
        return None
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.placement_group(plan.bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"grpo: could not reserve {plan.bundles} ({plan.mode}) in {timeout_s:.0f} s; "
                           f"cluster resources: {ray.cluster_resources()}")
    plan.trainer = {**plan.trainer, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, 0)}
    return group
