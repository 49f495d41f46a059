"""Final-answer extraction from model completions.

``strict=True`` (an RL reward that wants the format): the last ``\\boxed{...}`` / ``\\fbox{...}`` only.

Default (evaluation, and the accuracy reward unless a recipe asks for strict), the way common graders read
completions: the *last stated* answer, a box or an explicit phrase ("The final answer is X", "Answer: X",
"Final Answer: The final answer is X. I hope it is correct."), whichever comes later; when there is neither,
:class:`Extraction` carries the completion's tail, and the verifier lets math-verify's own LaTeX /
expression extraction find the final answer there (in a worker, under the pool's timeout). All boxes are kept,
so that an answer given as several boxes (``\\boxed{(2,2)}`` and ``\\boxed{(6,2)}``) can be compared as a set.

Answers are normalised for what models and datasets spell differently: markdown bold, full-width and other
Unicode digits, signs and vulgar fractions (``３``, ``−``, ``½``). The work is bounded on any input (answers over
``MAX_ANSWER_CHARS`` count as unclosed, only the last boxes are tried) and no string (NUL bytes, invalid UTF-8,
lone surrogates, megabytes of braces) makes it raise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_ANSWER_CHARS = 4096
FALLBACK_TAIL_CHARS = 2048  # what math-verify's own extraction sees of a completion without box or phrase
PHRASE_WINDOW_CHARS = 8192  # without a box, answer phrases are looked for at the end of the completion
_PHRASES = re.compile(
    # horizontal space only before a line's "answer": ``^\s*`` at every line start ran over the newlines that follow
    # and back, quadratic in a run of blank lines (200k of them took over a minute)
    r"(?:final answer|the answer)\s*(?:is|:)\s*(?P<a>[^\n]{1,300})|^[ \t]*answer\s*:\s*(?P<b>[^\n]{1,300})",
    re.IGNORECASE | re.MULTILINE,
)
_HOPE = re.compile(r"\s*I hope it is correct\b.*$", re.IGNORECASE | re.DOTALL)
_VULGAR = {"½": "1/2", "⅓": "1/3", "⅔": "2/3", "¼": "1/4", "¾": "3/4", "⅕": "1/5", "⅖": "2/5", "⅗": "3/5",
           "⅘": "4/5", "⅙": "1/6", "⅚": "5/6", "⅐": "1/7", "⅛": "1/8", "⅜": "3/8", "⅝": "5/8", "⅞": "7/8",
           "⅑": "1/9", "⅒": "1/10"}
_UNICODE = str.maketrans({
    **{chr(0xFF10 + d): str(d) for d in range(10)},  # full-width digits
    "＋": "+", "－": "-", "／": "/", "．": ".", "，": ",", "（": "(", "）": ")", "＝": "=",
    "−": "-", "–": "-", "⁄": "/", "×": "\\times ", "÷": "\\div ",
})


def clean_text(text) -> str:
    """Any completion as a ``str``: bytes are decoded (invalid UTF-8 replaced), NUL bytes removed."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        text = "" if text is None else str(text)
    if "\x00" in text:
        text = text.replace("\x00", "")
    return text.encode("utf-8", errors="replace").decode("utf-8")


def normalize_unicode(answer: str) -> str:
    """Full-width and other Unicode digits, signs and vulgar fractions as ASCII (``３`` -> 3, ``½`` -> 1/2);
    other Unicode digits (Arabic-Indic, ...) through their decimal value. Superscripts are left alone."""
    if answer.isascii():
        return answer
    out = []
    for ch in answer.translate(_UNICODE):
        if ch in _VULGAR:
            out.append(_VULGAR[ch])
        elif not ch.isascii() and ch.isdecimal():
            out.append(str(int(ch)))
        else:
            out.append(ch)
    return "".join(out)


