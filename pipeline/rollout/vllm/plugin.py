"""SSE models in vLLM: the out-of-tree model plugin and the parts of it that need no vLLM.

vLLM calls :func:`register` in each of its processes through the ``vllm.general_plugins`` entry point
(``pyproject.toml``); it registers ``SSEForCausalLM`` with vLLM's ``ModelRegistry`` (the model itself is
:mod:`pipeline.rollout.vllm.model`, imported by vLLM only when it loads such a checkpoint). In vLLM:

- softmax-attention layers (``attn``, ``swa``) run through vLLM's ``Attention`` (paged KV cache, its kernels);
- linear layers (``sse``, ``gla``, ``gdn``, ``retnet``) are stateful, mamba-style layers: vLLM keeps one state row
  per sequence, ``[1 + N, H, K, V]`` float32 for SSE (the shared partition and the N sparse ones, as in this
  package's :class:`~pipeline.rollout.cache.SlotCache`), and each layer runs this package's own mixer over it
  (:func:`run_linear_layer`, here so that it runs without vLLM): our Triton decode kernel for one token per
  sequence, the chunked kernels for prompts;
- embeddings, norms, MLPs and the head are this package's modules, so a checkpoint of ``SSEForCausalLM`` loads by
  name (:func:`vllm_weight_name`).

Limits (checked by :func:`check_supported`): one GPU (no tensor parallelism), one kind of linear layer per model
(vLLM gives every stateful layer one state shape), and the attention head size equal to ``head_dim`` (vLLM sizes
its KV pages from ``head_dim``). Prefix caching is off: a state row holds a whole sequence, not a block of it.
"""

from __future__ import annotations

import torch

from sse_model.cache import LinearLayerState
from sse_model.layers.common import ForwardContext

ARCHITECTURE = "SSEForCausalLM"
MODEL_CLASS = "pipeline.rollout.vllm.model:SSEForCausalLMVllm"
LINEAR_MIXERS = ("sse", "gla", "gdn", "retnet")
STATE_DTYPE = torch.float32  # as the rollout engine keeps them


def register() -> None:
    """The ``vllm.general_plugins`` entry point: our config for ``AutoConfig``, our model for vLLM."""
    from vllm import ModelRegistry

    import sse_model  # noqa: F401  (registers SSEConfig with AutoConfig)

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


def linear_kind(config) -> str | None:
    """The model's one kind of linear layer (None: attention only)."""
    kinds = sorted({k for k in config.mixer_types if k in LINEAR_MIXERS})
    if len(kinds) > 1:
        raise ValueError(f"mixer_types mixes linear layers {kinds}; vLLM gives every stateful layer one state "
                         "shape, so a model served by vLLM has one kind")
    return kinds[0] if kinds else None


def check_supported(config, tensor_parallel_size: int = 1) -> None:
    """Raises ``ValueError`` naming the setting that vLLM cannot serve."""
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: the SSE plugin runs on one GPU")
    if linear_kind(config) is None:
        raise ValueError("mixer_types has no linear layer: serve an attention-only model as Llama "
                         "(sse_model.convert.export_to_llama)")
    if any(k in ("attn", "swa") for k in config.mixer_types) and config.attn_head_dim != config.head_dim:
        raise ValueError(f"attention head size {config.attn_head_dim} differs from head_dim {config.head_dim}; "
                         "vLLM sizes the KV cache from head_dim")


def state_shapes(config) -> tuple[tuple[int, ...], ...]:
    """Per-sequence state of each linear layer, vLLM's ``get_state_shape``: the recurrent state, then (with short
    convolutions) the query and key convolution caches. ``()`` for attention-only models."""
    from sse_model.cache import linear_state_shapes

    kind = linear_kind(config)
    if kind is None:
        return ()
    recurrent, conv = linear_state_shapes(config, kind)
    return (recurrent,) if conv is None else (recurrent, conv, conv)


