"""Answer verification with math-verify in a pool of worker processes with a hard per-item timeout.

math-verify (sympy underneath) can hang or blow up on hostile inputs (``10^{10^{10^{10}}}``, huge factorials)
inside C code where no signal reaches, and its own signal-based timeout only works in a main thread. So every
comparison runs in a worker process; a worker that overruns its deadline is killed (SIGKILL) and replaced, and
the item scores 0. Workers start from a fork server that has math-verify preloaded, so a replacement costs
milliseconds, not an import.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from multiprocessing.connection import wait

from .extract import MAX_ANSWER_CHARS, clean_text, extract, normalize_unicode


def _as_latex(answer: str) -> str:
    answer = answer.strip()
    if "$" in answer or "\\boxed" in answer:
        return answer
    return "\\boxed{" + answer + "}"


def _normalise(answer: str) -> str:
    return "".join(answer.split()).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".").rstrip("\\")


_E_NOTATION = re.compile(r"(?<![\\\w])(\d+(?:\.\d+)?)[eE]([+-]?\d+)(?![\w])")
_THIN_SPACE_GROUPS = re.compile(r"(?<=\d)\\[,;:! ](?=\d{3}(?!\d))")
_BRACED_COMMA_GROUPS = re.compile(r"(?<=\d)\s*\{\s*,\s*\}\s*(?=\d{3}(?!\d))")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _canonical(answer: str) -> str:
    """Spellings math-verify misses: currency signs, ``1.5e3``, thousands separators ``1\\,000``,
    ``14{,}916`` and, for a lone number, ``12,000,023``."""
    answer = answer.replace("\\$", "").replace("\\dollar", "")
    answer = _E_NOTATION.sub(lambda m: f"{m.group(1)}\\times10^{{{m.group(2)}}}", answer)
    answer = _BRACED_COMMA_GROUPS.sub("", _THIN_SPACE_GROUPS.sub("", answer))
    if _THOUSANDS.fullmatch(answer.strip()):
        answer = answer.replace(",", "")
    return answer


@lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    from math_verify import parse

    return parse(_as_latex(gold), parsing_timeout=None)


_ELLIPSIS = re.compile(r"\\[lcv]?dots\b|\\ldots|\\cdots|\.\.\.|…")
_LISTED_ELLIPSIS = re.compile(r",\s*(?:\\[lcv]?dots\b|\.\.\.|…)|(?:\\[lcv]?dots\b|\.\.\.|…)\s*,")


def _is_sequence(answer: str) -> bool:
    """A short answer that lists terms with an ellipsis (not a worked solution that mentions one)."""
    return len(answer) <= 200 and bool(_LISTED_ELLIPSIS.search(answer))


def _sequence_form(answer: str) -> str:
    return _ELLIPSIS.sub("...", _normalise(answer)).replace("{", "").replace("}", "")


def answers_match(prediction: str, gold: str) -> bool:
    """True if ``prediction`` is mathematically equal to ``gold`` (both answer strings, LaTeX or plain).

    An answer with an ellipsis (a sequence or pattern, ``1, 3, 5, \\ldots, 2n-1``) is compared as written:
    math-verify reads such lists as a single number and would call any two of them equal.
    Runs math-verify with its own timeouts off: call it only inside a worker of :class:`VerifierPool`."""
    if _normalise(prediction) == _normalise(gold):
        return True
    if _is_sequence(prediction) or _is_sequence(gold):
        return _sequence_form(prediction) == _sequence_form(gold)
    from math_verify import parse, verify

    prediction, gold = _canonical(prediction), _canonical(gold)
    candidates = [(prediction, gold)]
    if "%" in prediction or "%" in gold:  # "12.5\\%" vs "12.5": also compare without the percent sign
        candidates.append(tuple(x.replace("\\%", "").replace("%", "") for x in (prediction, gold)))
    for pred, ref in candidates:
        gold_parsed = _parse_gold(ref)
        pred_parsed = parse(_as_latex(pred), parsing_timeout=None)
        if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None):
            return True
    return False


def judge(candidates: tuple[str, ...], tail: str | None, gold: str) -> tuple[bool, str | None]:
    """Whether any candidate answer equals ``gold``; with no candidate, math-verify's own extraction of the
    final answer in ``tail``. Returns (correct, the answer that was judged)."""
    for candidate in candidates:
        if answers_match(candidate, gold):
            return True, candidate
    if candidates:
        first = candidates[0]
        if not re.search(r"[A-Za-z]{3,}\s+[A-Za-z]{3,}", first):  # an answer, not a sentence: judged as such
            return False, first
        tail = first  # a sentence ("Sphere was planted 3 hours ago"): math-verify finds its answer
    if not tail:
        return False, None
    from math_verify import parse, verify

    found = parse(tail, parsing_timeout=None)
    if not found:
        return False, candidates[0] if candidates else None
    answer = str(found[-1])
    if _is_sequence(gold):
        return answers_match(answer, gold), answer
    # the gold as LaTeX, and as math-verify reads plain text (what its extraction did to the completion)
    for gold_parsed in (_parse_gold(_canonical(gold)), parse(gold, parsing_timeout=None)):
        if gold_parsed and verify(gold_parsed, found, timeout_seconds=None):
            return True, answer
    return False, answer


def _reaper_main(conn) -> None:
    """Kills the pool's workers when the process that owns the pool is gone (killed with SIGKILL, say): the pipe
    from the owner reaches EOF. A worker stuck in C code holding the GIL cannot watch for that itself, and
    multiprocessing's fork server keeps running while its children do."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids: set[int] = set()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            return
        if message is None:  # the pool closed normally
            return
        pids.add(message)