def _braced(text: str, start: int, limit: int) -> str | None:
    """Content of the brace group opening at ``text[start] == '{'``; None if it does not close within
    ``limit`` characters. ``\\{`` and ``\\}`` are literal braces (LaTeX sets), not structure."""
    depth = 0
    end = min(len(text), start + limit + 2)
    i = start
    while i < end:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def boxes(text: str, max_chars: int = MAX_ANSWER_CHARS, max_candidates: int = 32) -> list[tuple[int, str]]:
    """``(position, content)`` of the complete ``\\boxed{...}`` / ``\\fbox{...}`` (also ``\\boxed {5}`` and
    ``\\boxed 5``) among the last ``max_candidates``, in order. Contents over ``max_chars`` count as not closed,
    which bounds the work on adversarial inputs."""
    found = []
    for m in list(_BOX.finditer(text))[-max_candidates:]:
        after = m.end()
        gap = re.match(r"\s*", text[after:after + 100]).end()
        if after + gap < len(text) and text[after + gap] == "{":
            content = _braced(text, after + gap, max_chars)
        elif gap:
            token = re.match(r"([^\s$]+)", text[after + gap:after + gap + 200])
            content = token.group(1) if token else None
        else:
            content = None
        if content is not None and content.strip():
            found.append((m.start(), content.strip()))
    return found


def last_boxed(text: str, max_chars: int = MAX_ANSWER_CHARS, max_candidates: int = 32) -> str | None:
    """Content of the last complete box, or None."""
    found = boxes(clean_text(text), max_chars, max_candidates)
    return found[-1][1] if found else None


def _tidy(answer: str) -> str:
    """An answer as stated in running text: without "I hope it is correct", a nested "The final answer is",
    markdown bold, the closing period, ``$...$`` delimiters, or a box around it."""
    for _ in range(3):
        before = answer
        answer = _HOPE.sub("", answer).strip()
        nested = list(_PHRASES.finditer(answer))
        if nested:
            answer = (nested[-1].group("a") or nested[-1].group("b")).strip()
        answer = answer.strip()
        span = re.match(r"\$([^$]{1,%d})\$" % MAX_ANSWER_CHARS, answer) or re.match(r"\\\((.{1,%d}?)\\\)" % MAX_ANSWER_CHARS, answer)
        if span:  # "$x$. Some more sentences": the math span is the answer
            answer = span.group(1).strip()
        else:  # "16. Then we check ...": the first sentence
            answer = re.split(r"\.\s+(?=[A-Z])", answer, maxsplit=1)[0]
        answer = answer.strip().rstrip(".").strip()
        for mark in ("**", "__"):
            if answer.startswith(mark) and answer.endswith(mark) and len(answer) > 2 * len(mark):
                answer = answer[len(mark):-len(mark)].strip()
        answer = answer.replace("**", "")
        if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
            answer = answer.strip("$").strip()
        inner = last_boxed(answer)
        if inner is not None:
            answer = inner
        if answer == before:
            break
    return answer


@dataclass
class Extraction:
    """What a completion states as its answer. ``answer`` is None when there is no box and no answer phrase
    (or, in strict mode, no box); then ``tail`` (default mode) is the end of the completion, for math-verify's
    own extraction. ``boxes`` are all boxed answers, in order."""

    answer: str | None
    boxes: list[str] = field(default_factory=list)
    tail: str | None = None


def extract(text, strict: bool = False) -> Extraction:
    text = clean_text(text)
    found = boxes(text)
    contents = [normalize_unicode(c) for _, c in found]
    if strict:
        return Extraction(contents[-1] if contents else None, contents)
    # only a phrase after the last box can be the last stated answer
    start = found[-1][0] if found else max(0, len(text) - PHRASE_WINDOW_CHARS)
    phrases = list(_PHRASES.finditer(text, start))
    if phrases and (not found or phrases[-1].start() > found[-1][0]):
        answer = _tidy(phrases[-1].group("a") or phrases[-1].group("b"))
        return Extraction(normalize_unicode(answer) if answer else None, contents)
    if found:
        return Extraction(contents[-1], contents)
    tail = text[-FALLBACK_TAIL_CHARS:].strip()
    return Extraction(None, [], normalize_unicode(tail) if tail else None)


def extract_answer(text, strict: bool = False) -> str | None:
    """The final answer in ``text`` (see :func:`extract`); None if none is stated."""
    return extract(text, strict).answer
