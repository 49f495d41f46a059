"""The rollout engine behind evaluation's generation interface (:class:`eval.generation.GenerationBackend`)."""

from __future__ import annotations

from eval.generation import Completion

from .sampling import SamplingParams


def _runs(keys: list, limit: int) -> list[list[int]]:
    """Indices of ``keys`` in runs of equal consecutive keys, at most ``limit`` long: each run becomes one engine
    request with ``n`` samples (its prompt prefilled once, its state forked)."""
    groups: list[list[int]] = []
    for i, key in enumerate(keys):
        if groups and keys[groups[-1][0]] == key and len(groups[-1]) < limit:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class EngineBackend:
    """Consecutive samples of one prompt with consecutive seeds become one request with ``n`` samples;
    completions stream out as requests finish."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, sampling, seeds):
        keys = [(prompt, seed - i) for i, (prompt, seed) in enumerate(zip(prompts, seeds))]  # same prompt, seed run
        pending = {}
        for group in _runs(keys, self.engine.max_slots):
            params = SamplingParams(n=len(group), temperature=sampling.temperature, top_p=sampling.top_p,
                                    top_k=sampling.top_k, max_tokens=sampling.max_new_tokens, seed=seeds[group[0]],
                                    logprobs=False)
            pending[self.engine.add_request(prompts[group[0]], params)] = group
        while self.engine.has_unfinished():
            for out in self.engine.step():
                for index, completion in zip(pending.pop(out.request_id), out.outputs):
                    yield index, Completion(completion.text, len(completion.token_ids), completion.finish_reason)
