"""Attention transfer: teaching a converted model's SSE layers to compute what the attention layers they replaced
computed, before any language-model training (LoLCATs' attention transfer, RADLADS' stage 1).

The teacher is the source Transformer, frozen, as an all-attention model of this package
(:func:`sse_model.convert.convert_to_sse` with every layer kept as attention: it computes what the source computes and
reads packed batches the same way). One teacher forward gives, for every layer the student turned into SSE, the
layer's input (the block's normed hidden state) and its attention output before the skip connection. Each student
SSE layer then reads the teacher's input and is scored against the teacher's output: all layers in one pass, every
layer from the teacher's own hidden states, so no error is carried from one layer into the next, and nothing but
the SSE layers runs in the student (the kept attention layers, the MLPs, norms and embeddings are the teacher's
and stay frozen).

The loss of a layer is its mean squared error divided by the mean square of the teacher's output (1.0 is what an
output of zeros scores), so layers of different scale weigh the same and the numbers read alike across models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .configuration_sse import ATTENTION_MIXERS
from .layers.sse import SSEAttention

# what alignment trains in each SSE layer: "new" the parameters conversion could not inherit (LoRA, decay gates,
# router, output gate and norm), "all" those and the inherited q/k/v/o projections
TRAINABLE = ("new", "all")
INHERITED = ("q_proj", "k_proj", "v_proj", "o_proj")


def sse_layers(model) -> list[int]:
    """Indices of the layers that are not softmax attention (those conversion created)."""
    return [i for i, kind in enumerate(model.config.mixer_types) if kind not in ATTENTION_MIXERS]


def aligned_parameters(model, which: str = "all") -> list[tuple[str, nn.Parameter]]:
    """The ``(name, parameter)`` pairs alignment trains in ``model`` (see :data:`TRAINABLE`)."""
    if which not in TRAINABLE:
        raise ValueError(f"which must be one of {TRAINABLE}, got {which!r}")
    chosen = []
    for i in sse_layers(model):
        for name, param in model.model.layers[i].attn.named_parameters():
            if which == "all" or name.split(".")[0] not in INHERITED:
                chosen.append((f"model.layers.{i}.attn.{name}", param))
    return chosen


def freeze_all_but_aligned(model, which: str = "all") -> int:
    """Sets ``requires_grad`` on the aligned parameters only; returns how many values train."""
    model.requires_grad_(False)
    params = [p for _, p in aligned_parameters(model, which)]
    for p in params:
        p.requires_grad_(True)
    return sum(p.numel() for p in params)


@dataclass
class LayerPair:
    """What the teacher gave one layer: its input (normed hidden state) and attention output (no skip connection)."""

    inputs: torch.Tensor
    target: torch.Tensor


class TeacherTaps:
    """Forward hooks on the teacher's attention layers at ``layers``: each teacher forward fills ``pairs`` (layer ->
    :class:`LayerPair`) and ``context`` (the forward context the layers shared: positions and packed boundaries)."""

    def __init__(self, teacher, layers: list[int]):
        self.pairs: dict[int, LayerPair] = {}
        self.context = None
        self._handles = []
        for i in layers:
            mixer = teacher.model.layers[i].attn
            self._handles.append(mixer.register_forward_pre_hook(self._input_hook(i)))
            self._handles.append(mixer.o_proj.register_forward_pre_hook(self._output_hook(i)))

    def _input_hook(self, i):
        def hook(module, args):
            self.pairs[i] = LayerPair(args[0].detach(), None)
            self.context = args[1]
        return hook

    def _output_hook(self, i):
        def hook(module, args):  # o_proj(o, residual): the projection of o alone is the layer's output
            self.pairs[i].target = F.linear(args[0], module.weight, module.bias).detach()
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def normalized_mse(prediction: torch.Tensor, target: torch.Tensor, token_mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``mean((p - t)^2) / mean(t^2)`` over the real tokens, in float32."""
    err = (prediction.float() - target.float()).pow(2).sum(-1)
    scale = target.float().pow(2).sum(-1)
    if token_mask is not None:
        err, scale = err[token_mask], scale[token_mask]
    return err.sum() / scale.sum().clamp(min=1e-12)


class AttentionTransfer(nn.Module):
    """Per-layer alignment losses of ``student``'s SSE layers against ``teacher``'s attention layers.

    ``forward(input_ids, ...)`` (the model's own inputs: packed rows with ``cu_seqlens``/``position_ids``, or padded
    rows with ``attention_mask``) returns ``{layer index: normalised MSE}``; their mean is the loss.
    """

    def __init__(self, student, teacher):
        super().__init__()
        if student.config.num_hidden_layers != teacher.config.num_hidden_layers:
            raise ValueError("student and teacher have different numbers of layers")
        kept = [kind for kind in teacher.config.mixer_types if kind not in ATTENTION_MIXERS]
        if kept:
            raise ValueError(f"the teacher must be all attention (convert with mixer_types=['attn'] * L), has {kept}")
        self.layers = sse_layers(student)
        if not self.layers:
            raise ValueError("the student has no SSE layer to align")
        bad = [i for i in self.layers if not isinstance(student.model.layers[i].attn, SSEAttention)]
        if bad:
            raise ValueError(f"attention transfer aligns SSE layers; layers {bad} are other linear mixers")
        self.student = student
        self.teacher = [teacher.eval().requires_grad_(False)]  # a list: not a submodule (never trained, never saved)
        self._taps = TeacherTaps(teacher, self.layers)

    def forward(self, **inputs) -> dict[int, torch.Tensor]:
        teacher = self.teacher[0]
        with torch.no_grad():
            teacher.model(**inputs, use_cache=False)  # the backbone: the LM head is not needed
        ctx = self._taps.context
        losses = {}
        for i in self.layers:
            pair = self._taps.pairs[i]
            prediction, _ = self.student.model.layers[i].attn(pair.inputs, ctx)
            losses[i] = normalized_mse(prediction, pair.target, ctx.token_mask)
        self._taps.pairs.clear()
        return losses


@torch.no_grad()
def attention_like_start(model, decay_bias: float = 6.0) -> None:
    """An SSE-aware start for converted layers: decays near 1 (``logsigmoid(decay_bias) / gate_logit_normalizer`` per
    token, about 2.5e-3 / 16 at 6.0, a memory of thousands of tokens, as attention's is the whole context)
    instead of fresh gates' ``logsigmoid(0) / 16`` (a memory of ~20 tokens); the gates' input weights are scaled
    by 0.1 so that the bias, not the token, sets the decay at the start. The output gate cannot start as the
    identity (``silu(g_proj(x))`` has no bias), so it and the norm keep their fresh start; alignment learns them."""
    for i in sse_layers(model):
        mixer = model.model.layers[i].attn
        if getattr(mixer, "transition", None) == "gla":
            for gate in mixer.gk_proj:
                gate[1].bias.fill_(decay_bias)
                gate[1].weight.mul_(0.1)
