"""GRPO's trainer passes at the paper's lengths: the log-prob pass and the loss pass over a generation batch.

    python -m benchmarks.pipeline.grpo_loss_pass                                   # sse-h-2b, transformer-2b (GPU)
    python -m benchmarks.pipeline.grpo_loss_pass --models sse-h-tiny --shapes 4x64 --prompt 16 --device cpu
    python -m benchmarks.pipeline.grpo_loss_pass --models sse-h-2b --shapes 16x32768 --precisions bf16-mixed fp32

For each model (random weights, float32 masters, bf16 autocast on CUDA, gradient checkpointing, as
``recipes/paper-2b`` trains) and each ``COMPLETIONSxLENGTH`` shape: completions of ``LENGTH`` tokens after
``--prompt``-token prompts, in micro-batches of ``--micro-batch`` rows packed padding-free into forwards of at most
``micro-batch x (prompt + length)`` tokens (the trainer's default budget, :func:`pipeline.packing.packed_logps`).
Times the log-prob pass (no gradients: the old policy's log-probs) and the loss pass (a policy-gradient surrogate
with the per-token ratio, backward, gradients accumulated over the micro-batches), and the peak memory. Prints a
markdown table. ``--precisions fp32`` times the passes without autocast, as ``precision: fp32`` trains: with a
float32 engine, the setting under which engine and trainer compute the same policy (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from benchmarks.common import model_spec, release


def timed_passes(model, completions: int, length: int, prompt: int, micro_batch: int, device: torch.device,
                 precision: str = "bf16-mixed") -> dict:
    from pipeline.packing import packed_logps

    def autocast():
        if device.type == "cuda" and precision == "bf16-mixed":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    vocab, width = model.config.vocab_size, prompt + length
    batches = [torch.randint(10, vocab, (min(micro_batch, completions - i), width), device=device)
               for i in range(0, completions, micro_batch)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    old = []
    with torch.no_grad():
        for ids in batches:
            old.append(packed_logps(model, ids, torch.ones_like(ids), length, ids.numel(), autocast)[0])
    sync()
    logp_s = time.perf_counter() - start
    start = time.perf_counter()
    for ids, old_logps in zip(batches, old):
        logps, _ = packed_logps(model, ids, torch.ones_like(ids), length, ids.numel(), autocast)
        advantages = torch.randn(ids.shape[0], 1, device=device)
        loss = -(torch.exp(logps - old_logps) * advantages).sum() / (completions * length)
        loss.backward()
    sync()
    loss_s = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"logp_s": logp_s, "loss_s": loss_s, "peak_gib": peak, "tokens": completions * width}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["sse-h-2b", "transformer-2b"],
                        help="presets, each optionally with config settings: sse-h-2b:sse_backward_head_groups=3")
    parser.add_argument("--shapes", nargs="+", default=["64x8192", "16x32768"], help="COMPLETIONSxLENGTH")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2, help="rows per packed forward (paper-2b: 2)")
    parser.add_argument("--precisions", nargs="+", default=["bf16-mixed"], choices=["bf16-mixed", "fp32"],
                        help="bf16 autocast over float32 masters (the recipes' on CUDA), or float32 throughout")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from trl.trainer.utils import add_fused_lm_head

    from sse_model import SSEConfig, SSEForCausalLM

    device = torch.device(args.device)
    if device.type == "cuda":
        import kernels

        kernels.register()
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        longest = max(length for _, length in shapes) + args.prompt
        preset, settings = model_spec(name)
        config = SSEConfig.from_preset(preset, **settings, max_position_embeddings=max(longest, 4096))
        model = SSEForCausalLM(config).to(device).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as TRL's GRPOTrainer patches its policy
        for precision in args.precisions:
            timed_passes(model, 2, 64, 16, 2, device, precision)  # compile and warm up
            for completions, length in shapes:
                try:
                    r = timed_passes(model, completions, length, args.prompt, args.micro_batch, device, precision)
                except torch.OutOfMemoryError:
                    r = None
                    model.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                rows.append((name, precision, completions, length, r))
                print(name, precision, completions, length, r, flush=True)
        del model
        release(device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\nGRPO trainer passes, prompts of {args.prompt} tokens, micro-batches of {args.micro_batch} rows "
          f"({where})\n")
    print("| model | precision | completions x length | tokens | log-prob pass s | loss pass s | loss pass tokens/s "
          "| peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, precision, completions, length, r in rows:
        if r is None:
            print(f"| {name} | {precision} | {completions} x {length} | | out of memory | | | |")
            continue
        peak = "n/a" if device.type != "cuda" else f"{r['peak_gib']:.1f}"
        print(f"| {name} | {precision} | {completions} x {length} | {r['tokens']:,} | {r['logp_s']:.1f} | "
              f"{r['loss_s']:.1f} | {r['tokens'] / r['loss_s']:,.0f} | {peak} |")


if __name__ == "__main__":
    main()