def state_dtypes(config, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The recurrent state in float32, the convolution caches in the model's dtype (as the rollout engine)."""
    return tuple([STATE_DTYPE] + [model_dtype] * (len(state_shapes(config)) - 1))


def vllm_weight_name(name: str) -> str | None:
    """A checkpoint tensor's parameter in the vLLM model: each mixer sits in a vLLM layer as ``.inner``
    (``model.layers.3.attn.q_proj.weight`` -> ``model.layers.3.attn.inner.q_proj.weight``); None: not a parameter
    (rotary frequencies are rebuilt, not loaded)."""
    if name.endswith(".inv_freq"):
        return None
    parts = name.split(".")
    if len(parts) > 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] == "attn":
        return ".".join(parts[:4] + ["inner"] + parts[4:])
    return name


class StateRows:
    """The linear half of this package's cache protocol over one vLLM layer's state tensors (``[rows, *shape]``
    each), for the sequences in rows ``slots``: what a mixer reads, writes back, or decodes in place."""

    def __init__(self, states: tuple[torch.Tensor, ...], slots: torch.Tensor):
        self.states, self.slots = states, slots

    def read_linear(self, layer_idx: int, recurrent: bool = True) -> LinearLayerState:
        conv = tuple(s[self.slots] for s in self.states[1:])
        return LinearLayerState(self.states[0][self.slots] if recurrent else None, conv or None)

    def write_linear(self, layer_idx: int, state: LinearLayerState) -> None:
        if state.recurrent is not None:
            self.states[0][self.slots] = state.recurrent.to(self.states[0].dtype)
        for pool, value in zip(self.states[1:], state.conv or ()):
            pool[self.slots] = value.to(pool.dtype)

    def linear_pool(self, layer_idx: int):
        return self.states[0], self.slots


def run_linear_layer(mixer, hidden: torch.Tensor, positions: torch.Tensor, states: tuple[torch.Tensor, ...],
                     meta) -> torch.Tensor:
    """One of this package's linear mixers over vLLM's flat batch ``hidden`` ``[tokens, D]``: the decoding
    sequences first (one token each), then the prompts or prompt chunks. ``meta`` is vLLM's linear-attention
    metadata (``num_decodes``, ``num_decode_tokens``, ``num_prefills``, ``query_start_loc``, ``seq_lens``,
    ``state_indices_tensor``: each sequence's state row); None in vLLM's memory profiling, where the mixer runs
    without states. The decodes run as one batch, their rows updated in place (the decode kernel). The prompts run
    from their rows' states, zeros for a new sequence (a row still holds a finished one's), and write them back:
    packed in one varlen call (``cu_seqlens``, a state per sequence), as the engine's packed prefill, since a
    forward at a small width is bound by its launches and vLLM admits new prompts beside the decodes at almost
    every step; one by one where the layer keeps short-convolution caches, whose packed form keeps none per
    sequence. Rows past the scheduled tokens (padding) stay zero."""

    def run(x, pos, slots, cu_seqlens=None):
        cache = None if slots is None else StateRows(states, slots)
        return mixer(x, ForwardContext(pos, pos, cu_seqlens=cu_seqlens, cache=cache))[0]

    if meta is None:
        return run(hidden[None], positions[None], None)[0]
    out = torch.zeros_like(hidden)
    rows = meta.state_indices_tensor
    decodes, decode_tokens, prefills = meta.num_decodes, meta.num_decode_tokens, meta.num_prefills
    if decodes:  # padded rows of a CUDA-graph batch carry a negative index: they write the unused row 0
        slots = rows[:decodes].long().clamp(min=0)
        out[:decode_tokens] = run(hidden[:decode_tokens, None], positions[:decode_tokens, None], slots)[:, 0]
    if not prefills:
        return out
    bounds = meta.query_start_loc[decodes:decodes + prefills + 1].long()
    slots = rows[decodes:decodes + prefills].long()
    new = meta.seq_lens[decodes:decodes + prefills].long() == bounds[1:] - bounds[:-1]  # nothing before this chunk
    for state in states:
        state[slots[new]] = 0
    starts = bounds.tolist()
    if len(states) == 1:  # no convolution caches: every prompt in one call
        first, last = starts[0], starts[-1]
        out[first:last] = run(hidden[None, first:last], positions[None, first:last], slots, bounds - first)[0]
        return out
    for j in range(prefills):
        start, end = starts[j], starts[j + 1]
        out[start:end] = run(hidden[None, start:end], positions[None, start:end], slots[j:j + 1])[0]
    return out
