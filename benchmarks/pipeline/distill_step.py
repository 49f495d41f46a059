"""Seconds per distillation step at SmolLM2-135M's shape (random weights, the character tokenizer), with and
without the teacher's logits: ``python -m benchmarks.pipeline.distill_step``. Prints ms/step, peak memory and the
allocator's retries (a sign of fragmentation) for each setting. Every setting trains on the same batches: the first
one run also pays for every shape seen for the first time (compilations, cuDNN plans), the later ones do not: run a
setting twice (``0 0``) to see that cost alone."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from benchmarks.kernels.bench_packed import SMOLLM2
    from pipeline.data import drop_overlong, sft_dataset
    from pipeline.models import TRAINING_DTYPE, load_model, load_teacher, resolve_device
    from pipeline.recipe import load_recipe
    from pipeline.stages.distill import SSESFTTrainer, sft_config
    from pipeline.tokenizer import build_char_tokenizer

    work = Path(tempfile.mkdtemp(prefix="distill-step-"))
    source = work / "smollm2-shape"
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)).save_pretrained(source)
    tokenizer.save_pretrained(source)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)

    for weight in [float(w) for w in (sys.argv[1:] or ["0", "0.5"])]:
        recipe = load_recipe("smollm2-135m", [f"model.convert_from={source}", "distill.data.max_samples=2000",
                                              f"distill.teacher_kl={weight}", "distill.max_steps=6"])
        model, tok = load_model(recipe.model, None, dtype=TRAINING_DTYPE)
        data, _ = drop_overlong(sft_dataset(recipe.distill.data, recipe.prompt_instruction), tok, 1024)
        teacher = load_teacher(recipe.model).cuda() if weight else None
        clock = Clock()
        clock.times = []
        torch.cuda.reset_peak_memory_stats()
        trainer = SSESFTTrainer(model=model.cuda(), args=sft_config(recipe, work / "run", resolve_device("cuda")),
                                train_dataset=data, processing_class=tok, teacher=teacher, teacher_kl=weight,
                                callbacks=[clock])
        trainer.train()
        stats = torch.cuda.memory_stats()
        print(f"teacher_kl={weight}: ms/step {[round(1e3 * t) for t in clock.times]}, peak "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, alloc retries {stats.get('num_alloc_retries')}",
              flush=True)
        del trainer, model, teacher
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
