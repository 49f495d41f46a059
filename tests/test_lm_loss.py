"""``sse-pipeline loss``'s arms: draws grouped by label, the ratio to the first arm with an interval over draws and
records (the GPU part, scoring real models, is in tests/test_known_models.py)."""

import random

import pytest

from pipeline.lm_loss import LossResult, group, markdown, parse_model, ratio_interval


def draw(label: str, record_losses: list[float], tokens: int = 100) -> LossResult:
    return LossResult(f"runs/{label}/{len(record_losses)}", sum(record_losses) / tokens, 0.5, tokens,
                      len(record_losses), record_losses=record_losses, label=label)


def test_models_are_paths_or_labelled_paths():
    assert parse_model("runs/a/distill/final") == ("runs/a/distill/final", "runs/a/distill/final")
    assert parse_model("SSE-H=runs/a/distill/final") == ("SSE-H", "runs/a/distill/final")
    for bad in ("=runs/a", "SSE-H="):
        with pytest.raises(ValueError, match="LABEL=PATH"):
            parse_model(bad)


def test_draws_of_a_label_form_one_arm_in_first_seen_order():
    results = [draw("T", [1.0, 2.0]), draw("S", [2.0, 2.0]), draw("T", [3.0, 2.0])]
    arms = group(results)
    assert [a.label for a in arms] == ["T", "S"] and [len(a.draws) for a in arms] == [2, 1]
    assert arms[0].loss == pytest.approx((0.03 + 0.05) / 2)
    with pytest.raises(ValueError, match="one tokenizer"):
        group([draw("T", [1.0]), draw("T", [1.0], tokens=90)])


def test_a_ratio_the_records_fix_has_no_width_and_spread_draws_widen_it():
    rng = random.Random(0)
    base = [rng.uniform(50, 150) for _ in range(200)]
    reference = group([draw("T", base)])[0]
    scaled = group([draw("S", [1.1 * x for x in base])])[0]
    assert ratio_interval(reference, scaled) == pytest.approx((1.1, 1.1))
    # noisy draws around 1.1x: one draw's interval (records only) is narrower than two draws' that disagree
    noisy = [draw("S", [f * x * rng.uniform(0.8, 1.2) for x in base]) for f in (1.0, 1.2)]
    low1, high1 = ratio_interval(reference, group(noisy[:1])[0])
    low2, high2 = ratio_interval(reference, group(noisy)[0])
    assert high2 - low2 > 2 * (high1 - low1)
    assert low2 < sum(a.loss for a in noisy) / 2 / reference.loss < high2


def test_the_table_gives_each_arm_a_row_and_the_first_as_reference():
    rng = random.Random(1)
    base = [rng.uniform(50, 150) for _ in range(50)]
    arms = group([draw("T", base), draw("S", [1.2 * x for x in base]), draw("S", [1.3 * x for x in base])])
    rows = [line for line in markdown(arms, ratios=True).splitlines() if line.startswith("| ")][2:]
    assert rows[0].startswith("| T | 1 |") and rows[0].endswith("| 1.00 |")
    assert rows[1].startswith("| S | 2 |") and "| 1.250 (1.200-1.300) |" in rows[1], rows[1]
    assert "x first" not in markdown(arms, ratios=False)


def test_packed_records_score_as_each_record_alone():
    """An SSE model reads records packed into rows (position ids restarting at each): each record's summed loss and
    token count equal those of the record alone, so packing is only speed."""
    import torch
    from datasets import Dataset

    from pipeline.lm_loss import completion_loss, encode, packs
    from pipeline.models import load_model
    from pipeline.recipe import load_recipe

    assert packs([3, 4, 2, 9, 1], 7) == [[0, 1], [2], [3], [4]]  # a record over the budget alone
    assert packs([5, 5, 5], 1) == [[0], [1], [2]]
    recipe = load_recipe("demo")
    model, tokenizer = load_model(recipe.model, None, seed=0)
    rng = random.Random(3)
    rows = [{"prompt": [{"role": "user", "content": f"{rng.randint(1, 999)}+{rng.randint(1, 99)}?"}],
             "completion": [{"role": "assistant", "content": "so " * rng.randint(1, 12) + f"{rng.randint(1, 999)}"}]}
            for _ in range(9)]
    data = Dataset.from_list(rows)
    lengths = [len(encode(tokenizer, row)[0]) for row in rows]
    assert max(map(len, packs(lengths, 120))) >= 3  # rows of several records
    alone = completion_loss(model, tokenizer, data, torch.device("cpu"), pack_tokens=1)
    packed = completion_loss(model, tokenizer, data, torch.device("cpu"), pack_tokens=120)
    assert packed.record_tokens == alone.record_tokens
    assert packed.record_losses == pytest.approx(alone.record_losses, rel=1e-4, abs=1e-4)
    assert packed.accuracy == alone.accuracy


