"""What the engine keeps of a request while it runs: the request (prompt, sampling parameters, its slots), each of its
``n`` sequences (tokens so far, why it stopped), and the outputs handed back (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # "stop" | "length"
    stop_reason: int | str | None = None
    # (first token, weights version) where the weights changed while it was generated (partial rollouts); None: one
    weight_versions: list[tuple[int, int]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass(eq=False)  # identity: the queues find and remove this very sequence
class Sequence:
    """One sample of a request, in its slot."""

    request: "Request"
    index: int
    slot: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prefilled: int = 0  # tokens recomputed so far after a preemption
    stamp: int = 0  # admission order: the newest is preempted first

    @property
    def cached(self) -> list[int]:
        """What the slot holds before the next decode step: the prompt and every token but the last sampled."""
        return self.request.prompt_ids + self.token_ids[:-1]

    @property
    def cached_length(self) -> int:
        return len(self.request.prompt_ids) + len(self.token_ids) - 1

    def append(self, token: int, logprob: float, eos_ids: set[int], max_model_len: int, tokenizer=None) -> None:
        """A sampled token, and whether it ends the sequence: a stop token (the tokenizer's end unless
        ``ignore_eos``), a stop string, ``max_tokens`` or the model's length."""
        params = self.request.params
        self.token_ids.append(token)
        if params.logprobs:
            self.logprobs.append(logprob)
        stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos_ids)
        if token in stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif params.stop_strings and tokenizer is not None:
            window = max(8, 2 * max(len(s) for s in params.stop_strings))
            tail = tokenizer.decode(self.token_ids[-window:], skip_special_tokens=True)
            hit = next((s for s in params.stop_strings if s in tail), None)
            if hit is not None:
                self.finish_reason, self.stop_reason = "stop", hit
        if self.finish_reason is None and (len(self.token_ids) >= params.max_tokens or
                                           len(self.request.prompt_ids) + len(self.token_ids) >= max_model_len):
            self.finish_reason = "length"


@dataclass(eq=False)
class Request:
    id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    slots: list[int] = field(default_factory=list)
    prefilled: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    stamp: int = 0  # admission order
    promised: int = 0  # free blocks promised to its forks

    @classmethod
    def of(cls, request_id: str, prompt, params: SamplingParams, tokenizer, vocab_size: int,
           max_model_len: int) -> "Request":
        """A request from a text prompt (with a tokenizer) or token ids, refused with ``ValueError`` (``TypeError``
        for parameters of another type) if it cannot run on this model."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or give the engine a tokenizer")
            prompt_ids, text = tokenizer(prompt, add_special_tokens=False)["input_ids"], prompt
        else:
            prompt_ids, text = [int(t) for t in prompt], None
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        return cls(request_id, text, prompt_ids, params, time.monotonic())

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and all(s.finish_reason is not None for s in self.seqs)

    def output(self, tokenizer=None) -> RequestOutput:
        """Its samples as vLLM hands them back (text cut at a stop string unless asked to include it)."""
        outputs = []
        for seq in self.seqs:
            text = ""
            if tokenizer is not None:
                text = tokenizer.decode(seq.token_ids, skip_special_tokens=True)
                if isinstance(seq.stop_reason, str):
                    cut = text.find(seq.stop_reason)
                    if cut >= 0:
                        text = text[:cut + (len(seq.stop_reason) if self.params.include_stop_str_in_output else 0)]
            outputs.append(CompletionOutput(seq.index, text, seq.token_ids,
                                            seq.logprobs if self.params.logprobs else None,
                                            seq.finish_reason, seq.stop_reason))
        return RequestOutput(self.id, self.prompt, self.prompt_ids, outputs)
