"""Ray wrappers: a rollout engine per actor, and a fleet that spreads requests over several of them."""

from __future__ import annotations

import ray

from .engine import Engine, RequestOutput
from .sampling import SamplingParams


class RolloutWorker:
    """An :class:`Engine` inside a Ray actor; same methods, results returned by value."""

    def __init__(self, model, tokenizer=None, sleep_between_calls: bool = False, **engine_kwargs):
        import torch

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.engine = Engine(model, tokenizer, **engine_kwargs)
        self.sleep_between_calls = sleep_between_calls  # colocated with a trainer: free memory between rollouts

    def generate(self, prompts, sampling_params) -> list[RequestOutput]:
        outputs = self.engine.generate(prompts, sampling_params)
        if self.sleep_between_calls:
            self.engine.sleep()
        return outputs

    def update_weights(self, weights) -> int:
        self.engine.update_weights(weights)
        return self.engine.weights_version

    def get_stats(self) -> dict:
        return self.engine.get_stats()

    def capacity(self, seq_len: int | None = None) -> int:
        return self.engine.capacity(seq_len)


class EngineFleet:
    """``num_engines`` rollout actors behind one ``generate``: requests are dealt out in turn (all samples
    of a request stay on one engine, where they share its prefill), results come back in order."""

    def __init__(self, model, tokenizer=None, num_engines: int = 1, num_gpus: float = 0, num_cpus: float = 1,
                 **engine_kwargs):
        actor = ray.remote(num_gpus=num_gpus, num_cpus=num_cpus)(RolloutWorker)
        self.workers = [actor.remote(model, tokenizer, **engine_kwargs) for _ in range(num_engines)]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        shards = [list(range(i, len(prompts), len(self.workers))) for i in range(len(self.workers))]
        futures = [w.generate.remote([prompts[j] for j in idx], [params[j] for j in idx])
                   for w, idx in zip(self.workers, shards) if idx]
        results: list[RequestOutput | None] = [None] * len(prompts)
        for idx, outs in zip([s for s in shards if s], ray.get(futures)):
            for j, out in zip(idx, outs):
                results[j] = out
        return results  # type: ignore[return-value]

    def update_weights(self, state_dict) -> list[int]:
        """Sends the weights once to the object store; every engine loads them."""
        ref = ray.put({k: v.detach().cpu() for k, v in state_dict.items()})
        return ray.get([w.update_weights.remote(ref) for w in self.workers])

    def get_stats(self) -> list[dict]:
        return ray.get([w.get_stats.remote() for w in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