def test_a_transformers_llama_is_scored_packed_as_the_model_it_converts_to():
    """A transformers Llama reads records one a forward; as the all-attention model it converts to (what ``loss``
    scores it as) it reads them packed, with the same loss for every record."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.lm_loss import completion_loss, packed_reader
    from pipeline.tokenizer import build_char_tokenizer
    from sse_model import SSEForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=False)).eval()
    rng = random.Random(5)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{rng.randint(1, 999)}?"}],
                               "completion": [{"role": "assistant", "content": "ok " * rng.randint(1, 9)}]}
                              for _ in range(7)])
    alone = completion_loss(llama, tokenizer, data, torch.device("cpu"))
    reader = packed_reader(llama)
    assert isinstance(reader, SSEForCausalLM) and packed_reader(reader) is reader
    packed = completion_loss(reader, tokenizer, data, torch.device("cpu"), pack_tokens=200)
    assert packed.record_tokens == alone.record_tokens
    assert packed.record_losses == pytest.approx(alone.record_losses, rel=1e-4, abs=1e-4)


def test_the_figure_draws_every_arm(tmp_path):
    from pipeline.lm_loss import plot

    arms = group([draw("T", [100.0, 120.0]), draw("S", [150.0, 170.0]), draw("S", [160.0, 150.0])])
    path = plot(arms, "2 records of test", tmp_path / "loss.png")
    assert path.stat().st_size > 1000


def test_gsm8k_solutions_read_as_distillation_rows_have_them():
    """``--as-trained``: GSM8K test's solutions in the format gsm8k_train was rewritten to, so that a loss gap can be
    told apart from the markup (calculator annotations, ``#### N``) that distillation never shows."""
    import json

    from eval.benchmarks import DATA_DIR
    from pipeline.data import PACKAGED, gsm8k_as_trained

    solution = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 1,018"
    assert gsm8k_as_trained(solution) == \
        "Janet sells 16 - 3 - 4 = 9 duck eggs.\nShe makes 9 * 2 = $18.\nThe answer is \\boxed{1018}."
    with pytest.raises(ValueError, match="no closing '#### N' line"):
        gsm8k_as_trained("The answer is \\boxed{3}.")
    test = [json.loads(line) for line in (DATA_DIR / "gsm8k_test.jsonl").open()]
    assert all(gsm8k_as_trained(r["solution"]) == gsm8k_as_trained(r["solution"], r["answer"]) for r in test)
    train = [json.loads(line) for line in PACKAGED["gsm8k_train"].open()]
    assert all("<<" not in r["solution"] and r["solution"].endswith(f"\\boxed{{{r['answer']}}}.") for r in train)
    # beside each, the solution as published, which conversion's validation scores (--solution-field published)
    assert all(gsm8k_as_trained(r["published"], r["answer"]) == r["solution"] for r in train)
    assert sum("<<" in r["published"] for r in train) > 0.9 * len(train)


def test_earlier_scorings_pool_as_draws_and_other_records_are_refused(tmp_path):
    """``--scored``: the .json an earlier ``--out`` wrote comes back as its draws (one session's Transformer beside
    another's SSE-H, one table); a scoring of other records (count, split, format) is refused naming the file."""
    import json
    from dataclasses import asdict

    from pipeline.lm_loss import main

    data = tmp_path / "solutions.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1?", "solution": f"{i + 1}", "published": f"#### {i + 1}"})
                            + "\n" for i in range(6)))
    rng = random.Random(2)
    base = [rng.uniform(5, 15) for _ in range(6)]

    def saved(name, results, records=6, as_trained=False, solution_field="solution"):
        path = tmp_path / name
        path.write_text(json.dumps({"data": str(data), "split": "train", "solution_field": solution_field,
                                    "as_trained": as_trained, "records": records,
                                    "models": [asdict(r) for r in results]}))
        return str(path)

    first = saved("a.json", [draw("T", base), draw("S", [1.2 * x for x in base])])
    second = saved("b.json", [draw("T", [1.02 * x for x in base]), draw("S", [1.3 * x for x in base])])
    out = tmp_path / "pooled.md"
    text = main([], str(data), 6, None, "cpu", str(out), scored_files=[first, second])
    rows = [line for line in text.splitlines() if line.startswith("| ")][2:]
    assert rows[0].startswith("| T | 2 |") and rows[1].startswith("| S | 2 |"), text
    assert f"| {1.25 / 1.01:.3f} (" in rows[1], rows[1]
    assert json.loads(out.with_suffix(".json").read_text())["models"][3]["label"] == "S"
    for name, kwargs, key in (("c.json", {"records": 5}, "records"), ("d.json", {"as_trained": True}, "as_trained"),
                              ("e.json", {"solution_field": "published"}, "solution_field")):
        with pytest.raises(ValueError, match=rf"--scored .*{name}: {key} is"):
            main([], str(data), 6, None, "cpu", None, scored_files=[first, saved(name, [draw("T", base)], **kwargs)])
    # another field's solutions: pooled only with scorings of that field, and the table says which
    published = saved("f.json", [draw("T", base)], solution_field="published")
    text = main([], str(data), 6, None, "cpu", None, scored_files=[published], solution_field="published")
    assert "solutions from field `published`" in text
    with pytest.raises(ValueError, match=r"--scored .*a.json: solution_field is 'solution'"):
        main([], str(data), 6, None, "cpu", None, scored_files=[first], solution_field="published")
    with pytest.raises(ValueError, match="no model to score"):
        main([], str(data), 6, None, "cpu", None)


