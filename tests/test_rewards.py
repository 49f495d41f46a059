"""Rewards: labelled verdicts, adversarial inputs under a hard timeout, TRL-style reward functions."""

import multiprocessing as mp
import time
import os
import subprocess
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from reward_cases import CASES  # noqa: E402

from rewards import AccuracyReward, FormatReward, MathVerifier, OverlongPenalty, VerifierPool  # noqa: E402
from rewards.extract import extract_answer, last_boxed  # noqa: E402

TIMEOUT = 2.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(pool=VerifierPool(num_workers=2, timeout=TIMEOUT))
    yield v
    v.close()


def test_labelled_cases(verifier):
    assert len(CASES) >= 150
    scores, stats, answers = verifier.score([c[1] for c in CASES], [c[2] for c in CASES])
    wrong = [(c[0], c[1][-50:], c[2], c[3], a) for c, s, a in zip(CASES, scores, answers) if bool(s) != c[3]]
    assert not wrong, f"{len(wrong)} disagreements: {wrong[:10]}"
    assert stats.timeouts == 0 and stats.crashes == 0


def adversarial_inputs():
    items = []
    for n in (10, 100, 1000, 10_000, 100_000):
        items.append(("\\boxed{" + "{" * n + "1" + "}" * n + "}", "1"))
        items.append(("\\boxed{" + "\\frac{" * n + "1", "1"))
        items.append(("{" * n + "\\boxed{2}", "2"))
    towers = ["10^{10^{10^{10}}}", "9^{9^{9^{9}}}", "2^{2^{2^{2^{2^{2}}}}}", "(10^{100})^{10^{100}}",
              "1000000!", "(10^{10})!", "100!!!!", "10^{10^{10}}!", "\\prod_{k=1}^{10^9} k",
              "\\sum_{n=1}^{10^{12}} n^2", "x^{x^{x^{x^{x}}}}", "e^{e^{e^{e^{100}}}}", "\\binom{10^{9}}{10^{8}}",
              "9" * 5000, "1e100000", "10^{-10^{10}}", "\\sqrt[10^{10}]{2}", "\\int_0^1 e^{x^{x^x}} dx",
              "\\lim_{x\\to0} \\frac{\\sin(x^{x^x})}{x}", "\\frac{10^{10^{5}}}{10^{10^{5}}+1}"]
    for t in towers:
        items.append((f"Thus \\boxed{{{t}}}", "5"))
        items.append(("\\boxed{5}", t))
        items.append((f"\\boxed{{{t}}}", t))
        items.append((f"The final answer is ${t}$", t))
    rng = random.Random(0)
    tokens = ["\\frac", "{", "}", "^", "_", "\\sqrt", "10", "x", "!", "\\left(", "\\right)", "\\cdot", "9", "\\\\",
              "&", "$", "\\boxed", "\\infty", "e", "i", "\\pi", "(", ")", "[", "]", ",", "-", "+", "/", "%"]
    for _ in range(30):
        garbage = "".join(rng.choice(tokens) for _ in range(rng.randint(5, 400)))
        items.append((f"\\boxed{{{garbage}}}", garbage[::-1]))
    for big in ("1" * 100_000, "x+" * 50_000, "\\frac{1}{2}" * 10_000, "a" * 150_000):
        items.append((f"\\boxed{{{big}}}", "1"))
        items.append((big, "1"))
        items.append(("\\boxed{1}", big))
    invalid = ["\\frac{", "\\begin{pmatrix", "}}}{{{", "\\sqrt[", "\\left(", "$$$", "\\boxed{\\boxed{\\boxed{",
               "\\end{matrix}", "^^^^", "_{_{_{", "\\\\\\\\\\\\", "\\frac{1}{0}", "0/0", "\\infty - \\infty",
               "\\text{", "\\mathrm{\\mathrm{", "&&&", "\\begin{pmatrix}1&2\\\\3\\end{pmatrix}", "1/(x-x)",
               "\\log(0)", "\\sqrt{-1}^{i^{i}}", "\\{\\{\\{\\}", "(((((", "]]]", "\\undefinedmacro{3}"]
    for t in invalid:
        items.append((f"\\boxed{{{t}}}", "3"))
        items.append(("\\boxed{3}", t))
    binary = [b"\xff\xfe\\boxed{3}", b"\\boxed{\xc3\x28}", bytes(range(256)), b"\x00" * 1000,
              "\\boxed{1\x002}", "\x00\\boxed{4}", "\ud800\\boxed{5}", "\\boxed{\u202e321}", "\\boxed{١٢٣}",
              "\\boxed{😀}", "\\boxed{\u200b7}", "\\boxed{" + "\u0301" * 1000 + "}"]
    for t in binary:
        items.append((t, "3"))
        items.append((t, "\x00"))
    many_boxes = "\\boxed{1}" * 10_000
    items += [(many_boxes, "1"), ("\\boxed{" * 50_000, "1"), ("}" * 100_000, "1"), ("", ""), (None, "1")]
    matrix = "\\begin{pmatrix}" + "\\\\".join("&".join(["x"] * 40) for _ in range(40)) + "\\end{pmatrix}"
    items += [(f"\\boxed{{{matrix}}}", matrix), (f"\\boxed{{{matrix}}}", "1")]
    return items


