"""SSE model family for Hugging Face transformers: ``SSEModel`` and ``SSEForCausalLM``.

Module names follow flash-linear-attention's SSE models (``model.embeddings``, ``model.layers[i].attn_norm``,
``.attn``, ``.mlp_norm``, ``.mlp``, ``model.norm``, ``lm_head``) so that their checkpoints map one to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, MoeCausalLMOutputWithPast

from .cache import ModelCache, SSEHybridCache

# the cache's field in transformers' model outputs: ``cache`` in newer releases, where ``past_key_values`` warns on
# every process's first use; ``past_key_values`` before
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
from .configuration_sse import SSEConfig
from .layers.attention import SoftmaxAttention
from .layers.common import ForwardContext
from .layers.linear import LinearAttention, init_gdn_decay
from .layers.sse import SSEAttention
from .modules import Linear, RMSNorm, RotaryEmbedding, ShortConvolution, SwiGLUMLP, pack_linears
from .ops.checkpointing import KeptOutputs
from .ops.varlen import check_cu_seqlens, cu_seqlens_from_position_ids


def build_mixer(config: SSEConfig, layer_idx: int) -> nn.Module:
    kind = config.mixer_types[layer_idx]
    if kind == "sse":
        return SSEAttention(config, layer_idx)
    if kind in ("gla", "gdn", "retnet"):
        return LinearAttention(config, layer_idx, kind)
    if kind == "attn":
        return SoftmaxAttention(config, layer_idx)
    if kind == "swa":
        return SoftmaxAttention(config, layer_idx, window=config.sliding_window)
    raise ValueError(f"unknown mixer {kind!r} for layer {layer_idx}")


class SSEBlock(GradientCheckpointingLayer):
    """Pre-norm block: ``h + mixer(norm(h))``, then ``h + mlp(norm(h))``; each skip connection is added by the
    output projection it follows (in one kernel when generating)."""

    def __init__(self, config: SSEConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = build_mixer(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext):
        hidden_states, aux_loss = self.attn(self.attn_norm(hidden_states), ctx, residual=hidden_states)
        hidden_states = self.mlp(self.mlp_norm(hidden_states), residual=hidden_states)
        return hidden_states, aux_loss


class SSEPreTrainedModel(PreTrainedModel):
    config_class = SSEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SSEBlock"]
    _supports_sdpa = True

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=checkpoint, **kwargs):
        """transformers' hook; non-reentrant checkpointing given no ``context_fn`` of its own keeps the chunk
        plans (and, with ``config.checkpointing_keeps_linear_attention``, the chunk kernels' outputs) from the
        forward for the rebuild (see :mod:`sse_model.ops.checkpointing`)."""
        options = getattr(gradient_checkpointing_func, "keywords", {})
        if enable and options.get("use_reentrant") is False and "context_fn" not in options:
            keep_large = self.config.checkpointing_keeps_linear_attention
            gradient_checkpointing_func = partial(gradient_checkpointing_func,
                                                  context_fn=lambda: KeptOutputs(keep_large).contexts())
        super()._set_gradient_checkpointing(enable, gradient_checkpointing_func, **kwargs)

    def pack_projections(self) -> None:
        """Lays out each module's ``input_projections()`` side by side in memory (:func:`pack_linears`), so that
        generation reads each group in one matrix product: the rollout engine calls it. Parameters stay separate
        (views); training is unchanged."""
        for module in self.modules():
            if hasattr(module, "input_projections"):
                pack_linears(*module.input_projections())

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, ShortConvolution)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):  # non-persistent: rebuilt after meta-device loading
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, LinearAttention) and hasattr(module, "log_decay"):
            init.copy_(module.log_decay, module.compute_log_decay())
        if isinstance(module, (SSEAttention, LinearAttention)) and hasattr(module, "A_log"):
            if not getattr(module.A_log, "_is_hf_initialized", False):
                init_gdn_decay(module.A_log, module.dt_bias)


@dataclass
class SSECausalLMOutput(MoeCausalLMOutputWithPast):
    """In training ``loss = lm_loss + aux_loss_coef * aux_loss``, in evaluation ``loss = lm_loss``; ``aux_loss`` (the
    summed partition-balance loss) is reported in both."""

    lm_loss: torch.Tensor | None = None


class SSEModel(SSEPreTrainedModel):
    def __init__(self, config: SSEConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(SSEBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        # The residual stream's dtype when it should be wider than the weights (None: the embeddings'). A bf16
        # rollout engine sets float32: the skip connections then add as in training, where float32 master weights
        # under bf16 autocast keep the stream in float32 (the norms still write the weights' dtype).
        self.residual_dtype: torch.dtype | None = None
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SSEHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        hidden = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.residual_dtype is not None:
            hidden = hidden.to(self.residual_dtype)
        B, T = hidden.shape[:2]
        if cu_seqlens is None:
            cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            cu_seqlens = cu_seqlens_from_position_ids(position_ids)
        packed_prefill = False  # several prompts in one packed row, each into an empty slot of an engine's cache
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, B, T)
            packed_prefill = bool(getattr(past_key_values, "packs_prefill", False))
            if not packed_prefill and (use_cache or past_key_values is not None):
                raise ValueError("packed sequences (cu_seqlens) are cached only by an engine's SlotCache (a "
                                 "prefill of empty slots); pass use_cache=False")
            use_cache = packed_prefill
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if past_key_values is not None and not isinstance(past_key_values, ModelCache):
            raise TypeError(
                f"past_key_values must be an SSEHybridCache or an engine's SlotCache, got "
                f"{type(past_key_values).__name__}; "
                "leave it unset and the model creates one"
            )
        cache = past_key_values if past_key_values is not None else (
            SSEHybridCache.for_config(self.config) if use_cache else None
        )
        past = cache.seen_tokens if isinstance(cache, SSEHybridCache) else 0

        key_mask = token_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be a 2-D [batch, length] padding mask, got {attention_mask.dim()}-D")
            key_mask = attention_mask.bool()
            if key_mask.shape[1] < past + T:
                key_mask = F.pad(key_mask, (past + T - key_mask.shape[1], 0), value=True)
            key_mask = key_mask[:, -(past + T):]
            if bool(key_mask.all()):
                key_mask = None
            else:
                token_mask = key_mask[:, -T:]

        query_index = cache.query_index(T, hidden.device) if cache is not None and not packed_prefill else \
            torch.arange(T, device=hidden.device)[None]
        if position_ids is None:
            if key_mask is not None:
                position_ids = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            elif cu_seqlens is not None:
                pos = torch.arange(T, device=hidden.device)
                starts = cu_seqlens.long()[torch.searchsorted(cu_seqlens.long()[1:], pos, right=True)]
                position_ids = (pos - starts)[None]
            else:
                position_ids = query_index.expand(B, T)
        elif position_ids.shape[-1] != T:
            position_ids = position_ids[..., -T:]

        ctx = ForwardContext(position_ids, query_index, token_mask, key_mask, cu_seqlens, cache)
        all_hidden = () if output_hidden_states else None
        aux_losses = []
        for layer in self.layers:
            if output_hidden_states:
                all_hidden += (hidden,)
            hidden, aux = layer(hidden, ctx)
            if aux is not None:
                aux_losses.append(aux)
        hidden = self.norm(hidden)
        if output_hidden_states:
            all_hidden += (hidden,)
        if cache is not None:
            cache.advance(cu_seqlens.diff() if packed_prefill else T)
        out = BaseModelOutputWithPast(last_hidden_state=hidden, hidden_states=all_hidden, **{CACHE_FIELD: cache})
        out.aux_loss = torch.stack(aux_losses).sum() if aux_losses else None
        return out


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Next-token cross-entropy (labels unshifted, as in transformers). In a packed batch the first token
    of each sequence is never a target of the previous sequence's last token."""
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].clone()
    if cu_seqlens is not None and cu_seqlens.numel() > 2:
        shift[0, cu_seqlens[1:-1].long() - 1] = ignore_index
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is None:
        num_items_in_batch = (shift != ignore_index).sum().clamp(min=1)
    return loss / num_items_in_batch


