"""``scripts.sample_solutions``: a model's own solutions, written as rows that distillation and alignment read."""

import json


def test_a_models_own_solutions_become_rows_with_the_prompt_it_saw(tmp_path):
    """The tiny demo model samples for five problems: each row is the prompt the model was given (the recipe's
    instruction in it) and its sample; the same seed writes the same file; samples cut at the limit are left out
    and counted unless kept (alignment text)."""
    from pipeline.data import prompt_dataset, sft_dataset
    from pipeline.recipe import DataSpec, load_recipe
    from scripts.sample_solutions import sample_solutions

    source = "builtin:arithmetic?n=5"
    kept = sample_solutions("demo", source, "train", tmp_path / "a.jsonl", max_tokens=12, keep_cut=True,
                            device="cpu")
    assert kept["problems"] == kept["written"] == 5 and 5 <= kept["tokens"] <= 5 * 12
    rows = sft_dataset(DataSpec(source=str(tmp_path / "a.jsonl")))
    asked = prompt_dataset(DataSpec(source=source), load_recipe("demo").prompt_instruction)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in asked]
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in records] == [r["answer"] for r in asked]
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)

    again = sample_solutions("demo", source, "train", tmp_path / "b.jsonl", max_tokens=12, keep_cut=True,
                             device="cpu")
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text() and again["cut"] == kept["cut"]
    finished = sample_solutions("demo", source, "train", tmp_path / "c.jsonl", max_tokens=12, device="cpu")
    assert finished["written"] == 5 - kept["cut"]
    assert len((tmp_path / "c.jsonl").read_text().splitlines()) == finished["written"]