def test_adversarial_inputs_are_bounded_and_harmless():
    """Every item scored within its timeout + 1 s (a short one: the items built to hang each cost it), the pool
    alive after them."""
    timeout = 1.0
    verifier = MathVerifier(pool=VerifierPool(num_workers=2, timeout=timeout))
    try:
        items = adversarial_inputs()
        assert len(items) >= 200
        scores, stats, _ = verifier.score([i[0] for i in items], [i[1] for i in items])
        assert all(s in (0.0, 1.0) for s in scores) and stats.timeouts > 0
        slow = [v.seconds for v in verifier.last_verdicts if v.seconds > timeout + 1.0]
        assert not slow, f"{len(slow)} items exceeded timeout + 1 s: {slow[:5]}"
        assert verifier.pool.alive() == verifier.pool.num_workers, "the pool must survive"
        # and it still works afterwards
        assert verifier.score(["\\boxed{\\frac{1}{2}}"], ["0.5"])[0] == [1.0]
    finally:
        verifier.close()


def test_workers_do_not_leak():
    before = set(p.pid for p in mp.active_children())
    pool = VerifierPool(num_workers=2, timeout=1.0)
    verifier = MathVerifier(pool=pool)
    verifier.score(["\\boxed{10^{10^{10^{10}}}}", "\\boxed{2}"], ["1", "2"])
    assert pool.restarts >= 1
    pool.close()
    leftover = [p for p in mp.active_children() if p.pid not in before and p.name != "ForkServerProcess"]
    assert not leftover, leftover


def test_extraction():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert last_boxed("\\boxed{x} and \\boxed{unclosed") == "x"
    assert extract_answer("The final answer is $\\frac{1}{2}$.") == "\\frac{1}{2}"
    assert extract_answer("The final answer is 7", strict=True) is None
    assert extract_answer("no answer here") is None


def test_trl_reward_functions(verifier):
    acc = AccuracyReward(verifier)
    completions = ["Step one. \\boxed{4}", [{"role": "assistant", "content": "So \\boxed{5}"}], "I give up"]
    assert acc(prompts=["p"] * 3, completions=completions, answer=["4", "4", "4"]) == [1.0, 0.0, 0.0]
    assert acc.last_stats.no_answer == 1 and acc.last_stats.items == 3
    with pytest.raises(KeyError, match="answer"):
        acc(prompts=["p"], completions=["\\boxed{1}"])
    fmt = FormatReward(min_reasoning_chars=10)
    assert fmt(completions=["2+2 is computed as four: \\boxed{4}", "\\boxed{4}", "long reasoning but no box"]) == \
        [1.0, 0.0, 0.0]
    think = FormatReward(min_reasoning_chars=5, think_tag="think")
    assert think(completions=["<think>2+2=4</think> so \\boxed{4}", "<think>2+2=4 so \\boxed{4}"]) == [1.0, 0.0]
    over = OverlongPenalty(max_length=100, cache_length=20)
    assert over(completions=["a"] * 4, completion_ids=[[0] * 50, [0] * 80, [0] * 90, [0] * 120]) == [0.0, 0.0, -0.5, -1.0]
    with pytest.raises(ValueError):
        OverlongPenalty(10, 20)


# ----------------------------------------------------------------------------------------------------------
# extraction and verification the way the common graders do it


