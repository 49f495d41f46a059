"""Final-answer extraction from model completions.

Order of preference: the last ``\\boxed{...}`` (or ``\\fbox{...}``, braces balanced, any nesting depth), then,
unless ``strict=True``, an explicit phrase ("The final answer is X", "Answer: X"). The work is bounded on any
input (answers over ``MAX_ANSWER_CHARS`` count as unclosed, only the last boxes are tried) and no string
(NUL bytes, invalid UTF-8, lone surrogates, megabytes of braces) makes it raise.
"""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 4096
_PHRASES = re.compile(
    r"(?:final answer|the answer)\s*(?:is|:)\s*(?P<a>[^\n]{1,300})|^\s*answer\s*:\s*(?P<b>[^\n]{1,300})",
    re.IGNORECASE | re.MULTILINE,
)


def clean_text(text) -> str:
    """Any completion as a ``str``: bytes are decoded (invalid UTF-8 replaced), NUL bytes removed."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        text = "" if text is None else str(text)
    if "\x00" in text:
        text = text.replace("\x00", "")
    return text.encode("utf-8", errors="replace").decode("utf-8")


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


_BOX = re.compile(r"\\(?:boxed|fbox)(?=[{ ])")


def last_boxed(text: str, max_chars: int = MAX_ANSWER_CHARS, max_candidates: int = 32) -> str | None:
    """Content of the last complete ``\\boxed{...}``/``\\fbox{...}`` (also ``\\boxed 5``), or None.

    Boxes whose content exceeds ``max_chars`` count as not closed; only the last ``max_candidates`` boxes
    are tried, which bounds the work on adversarial inputs."""
    text = clean_text(text)
    starts = [m.end() for m in _BOX.finditer(text)]
    for after in reversed(starts[-max_candidates:]):
        if text[after] == "{":
            content = _braced(text, after, max_chars)
        else:
            match = re.match(r" +([^\s$]+)", text[after:after + 200])
            content = match.group(1) if match else None
        if content is not None:
            return content.strip()
    return None


def _strip_phrase(answer: str) -> str:
    answer = answer.strip().rstrip(".").strip()
    if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
        answer = answer.strip("$").strip()
    inner = last_boxed(answer)
    return inner if inner is not None else answer


def extract_answer(text, strict: bool = False) -> str | None:
    """The final answer in ``text``: last box, else (unless ``strict``) the last answer phrase; None if none."""
    text = clean_text(text)
    boxed = last_boxed(text)
    if boxed is not None or strict:
        return boxed
    matches = list(_PHRASES.finditer(text))
    if not matches:
        return None
    match = matches[-1]
    return _strip_phrase(match.group("a") or match.group("b"))
