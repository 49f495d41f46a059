"""What holds the GPU's memory at the peak of a piece of work: the allocations alive at that moment, summed by the
line of this project that made them, from PyTorch's allocator trace (``torch.cuda.memory._record_memory_history``).

    with MemoryTrace() as trace:
        optimizer_step(...)
    print(peak_table(peak(trace.snapshot, trace.start_bytes)))

``python -m benchmarks.pipeline.train_at_length --trace-memory`` prints it for one step of each model: where a model's
peak goes beyond another's (SSE-H's training step against the Transformer's: docs/paper_scale.md).
"""

from __future__ import annotations

from collections import defaultdict

import torch

PROJECT = ("/sse_model/", "/kernels/", "/pipeline/")  # an allocation is charged to the innermost frame in these


class MemoryTrace:
    """Records the CUDA allocator's events (with Python stacks) while the block runs; ``snapshot`` is None without
    CUDA. ``start_bytes``: what was allocated when it began (the model, its optimizer states...)."""

    def __init__(self, max_entries: int = 2_000_000):
        self.max_entries, self.snapshot, self.start_bytes = max_entries, None, 0

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.start_bytes = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)


def where(frames: list[dict]) -> str:
    """``file:line (function)`` of the innermost frame in this project, else of the innermost frame."""
    inside = [f for f in frames if any(part in f["filename"] for part in PROJECT)]
    frame = (inside or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    path = frame["filename"]
    for part in PROJECT:  # the path from the package on
        if part in path:
            path = part.strip("/") + "/" + path.split(part, 1)[1]
            break
    return f"{path}:{frame['line']} ({frame['name']})"


def peak(snapshot: dict | None, start_bytes: int = 0, device: int = 0) -> dict | None:
    """The highest allocated memory during the trace, and the traced allocations alive then, by :func:`where`:
    ``{"peak_bytes", "before_bytes" (still held from before the trace), "live": [(where, bytes, count), ...]}``,
    largest first. Replays the trace twice: once for the moment of the peak, once for what is alive at it."""
    if snapshot is None:
        return None
    events = [e for e in snapshot["device_traces"][device] if e["action"] in ("alloc", "free_completed")]

    def replay(stop: int | None = None):
        live, total, best, best_at = {}, 0, 0, -1
        for i, e in enumerate(events if stop is None else events[:stop + 1]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames", []))
                total += e["size"]
                if total > best:
                    best, best_at = total, i
            else:  # free_completed: of a traced allocation, or of one made before the trace began
                live.pop(e["addr"], None)
                total -= e["size"]
        return live, total, best, best_at

    _, _, best, best_at = replay()
    live, total, _, _ = replay(best_at) if best_at >= 0 else ({}, 0, 0, -1)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        group = groups[where(frames)]
        group[0] += size
        group[1] += 1
    traced = sum(size for size, _ in live.values())
    return {"peak_bytes": start_bytes + max(best, 0), "before_bytes": start_bytes + total - traced,
            "live": sorted(((w, b, n) for w, (b, n) in groups.items()), key=lambda x: -x[1])}


def peak_table(found: dict | None, top: int = 12) -> str:
    """A markdown table of :func:`peak`'s largest groups."""
    if found is None:
        return "(no CUDA: no allocator trace)"
    gib = 2**30
    lines = [f"peak {found['peak_bytes'] / gib:.2f} GiB, of it {found['before_bytes'] / gib:.2f} GiB held from before "
             "the traced work", "", "| allocated at | GiB | tensors |", "| --- | --- | --- |"]
    lines += [f"| `{w}` | {b / gib:.3f} | {n} |" for w, b, n in found["live"][:top]]
    rest = found["live"][top:]
    if rest:
        lines.append(f"| {len(rest)} other places | {sum(b for _, b, _ in rest) / gib:.3f} | "
                     f"{sum(n for *_, n in rest)} |")
    return "\n".join(lines)
