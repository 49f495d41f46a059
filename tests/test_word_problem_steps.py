"""``python -m benchmarks.pipeline.word_problem_steps``: how far completions get through the worked steps of the
synthetic word problems, read from an evaluation's generations."""

import json

import pytest

from benchmarks.pipeline.word_problem_steps import equations, main, measure


def test_equations_are_read_and_checked_as_the_problems_compute():
    assert equations("28*4 = 112, so 28+112=140; 52/2=26 and 9 - 4 = 6; 7 x 3 = 21") == \
        [(112, True), (140, True), (26, True), (6, False), (21, True)]
    assert equations("57/3=19, 5/0=1, 2+2 is 4") == [(19, True), (1, False)]  # shares are whole; no '=' no equation


def test_a_completion_is_measured_against_its_problems_worked_solution(tmp_path, capsys):
    """The first validation problem's solution (2*8=16, 23+16=39, 39/3=13, 2*3=6, 13+6=19, 2*5=10, 19+10=29)
    copied whole, and a completion that gets two steps right, one wrong, and stops: equations per completion,
    arithmetic over the equations, the worked results reached by right equations, the boxed answer; two files of
    one label pool."""
    worked = ("The packs hold 2*8=16, so Mia has 23+16=39. One share is 39/3=13. The jars hold 2*3=6, so Mia has "
              "13+6=19. The jars hold 2*5=10, so Mia has 19+10=29. Mia has 29 shells now. \\boxed{29}")
    partial = "Mia gets 2*8=16 shells, so 23+16=39. Then 39/3=12. \\boxed{12}"
    files = []
    for i, text in enumerate((worked, partial)):
        files.append(tmp_path / f"{i}.jsonl")
        files[-1].write_text(json.dumps({"benchmark": "word_problems_val", "problem_id": "word-20261129-0",
                                         "sample": 0, "text": text}) + "\n")
    got = measure([str(f) for f in files])
    assert got["completions"] == 2 and got["equations"] == pytest.approx((7 + 3) / 2)
    assert got["arithmetic"] == pytest.approx(9 / 10) and got["reached"] == pytest.approx((1 + 2 / 7) / 2)
    assert got["accuracy"] == pytest.approx(0.5)
    main([f"model={files[0]}", f"model={files[1]}", "--out", str(tmp_path / "steps.md")])
    assert "| model | 2 | 5.00 | 90.0% | 64.3% | 50.00% |" in capsys.readouterr().out
    assert json.loads((tmp_path / "steps.json").read_text())["model"]["completions"] == 2
    files[0].write_text(json.dumps({"benchmark": "word_problems_val", "problem_id": "nope", "sample": 0,
                                    "text": ""}) + "\n")
    with pytest.raises(ValueError, match="0.jsonl:1: problem 'nope' is not in word_problems_val"):
        measure([str(files[0])])
    files[0].write_text(json.dumps({"benchmark": "gsm8k", "problem_id": "1", "sample": 0, "text": ""}) + "\n")
    with pytest.raises(ValueError, match="gsm8k: not a word-problem benchmark"):
        measure([str(files[0])])
