"""Sampling-based metrics: avg@k, unbiased pass@k, maj@k, bootstrap confidence intervals, length stats."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from functools import cache


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct) from n samples with c correct:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021), in the numerically stable product form."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Mean accuracy over all samples of all problems (each problem weighted equally)."""
    return sum(sum(row) / len(row) for row in correct) / len(correct)


def cluster_answers(answers: Sequence[str | None], equivalent: Callable[[str, str], bool] | None = None,
                    missing_votes: bool = False) -> list[int]:
    """Cluster id of each answer: equal after whitespace removal, or ``equivalent`` to a cluster's first
    member. Missing answers (None or empty) get their own cluster each by default, so a missing answer never
    wins a vote (our convention); ``missing_votes=True`` pools them into one cluster that can win, as
    Qwen2.5-Math's evaluation does (the problem then counts as wrong when it wins)."""
    reps: list[str] = []
    ids = []
    for answer in answers:
        if answer is None or not answer.strip():
            if not missing_votes:
                ids.append(-1 - len(ids))
                continue
            answer = ""
        key = "".join(answer.split())
        for i, rep in enumerate(reps):
            if key == rep or (equivalent is not None and equivalent(answer, rep)):
                ids.append(i)
                break
        else:
            reps.append(key)
            ids.append(len(reps) - 1)
    return ids


def majority_correct(clusters: Sequence[int], correct: Sequence[bool], k: int) -> bool:
    """maj@k for one problem: is the most frequent answer cluster among the first k samples correct?
    Ties go to the cluster seen first."""
    counts: dict[int, int] = {}
    first: dict[int, int] = {}
    for i, cluster in enumerate(clusters[:k]):
        if cluster < 0:
            continue
        counts[cluster] = counts.get(cluster, 0) + 1
        first.setdefault(cluster, i)
    if not counts:
        return False
    winner = max(counts, key=lambda c: (counts[c], -first[c]))
    return bool(correct[first[winner]])


