"""``eval/worked_steps.py``: how far completions get through a problem's worked steps, in the evaluation's summary
and report; ``python -m benchmarks.pipeline.word_problem_steps`` reads it from an evaluation's generations."""

import json

import pytest

from benchmarks.pipeline.word_problem_steps import main, measure
from eval.worked_steps import equations, worked_steps

# the first validation word problem's worked solution: 2*8=16, 23+16=39, 39/3=13, 2*3=6, 13+6=19, 2*5=10, 19+10=29
WORKED = ("The packs hold 2*8=16, so Mia has 23+16=39. One share is 39/3=13. The jars hold 2*3=6, so Mia has "
          "13+6=19. The jars hold 2*5=10, so Mia has 19+10=29. Mia has 29 shells now. \\boxed{29}")
PARTIAL = "Mia gets 2*8=16 shells, so 23+16=39. Then 39/3=12. \\boxed{12}"  # two steps right, one wrong, stops


def test_equations_are_read_and_checked_as_the_problems_compute():
    """Products and shares before sums, shares whole; a chain is one equation (``2+3+4 = 9`` right, not ``3+4 = 9``
    wrong); the ends of decimals and of longer numbers are no equation; a sentence's full stop ends a result."""
    assert equations("Then Ken has 20-1=19. 28*4 = 112; 2+3+4 = 9, 10-2*3=4, 12/6*3=6, 16+10 = 40; 7 x 3 = 21") == \
        [(19, True), (112, True), (9, True), (4, True), (6, True), (40, False), (21, True)]
    assert equations("57/3=19, 7/2=3, 5/0=1, 1.5+2=3, 7/2=3.5, 2+2 is 4") == [(19, True), (3, True), (1, False)]


def test_worked_steps_count_equations_arithmetic_and_the_steps_reached():
    got = worked_steps([WORKED, PARTIAL], [WORKED, WORKED])
    assert got["equations"] == pytest.approx((7 + 3) / 2) and got["arithmetic"] == pytest.approx(9 / 10)
    assert got["reached"] == pytest.approx((1 + 2 / 7) / 2) and "right_by_every_step" not in got
    assert worked_steps([WORKED], ["The answer is $\\frac{1}{2}$."]) is None  # solutions not written in steps


def test_right_by_every_step_counts_no_right_answer_reached_by_wrong_steps():
    """A right answer counts only where the completion reached every intermediate result by a right equation: the
    GRPO model's `1*6=6 books` then `6+20=26` (the solution's 1+6=7 and 7-1=6 skipped) is right, not by every step."""
    lucky = "Then Noah has 3-2=1. Noah uses up 1*6=6. Noah has 6+20=26. \\boxed{26}"
    solution = "Then Noah has 3-2=1. Noah finds 1*6=6, so Noah has 1+6=7. Then Noah has 7-1=6. After buying 20 more, " \
               "Noah has 6+20=26. Noah has 26 books now. \\boxed{26}"
    got = worked_steps([solution, lucky, solution.replace("7-1=6", "7-1=5")], [solution] * 3, right=[True, True, False])
    assert got["right_by_every_step"] == pytest.approx(1 / 3)  # the lucky one and the wrong one count for nothing


def test_the_evaluation_reports_worked_steps_where_every_solution_states_them(tmp_path, capsys):
    """The summary and the report of a word-problem set carry the measure; a set without worked solutions does not;
    the script reads the same from the generations, two files of one label pooled."""
    from eval.benchmarks import Problem, load_problems
    from eval.report import accuracy_cell, markdown_table
    from test_eval import scored

    problem = load_problems("word_problems_val", limit=1)[0]
    assert problem.solution == WORKED
    summary = scored([problem], [WORKED, PARTIAL])
    assert summary["worked_steps"] == worked_steps([WORKED, PARTIAL], [WORKED] * 2, right=[True, False])
    assert "| toy | 5.00 | 90.0% | 64.3% | 50.0% |" in markdown_table({"benchmarks": {"toy": summary}})
    assert accuracy_cell(summary).endswith("; worked steps 64.3% reached, 90.0% of equations right, 50.0% right by "
                                           "every step")  # compare, sweep
    older = {**summary, "worked_steps": worked_steps([WORKED, PARTIAL], [WORKED] * 2)}  # kept before it was measured
    assert accuracy_cell(older).endswith("of equations right")
    assert "worked_steps" not in scored([Problem("1", "What is 2+2?", "4")], ["\\boxed{4}"] * 2)

    files = []
    for i, text in enumerate((WORKED, PARTIAL)):
        files.append(tmp_path / f"{i}.jsonl")
        files[-1].write_text(json.dumps({"benchmark": "word_problems_val", "problem_id": problem.id, "sample": 0,
                                         "text": text}) + "\n")
    assert measure([str(f) for f in files]) == {"completions": 2, **summary["worked_steps"]}
    main([f"model={files[0]}", f"model={files[1]}", "--out", str(tmp_path / "steps.md")])
    assert "| model | 2 | 5.00 | 90.0% | 64.3% | 50.0% |" in capsys.readouterr().out
    assert json.loads((tmp_path / "steps.json").read_text())["model"]["completions"] == 2
    files[0].write_text(json.dumps({"benchmark": "word_problems_val", "problem_id": "nope", "sample": 0,
                                    "text": ""}) + "\n")
    with pytest.raises(ValueError, match="0.jsonl:1: problem 'nope' is not in word_problems_val"):
        measure([str(files[0])])
    files[0].write_text(json.dumps({"benchmark": "math500", "problem_id": "math500-0", "sample": 0, "text": ""}) + "\n")
    with pytest.raises(ValueError, match="math500: not every worked solution states its steps"):
        measure([str(files[0])])


def test_compare_pairs_the_share_right_by_every_step_problem_by_problem(tmp_path):
    """Each problem's share right by every step is kept in the summary, and compare gives its change between a run's
    models: distilled, a right answer by skipped steps; after GRPO, the worked solution's steps."""
    from eval.benchmarks import load_problems
    from eval.report import write_reports
    from pipeline.compare import markdown, read_run
    from test_eval import scored

    problem = load_problems("word_problems_val", limit=1)[0]
    lucky = "Mia has 23+16=39. \\boxed{29}"  # right, two of seven steps
    for stage, texts in (("distill", [lucky, PARTIAL]), ("grpo", [WORKED, lucky])):
        summary = scored([problem], texts)
        assert summary["per_problem"][0]["right_by_every_step"] == (0.5 if stage == "grpo" else 0.0)
        write_reports({"benchmarks": {"word_problems_val": summary}, "model": f"{tmp_path}/run/{stage}/final [x]"},
                      tmp_path / "run" / "eval" / stage)
    text = markdown([read_run("run", tmp_path / "run")])
    assert "| run: after distillation -> after GRPO | +50.0 (" in text.split("| change, right by every step |")[1]