def _worker_main(conn) -> None:
    """Worker loop: ``(job, candidates, tail, gold)`` in, ``(job, correct, answer, error)`` out; ``None`` stops it."""
    import logging
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": the pool enforces it
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job, candidates, tail, gold = message
        try:
            conn.send((job, *judge(candidates, tail, gold), None))
        except BaseException as err:  # noqa: BLE001 - any failure of one item scores 0, the worker lives on
            try:
                conn.send((job, False, None, f"{type(err).__name__}: {str(err)[:200]}"))
            except (OSError, ValueError):
                return


@dataclass
class Verdict:
    correct: bool
    status: str  # ok | no_answer | too_long | gold_too_long | timeout | crash | error
    seconds: float = 0.0  # from dispatch to a worker until the verdict
    answer: str | None = None  # what was judged (math-verify's extraction when the completion stated none)


@dataclass
class VerifyStats:
    """What one batch of verification cost and what went wrong."""

    items: int = 0
    seconds: float = 0.0
    timeouts: int = 0
    crashes: int = 0
    errors: int = 0
    no_answer: int = 0
    too_long: int = 0
    gold_too_long: int = 0
    unique_pairs: int = 0
    correct: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self, prefix: str = "") -> dict:
        keys = ("items", "seconds", "timeouts", "crashes", "errors", "no_answer", "too_long", "gold_too_long",
                "unique_pairs", "correct")
        return {f"{prefix}{k}": getattr(self, k) for k in keys}


@contextlib.contextmanager
def _without_main_module():
    """Workers run :func:`_worker_main` of this module and need nothing of the caller's ``__main__``; hiding it
    while they start keeps multiprocessing from re-running a calling script that has no
    ``if __name__ == "__main__":`` guard in every worker (which killed them, and scored every answer 0)."""
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if main is not None and hasattr(main, name)}
    try:
        if "__file__" in saved:
            del main.__file__
        if "__spec__" in saved:
            main.__spec__ = None  # multiprocessing reads it unconditionally
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def _start(ctx, target):
    """A daemon process running ``target(pipe end)``; returns (process, our end of the pipe)."""
    conn, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child,), daemon=True)
    with _without_main_module():
        process.start()
    child.close()
    return process, conn


