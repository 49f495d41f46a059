"""Distillation at the paper's lengths: optimizer steps of the 2B models on packed rows of long sequences.

    python -m benchmarks.pipeline.train_at_length                       # sse-h-2b, transformer-2b; 8k, 16k, 32k (GPU)
    python -m benchmarks.pipeline.train_at_length --lengths 300 32768 --attention varlen per-sequence
    python -m benchmarks.pipeline.train_at_length --lengths 32768 --trace-memory   # what is alive at each peak
    python -m benchmarks.pipeline.train_at_length --lengths 32768 --pieces 0       # the SSE state walks never split
    python -m benchmarks.pipeline.train_at_length --models sse-h-tiny --tokens 256 --lengths 64 256 --device cpu

One optimizer step is what ``recipes/paper-2b``'s distillation does per step, on random weights: ``--accumulation``
packed rows of ``--tokens`` tokens each (the recipe: 16 rows of 32,768; the default 4 keeps a table inside one
device call and changes only how often AdamW runs, not the rows' cost or the peak), every row made of sequences of one
``--lengths`` value (position ids restarting at each sequence, as TRL's padding-free collator hands them to the
model, so the SSE states reset and attention stays inside each sequence); float32 master weights, bf16 autocast
on CUDA, non-reentrant gradient checkpointing, TRL's fused LM head (what ``SFTTrainer`` patches in: the
``[tokens, vocab]`` logits never exist) plus the partition-balance loss, then AdamW (fused on CUDA), as the
trainer's defaults. Prints per model and length: tokens/s (median optimizer step after the first), the first
step's time (compilations included), peak memory, and the ratio to the first all-attention model in ``--models``
at the same length. ``--attention`` also times the per-sequence SDPA fallback of the softmax layers.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from benchmarks.common import model_spec, release


def packed_rows(tokens: int, length: int, rows: int, vocab: int, device) -> list[dict]:
    """``rows`` packed rows of ``tokens`` tokens, each of sequences of ``length`` tokens (the last one shorter),
    in the shape TRL's padding-free collator gives: ``input_ids``, ``labels`` and restarting ``position_ids``."""
    lengths = [length] * (tokens // length) + ([tokens % length] if tokens % length else [])
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    batches = []
    for _ in range(rows):
        ids = torch.randint(0, vocab, (1, tokens), device=device)
        labels = ids.clone()
        labels[0, positions[0] == 0] = -100  # as the collator: a sequence's first token is no target
        batches.append(dict(input_ids=ids, labels=labels, position_ids=positions))
    return batches


def prepare(model):
    """The model as the distillation trainer runs it: checkpointing, TRL's fused LM head, and a hook that keeps the
    backbone's balance loss (:mod:`pipeline.balance` adds it the same way). Returns the list the hook fills."""
    from trl.trainer.utils import add_fused_lm_head

    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # SFTTrainer's outputs
    balance: list[torch.Tensor] = []
    model.get_submodule(model.base_model_prefix).register_forward_hook(
        lambda module, args, output: balance.append(output.aux_loss) if output.aux_loss is not None else None)
    return balance


def optimizer_step(model, optimizer, batches: list[dict], balance: list, autocast) -> float:
    """One optimizer step over ``batches`` (gradient accumulation, the loss normalised by the step's scored
    tokens, as the trainer does with ``num_items_in_batch``); returns the mean loss per scored token."""
    scored = sum(int((b["labels"] != -100).sum()) for b in batches)
    coef = float(getattr(model.config, "aux_loss_coef", 0.0) or 0.0)
    total = 0.0
    for batch in batches:
        balance.clear()
        with autocast():
            out = model(**batch, fused_lm_head=True, num_items_in_batch=scored, use_cache=False)
        loss = out.loss
        if balance and coef:
            loss = loss + coef * torch.stack([b.float() for b in balance]).mean() / len(batches)
        loss.backward()
        total += float(out.loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def measure(model, tokens: int, length: int, accumulation: int, steps: int, device: torch.device,
            trace_memory: bool = False) -> dict:
    """Times ``steps + 1`` optimizer steps of ``model`` (prepared with :func:`prepare`) on fresh random rows; with
    ``trace_memory`` one more step under the allocator trace (:mod:`benchmarks.pipeline.memory_peak`), untimed."""
    cuda = device.type == "cuda"
    balance = prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=cuda)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps + 1):
        batches = packed_rows(tokens, length, accumulation, model.config.vocab_size, device)
        sync()
        start = time.perf_counter()
        losses.append(optimizer_step(model, optimizer, batches, balance, autocast))
        sync()
        times.append(time.perf_counter() - start)
    median = sorted(times[1:])[len(times[1:]) // 2] if steps else times[0]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    found = None
    if trace_memory:
        from .memory_peak import MemoryTrace, peak as traced_peak

        batches = packed_rows(tokens, length, accumulation, model.config.vocab_size, device)
        with MemoryTrace() as trace:
            optimizer_step(model, optimizer, batches, balance, autocast)
        found = traced_peak(trace.snapshot, trace.start_bytes)
    return dict(tokens_per_s=tokens * accumulation / median, step_s=median, first_s=times[0], peak_gib=peak,
                losses=losses, memory=found)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["sse-h-2b", "transformer-2b"],
                        help="presets, each optionally with config settings: sse-h-2b:sse_backward_head_groups=3")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per packed row (paper-2b: 32768)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="sequence lengths")
    parser.add_argument("--accumulation", type=int, default=4, help="rows per optimizer step (paper-2b: 16)")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps after the first")
    parser.add_argument("--attention", nargs="+", default=["varlen"], help="varlen, per-sequence (softmax layers)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trace-memory", action="store_true",
                        help="after the timed steps, one traced step: what is alive at its peak, by source line")
    parser.add_argument("--pieces", type=int, default=None,
                        help="chunks a piece of the SSE kernels' state walks where a call splits them (0: never; "
                             "default kernels.sse_chunk.PIECE_CHUNKS)")
    args = parser.parse_args(argv)
    if args.pieces is not None:
        from kernels import sse_chunk

        sse_chunk.PIECE_CHUNKS = args.pieces
    from benchmarks.kernels.bench_packed import attention_path
    from sse_model import SSEConfig, SSEForCausalLM

    device = torch.device(args.device)
    if device.type == "cuda":
        import kernels

        kernels.register()
    rows = []
    for path in args.attention:
        for length in args.lengths:
            for name in args.models:
                torch.manual_seed(0)
                preset, settings = model_spec(name)
                config = SSEConfig.from_preset(preset, **settings, max_position_embeddings=max(args.tokens, 4096))
                model = SSEForCausalLM(config).to(device)
                try:
                    with attention_path(path):
                        r = measure(model, args.tokens, length, args.accumulation, args.steps, device,
                                    args.trace_memory)
                except torch.OutOfMemoryError:
                    r = None
                rows.append((path, length, name, r, set(config.mixer_types) == {"attn"}))
                print(path, length, name, r and {k: v for k, v in r.items() if k not in ("losses", "memory")},
                      flush=True)
                del model
                release(device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\nOptimizer steps of {args.accumulation} packed rows x {args.tokens:,} tokens ({where}; AdamW, "
          f"{'bf16 autocast, ' if device.type == 'cuda' else ''}checkpointing, fused LM head)\n")
    print("| attention | sequence length | model | tokens/s | vs Transformer | step s | first step s | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path, length, name, r, _ in rows:
        base = next((b["tokens_per_s"] for p, n, _, b, attn in rows if (p, n) == (path, length) and attn and b), None)
        if r is None:
            print(f"| {path} | {length:,} | {name} | out of memory | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        print(f"| {path} | {length:,} | {name} | {r['tokens_per_s']:,.0f} | {ratio} | {r['step_s']:.2f} | "
              f"{r['first_s']:.1f} | {r['peak_gib']:.1f} |")
    if args.trace_memory:
        from .memory_peak import peak_table

        for path, length, name, r, _ in rows:
            if r is not None:
                print(f"\n#### What is alive at the peak of a traced step: {name}, {path}, {length:,}\n")
                print(peak_table(r["memory"]))


if __name__ == "__main__":
    main()
