"""Configuration of the SSE model family (pure and hybrid SSE, GLA, Gated DeltaNet, RetNet and attention)."""

from __future__ import annotations

import copy
import math

from transformers import PretrainedConfig

MIXERS = ("sse", "gla", "gdn", "retnet", "attn", "swa")
ATTENTION_MIXERS = ("attn", "swa")
ACTIVATIONS = ("identity", "silu", "softmax")
SSE_GATINGS = ("write_read", "write", "read", "none")


def hybrid_mixer_types(num_layers: int, linear: str = "sse", attn_every: int = 6, attn: str = "attn") -> list[str]:
    """``[linear] * (attn_every - 1) + [attn]`` repeated: SSE-H is one softmax layer after every five."""
    if attn_every <= 0:
        return [linear] * num_layers
    return [attn if (i + 1) % attn_every == 0 else linear for i in range(num_layers)]


def default_intermediate_size(hidden_size: int, hidden_ratio: float = 4) -> int:
    """SwiGLU width with ``hidden_ratio * hidden^2`` MLP parameters, rounded up to 256 (as in fla)."""
    size = int(hidden_size * hidden_ratio * 2 / 3)
    return 256 * ((size + 255) // 256)


class SSEConfig(PretrainedConfig):
    r"""Configuration of :class:`SSEForCausalLM`.

    The model is a stack of pre-norm blocks (RMSNorm, token mixer, RMSNorm, SwiGLU MLP). ``mixer_types``
    chooses each block's mixer: ``sse`` (Sparse State Expansion), ``gla``, ``gdn`` (Gated DeltaNet),
    ``retnet`` (fixed per-head decay), ``attn`` (causal softmax attention with RoPE, optional GQA) or
    ``swa`` (``attn`` restricted to a ``sliding_window``). SSE-H is ``[sse] * 5 + [attn]`` repeated.

    Linear mixers (``sse``, ``gla``, ``gdn``, ``retnet``) share ``num_heads``, ``head_dim`` (the key
    dimension, i.e. state rows per partition) and ``expand_v`` (value dim = ``head_dim * expand_v``).

    SSE defaults follow the public reference layer of flash-linear-attention (``fla.layers.sse``), which
    resolves the paper's ambiguities; each choice is an option:

    - ``q_activation="silu"``, ``k_activation`` = ``"softmax"`` over the head dim for the GLA transition and
      ``"silu"`` for GDN (``None`` picks these), ``v_activation="silu"``;
    - ``row_topk``: the paper's row-sparse key ``softmax(top-k(x W_k))`` and decay only on those rows
      (eq. 7); ``None`` keeps all rows (the reference). Applies to every partition; GLA transition only;
    - ``lora_side="sparse"``: the sparse partitions use ``W_q x + LoRA(x)``, the always-selected partition the
      plain projections (reference); ``"shared"`` is the paper's reading (LoRA on the shared partition).
      ``lora_rank=None`` uses the reference's rank, ``head_dim * expand_v``; the paper used 64;
    - router ``p = softmax(x W_e)`` over the N sparse partitions; ``sse_gating`` scales the writes and/or
      reads of the selected partitions by ``p`` (``write_read`` as in the paper; ``write``, ``read`` and
      ``none`` are the ablations); ``num_writers`` / ``num_readers`` are the top-K of each side;
    - ``sse_transition="gla"`` (two low-rank decay gates, ``logsigmoid(.) / gate_logit_normalizer``) or
      ``"gdn"`` (gated delta rule, SSE-GDN) where ``gdn_gate_target`` says what the write gate scales:
      ``"key"`` (the reference) gates q and k *before* the in-op L2 norm, which divides both gates away: the
      router then learns from the balance loss alone (its gradient from the LM loss is ~1e-5 of the query
      projection's). ``"value"`` normalises q and k first and gates the value (write) and the query (read),
      so the router's choice reaches the output; use it to train SSE-GDN's routing, ``"key"`` to match
      the reference's checkpoints;
    - ``aux_loss_coef * N / K * sum_i f_i mean(p_i)``: partition-balance loss, added to the LM loss.

    ``linear_qkv_bias`` gives the linear mixers' Q/K/V projections a bias (set when converting Qwen2-style
    models, whose attention has one); ``output_bias`` gives every mixer's output projection one (Llama with
    ``attention_bias``). ``rope_parameters`` (transformers' format: ``rope_type`` plus its keys, e.g. Llama-3's
    or YaRN's scaling) makes the softmax layers rotate as the converted source did; types whose frequencies
    depend on the sequence length at run time (``dynamic``, ``longrope``) are refused. ``sla_gates`` adds the head-level softmax read/write gates of Softmax Linear Attention to ``gla``,
    ``gdn`` and ``retnet`` mixers. ``sse_implementation`` picks the SSE algorithm (``auto``, ``mask``,
    ``varlen``, ``recurrent``); ``linear_mode`` the inner linear-attention form (``auto``, ``chunk``,
    ``recurrent``).

    ``checkpointing_keeps_linear_attention``: under (non-reentrant) gradient checkpointing, the chunked
    linear-attention kernels' outputs and chunk states are kept from the forward instead of computed again
    when the backward rebuilds the block (the Triton kernels; see ``sse_model/ops/checkpointing.py``). Saves
    about a third of those kernels' time per step; costs, per layer, the output plus the chunk states, about
    ``2 * head_dim / 64`` times the size of the layer's keys for GLA (twice that for SSE's rows): +6.4 GiB
    for the 24-layer benchmark model at 8 x 4k tokens. Off by default: it pays only where the GPU, not the
    host, bounds the step (``docs/benchmarks.md``). The chunk plans (small) are kept either way.

    ``sse_backward_head_groups``: above 1, the SSE chunk kernels' backward makes the chunk states again, this
    many groups of heads one after another, instead of keeping the forward's: neither the states (about
    ``head_dim / 16`` units of the layer's keys) between the forward and the backward nor all heads' states and
    their gradients at once inside it, for one more state pass a step (``docs/paper_scale.md``); on packed rows the
    six feature-mapped inputs are made again a group at a time too. It must divide ``num_heads``.
    """

    model_type = "sse_hybrid"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 24,
        mixer_types: list[str] | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 32768,
        # linear mixers
        num_heads: int = 16,
        head_dim: int = 128,
        expand_v: float = 1.0,
        use_output_gate: bool = True,
        linear_qkv_bias: bool = False,
        gate_low_rank_dim: int = 16,
        gate_logit_normalizer: float = 16.0,
        use_short_conv: bool = False,
        conv_size: int = 4,
        q_activation: str = "silu",
        k_activation: str | None = None,
        v_activation: str = "silu",
        allow_neg_eigval: bool = False,
        sla_gates: bool = False,
        linear_mode: str = "auto",
        chunk_size: int = 16,
        # SSE
        num_sparse_partitions: int = 4,
        num_writers: int = 1,
        num_readers: int = 1,
        sse_transition: str = "gla",
        sse_gating: str = "write_read",
        gdn_gate_target: str = "key",
        row_topk: int | None = None,
        lora_rank: int | None = None,
        lora_side: str = "sparse",
        sse_implementation: str = "auto",
        aux_loss_coef: float = 0.01,
        checkpointing_keeps_linear_attention: bool = False,
        sse_backward_head_groups: int = 1,
        # softmax attention
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        attention_head_dim: int | None = None,
        attention_bias: bool = False,
        output_bias: bool = False,
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        sliding_window: int | None = None,
        # tokens
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size or default_intermediate_size(hidden_size)
        self.num_hidden_layers = num_hidden_layers
        self.mixer_types = list(mixer_types) if mixer_types is not None else hybrid_mixer_types(num_hidden_layers)
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings

        self.num_heads = num_heads
        self.head_dim = head_dim
        self.expand_v = expand_v
        self.use_output_gate = use_output_gate
        self.linear_qkv_bias = linear_qkv_bias
        self.gate_low_rank_dim = gate_low_rank_dim
        self.gate_logit_normalizer = gate_logit_normalizer
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.q_activation = q_activation
        self.k_activation = k_activation
        self.v_activation = v_activation
        self.allow_neg_eigval = allow_neg_eigval
        self.sla_gates = sla_gates
        self.linear_mode = linear_mode
        self.chunk_size = chunk_size

        self.num_sparse_partitions = num_sparse_partitions
        self.num_writers = num_writers
        self.num_readers = num_readers
        self.sse_transition = sse_transition
        self.sse_gating = sse_gating
        self.gdn_gate_target = gdn_gate_target
        self.row_topk = row_topk
        self.lora_rank = lora_rank
        self.lora_side = lora_side
        self.sse_implementation = sse_implementation
        self.aux_loss_coef = aux_loss_coef
        self.checkpointing_keeps_linear_attention = checkpointing_keeps_linear_attention
        self.sse_backward_head_groups = sse_backward_head_groups

        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.attention_head_dim = attention_head_dim
        self.attention_bias = attention_bias
        self.output_bias = output_bias
        # a scaled RoPE (transformers' ``rope_parameters``: rope_type and its keys) carries its own base
        self.rope_parameters = dict(rope_parameters) if rope_parameters else None
        self.rope_theta = float(self.rope_parameters.get("rope_theta", rope_theta)) if self.rope_parameters else rope_theta
        self.sliding_window = sliding_window
        self.use_cache = use_cache

        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_sse()

    # ------------------------------------------------------------------------------------------------
    @property
    def head_v_dim(self) -> int:
        return int(round(self.head_dim * self.expand_v))

    @property
    def attn_head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    def key_activation(self, transition: str) -> str:
        """The key feature map for a linear mixer of ``transition`` (``gla`` or ``gdn``)."""
        if self.k_activation is not None:
            return self.k_activation
        return "softmax" if transition == "gla" else "silu"

    def resolved_lora_rank(self) -> int:
        return self.lora_rank if self.lora_rank is not None else self.head_v_dim

    def validate_sse(self) -> None:
        """Raises ``ValueError`` naming the field for any inconsistent setting."""

        def fail(field, message):
            raise ValueError(f"SSEConfig.{field}: {message}")

        if len(self.mixer_types) != self.num_hidden_layers:
            fail("mixer_types", f"has {len(self.mixer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        for i, kind in enumerate(self.mixer_types):
            if kind not in MIXERS:
                fail("mixer_types", f"layer {i} has unknown mixer {kind!r}; expected one of {MIXERS}")
        for field, value in (("q_activation", self.q_activation), ("v_activation", self.v_activation),
                             ("k_activation", self.k_activation)):
            if value is not None and value not in ACTIVATIONS:
                fail(field, f"unknown activation {value!r}; expected one of {ACTIVATIONS}")
        if self.head_dim <= 0 or self.num_heads <= 0:
            fail("head_dim", "num_heads and head_dim must be positive")
        if not math.isclose(self.head_dim * self.expand_v, self.head_v_dim, rel_tol=1e-6):
            fail("expand_v", f"head_dim * expand_v = {self.head_dim * self.expand_v} is not an integer")
        uses = set(self.mixer_types)
        if uses & set(ATTENTION_MIXERS):
            if self.hidden_size % self.num_attention_heads and self.attention_head_dim is None:
                fail("num_attention_heads", f"{self.num_attention_heads} does not divide hidden_size {self.hidden_size}; "
                     "set attention_head_dim")
            if self.num_attention_heads % self.num_key_value_heads:
                fail("num_key_value_heads", f"{self.num_key_value_heads} does not divide num_attention_heads "
                     f"{self.num_attention_heads}")
        if "swa" in uses and (self.sliding_window is None or self.sliding_window < 1):
            fail("sliding_window", "an 'swa' layer needs sliding_window >= 1")
        if "sse" in uses:
            N = self.num_sparse_partitions
            if N < 1:
                fail("num_sparse_partitions", f"must be >= 1, got {N}")
            for field in ("num_writers", "num_readers"):
                value = getattr(self, field)
                if not 1 <= value <= N:
                    fail(field, f"top-K = {value} must be between 1 and num_sparse_partitions = {N}")
            if self.sse_transition not in ("gla", "gdn"):
                fail("sse_transition", f"unknown transition {self.sse_transition!r}; expected 'gla' or 'gdn'")
            if self.sse_gating not in SSE_GATINGS:
                fail("sse_gating", f"unknown gating {self.sse_gating!r}; expected one of {SSE_GATINGS}")
            if self.gdn_gate_target not in ("key", "value"):
                fail("gdn_gate_target", f"expected 'key' or 'value', got {self.gdn_gate_target!r}")
            if self.lora_side not in ("sparse", "shared"):
                fail("lora_side", f"expected 'sparse' or 'shared', got {self.lora_side!r}")
            if self.sse_implementation not in ("auto", "mask", "varlen", "recurrent"):
                fail("sse_implementation", f"unknown implementation {self.sse_implementation!r}")
        if self.row_topk is not None:
            if not 1 <= self.row_topk <= self.head_dim:
                fail("row_topk", f"must be between 1 and head_dim = {self.head_dim}, got {self.row_topk}")
            if uses & {"gdn"} or ("sse" in uses and self.sse_transition == "gdn"):
                fail("row_topk", "row-sparse updates need a per-row (GLA) decay; not defined for the GDN transition")
        if self.linear_mode not in ("auto", "chunk", "recurrent"):
            fail("linear_mode", f"unknown mode {self.linear_mode!r}")
        if self.rope_parameters is not None:
            if not isinstance(self.rope_parameters, dict):
                fail("rope_parameters", f"expected a dict, got {type(self.rope_parameters).__name__}")
            from .modules import rope_frequencies

            try:
                rope_frequencies(8, self.rope_theta, self.rope_parameters, self.max_position_embeddings)
            except (ValueError, KeyError) as e:
                fail("rope_parameters", str(e))

    # ------------------------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "SSEConfig":
        """A named configuration (see :data:`PRESETS`), with keyword overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        kwargs = copy.deepcopy(PRESETS[name])
        kwargs.update(overrides)
        return cls(**kwargs)


# The paper's models (its Table 7): MHA + SwiGLU backbone, head dim 128, SSE n4k1 with one shared partition and
# LoRA rank 64; 2B = 18 layers x 2304, 18 heads (the hybrid: 3 softmax layers), 600M = 24 layers x 1024, 8 heads,
# pure SSE. The vocabulary is Qwen2.5's (151,646 tokens padded to 151,936), the tokenizer family of the
# distillation data. Parameter counts (non-embedding, untied head): sse-h-2b 1.167B against the paper's 1.3B
# (the paper does not give its MLP width; ours is fla's default, 8/3 x hidden rounded to 256 = 6144), sse-600m
# 0.323B against 300M. sse-h-600m is this project's hybrid at the 600M width (the paper's 600M runs are pure).
PRESETS: dict[str, dict] = {
    "sse-h-2b": dict(
        vocab_size=151936, hidden_size=2304, num_hidden_layers=18,
        mixer_types=hybrid_mixer_types(18), num_heads=18, head_dim=128, num_attention_heads=18,
        num_sparse_partitions=4, num_writers=1, num_readers=1, lora_rank=64, rope_theta=1e6,
        max_position_embeddings=32768,
    ),
    # a ~7B SSE-H for sharded training (FSDP) measurements: Qwen2.5-7B's shape (28 layers x 3584, MLP 18,944, GQA
    # attention layers of 4 KV heads) with the paper's SSE layers (full-width K/V, n4k1, LoRA 64); 8.19B parameters,
    # 131 GB of float32 training state (weights, gradients, AdamW): more than any one GPU holds
    "sse-h-7b": dict(
        vocab_size=151936, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        mixer_types=hybrid_mixer_types(28), num_heads=28, head_dim=128, num_attention_heads=28, num_key_value_heads=4,
        num_sparse_partitions=4, num_writers=1, num_readers=1, lora_rank=64, rope_theta=1e6,
        max_position_embeddings=32768,
    ),
    "sse-2b": dict(
        vocab_size=151936, hidden_size=2304, num_hidden_layers=18, mixer_types=["sse"] * 18,
        num_heads=18, head_dim=128, num_attention_heads=18, num_sparse_partitions=4, lora_rank=64,
    ),
    "transformer-2b": dict(
        vocab_size=151936, hidden_size=2304, num_hidden_layers=18, mixer_types=["attn"] * 18,
        num_heads=18, head_dim=128, num_attention_heads=18, rope_theta=1e6, max_position_embeddings=32768,
    ),
    "sse-600m": dict(
        vocab_size=151936, hidden_size=1024, num_hidden_layers=24, mixer_types=["sse"] * 24,
        num_heads=8, head_dim=128, num_attention_heads=8, num_sparse_partitions=4, lora_rank=64,
    ),
    "sse-h-600m": dict(
        vocab_size=151936, hidden_size=1024, num_hidden_layers=24, mixer_types=hybrid_mixer_types(24),
        num_heads=8, head_dim=128, num_attention_heads=8, num_sparse_partitions=4, lora_rank=64,
    ),
    "sse-h-100m": dict(
        vocab_size=151936, hidden_size=512, num_hidden_layers=12, mixer_types=hybrid_mixer_types(12),
        num_heads=4, head_dim=128, num_attention_heads=8, num_sparse_partitions=4, tie_word_embeddings=True,
    ),
    # SmolLM2-135M-Instruct converted (recipes/smollm2-135m.yaml): 30 layers x 576, 9 heads of 64, 3 KV heads, tied
    # embeddings; what sse_config_from_transformer makes of its Llama config (a test holds them equal), for the
    # benchmarks of the real model's shape with random weights.
    "sse-h-smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        mixer_types=hybrid_mixer_types(30), num_heads=9, head_dim=64, num_attention_heads=9, num_key_value_heads=3,
        attention_head_dim=64, num_sparse_partitions=4, rope_theta=100000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "transformer-smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, mixer_types=["attn"] * 30,
        num_heads=9, head_dim=64, num_attention_heads=9, num_key_value_heads=3, attention_head_dim=64,
        rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "sse-h-tiny": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, mixer_types=hybrid_mixer_types(6),
        num_heads=4, head_dim=16, num_attention_heads=4, num_sparse_partitions=4, intermediate_size=128,
        max_position_embeddings=4096,
    ),
}