def bootstrap_ci(values: Sequence[float], iterations: int = 2000, alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean, resampling problems: the resamples
    ``[values[rng.randrange(n)] for _ in range(n)]`` of ``rng = random.Random(seed)``, each summed in order, made in
    blocks with numpy (:func:`randrange_blocks`), so every interval is the plain loop's at a fifth of its time."""
    if not values:
        return (float("nan"), float("nan"))
    import numpy as np

    n = len(values)
    table = np.asarray(values, dtype=np.float64)
    means: list[float] = []
    for rows in randrange_blocks(seed, n, iterations):
        means += (table[rows].cumsum(axis=1)[:, -1] / n).tolist()  # a running sum: the loop's order of additions
    return percentile_interval(means, alpha)


def randrange_blocks(seed: int, n: int, rows: int, block_values: int = 1 << 22):
    """``rows`` rows of ``n`` successive draws of ``random.Random(seed).randrange(n)``, as ``[b, n]`` integer
    arrays of at most ``block_values`` draws: CPython draws each try as one 32-bit word of its Mersenne Twister,
    keeps the word's top ``n.bit_length()`` bits and tries again if they reach ``n``; numpy's MT19937, started
    from the same state, gives the same words in bulk."""
    import numpy as np

    if not 0 < n < 1 << 32:
        raise ValueError(f"randrange_blocks: n={n} outside 1..2**32-1")
    state = random.Random(seed).getstate()[1]  # the 624 words of the key, then the position in it
    words = np.random.MT19937()
    words.state = {"bit_generator": "MT19937", "state": {"key": np.array(state[:-1], dtype=np.uint32),
                                                         "pos": state[-1]}}
    shift = 32 - n.bit_length()
    spare = np.empty(0, dtype=np.uint64)
    block = max(1, block_values // n)
    for start in range(0, rows, block):
        need = min(block, rows - start) * n
        parts, have = [spare], len(spare)
        while have < need:  # each word kept with probability above 1/2
            tries = words.random_raw(2 * (need - have) + 64) >> shift
            kept = tries[tries < n]
            parts.append(kept)
            have += len(kept)
        drawn = np.concatenate(parts)
        yield drawn[:need].reshape(-1, n)
        spare = drawn[need:]


def ks_for(n: int) -> list[int]:
    """Powers of two up to n, and n itself."""
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= n]
    return ks if n in ks else ks + [n]


def summarize(problems: list[dict], seed: int = 0) -> dict:
    """Metrics of one benchmark. Each problem: ``{"correct": [bool]*n, "clusters": [int]*n,
    "lengths": [int]*n, "truncated": [bool]*n}`` with the same n for all problems, and optionally ``"boxed":
    [bool]*n`` (the answer given as the prompt asks, in a box) with ``"boxed_correct": [bool]*n`` (the last box's
    answer right): then ``boxed_rate``, which tells a
    model that answers in the format from one whose score is the fallback's reading of unformatted text, and
    ``boxed_avg@n`` with its interval, the accuracy of boxed answers alone (an unboxed answer counts wrong): the
    strict reading, which shows a training step that raises the score by dropping the format."""
    n = min(len(p["correct"]) for p in problems)
    correct = [p["correct"][:n] for p in problems]
    per_problem = [sum(row) / n for row in correct]  # what the bootstrap resamples
    lengths = [length for p in problems for length in p["lengths"][:n]]
    truncated = [t for p in problems for t in p["truncated"][:n]]
    result = {
        "problems": len(problems),
        "repeats": n,
        f"avg@{n}": avg_at_k(correct),
        f"avg@{n}_ci95": bootstrap_ci(per_problem, seed=seed),
        "pass@k": {k: sum(pass_at_k(n, sum(row), k) for row in correct) / len(correct) for k in ks_for(n)},
        "maj@k": {k: sum(majority_correct(p["clusters"], p["correct"], k) for p in problems) / len(problems)
                  for k in ks_for(n)},
        "per_problem_accuracy": per_problem,
        "mean_length": sum(lengths) / len(lengths) if lengths else 0.0,
        "max_length": max(lengths, default=0),
        "truncation_rate": sum(truncated) / len(truncated) if truncated else 0.0,
    }
    if all("boxed" in p for p in problems):
        boxed = [b for p in problems for b in p["boxed"][:n]]
        result["boxed_rate"] = sum(boxed) / len(boxed) if boxed else 0.0
        strict = [p["boxed_correct"][:n] for p in problems]
        result[f"boxed_avg@{n}"] = avg_at_k(strict)
        result["per_problem_boxed_accuracy"] = [sum(row) / n for row in strict]
        result[f"boxed_avg@{n}_ci95"] = bootstrap_ci(result["per_problem_boxed_accuracy"], seed=seed)
    return result


def hierarchical_bootstrap(arms: list[list[dict[str, float]]], iterations: int = 2000,
                           seed: int = 0, paired: bool = False) -> list[list[float]]:
    """Resamples the draws (independent training runs) of each arm and the problems they share: ``arms[a]`` holds arm
    ``a``'s draws, each problem id -> accuracy. Each iteration draws the problems once (shared by every arm: a
    comparison stays paired) and each arm's draws with replacement, and returns each arm's mean over them. With one
    draw per arm this is the problems' bootstrap; with several, the spread between runs widens the interval as it
    should (resampling problems alone left it out). ``paired``: the arms are the same runs at two stages (draw ``i``
    of each is one run's), so one draw of runs serves every arm and a run's own change is what varies."""
    import numpy as np

    shared = [k for k in arms[0][0] if all(k in d for arm in arms for d in arm)]
    if not shared:
        return []
    if paired and len({len(arm) for arm in arms}) > 1:
        raise ValueError(f"paired arms need as many draws each (one per run), got {[len(arm) for arm in arms]}")
    rng = np.random.default_rng(seed)
    tables = [np.array([[d[k] for k in shared] for d in arm]) for arm in arms]  # [draws, problems] per arm
    out = []
    for _ in range(iterations):
        problems = rng.integers(0, len(shared), len(shared))
        if paired:
            runs = rng.integers(0, len(tables[0]), len(tables[0]))
            out.append([float(t[runs][:, problems].mean()) for t in tables])
        else:
            out.append([float(t[rng.integers(0, len(t), len(t))][:, problems].mean()) for t in tables])
    return out


def percentile_interval(values: Sequence[float], alpha: float = 0.05) -> tuple[float, float]:
    """The central ``1 - alpha`` interval of bootstrap ``values``."""
    values = sorted(values)
    n = len(values)
    return values[int(alpha / 2 * n)], values[min(n - 1, int((1 - alpha / 2) * n))]


@cache
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (``p`` in (0.5, 1)): its density integrated (Simpson's rule on the substitution
    t = tan u, which maps the heavy tail onto a finite interval) and the CDF inverted by bisection."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, n: int = 400) -> float:  # P(T <= x), x >= 0
        end = math.atan(x)
        h = end / n
        total = 0.0
        for i in range(n + 1):
            u = i * h
            t = math.tan(u)
            f = math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df)) / math.cos(u) ** 2
            total += f * (1 if i in (0, n) else 4 if i % 2 else 2)
        return 0.5 + total * h / 3

    low, high = 0.0, 1.0
    while cdf(high) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def prediction_interval(values: Sequence[float], alpha: float = 0.05) -> tuple[float, float]:
    """Where a new draw of the setting that gave ``values`` (two or more independent draws) lands with
    probability 1 - ``alpha``: mean +- t * sd * sqrt(1 + 1/n). Unlike the draws' range, which a new draw leaves
    half of the time with three of them, it holds a run that behaves alike 95% of the time."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(1 - alpha / 2, n - 1) * sd * math.sqrt(1 + 1 / n)
    return mean - half, mean + half
