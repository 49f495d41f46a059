"""Where a decode step of the rollout engine spends its time (GPU); prints markdown tables.

    python -m benchmarks.rollout.profile_engine --preset sse-h-2b --sequences 256 --context 1024

``--sequences`` rows (``--samples`` per prompt, prompts of ``--context`` tokens, random weights) are prefilled
(one sample per prompt by default: samples of one prompt share its KV blocks, which attention then reads largely
from L2, so the step looks shorter than it is in a long rollout, where each sample's own tokens dominate);
then at that length: an engine step (forward, sampling, bookkeeping) synchronised and as served (steps back to
back, the host's work overlapped), how busy served steps keep the GPU and its longest idle gaps, the forward alone
(CUDA graph replay; eager with the paged decode attention and with gather + SDPA), the sampler alone (the one-pass
kernel and the PyTorch path that filters), the step's memory roofline, the eager forward's GPU time by kernel and
by the PyTorch operator that launched it (torch.profiler), the operators' calls by the line of this project
that called them, and a prefill forward of one prompt and of several packed in one row. Each timing is the median over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.kernels.bench_sse import copy_bandwidth

from .benchmark import build, decode_step_bytes
from pipeline.rollout.engine import Engine
from pipeline.rollout.sampling import SamplingParams, sample


def median_ms(fn, repeats: int, reset=None) -> float:
    """Median wall time of ``fn()`` in ms, the GPU synchronised around each run; ``reset()`` runs untimed
    before each."""
    times = []
    for _ in range(repeats + 2):  # two warm-ups
        if reset is not None:
            reset()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def served_ms(engine: Engine, steps: int) -> float:
    """ms per engine step over ``steps`` steps issued back to back, the GPU synchronised only around them: what a
    rollout sees, with the host's work overlapped with the GPU's where the engine overlaps it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def prefill_forward_ms(engine: Engine, prompts: int, tokens: int, repeats: int) -> float:
    """Median ms of one prefill forward of ``prompts`` new prompts of about ``tokens`` tokens each (packed in one
    row when more than one; each repeat new lengths, as real prompts bring), through the engine's own prefill:
    at a small model's width its cost is the host's launches, whatever the tokens."""
    times = []
    for r in range(repeats + 1):  # one warm-up
        engine.stats = type(engine.stats)()
        for i in range(prompts):
            length = tokens + (r * prompts + i) % 17
            ids = [1 + (7 * j + r) % (engine.config.vocab_size - 1) for j in range(length)]
            engine.add_request(ids, SamplingParams(max_tokens=1, seed=r))
        while engine.scheduler.waiting or engine.scheduler.prefilling:
            engine.step()
        assert engine.stats.prefill_forwards == 1, "the prompts should go in one forward: raise prefill_chunk_size"
        times.append(engine.stats.prefill_seconds * 1e3)
    return statistics.median(times[1:])


def operator_lines(fn, top: int) -> list[tuple[str, int]]:
    """``(source line and operator, calls)`` of the PyTorch operators ``fn`` runs, by the innermost line of this
    project that called them (views left out: they launch nothing), most first; where the small kernels come from."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = defaultdict(int)
    roots = ("sse_model/", "kernels/", "pipeline/")

    class Lines(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                frames = [f for f in traceback.extract_stack()
                          if f.filename != __file__ and any(r in f.filename for r in roots)]
                where = "(outside the project)"
                if frames:
                    name = frames[-1].filename
                    root = next(r for r in roots if r in name)
                    where = f"{root}{name.split(root, 1)[1]}:{frames[-1].lineno}"
                counts[f"{where} {func}"] += 1
            return func(*args, **(kwargs or {}))

    with Lines():
        fn()
    rows = sorted(counts.items(), key=lambda kv: -kv[1])
    return rows[:top] + [("(all operators)", sum(counts.values()))]


def gpu_timeline(fn, top: int) -> tuple[float, float, list[tuple[float, str, str]]]:
    """``fn`` under torch.profiler (GPU activity only): ``(wall us from the first kernel's start to the last's end,
    us the GPU was busy, the ``top`` longest idle gaps as (us, kernel before, kernel after))``: where served steps
    leave the GPU waiting (for the host, for a copy)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0, 0.0, []
    busy, gaps, end, before = 0.0, [], spans[0][0], ""
    for start, stop, name in spans:
        if start > end:
            gaps.append((start - end, before[:60], name[:60]))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, name
    return end - spans[0][0], busy, sorted(gaps, reverse=True)[:top]


