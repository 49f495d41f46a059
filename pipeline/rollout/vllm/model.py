"""``SSEForCausalLM`` as a vLLM model (the design: :mod:`pipeline.rollout.vllm.plugin`). Imported by vLLM only.

vLLM hands the model a flat batch of tokens, decodes first, then prompts (or prompt chunks); per layer it binds
``kv_cache`` (attention: paged KV; linear layers: the tuple of state tensors, ``[rows, *shape]``) and, per forward,
metadata naming each sequence's state row. How a linear layer runs such a batch: :func:`run_linear_layer`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from sse_model import SSEForCausalLM
from sse_model.configuration_sse import ATTENTION_MIXERS
from sse_model.modules import RotaryEmbedding, project

from .plugin import check_supported, run_linear_layer, state_dtypes, state_shapes, vllm_weight_name


def _register(vllm_config: VllmConfig, prefix: str, layer: nn.Module) -> None:
    """vLLM finds the layers it allocates a cache for, and binds it, by name in the static forward context."""
    context = vllm_config.compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"duplicate layer name {prefix!r}")
    context[prefix] = layer


class StatefulMixer(nn.Module, MambaBase):
    """One of this package's linear mixers (``inner``) as a vLLM stateful layer."""

    def __init__(self, inner: nn.Module, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.inner, self.config, self.prefix = inner, config, prefix
        self.model_dtype = vllm_config.model_config.dtype
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        _register(vllm_config, prefix, self)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR  # metadata: decodes first, a state row per sequence

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return state_shapes(self.config)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return state_dtypes(self.config, self.model_dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        return run_linear_layer(self.inner, hidden, positions, self.kv_cache, meta)


class PagedAttention(nn.Module):
    """This package's softmax attention (``inner``: projections and RoPE) over vLLM's paged KV cache."""

    def __init__(self, inner: nn.Module, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.inner = inner
        self.attn = Attention(inner.num_heads, inner.head_dim, inner.head_dim ** -0.5, num_kv_heads=inner.num_kv_heads,
                              cache_config=vllm_config.cache_config, per_layer_sliding_window=inner.window,
                              prefix=f"{prefix}.attn")

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a, T = self.inner, hidden.shape[0]
        q, k, v = project(hidden, *a.input_projections())
        q, k = a.rotary(q.view(1, T, a.num_heads, a.head_dim), k.view(1, T, a.num_kv_heads, a.head_dim),
                        positions[None])
        return a.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v))


class SSEForCausalLMVllm(nn.Module, HasInnerState, IsHybrid):
    """vLLM's entry to an ``SSEForCausalLM`` checkpoint: this package's modules, vLLM's caches."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_supported(config, vllm_config.parallel_config.tensor_parallel_size)
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("SSE models hold each sequence in one state row: pass enable_prefix_caching=False")
        self.config = config
        model = SSEForCausalLM(config)  # random weights until load_weights
        self.model, self.lm_head = model.model, model.lm_head
        for i, block in enumerate(self.model.layers):
            name = ".".join(p for p in (prefix, f"model.layers.{i}.attn") if p)
            if config.mixer_types[i] in ATTENTION_MIXERS:
                block.attn = PagedAttention(block.attn, vllm_config, name)
            else:
                block.attn = StatefulMixer(block.attn, config, vllm_config, name)
        for module in self.modules():  # never below float32, whatever vLLM's default dtype was at construction
            if isinstance(module, RotaryEmbedding):
                module.inv_freq = module.compute_inv_freq().to(module.inv_freq.device)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        hidden = self.model.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.model.layers:
            hidden = hidden + block.attn(block.attn_norm(hidden), positions)
            hidden = hidden + block.mlp(block.mlp_norm(hidden))
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # log-probabilities from float32 logits, as the rollout engine

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies each checkpoint tensor into its parameter (:func:`vllm_weight_name`); returns the names loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            target = vllm_weight_name(name)
            if target is None or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter {target!r} in {type(self).__name__}")
            if params[target].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model's "
                                 f"{target!r} {tuple(params[target].shape)}")
            params[target].data.copy_(tensor)
            loaded.add(target)
        return loaded

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return state_shapes(vllm_config.model_config.hf_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return state_dtypes(vllm_config.model_config.hf_config, vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        """Only prefix caching copies states, and it is refused above; each state is copied whole."""
        return (get_temporal_copy_spec,) * 3