class _Worker:
    def __init__(self, ctx, reaper):
        self.process, self.conn = _start(ctx, _worker_main)
        reaper.send(self.process.pid)

    def kill(self) -> None:
        try:
            self.process.kill()
        finally:
            self.process.join(timeout=5)
            self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class VerifierPool:
    """A fixed set of verifier processes. ``map`` checks many (prediction, gold) pairs in parallel, each
    within ``timeout`` seconds of wall time or scored 0; it never raises for any input."""

    def __init__(self, num_workers: int | None = None, timeout: float = 5.0, start_method: str = "forkserver"):
        self.timeout = timeout
        self.num_workers = num_workers or max(1, min(8, (os.cpu_count() or 2)))
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload([__name__, "math_verify"])
        self._reaper_process, self._reaper = _start(self._ctx, _reaper_main)
        self._workers = [_Worker(self._ctx, self._reaper) for _ in range(self.num_workers)]
        self.restarts = 0
        atexit.register(self.close)

    def map(self, items: list[tuple]) -> list[Verdict]:
        """``items``: ``(candidates, tail, gold)`` (see :func:`judge`) or plain ``(prediction, gold)`` pairs."""
        pairs = [((item[0],), None, item[1]) if len(item) == 2 else item for item in items]
        if not self._workers:
            raise RuntimeError("the verifier pool is closed")
        results: list[Verdict | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        idle = list(range(len(self._workers)))
        busy: dict[int, tuple[int, float]] = {}  # worker index -> (job, deadline)
        started: dict[int, float] = {}
        while pending or busy:
            while pending and idle:
                w, job = idle.pop(), pending.popleft()
                try:
                    started[job] = time.monotonic()
                    self._workers[w].conn.send((job, *pairs[job]))
                    busy[w] = (job, started[job] + self.timeout)
                except (OSError, ValueError):
                    results[job] = Verdict(False, "crash")
                    self._replace(w)
                    idle.append(w)
            if not busy:
                continue
            next_deadline = min(deadline for _, deadline in busy.values())
            conns = {self._workers[w].conn: w for w in busy}
            for conn in wait(list(conns), timeout=max(0.0, next_deadline - time.monotonic())):
                w = conns[conn]
                job = busy.pop(w)[0]
                try:
                    got_job, correct, answer, error = conn.recv()
                    assert got_job == job
                    status = "error" if error else ("no_answer" if answer is None else "ok")  # nothing to judge
                    results[job] = Verdict(bool(correct), status, time.monotonic() - started[job], answer)
                except (EOFError, OSError, AssertionError):
                    results[job] = Verdict(False, "crash", time.monotonic() - started[job])
                    self._replace(w)
                idle.append(w)
            now = time.monotonic()
            for w, (job, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[w]
                    results[job] = Verdict(False, "timeout", now - started[job])
                    self._replace(w)
                    idle.append(w)
        return results  # type: ignore[return-value]

    def _replace(self, w: int) -> None:
        self._workers[w].kill()
        self._workers[w] = _Worker(self._ctx, self._reaper)
        self.restarts += 1

    def alive(self) -> int:
        return sum(worker.process.is_alive() for worker in self._workers)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []
        if self._reaper is not None:
            try:
                self._reaper.send(None)
            except (OSError, ValueError):
                pass
            self._reaper_process.join(timeout=2)
            self._reaper.close()
            self._reaper = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MathVerifier:
    """Completions and ground-truth answers in, 1/0 scores and :class:`VerifyStats` out.

    Extraction runs here (bounded, never raises); only extracted answers go to the pool, and identical
    (answer, gold) pairs of one call are verified once, which matters with 8 rollouts per prompt."""

    def __init__(self, pool: VerifierPool | None = None, strict: bool = False, max_answer_chars: int = MAX_ANSWER_CHARS,
                 **pool_kwargs):
        self.pool = pool or VerifierPool(**pool_kwargs)
        self.strict = strict
        self.max_answer_chars = max_answer_chars

    def score(self, completions: list, golds: list) -> tuple[list[float], VerifyStats, list[str | None]]:
        """Scores, stats, and the answer judged for each completion (None where none was found)."""
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} ground-truth answers")
        start = time.perf_counter()
        stats = VerifyStats(items=len(completions))
        extractions = [extract(text, strict=self.strict) for text in completions]
        verdicts: list[Verdict | None] = [None] * len(completions)
        unique: dict[tuple, list[int]] = {}
        for i, (found, gold) in enumerate(zip(extractions, golds)):
            gold = normalize_unicode(clean_text(gold)).strip()
            candidates = [found.answer] if found.answer else []
            distinct = list(dict.fromkeys(found.boxes))
            if len(distinct) >= 2:  # an answer given as several boxes: compare them together, as a set
                candidates.append(", ".join(distinct))
            if len(gold) > self.max_answer_chars:
                verdicts[i] = Verdict(False, "gold_too_long")
            elif not candidates and not found.tail:
                verdicts[i] = Verdict(False, "no_answer")
            elif any(len(c) > self.max_answer_chars for c in candidates):
                verdicts[i] = Verdict(False, "too_long", answer=found.answer)
            else:
                unique.setdefault((tuple(candidates), None if candidates else found.tail, gold), []).append(i)
        keys = list(unique)
        for key, verdict in zip(keys, self.pool.map(keys)):
            for i in unique[key]:
                verdicts[i] = verdict
        self.last_verdicts = verdicts
        for verdict in verdicts:
            stats.correct += verdict.correct
            if verdict.status in ("timeout", "crash", "error", "no_answer", "too_long", "gold_too_long"):
                name = {"timeout": "timeouts", "crash": "crashes", "error": "errors"}.get(verdict.status, verdict.status)
                setattr(stats, name, getattr(stats, name) + 1)
        stats.unique_pairs = len(keys)
        stats.seconds = time.perf_counter() - start
        answers = [v.answer if v.answer is not None else e.answer for v, e in zip(verdicts, extractions)]
        return [float(v.correct) for v in verdicts], stats, answers

    def close(self) -> None:
        self.pool.close()


_DEFAULT: MathVerifier | None = None


def default_verifier() -> MathVerifier:
    """The process-wide verifier that reward functions share (created on first use)."""
    global _DEFAULT
    if _DEFAULT is None or not _DEFAULT.pool._workers:
        _DEFAULT = MathVerifier()
    return _DEFAULT