GRADER_CASES = [  # (what, completion, gold, default verdict, strict verdict)
    ("fallback: no box, no phrase", "We solve the inequality step by step.\nTherefore x >= 5 is the solution.",
     "x \\ge 5", True, False),
    ("fallback: a number at the end", "Adding the two parts gives a total of 42 apples.", "42", True, False),
    ("fallback: wrong number", "Adding the two parts gives a total of 41 apples.", "42", False, False),
    ("several boxes form the answer", "The solutions are \\boxed{(2,2)} and \\boxed{(6,2)}.", "(2, 2), (6, 2)",
     True, True),
    ("nested final-answer phrase", "Final Answer: The final answer is 7.78.", "7.78", True, False),
    ("nested phrase and hope", "Final Answer: The final answer is $7.78$. I hope it is correct.", "7.78", True, False),
    ("markdown bold", "So the answer is: **73**", "73", True, False),
    ("space before the brace", "Hence \\boxed {5}.", "5", True, True),
    ("the last stated answer wins", "First guess \\boxed{3}. Checking again, that was wrong.\nFinal answer: 5",
     "5", True, False),
    ("an earlier phrase loses to a later box", "The answer is 3? No: recomputing, \\boxed{5}", "5", True, True),
    ("sequences are not numbers", "\\boxed{1, 3, 5, \\ldots, 2n-1}", "1, 2, \\ldots, n", False, False),
    ("the same sequence", "\\boxed{1,2,\\dots,n}", "1, 2, \\ldots, n", True, True),
    ("full-width digits", "\\boxed{３}", "3", True, True),
    ("vulgar fraction", "\\boxed{½}", "\\frac{1}{2}", True, True),
    ("unicode minus", "\\boxed{−5}", "-5", True, True),
    ("unicode gold", "\\boxed{12}", "１２", True, True),
]


@pytest.mark.parametrize("strict", [False, True])
def test_grader_behaviour(verifier, strict):
    checker = MathVerifier(pool=verifier.pool, strict=strict)
    scores, stats, _ = checker.score([c[1] for c in GRADER_CASES], [c[2] for c in GRADER_CASES])
    wrong = [(c[0], s) for c, s in zip(GRADER_CASES, scores) if bool(s) != c[4 if strict else 3]]
    assert not wrong, f"{'strict' if strict else 'default'} mode disagrees on: {wrong}"
    assert stats.timeouts == 0 and stats.crashes == 0


def test_extraction_details():
    assert extract_answer("Final Answer: The final answer is 7.78.") == "7.78"
    assert extract_answer("The answer is **73**.") == "73"
    assert extract_answer("\\boxed {x+1}") == "x+1"
    assert extract_answer("\\boxed{3} then The final answer is 4") == "4"
    assert extract_answer("The final answer is 4, so \\boxed{3}") == "3"
    assert extract_answer("Thus the answer is $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert extract_answer("nothing stated here") is None  # left to math-verify's extraction by the verifier


def test_gold_answers_are_length_capped(verifier):
    start = time.perf_counter()
    scores, stats, _ = verifier.score(["\\boxed{1}"], ["1" * 1_000_000])
    assert scores == [0.0] and stats.gold_too_long == 1
    assert time.perf_counter() - start < 1.0, "a megabyte of gold must be refused, not verified"


def test_scoring_works_from_a_script_without_a_main_guard(tmp_path):
    """multiprocessing re-runs an unguarded calling script in every worker; the workers crashed and every
    answer silently scored 0. Workers must not depend on the caller's __main__."""
    script = tmp_path / "unguarded.py"
    script.write_text("from rewards import MathVerifier\n"
                      "v = MathVerifier(num_workers=1, timeout=10)\n"
                      "scores, stats, _ = v.score(['So \\\\boxed{\\\\frac{1}{2}}'], ['0.5'])\n"
                      "print('SCORE', scores[0], stats.crashes)\n"
                      "v.close()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "SCORE 1.0 0" in out.stdout, out.stdout + out.stderr[-2000:]


def test_workers_die_with_a_killed_caller(tmp_path):
    """A worker stuck in a computation no signal reaches must not outlive its caller (kill -9)."""
    script = tmp_path / "caller.py"
    script.write_text("from rewards import VerifierPool\n"
                      "if __name__ == '__main__':\n"
                      "    pool = VerifierPool(num_workers=1, timeout=300)\n"
                      "    print('WORKER', pool._workers[0].process.pid, flush=True)\n"
                      "    pool.map([('10^{10^{10}}!', '5')])\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    worker = int(proc.stdout.readline().split()[1])
    time.sleep(2.0)  # the worker is computing
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(worker, 9)
    pytest.fail("the verifier worker outlived its killed caller by 10 s")


@pytest.mark.timeout(30)
def test_answer_extraction_is_linear_in_blank_lines():
    """A box followed by 200k newlines (or lines that start like an answer phrase): the answer-phrase search ran
    ``^\\s*answer`` from every line start over every newline after it, over a minute for this input; a completion
    must cost a bounded time anywhere in reward and scoring."""
    from rewards.extract import extract

    assert extract("\\boxed{7}" + "\n" * 200_000).answer == "7"
    assert extract("\\boxed{7}" + "answer\n" * 100_000 + "answer: 8").answer == "8"
