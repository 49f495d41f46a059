"""The conventions of generation that training and evaluation share: the instruction appended to every problem
and the user turn it makes, each request's sampling seed, and the tokens generation stops at."""

from __future__ import annotations

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def user_message(problem: str, instruction: str = INSTRUCTION) -> dict:
    """The user turn that asks ``problem``, in training and evaluation alike: the problem, then the instruction."""
    return {"role": "user", "content": f"{problem}\n{instruction}" if instruction else problem}


def request_seed(seed: int, group: int, member: int) -> int:
    """The sampling seed of one request: member ``member`` of group ``group`` (a problem's samples in
    evaluation, a step's prompts in GRPO). Consecutive members get consecutive seeds, so that an engine can
    serve them as one request with n samples."""
    return (seed * 1_000_003 + group * 100_003 + member) % (2**31 - 1)


def end_of_sequence_ids(model, tokenizer=None) -> set[int]:
    """The tokens generation stops at: the model config's ``eos_token_id``, its generation config's (where HF
    ``generate`` and vLLM look; a chat model's end of turn may be named there alone) and the tokenizer's; each an id
    or a list of ids."""
    found = []
    for source in (getattr(model, "config", None), getattr(model, "generation_config", None), tokenizer):
        ids = getattr(source, "eos_token_id", None)
        found += ids if isinstance(ids, (list, tuple)) else [ids]
    return {int(i) for i in found if i is not None}
