"""The model: incremental decoding, generation, padding, packing, save/load, aux loss, config errors."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import assert_close
from sse_model import SSEConfig, SSEForCausalLM, SSEHybridCache

BASE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, pad_token_id=0)
MIXERS = {
    "sse-gla": dict(mixer_types=["sse", "attn"]),
    "sse-gdn": dict(mixer_types=["sse", "attn"], sse_transition="gdn"),
    "sse-gdn-value-gate": dict(mixer_types=["sse", "sse"], sse_transition="gdn", gdn_gate_target="value"),
    "sse-rowtopk-conv-swa": dict(mixer_types=["sse", "swa"], row_topk=3, use_short_conv=True, sliding_window=5,
                                 lora_side="shared", num_writers=2, num_readers=1),
    "gla-gdn-sla": dict(mixer_types=["gla", "gdn"], sla_gates=True),
    "retnet-swa": dict(mixer_types=["retnet", "swa"], sliding_window=4),
    "attn": dict(mixer_types=["attn", "attn"]),
}


def tiny(mixer="sse-gla", dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    config = SSEConfig(**{**BASE, **MIXERS[mixer], **overrides})
    return SSEForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("mixer", list(MIXERS))
@pytest.mark.parametrize("impl", ["mask", "varlen"])
def test_prefill_then_decode_matches_full_forward(mixer, impl):
    model = tiny(mixer, sse_implementation=impl)
    x = torch.randint(1, 97, (2, 23))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :9], use_cache=True)
        cache, pieces = out.past_key_values, [out.logits]
        out = model(x[:, 9:15], past_key_values=cache)  # a second prefill chunk
        pieces.append(out.logits)
        for t in range(15, 23):
            pieces.append(model(x[:, t:t + 1], past_key_values=cache).logits)
    assert_close(torch.cat(pieces, 1), full, torch.float64, mixer)


def test_sse_h_preset_prefill_then_decode():
    torch.manual_seed(0)
    model = SSEForCausalLM(SSEConfig.from_preset("sse-h-tiny")).eval()
    x = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :20], use_cache=True)
        pieces = [out.logits] + [model(x[:, t:t + 1], past_key_values=out.past_key_values).logits
                                 for t in range(20, 30)]
    assert_close(torch.cat(pieces, 1), full, torch.float32, "SSE-H")


def test_greedy_generate_matches_argmax_loop():
    model = tiny("sse-gla", dtype=torch.float32)
    prompt = torch.randint(1, 97, (1, 7))
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids)


def test_sampling_is_seeded():
    model = tiny("sse-gla", dtype=torch.float32)
    prompt = torch.randint(1, 97, (2, 5))
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                   do_sample=True, top_p=0.9, temperature=1.0, eos_token_id=None))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("mixer", ["sse-gla", "sse-rowtopk-conv-swa", "gla-gdn-sla"])
def test_left_padded_batch_matches_single_sequences(mixer):
    model = tiny(mixer, dtype=torch.float32)
    prompts = [torch.randint(1, 97, (n,)) for n in (9, 4, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    for i, p in enumerate(prompts):
        single = model.generate(p[None], max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert torch.equal(batch[i, width:], single[0, len(p):]), f"prompt {i}"


@pytest.mark.parametrize("mixer", ["sse-gla", "sse-gdn", "sse-rowtopk-conv-swa", "gla-gdn-sla"])
def test_packed_batch_has_no_cross_sample_leakage(mixer):
    model = tiny(mixer)
    lengths = [5, 11, 3]
    seqs = [torch.randint(1, 97, (n,)) for n in lengths]
    packed = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        out = model(packed, position_ids=position_ids, labels=packed)
        start, losses, tokens = 0, [], 0
        for s in seqs:
            single = model(s[None], labels=s[None])
            assert_close(out.logits[:, start:start + len(s)], single.logits, torch.float64, "logits")
            losses.append(single.lm_loss * (len(s) - 1))
            tokens += len(s) - 1
            start += len(s)
    assert_close(out.lm_loss, sum(losses) / tokens, torch.float64, "packed loss")


def test_save_load_round_trip_and_auto_classes(tmp_path):
    model = tiny("sse-rowtopk-conv-swa", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert isinstance(AutoConfig.from_pretrained(tmp_path), SSEConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, SSEForCausalLM)
    x = torch.randint(1, 97, (2, 13))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_packed_projections_change_no_output_gradient_or_checkpoint(mixer, tmp_path):
    """``pack_projections`` (what the rollout engine does): every group is then read in one product without
    autograd; decoding, gradients, in-place updates and save/load are those of the unpacked model."""
    from sse_model.modules import packed_weights

    model, reference = tiny(mixer), tiny(mixer)
    params = dict(model.named_parameters())
    groups = [m.input_projections() for m in model.modules() if hasattr(m, "input_projections")]
    assert all(packed_weights(g) is None for g in groups if len(g) > 1)
    model.pack_projections()
    assert all(p is params[n] for n, p in model.named_parameters())  # the same parameters, now views
    assert all(packed_weights(g) is not None for g in groups)
    x = torch.randint(1, 97, (2, 12))
    with torch.no_grad():
        for m in (model, reference):
            out = m(x[:, :8], use_cache=True)
            m.decoded = [out.logits] + [m(x[:, t:t + 1], past_key_values=out.past_key_values).logits
                                        for t in range(8, 12)]
    assert_close(torch.cat(model.decoded, 1), torch.cat(reference.decoded, 1), torch.float64, "packed decode")
    for m in (model, reference):
        m.train()(x, labels=x).loss.backward()
    for n, p in reference.named_parameters():
        assert_close(params[n].grad, p.grad, torch.float64, f"gradient of {n}")
    with torch.no_grad():  # an in-place update (optimizer, weight sync) reaches the packed tensor
        group = groups[0]
        group[-1].weight.add_(1.0)
        assert torch.equal(packed_weights(group)[0][-group[-1].out_features:], group[-1].weight)
    model.eval().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).state_dict()
    assert all(torch.equal(loaded[n], p) for n, p in model.state_dict().items())
    model.float()  # a conversion unpacks; generation falls back to one product per map
    assert all(packed_weights(g) is None for g in groups if len(g) > 1)


def test_aux_loss_rises_when_routing_collapses():
    model = tiny("sse-gla", dtype=torch.float32, mixer_types=["sse", "sse"], num_sparse_partitions=4).train()
    x = torch.randint(1, 97, (4, 64))
    balanced = model(x, labels=x)
    collapse = torch.tensor([0.0, 0.0, 10.0, 0.0])  # every token prefers partition 2
    hooks = [layer.attn.e_proj.register_forward_hook(lambda mod, inp, out: out + collapse)
             for layer in model.model.layers]
    collapsed = model(x, labels=x)
    for hook in hooks:
        hook.remove()
    # per layer: ~1 for balanced routing, N / K = 4 when every token writes the same partition
    assert balanced.aux_loss.item() < 2 * 1.3
    assert collapsed.aux_loss.item() > 2 * 3.9
    assert torch.allclose(collapsed.loss, collapsed.lm_loss + 0.01 * collapsed.aux_loss)


def test_eval_loss_is_the_language_model_loss():
    """The balance loss trains the router; evaluation losses (perplexities) leave it out and report it apart."""
    model = tiny("sse-gla", dtype=torch.float32, mixer_types=["sse", "sse"], num_sparse_partitions=4)
    x = torch.randint(1, 97, (2, 16))
    model.train()
    train = model(x, labels=x)
    model.eval()
    with torch.no_grad():
        evaluation = model(x, labels=x)
    assert torch.allclose(train.loss, train.lm_loss + 0.01 * train.aux_loss)
    assert torch.equal(evaluation.loss, evaluation.lm_loss) and evaluation.aux_loss > 0
    assert torch.allclose(evaluation.lm_loss, train.lm_loss)


@pytest.mark.parametrize("overrides, field", [
    (dict(num_writers=5), "num_writers"),
    (dict(num_readers=0), "num_readers"),
    (dict(mixer_types=["sse", "mamba"]), "mixer_types"),
    (dict(mixer_types=["sse"]), "mixer_types"),
    (dict(num_attention_heads=5), "num_attention_heads"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(expand_v=0.3), "expand_v"),
    (dict(row_topk=3, sse_transition="gdn"), "row_topk"),
    (dict(row_topk=99), "row_topk"),
    (dict(mixer_types=["sse", "swa"]), "sliding_window"),
    (dict(sse_gating="sometimes"), "sse_gating"),
])
def test_inconsistent_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        SSEConfig(**{**BASE, **MIXERS["sse-gla"], **overrides})


def test_cache_memory_is_constant_for_linear_layers():
    model = tiny("sse-gla", dtype=torch.float32, mixer_types=["sse", "sse"])
    out = model(torch.randint(1, 97, (1, 50)), use_cache=True)
    cache: SSEHybridCache = out.past_key_values
    size = cache.memory_bytes()
    model(torch.randint(1, 97, (1, 1)), past_key_values=cache)
    assert cache.memory_bytes() == size
    assert cache.layers[0].recurrent.shape == (1, 5, 2, 8, 8)


def test_gradient_checkpointing_gives_same_gradients():
    model = tiny("sse-gla", dtype=torch.float64).train()
    x = torch.randint(1, 97, (2, 17))
    model(x, labels=x).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        assert_close(p.grad, plain[n], torch.float64, n)


def test_paper_presets_match_the_paper():
    """The paper's Table 7 shapes, LoRA rank 64, and non-embedding sizes near its 1.3B / 300M."""
    for name, layers, hidden, heads, target in (("sse-h-2b", 18, 2304, 18, 1.3e9), ("sse-600m", 24, 1024, 8, 3e8)):
        config = SSEConfig.from_preset(name)
        assert (config.num_hidden_layers, config.hidden_size, config.num_heads) == (layers, hidden, heads)
        assert config.resolved_lora_rank() == 64 and config.num_sparse_partitions == 4 and config.num_writers == 1
        with torch.device("meta"):
            model = SSEForCausalLM(config)
        embedding = model.model.embeddings.weight.numel() + model.lm_head.weight.numel()
        non_embedding = sum(p.numel() for p in model.parameters()) - embedding
        assert abs(non_embedding - target) / target < 0.12, f"{name}: {non_embedding / 1e9:.3f}B"
    assert SSEConfig.from_preset("sse-600m").mixer_types == ["sse"] * 24
    assert SSEConfig.from_preset("sse-h-2b").mixer_types.count("attn") == 3


def test_smollm2_presets_are_what_conversion_makes_of_smollm2():
    """``sse-h-smollm2`` / ``transformer-smollm2`` (benchmarks at the real model's shape) equal the configuration
    conversion builds from SmolLM2-135M's Llama config, every field that shapes the computation."""
    from transformers import LlamaConfig

    from benchmarks.kernels.bench_packed import SMOLLM2
    from sse_model.convert import sse_config_from_transformer

    skip = {"bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"}
    for preset, mixers in (("sse-h-smollm2", None), ("transformer-smollm2", ["attn"] * 30)):
        made = sse_config_from_transformer(LlamaConfig(**SMOLLM2), mixers).to_dict()
        named = SSEConfig.from_preset(preset).to_dict()
        assert {k: v for k, v in named.items() if k not in skip} == {k: v for k, v in made.items() if k not in skip}


def test_gdn_gate_target_value_lets_the_router_learn_from_the_output():
    """With the reference's key gating the in-op L2 norm divides the router's gates away; value gating keeps them."""
    ratios = {}
    for target in ("key", "value"):
        torch.manual_seed(0)
        config = SSEConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, mixer_types=["sse"], num_heads=2,
                           head_dim=8, num_sparse_partitions=4, sse_transition="gdn", gdn_gate_target=target,
                           aux_loss_coef=0.0, intermediate_size=64)
        model = SSEForCausalLM(config).double()
        x = torch.randint(1, 97, (2, 24))
        model(x, labels=x).loss.backward()
        attn = model.model.layers[0].attn
        ratios[target] = float(attn.e_proj.weight.grad.norm() / attn.q_proj.weight.grad.norm())
    assert ratios["key"] < 1e-4 < 1e-3 < ratios["value"], ratios


def test_bad_checkpoint_paths_give_one_line_errors(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from sse_model.checkpoint import CheckpointError, load_pretrained

    with pytest.raises(CheckpointError, match="no such model directory"):
        load_pretrained(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty: no config.json here"):
        load_pretrained(tmp_path / "empty")
    model = tiny("sse-gla", dtype=torch.float32)
    model.save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    with pytest.raises(CheckpointError, match=r"cut: its weights do not load .*model.safetensors"):
        load_pretrained(tmp_path / "cut")
    LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")
    assert load_pretrained(tmp_path / "llama").config.model_type == "llama"
    with pytest.raises(CheckpointError, match=r"llama: a 'llama' model; an SSE model is needed here"):
        load_pretrained(tmp_path / "llama", require_sse=True)


def test_rotary_frequencies_stay_float32_when_the_model_is_cast():
    """A bf16 ``inv_freq`` turns the angle at position 32k into noise; the bf16 model must rotate like fp32."""
    from sse_model.modules import RotaryEmbedding

    reference = tiny("attn", dtype=torch.float32)
    model = tiny("attn", dtype=torch.float32).to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            assert module.inv_freq.dtype == torch.float32
            assert torch.equal(module.inv_freq, module.compute_inv_freq())
    rope = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    rope32 = next(m for m in reference.modules() if isinstance(m, RotaryEmbedding))
    q = torch.randn(1, 4, 2, rope.dim)
    positions = torch.tensor([[5, 2_000, 8_000, 32_000]])
    got = rope(q.bfloat16(), q.bfloat16(), positions)[0].float()
    want = rope32(q.bfloat16().float(), q.bfloat16().float(), positions)[0]
    assert (got - want).abs().max() < 2e-2  # bf16 rounding of the output only
    assert rope.to(torch.float64).inv_freq.dtype == torch.float64  # wider dtypes are kept (parity tests)