def test_the_kept_conversion_test_reads_as_a_cost_per_calculator_annotation(capsys):
    """``benchmarks.pipeline.loss_by_markup`` on the kept scorings of GSM8K test (docs/runs/2026-11-29b-conversion-test):
    the table docs/real_model.md quotes, where the distilled SSE-H pays three times the Transformer's loss for each
    calculator annotation and the same for the closing line."""
    from pathlib import Path

    from benchmarks.pipeline.loss_by_markup import main

    kept = Path(__file__).resolve().parents[1] / "docs" / "runs" / "2026-11-29b-conversion-test"
    main([str(kept / "loss_gsm8k.json.gz"), str(kept / "loss_gsm8k_trained.json.gz")])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows["SSE-H-distilled"][2:5] == ["33.9", "17.5", "3.05"]
    assert rows["Transformer-distilled"][2:5] == ["11.1", "18.5", "1.00"]
    with pytest.raises(ValueError, match="not one set's records as published and as trained"):
        main([str(kept / "loss_gsm8k.json.gz"), str(kept / "loss_aime.json.gz")])


def test_the_kept_aime_scoring_reads_by_how_much_each_solution_repeats():
    """``benchmarks.pipeline.loss_by_copying`` on the kept AIME scoring: the distilled SSE-H's ratio to the
    distilled Transformer rises with the share of a solution repeating earlier text (from the least- to the
    most-repeating quarter, as docs/real_model.md quotes); a run of text repeated counts only from the given
    length."""
    from pathlib import Path

    from benchmarks.pipeline.loss_by_copying import copied_share, main

    assert copied_share("x = 12345678", "so x = 12345678 and y", 8) == len("x = 12345678") / len("so x = 12345678 and y")
    assert copied_share("abc", "abcabc", 4) == 0.0 and copied_share("", "abcdabcd", 4) == 0.5
    kept = Path(__file__).resolve().parents[1] / "docs" / "runs" / "2026-11-29b-conversion-test"
    lines = [line.strip("| ").split(" | ") for line in main([str(kept / "loss_aime.json.gz")]).splitlines()
             if line.startswith("| ") and "---" not in line]
    column = lines[0].index("SSE-H-distilled x")  # x the distilled Transformer
    ratios = [float(r[column]) for r in lines[1:]]  # by copied share, least first
    assert ratios == sorted(ratios) and (ratios[0], ratios[-1]) == (1.39, 1.73)


def test_the_unigram_baseline_is_the_training_tokens_frequencies_add_one_smoothed():
    """The row of a model that reads nothing: each solution token's -log of its add-one smoothed frequency among
    the training rows' solution tokens; top-1, the commonest of them. Checked against the sum written out."""
    import math
    from collections import Counter

    from pipeline.data import sft_dataset
    from pipeline.lm_loss import encode, unigram_loss
    from pipeline.recipe import DataSpec
    from pipeline.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    train = sft_dataset(DataSpec(source="builtin:arithmetic?terms=2", max_samples=40, seed=1))
    scored = sft_dataset(DataSpec(source="builtin:arithmetic?terms=3", max_samples=7, seed=2))
    result = unigram_loss(tokenizer, train, scored)
    counts = Counter(t for ids, start in map(lambda r: encode(tokenizer, r), train) for t in ids[start:])
    total, vocab = sum(counts.values()), len(tokenizer)
    targets = [ids[start:] for ids, start in (encode(tokenizer, r) for r in scored)]
    expected = [-sum(math.log((counts[t] + 1) / (total + vocab)) for t in ids) for ids in targets]
    assert result.record_losses == pytest.approx(expected) and result.records == 7
    assert result.loss == pytest.approx(sum(expected) / sum(map(len, targets)))
    top = counts.most_common(1)[0][0]
    assert result.accuracy == pytest.approx(sum(ids.count(top) for ids in targets) / sum(map(len, targets)))
    # a token never seen in training costs log(total + vocab), finite
    assert 0 < result.loss < math.log(total + vocab)


def test_the_loss_table_takes_the_unigram_row_from_the_recipes_distillation_rows(tmp_path):
    """``--unigram``: a row of its own, beside the models, from the recipe's tokenizer and distillation rows; refused
    without a recipe."""
    from pipeline.lm_loss import main

    text = main([], "builtin:arithmetic?terms=2", 5, "demo", "cpu", str(tmp_path / "loss.md"), unigram=True)
    assert "| tokens' frequencies (no reading) | 1 |" in text and "5 records of" in text
    with pytest.raises(ValueError, match="--recipe"):
        main([], "builtin:arithmetic?terms=2", 5, None, "cpu", None, unigram=True)
