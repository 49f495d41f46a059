"""``engine.backend``: the recipe key, the engine it builds, and the vLLM engine's translation of our sampling
parameters and of vLLM's outputs (``pipeline/rollout/vllm/engine.py``). vLLM itself runs on the GPU."""

import importlib.util
from types import SimpleNamespace

import pytest

from pipeline.recipe import RecipeError, load_recipe
from pipeline.rollout import Engine, SamplingParams, create_engine
from pipeline.rollout.vllm.engine import from_vllm_output, to_vllm_kwargs
from sse_model import SSEConfig, SSEForCausalLM


def test_the_recipe_key_takes_sse_or_vllm():
    assert load_recipe("demo").grpo.engine.backend == "sse"
    assert load_recipe("demo", ["eval.engine.backend=vllm"]).eval.engine.backend == "vllm"
    with pytest.raises(RecipeError, match=r"grpo.engine.backend: .vlm. is not one of"):
        load_recipe("demo", ["grpo.engine.backend=vlm"])


def test_sse_builds_this_package_engine():
    model = SSEForCausalLM(SSEConfig.from_preset("sse-h-tiny")).eval()
    assert isinstance(create_engine(model, None, backend="sse", max_slots=2, max_model_len=32), Engine)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_missing_is_named_with_its_key(tmp_path):
    with pytest.raises(ImportError, match=r"engine.backend: vllm needs vLLM 0.25.1.*scripts\.vllm_site"):
        create_engine(str(tmp_path), None, backend="vllm")


def test_vllm_serves_checkpoints_not_model_objects():
    with pytest.raises(TypeError, match="checkpoint folder"):
        create_engine(object(), None, backend="vllm")


def test_sampling_parameters_in_vllm_names():
    kwargs = to_vllm_kwargs(SamplingParams(n=8, temperature=0.7, top_p=0.9, top_k=0, max_tokens=64, stop="</s>",
                                           seed=3, include_stop_str_in_output=True))
    assert kwargs == dict(n=8, temperature=0.7, top_p=0.9, top_k=-1, max_tokens=64, stop=["</s>"],
                          stop_token_ids=None, ignore_eos=False, seed=3, logprobs=0, include_stop_str_in_output=True)
    assert to_vllm_kwargs(SamplingParams(top_k=5, logprobs=False))["top_k"] == 5
    assert to_vllm_kwargs(SamplingParams(logprobs=False))["logprobs"] is None


def test_vllm_outputs_become_ours():
    """vLLM's ``RequestOutput`` (the fields read, as vLLM 0.25.1 names them): per sample, a dict per token from
    token id to its ``Logprob``; ours keeps the sampled token's."""
    lp = SimpleNamespace
    sample = SimpleNamespace(index=1, text="ab", token_ids=(5, 9), finish_reason="length", stop_reason=None,
                             logprobs=[{5: lp(logprob=-0.5)}, {9: lp(logprob=-1.25), 2: lp(logprob=-0.1)}])
    out = SimpleNamespace(request_id=7, prompt=None, prompt_token_ids=[1, 2, 3], outputs=[sample])
    ours = from_vllm_output(out)
    assert ours.request_id == "7" and ours.prompt_token_ids == [1, 2, 3]
    (c,) = ours.outputs
    assert (c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) == (1, "ab", [5, 9], [-0.5, -1.25], "length")
    sample.logprobs = None
    assert from_vllm_output(out).outputs[0].logprobs is None
