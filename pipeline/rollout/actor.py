"""Ray wrappers: a rollout engine per actor, and a fleet that spreads requests over several of them and
replaces an engine that dies."""

from __future__ import annotations

import logging

import ray

from .engine import Engine, RequestOutput
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


class RolloutWorker:
    """An :class:`Engine` inside a Ray actor; same methods, results returned by value."""

    def __init__(self, model, tokenizer=None, sleep_between_calls: bool = False, **engine_kwargs):
        import torch

        from ..storage import materialize

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.source = model if isinstance(model, str) else None
        if isinstance(model, str):  # a local checkpoint, or a stored one this node fetches into its cache
            model = str(materialize(model))
        self.engine = Engine(model, tokenizer, **engine_kwargs)
        self.sleep_between_calls = sleep_between_calls  # colocated with a trainer: free memory between rollouts

    def generate(self, prompts, sampling_params) -> list[RequestOutput]:
        outputs = self.engine.generate(prompts, sampling_params)
        if self.sleep_between_calls:
            self.engine.sleep()
        return outputs

    def update_weights(self, weights, version: int | None = None) -> int:
        self.engine.update_weights(weights, version)
        return self.engine.weights_version

    def get_stats(self) -> dict:
        return {**self.engine.get_stats(), "node": ray.get_runtime_context().get_node_id(), "source": self.source}

    def capacity(self, seq_len: int | None = None) -> int:
        return self.engine.capacity(seq_len)


class EngineFleet:
    """``num_engines`` rollout actors behind one ``generate``: requests are dealt out in turn (all samples
    of a request stay on one engine, where they share its prefill), results come back in order.

    An engine whose actor dies (its process killed, its node lost) is replaced by a new actor built from the
    same arguments, given the latest synced weights, and its share of the call is submitted again; sampling is
    seeded per request, so the results are those the dead engine would have returned. At most
    ``max_restarts`` replacements per fleet, then the call fails with the cause.
    """

    def __init__(self, model, tokenizer=None, num_engines: int = 1, num_gpus: float = 0, num_cpus: float = 1,
                 resources: dict | None = None, max_restarts: int = 3, **engine_kwargs):
        self._actor = ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, resources=resources or None)(RolloutWorker)
        self._args, self._kwargs = (model, tokenizer), engine_kwargs
        self.max_restarts, self.restarts = max_restarts, 0
        self._weights, self._version = None, 0  # the latest synced weights (an object ref), for replacements
        self.workers = [self._actor.remote(*self._args, **self._kwargs) for _ in range(num_engines)]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        shards = [list(range(i, len(prompts), len(self.workers))) for i in range(len(self.workers))]

        def submit(i):
            return self.workers[i].generate.remote([prompts[j] for j in shards[i]], [params[j] for j in shards[i]])

        pending = {i: submit(i) for i, idx in enumerate(shards) if idx}
        results: list[RequestOutput | None] = [None] * len(prompts)
        while pending:
            i, future = next(iter(pending.items()))
            try:
                outs = ray.get(future)
            except ray.exceptions.RayActorError as error:
                self._replace(i, error)
                pending[i] = submit(i)
                continue
            del pending[i]
            for j, out in zip(shards[i], outs):
                results[j] = out
        return results  # type: ignore[return-value]

    def _replace(self, i: int, error: Exception) -> None:
        if self.restarts >= self.max_restarts:
            raise RuntimeError(f"rollout engine {i} died and the fleet has already replaced {self.restarts} "
                               f"(max_restarts={self.max_restarts}): {error}") from error
        self.restarts += 1
        logger.warning("rollout engine %d died (%s); replacing it (%d of at most %d) and resubmitting its requests",
                       i, type(error).__name__, self.restarts, self.max_restarts)
        ray.kill(self.workers[i], no_restart=True)
        self.workers[i] = self._actor.remote(*self._args, **self._kwargs)
        if self._weights is not None:
            ray.get(self.workers[i].update_weights.remote(self._weights, self._version))

    def update_weights(self, state_dict) -> list[int]:
        """Sends the weights once to the object store; every engine loads them."""
        self._weights = ray.put({k: v.detach().cpu() for k, v in state_dict.items()})
        self._version += 1
        futures = [w.update_weights.remote(self._weights) for w in self.workers]
        versions = []
        for i, future in enumerate(futures):
            try:
                versions.append(ray.get(future))
            except ray.exceptions.RayActorError as error:  # the replacement is given these weights
                self._replace(i, error)
                versions.append(self._version)
        return versions

    def get_stats(self) -> list[dict]:
        return ray.get([w.get_stats.remote() for w in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
