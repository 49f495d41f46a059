"""The SSE model family: Sparse State Expansion linear attention and its hybrids, for transformers."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import SSEHybridCache
from .configuration_sse import PRESETS, SSEConfig, hybrid_mixer_types
from .modeling_sse import SSEForCausalLM, SSEModel

AutoConfig.register(SSEConfig.model_type, SSEConfig, exist_ok=True)
AutoModel.register(SSEConfig, SSEModel, exist_ok=True)
AutoModelForCausalLM.register(SSEConfig, SSEForCausalLM, exist_ok=True)

__all__ = ["PRESETS", "SSEConfig", "SSEForCausalLM", "SSEHybridCache", "SSEModel", "hybrid_mixer_types"]
