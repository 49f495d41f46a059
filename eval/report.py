"""Evaluation reports: ``summary.json``, a markdown table (benchmarks x metrics, as the paper's Table 5),
and a plot (accuracy per benchmark with 95% intervals, pass@k curves)."""

from __future__ import annotations

import json
from pathlib import Path

from common.files import atomic_write


def summary_json(summary: dict, indent: int = 2) -> str:
    """``summary`` as JSON with each flat record (a problem's entry, an interval, pass@k) on one line and the rest
    indented: a summary of a few thousand problems stays a file one reads and diffs line by line, at about half the
    bytes of ``json.dumps(indent=...)``, which puts every field of every problem on its own line."""

    def scalar(value) -> bool:
        return not isinstance(value, (dict, list))

    def flat(value) -> bool:  # scalars, lists and dicts of scalars (a problem's answers, its baselines): one line
        children = value.values() if isinstance(value, dict) else value
        return all(scalar(c) or (isinstance(c, (list, dict)) and all(map(scalar, c.values() if isinstance(c, dict)
                                                                          else c))) for c in children)

    def dump(value, depth: int) -> str:
        if scalar(value) or flat(value):  # empty containers too
            return json.dumps(value, default=float)
        pad, inner = " " * (indent * depth), " " * (indent * (depth + 1))
        if isinstance(value, dict):
            items = [f"{inner}{json.dumps(str(k))}: {dump(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        return "[\n" + ",\n".join(f"{inner}{dump(v, depth + 1)}" for v in value) + f"\n{pad}]"

    return dump(summary, 0) + "\n"


def _percent(rate: float | None) -> str:
    return "" if rate is None else f"{100 * rate:.0f}%"


def accuracy(m: dict, boxed: bool = False) -> tuple[float, float, float] | None:
    """A benchmark's avg@n and its 95% interval from its summary ``m``; ``boxed``: the boxed answers' alone (None
    in summaries written before it was counted)."""
    key = f"{'boxed_' if boxed else ''}avg@{m['repeats']}"
    return (m[key], *m[f"{key}_ci95"]) if key in m else None


def percent_ci(value: tuple[float, float, float] | None) -> str:
    return "" if value is None else "{:.1f} ({:.1f}-{:.1f})".format(*(100 * v for v in value))


def answer_style(m: dict) -> str:
    """How a model answered, from a benchmark's summary (or a pool of them): the mean completion length and the
    share given in a box. Near the floor two models of one accuracy can differ here, and the difference says where
    one's lead comes from (answers read by the last-number fallback, or the asked format)."""
    style = f", {m['mean_length']:.0f} tokens" if m.get("mean_length") is not None else ""
    return style + (f", {100 * m['boxed_rate']:.0f}% boxed" if m.get("boxed_rate") is not None else "")


def accuracy_cell(m: dict) -> str:
    """One table cell of a benchmark's summary, in %: the headline avg@n (95% CI; the boxed answers alone where the
    evaluation counted them), n, the answers' style (:func:`answer_style`), the lenient reading beside it, and the
    best trivial baseline and the worked steps (``eval/worked_steps.py``) where the summary has them."""
    strict = boxed_headline(m)
    cell = f"{percent_ci(headline(m))}{' boxed' if strict else ''}, n={m['repeats']}{answer_style(m)}"
    if strict:
        cell += f" ({percent_ci(accuracy(m))} lenient)"
    base = baseline_cell(m)
    return cell + (f"; baseline {base}" if base else "") + steps_cell(m.get("worked_steps"))


def steps_cell(steps: dict | None) -> str:
    """The worked steps of a cell (``eval/worked_steps.py``), where the summary has them."""
    if not steps:
        return ""
    every = steps.get("right_by_every_step")  # summaries from before it was measured have none
    return (f"; worked steps {100 * steps['reached']:.1f}% reached, {100 * steps['arithmetic']:.1f}% of equations "
            f"right" + (f", {100 * every:.1f}% right by every step" if every is not None else ""))


def boxed_headline(m: dict) -> bool:
    """Whether the headline of a benchmark's summary is its boxed answers alone: where the prompt asked for a box
    (``m["headline"]``; summaries from before it was recorded: wherever they counted boxed answers, as every recipe
    asked for them)."""
    return m["headline"].startswith("boxed_") if "headline" in m else accuracy(m, boxed=True) is not None


def headline(m: dict) -> tuple[float, float, float] | None:
    """A benchmark's headline accuracy and interval (:func:`boxed_headline`)."""
    return accuracy(m, boxed=boxed_headline(m))


def baseline_cell(m: dict) -> str:
    """The benchmark's best trivial baseline (what it is, its accuracy in %), and whether the model is shown to beat
    it; empty for summaries written before baselines were counted."""
    if "baselines" not in m:
        return ""
    best = m["baselines"]["best"]
    guess = m["baselines"][best].get("answer")
    what = f"{best} ({guess})" if guess is not None else best
    mark = "" if m.get("beats_baseline") else " **not beaten**"
    return f"{what}: {100 * m['baselines'][best]['accuracy']:.1f}{mark}"


def markdown_table(summary: dict) -> str:
    benches = summary["benchmarks"]
    lines = ["| benchmark | problems | n | headline avg@n (95% CI) | lenient avg@n (95% CI) | best trivial baseline "
             "| pass@n | maj@n | mean len | max len | truncated | boxed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in benches.items():
        n = m["repeats"]
        pass_n = m["pass@k"][n] if n in m["pass@k"] else m["pass@k"][str(n)]
        maj_n = m["maj@k"][n] if n in m["maj@k"] else m["maj@k"][str(n)]
        strict = boxed_headline(m)
        lines.append(f"| {name} | {m['problems']} | {n} | {percent_ci(headline(m))}{' boxed only' if strict else ''} | "
                     f"{percent_ci(accuracy(m))} | {baseline_cell(m)} | "
                     f"{100 * pass_n:.1f} | {100 * maj_n:.1f} | {m['mean_length']:.0f} | {m['max_length']} | "
                     f"{100 * m['truncation_rate']:.1f}% | {_percent(m.get('boxed_rate'))} |")
    strata = [(name, m["by_answer_size"]) for name, m in benches.items() if m.get("by_answer_size")]
    if strata:
        lines += ["", "By answer size (accuracy in %, the headline reading; the best baseline on the same problems):",
                  "", "| benchmark | answers | problems | headline | lenient | best baseline |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, groups in strata:
            for stratum, g in groups.items():
                lines.append(f"| {name} | {stratum} | {g['problems']} | {100 * g['accuracy']:.1f} | "
                             f"{100 * g['lenient_accuracy']:.1f} | {100 * g['best_baseline']:.1f} |")
    steps = [(name, m["worked_steps"]) for name, m in benches.items() if m.get("worked_steps")]
    if steps:
        lines += ["", "Worked steps (eval/worked_steps.py: the equations a completion writes, the share of them whose "
                  "arithmetic is right, the share of the worked solution's results reached by a right one, the share "
                  "of completions answered right having reached every one, which no guess earns):", "",
                  "| benchmark | equations a completion | arithmetic right | worked steps reached "
                  "| right by every step |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {w['equations']:.2f} | {100 * w['arithmetic']:.1f}% | {100 * w['reached']:.1f}% | "
                  + (f"{100 * w['right_by_every_step']:.1f}% |" if "right_by_every_step" in w else "|")
                  for name, w in steps]
    s = summary.get("sampling", {})
    lines.append("")
    if summary.get("model"):
        lines.append(f"Model: {summary['model']}.")
    for name, m in benches.items():
        if m.get("prompts_too_long"):
            lines.append(f"{name}: {m['prompts_too_long']} problems longer than the prompt limit were not generated "
                         "(scored wrong).")
        if m.get("prompts_truncated"):
            lines.append(f"{name}: {m['prompts_truncated']} problems were shortened to fit the prompt limit.")
    lines.append(f"Sampling: temperature {s.get('temperature')}, top-p {s.get('top_p')}, "
                 f"max new tokens {s.get('max_new_tokens')}. Accuracies in %. Headline: where the prompt asks for "
                 "\\boxed{}, only boxed answers count (boxed only); lenient: an unboxed answer read from the last "
                 "stated one counts too. Best trivial baseline: the best of the set's commonest answer given to every "
                 "problem and the question's last or first number, graded alike; **not beaten**: the headline's 95% "
                 "interval does not lie above it. boxed: the share of answers given in a box.")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = summary["benchmarks"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(benches)
    acc, err_lo, err_hi = [], [], []
    for name in names:
        value, lo, hi = headline(benches[name])
        acc.append(100 * value)
        err_lo.append(acc[-1] - 100 * lo)
        err_hi.append(100 * hi - acc[-1])
    bars = left.bar(names, acc, yerr=[err_lo, err_hi], capsize=4, color="tab:blue")
    left.bar_label(bars, labels=[f"{a:.1f}" for a in acc], padding=2, fontsize=8)
    top = max([a + e for a, e in zip(acc, err_hi)] + [1.0])
    left.set_ylim(0, min(100.0, top * 1.2) if top < 100 else 105)  # an all-zero run still has a 0-based axis
    baselines = [100 * benches[n]["baselines"][benches[n]["baselines"]["best"]]["accuracy"]
                 if "baselines" in benches[n] else None for n in names]
    drawn = [i for i, base in enumerate(baselines) if base is not None]
    for i in drawn:
        left.hlines(baselines[i], i - 0.4, i + 0.4, colors="tab:red", linestyles="--",
                    label="best trivial baseline" if i == drawn[0] else None)
    if drawn:
        left.legend(fontsize=8)
    left.set_ylabel("headline avg@n accuracy (%)")
    left.set_title("Accuracy per benchmark (95% bootstrap CI)")
    left.tick_params(axis="x", rotation=30)
    if max(benches[n]["repeats"] for n in names) < 2:  # one sample a problem: pass@k is one point, no curve
        right.text(0.5, 0.5, "pass@k needs more than one sample a problem", ha="center", va="center",
                   transform=right.transAxes)
        right.set_axis_off()
        names = []
    for name in names:
        ks = sorted(int(k) for k in benches[name]["pass@k"])
        values = [100 * benches[name]["pass@k"].get(k, benches[name]["pass@k"].get(str(k))) for k in ks]
        right.plot(ks, values, marker="o", label=name)
    if names:
        right.set_xscale("log", base=2)
        right.set_ylim(0, 105)
        right.set_xlabel("k")
        right.set_ylabel("pass@k (%)")
        right.set_title("pass@k")
        right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(summary: dict, output_dir: Path) -> None:
    output_dir = Path(output_dir)
    atomic_write(output_dir / "summary.json", summary_json(summary))
    atomic_write(output_dir / "results.md", markdown_table(summary))
    plot(summary, output_dir / "results.png")