def kernel_tables(fn, top: int):
    """One call of ``fn`` under torch.profiler: ``(kernel name, GPU ms, launches)`` per kernel and ``(operator, GPU
    ms of the kernels it launched itself, calls)`` per PyTorch operator (which op a generic kernel serves; Triton
    kernels launched from Python belong to none), largest first, each with an ``(all ...)`` total row."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time_total / 1e3
            count[event.name] += 1
    rows = sorted(total.items(), key=lambda kv: -kv[1])
    kernels = [(name, ms, count[name]) for name, ms in rows[:top]] + \
        [("(all kernels)", sum(total.values()), sum(count.values()))]
    ops = sorted(((a.key, a.self_device_time_total / 1e3, a.count) for a in prof.key_averages()
                  if a.self_device_time_total > 0 and a.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda row: -row[1])
    return kernels, ops[:top] + [("(all operators)", sum(ms for _, ms, _ in ops), sum(n for *_, n in ops))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sse-h-2b")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=12, help="kernels listed")
    args = parser.parse_args()
    import kernels

    kernels.register()
    B, context = args.sequences, args.context
    model = build(args.preset)
    engine = Engine(model, None, max_slots=B, max_model_len=context + 4 * args.repeats + 64, prefill_chunk_size=8192)
    prompts = [torch.randint(100, 1000, (context,)).tolist() for _ in range(B // args.samples)]
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=4 * args.repeats + 32, ignore_eos=True,
                            seed=0)
    for prompt in prompts:
        engine.add_request(prompt, params)
    start = time.perf_counter()
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    print(f"{args.preset}: {B} sequences at {context} tokens prefilled in {time.perf_counter() - start:.1f} s; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    rows = [("engine step, synchronised", median_ms(engine.step, args.repeats)),
            ("engine step, as served (back to back)", served_ms(engine, args.repeats))]
    wall, busy, gaps = gpu_timeline(lambda: [engine.step() for _ in range(5)], args.top)
    seqs = engine.scheduler.running
    ids = torch.tensor([s.token_ids[-1] for s in seqs], device="cuda")
    slots = torch.tensor([s.slot for s in seqs], device="cuda")
    lengths = engine.cache.lengths.clone()

    def restore():  # every forward below decodes the same position again
        engine.cache.lengths.copy_(lengths)

    with torch.no_grad():
        def forward():
            return engine.runner.forward_decode(ids, slots)

        rows.append(("forward, CUDA graph", median_ms(forward, args.repeats, restore)))
        engine.runner.use_cuda_graphs = False
        rows.append(("forward, eager", median_ms(forward, args.repeats, restore)))
        engine.cache.paged_decode = False
        rows.append(("forward, eager, attention by gather + SDPA", median_ms(forward, args.repeats, restore)))
        engine.cache.paged_decode = True
        restore()
        kernels_eager, ops_eager = kernel_tables(forward, args.top)
        restore()
        lines_eager = operator_lines(forward, 2 * args.top)
        restore()
        logits = forward()
    # temperature 1, top-p 1, top-k off
    ones, off = torch.ones(B, device="cuda"), torch.zeros(B, dtype=torch.long, device="cuda")
    seeds, steps = torch.arange(B, device="cuda"), torch.full((B,), 7, device="cuda")
    rows.append(("sampler, one pass (kernel)",
                 median_ms(lambda: sample(logits, ones, ones, off, seeds, steps, need_filter=False),
                           args.repeats)))
    p95 = torch.full((B,), 0.95, device="cuda")
    rows.append(("sampler, top-p 0.95 without a sort (kernel)",
                 median_ms(lambda: sample(logits, ones, p95, off, seeds, steps, need_filter=True, need_top_k=False),
                           args.repeats)))
    rows.append(("sampler, PyTorch with top-p/top-k filtering",
                 median_ms(lambda: sample(logits, ones, ones, off, seeds, steps, need_filter=True),
                           args.repeats)))

    bandwidth = copy_bandwidth()
    parts = decode_step_bytes(model, B, context)
    roofline = sum(parts.values()) / bandwidth * 1e3
    step = rows[0][1]
    print(f"\n| {args.preset}, {B} sequences at {context} tokens | ms | share of the step | vs roofline |")
    print("|---|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {ms / step:.0%} | {ms / roofline:.2f}x |")
    detail = " + ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items())
    print(f"| roofline of the forward ({detail} at {bandwidth / 1e12:.2f} TB/s) | {roofline:.2f} | "
          f"{roofline / step:.0%} | 1.00x |")
    for title, count, table in (("kernel", "launches", kernels_eager), ("PyTorch operator", "calls", ops_eager)):
        print(f"\n| {title} (eager forward) | GPU ms | {count} | share |\n|---|---|---|---|")
        all_ms = kernels_eager[-1][1]
        for name, ms, n in table:
            print(f"| `{name[:90]}` | {ms:.3f} | {n} | {ms / all_ms:.0%} |")
    print(f"\nFive served steps: GPU busy {busy / 1e3:.2f} ms of {wall / 1e3:.2f} ms ({busy / max(wall, 1e-9):.0%}); "
          "the longest idle gaps:\n\n| gap us | after kernel | before kernel |\n|---|---|---|")
    for gap, before, after in gaps:
        print(f"| {gap:.1f} | `{before}` | `{after}` |")
    print("\n| source line: PyTorch operator (eager forward) | calls |\n|---|---|")
    for name, n in lines_eager:
        print(f"| `{name[:110]}` | {n} |")
    fresh = Engine(model, None, max_slots=64, max_model_len=1024, prefill_chunk_size=32768)
    print("\n| prefill forward (the engine's, eager) | ms |\n|---|---|")
    for prompts, tokens in ((1, 128), (1, 512), (8, 128), (32, 128), (32, 512)):
        what = "one prompt" if prompts == 1 else f"{prompts} prompts packed in one row"
        print(f"| {what} of ~{tokens} tokens | {prefill_forward_ms(fresh, prompts, tokens, args.repeats):.1f} |")


if __name__ == "__main__":
    main()