class SSEForCausalLM(SSEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: SSEConfig):
        super().__init__(config)
        self.model = SSEModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own SSEHybridCache

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SSEHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SSECausalLMOutput:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            cu_seqlens=cu_seqlens,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep])
        loss = lm_loss = None
        aux_loss = outputs.aux_loss
        if labels is not None:
            if cu_seqlens is None:
                cu_seqlens = kwargs.get("cu_seq_lens_q", cu_seqlens_from_position_ids(position_ids))
            lm_loss = causal_lm_loss(logits, labels, cu_seqlens, kwargs.get("num_items_in_batch"))
            loss = lm_loss
            # the balance loss is a training objective (as in fla): evaluation losses and perplexities are the LM's
            if aux_loss is not None and self.config.aux_loss_coef and self.training:
                loss = lm_loss + self.config.aux_loss_coef * aux_loss.to(lm_loss.device)
        return SSECausalLMOutput(
            loss=loss,
            aux_loss=aux_loss,
            lm_loss=lm_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: SSEHybridCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = True,
        **kwargs,
    ) -> dict:
        """Feeds only the tokens the cache has not seen; positions come from the attention mask."""
        seen = past_key_values.seen_tokens if isinstance(past_key_values, SSEHybridCache) else 0
        inputs = {"past_key_values": past_key_values if seen else None, "use_cache": use_cache,
                  "attention_mask": attention_mask}
        if inputs_embeds is not None and not seen:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, seen:]
        if "logits_to_keep" in kwargs:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs
