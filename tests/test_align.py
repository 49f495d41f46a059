"""Attention transfer (sse_model.align), the align stage, and logit distillation from the converted Transformer."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sse_model.align import (AttentionTransfer, TeacherTaps, aligned_parameters, freeze_all_but_aligned,
                             normalized_mse, sse_layers)
from sse_model.convert import convert_to_sse

VOCAB, LENGTH = 24, 64


def markov_batch(n: int, generator: torch.Generator, table: torch.Tensor) -> torch.Tensor:
    """Rows of an order-2 Markov chain: after ``(a, b)`` one of three tokens ``table[a, b]``, with p 0.6/0.3/0.1
    (entropy 0.90 nats per token): a model must read the two previous tokens, which attention learns to do."""
    x = torch.zeros(n, LENGTH, dtype=torch.long)
    x[:, :2] = torch.randint(0, VOCAB, (n, 2), generator=generator)
    probs = torch.tensor([0.6, 0.3, 0.1]).expand(n, 3)
    for t in range(2, LENGTH):
        choice = torch.multinomial(probs, 1, generator=generator)[:, 0]
        x[:, t] = table[x[:, t - 2], x[:, t - 1], choice]
    return x


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=False))


def test_taps_give_each_layer_its_input_and_attention_output():
    """The target of layer i is what the teacher's attention at i computes from its normed input, without the skip
    connection; the context is the forward's own (packed boundaries included)."""
    llama = tiny_llama()
    teacher = convert_to_sse(llama, mixer_types=["attn"] * 6).eval()
    taps = TeacherTaps(teacher, [0, 3])
    ids = torch.randint(0, VOCAB, (1, 20))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    with torch.no_grad():
        teacher.model(input_ids=ids, cu_seqlens=cu, use_cache=False)
        hidden = teacher.model(input_ids=ids, cu_seqlens=cu, use_cache=False, output_hidden_states=True).hidden_states
        for i in (0, 3):
            layer = teacher.model.layers[i]
            x = layer.attn_norm(hidden[i])
            torch.testing.assert_close(taps.pairs[i].inputs, x)
            torch.testing.assert_close(taps.pairs[i].target, layer.attn(x, taps.context)[0])
    assert taps.context.cu_seqlens is cu and sorted(taps.pairs) == [0, 3]
    taps.remove()


def test_alignment_trains_only_the_sse_layers():
    student = convert_to_sse(tiny_llama())
    assert sse_layers(student) == [0, 1, 2, 3, 4]
    new = {name for name, _ in aligned_parameters(student, "new")}
    every = {name for name, _ in aligned_parameters(student, "all")}
    assert new < every and "model.layers.0.attn.q_proj.weight" in every - new
    assert "model.layers.0.attn.gk_proj.0.1.bias" in new and "model.layers.0.attn.o_norm.weight" in new
    assert not any(".5." in name or "mlp" in name for name in every)  # the kept attention layer and the MLPs: frozen
    count = freeze_all_but_aligned(student, "new")
    assert count == sum(p.numel() for p in student.parameters() if p.requires_grad) > 0
    assert not student.model.layers[0].attn.q_proj.weight.requires_grad
    assert not student.lm_head.weight.requires_grad and not student.model.layers[5].attn.q_proj.weight.requires_grad
    with pytest.raises(ValueError, match="which must be one of"):
        aligned_parameters(student, "everything")


def test_normalized_mse_reads_one_for_an_output_of_zeros():
    target = torch.randn(2, 5, 8)
    assert normalized_mse(torch.zeros_like(target), target).item() == pytest.approx(1.0)
    assert normalized_mse(target, target).item() == 0.0
    mask = torch.tensor([[True] * 5, [False] * 5])
    noisy = target.clone()
    noisy[1] = 100.0  # padding is not scored
    assert normalized_mse(noisy, target, mask).item() == 0.0


def test_the_teacher_must_be_all_attention():
    llama = tiny_llama()
    with pytest.raises(ValueError, match="must be all attention"):
        AttentionTransfer(convert_to_sse(llama), convert_to_sse(llama))


def test_alignment_brings_a_converted_model_back_to_its_teacher():
    """A tiny Llama trained on an order-2 Markov chain (so its attention means something); conversion alone loses it
    (the SSE layers' outputs are near zero), alignment on the teacher's hidden states brings the loss back within
    1.5x of the teacher's, with no language-model loss at all."""
    generator = torch.Generator().manual_seed(1)
    table = torch.randint(0, VOCAB, (VOCAB, VOCAB, 3), generator=generator)
    llama = tiny_llama()
    optimizer = torch.optim.AdamW(llama.parameters(), lr=3e-3)
    for _ in range(200):
        x = markov_batch(32, generator, table)
        loss = llama(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    test = markov_batch(64, torch.Generator().manual_seed(99), table)

    def lm_loss(model):
        with torch.no_grad():
            return model(input_ids=test, labels=test, use_cache=False).loss.item()

    teacher = convert_to_sse(llama, mixer_types=["attn"] * 6)
    taught = lm_loss(teacher)
    assert taught < 1.4  # it learned the chain (uniform is 3.18, the chain's entropy 0.90)
    torch.manual_seed(0)
    student = convert_to_sse(llama)
    converted = lm_loss(student)
    freeze_all_but_aligned(student, "all")
    transfer = AttentionTransfer(student, teacher)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    steps = 150
    first = last = None
    for step in range(steps):
        x = markov_batch(8, generator, table)
        losses = transfer(input_ids=x.reshape(1, -1), cu_seqlens=torch.arange(0, 8 * LENGTH + 1, LENGTH,
                                                                               dtype=torch.int32))
        loss = torch.stack(list(losses.values())).mean()
        first = loss.item() if first is None else first
        last = loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * 0.5 * (1 + math.cos(math.pi * (step + 1) / steps))
    aligned = lm_loss(student)
    assert converted > 1.5 * taught, (converted, taught)
    assert last < 0.5 * first, (first, last)
    assert aligned < 1.5 * taught, (aligned, taught, converted)


def test_teacher_kl_loss_mixes_cross_entropy_and_the_teachers_distribution(tmp_path):
    """Against a teacher that computes what the student computes, the KL term is 0 and the loss is (1 - w) times the
    cross-entropy; against another model it is the KL of the teacher's distribution from the student's, by hand."""
    from pipeline.data import sft_dataset
    from pipeline.models import resolve_device
    from pipeline.recipe import load_recipe
    from pipeline.stages.distill import SSESFTTrainer, sft_config
    from pipeline.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    student = convert_to_sse(llama, mixer_types=["attn"] * 6)
    recipe = load_recipe("demo", ["distill.data.max_samples=8", "distill.batch_size=4"])
    dataset = sft_dataset(recipe.distill.data, recipe.prompt_instruction)
    for teacher, weight in ((convert_to_sse(llama, mixer_types=["attn"] * 6), 0.25), (convert_to_sse(llama), 0.5)):
        trainer = SSESFTTrainer(model=student, args=sft_config(recipe, tmp_path, resolve_device("cpu")),
                                train_dataset=dataset, processing_class=tokenizer, teacher=teacher.eval(),
                                teacher_kl=weight, kd_temperature=2.0)
        batch = next(iter(trainer.get_train_dataloader()))
        student.train()
        with torch.no_grad():
            loss = trainer.compute_loss(student, dict(batch))
            logits = student(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
            reference = teacher(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        target = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[0, 1:]
        scored = target != -100
        ce = torch.nn.functional.cross_entropy(logits[scored], target[scored])
        p = torch.log_softmax(reference[scored] / 2.0, -1)
        q = torch.log_softmax(logits[scored] / 2.0, -1)
        kl = (p.exp() * (p - q)).sum(-1).mean() * 4.0
        torch.testing.assert_close(loss, (1 - weight) * ce + weight * kl, rtol=1e-4, atol=1e-5)
        logged = trainer._metrics["train"]
        assert logged["ce"][-1] == pytest.approx(ce.item(), rel=1e-4)
        assert logged["teacher_kl"][-1] == pytest.approx(kl.item(), rel=1e-4, abs=1e-6)
        if weight == 0.25:
            assert kl.item() < 1e-6  # the same computation: nothing to learn from the teacher
        else:
            assert kl.item() > 1e-3


@pytest.mark.parametrize("stage", ["align", "distill"])
def test_the_teacher_and_the_aligned_layers_run_in_the_trainings_precision(tmp_path, stage):
    """The Trainer's bf16 autocast wraps only the trained model's ``forward`` (accelerate): the teacher's forward and
    alignment's calls of single layers must enter it themselves, or they run in float32 (on a GPU: no bf16 tensor
    cores, and attention in SDPA's per-sequence float32 path; an alignment step of SmolLM2's recipe took 1.8 s so).
    One bf16 step of each stage on the CPU, recording whether autocast was on in every call."""
    from transformers import TrainingArguments

    from pipeline.models import resolve_device
    from pipeline.recipe import load_recipe
    from pipeline.stages.align import AlignmentTrainer, collate_packed
    from pipeline.stages.distill import SSESFTTrainer, sft_config
    from pipeline.data import sft_dataset
    from pipeline.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    teacher = convert_to_sse(llama, mixer_types=["attn"] * 6).eval()
    student = convert_to_sse(llama)
    seen = {"teacher": [], "student": []}
    for name, model in (("teacher", teacher), ("student", student)):
        for layer in model.model.layers:
            layer.attn.register_forward_pre_hook(
                lambda module, args, name=name: seen[name].append(torch.is_autocast_enabled("cpu")))
    if stage == "align":
        freeze_all_but_aligned(student, "all")
        rows = [{"input_ids": list(range(3, 35)), "lengths": [20, 12]}]
        args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, max_steps=1,
                                 per_device_train_batch_size=1, report_to=[], remove_unused_columns=False)
        trainer = AlignmentTrainer(model=student, args=args, train_dataset=rows, data_collator=collate_packed,
                                   teacher=teacher)
    else:
        recipe = load_recipe("demo", ["distill.data.max_samples=8", "distill.batch_size=4", "distill.max_steps=1",
                                      "precision=bf16-mixed"])
        trainer = SSESFTTrainer(model=student, args=sft_config(recipe, tmp_path, resolve_device("cpu")),
                                train_dataset=sft_dataset(recipe.distill.data, recipe.prompt_instruction),
                                processing_class=tokenizer, teacher=teacher, teacher_kl=0.5)
    assert trainer.args.bf16
    trainer.train()
    assert seen["teacher"] and seen["student"]
    assert all(seen["teacher"]) and all(seen["student"]), seen


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)])
def test_distillation_loss_in_chunks_is_the_whole_loss_and_keeps_only_the_logits(dtype, tol):
    """``distillation_sums`` over chunks of positions: the whole float32 loss's value and gradient (the logits as
    the models return them, float32 or bf16), while what autograd keeps for the backward pass is no more than the
    logits themselves; the same computation over all positions at once keeps three float32 copies."""
    from pipeline.stages.distill import _sums, distillation_sums

    torch.manual_seed(0)
    T, w = 2.0, 0.7
    student = (3 * torch.randn(37, 50)).to(dtype).requires_grad_()
    teacher = (3 * torch.randn(37, 50)).to(dtype)
    target = torch.randint(0, 50, (37,))

    def by_hand(s):
        s = s.float()
        p = torch.log_softmax(teacher.float() / T, -1)
        q = torch.log_softmax(s / T, -1)
        return (torch.nn.functional.cross_entropy(s, target, reduction="sum"),
                (p.exp() * (p - q)).sum() * T * T)

    kept = {}

    def pack(x):
        kept[id(x)] = x.numel() * x.element_size()
        return x

    def run(sums):
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            ce, kl = sums()
        loss = (1 - w) * ce + w * kl
        return loss, torch.autograd.grad(loss, student)[0], sum(kept.values())

    loss, grad, saved = run(lambda: distillation_sums(student, teacher, target, T, chunk=8))
    want_loss, want_grad, _ = run(lambda: by_hand(student))
    torch.testing.assert_close(loss, want_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=tol, atol=tol)
    # the same float32 computation over all positions at once (the loss before chunks): three float32 copies
    _, _, saved_whole = run(lambda: _sums(student, teacher, target, T))
    logits = (student.numel() + teacher.numel()) * student.element_size() + target.numel() * 8
    assert saved <= logits < saved_whole / 1.4, (saved, logits, saved_whole)
