"""The tiny CPU demo: a tiny SSE-H learns to answer arithmetic questions in ``\\boxed{}``."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from sse_model import SSEConfig, SSEForCausalLM

from .tokenizer import build_char_tokenizer


def arithmetic_examples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        pairs.append((f"{a}+{b}=?", f"\\boxed{{{a + b}}}"))
    return pairs


def run_demo(output_dir: str = "runs/demo", steps: int = 300, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    config = SSEConfig.from_preset("sse-h-tiny", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = SSEForCausalLM(config)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = arithmetic_examples(2000, seed)

    def encode(question, answer):
        msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        labels = [t if m else -100 for t, m in zip(out["input_ids"], out["assistant_masks"])]
        return out["input_ids"], labels

    start = time.time()
    for step in range(1, steps + 1):
        batch = [encode(*random.Random(seed * 100000 + step * 32 + i).choice(data)) for i in range(32)]
        width = max(len(b[0]) for b in batch)
        ids = torch.tensor([b[0] + [tokenizer.pad_token_id] * (width - len(b[0])) for b in batch])
        labels = torch.tensor([b[1] + [-100] * (width - len(b[1])) for b in batch])
        mask = (torch.arange(width)[None] < torch.tensor([len(b[0]) for b in batch])[:, None]).long()
        out = model(ids, attention_mask=mask, labels=labels)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
        if step % 50 == 0 or step == 1:
            print(f"step {step:4d}  loss {out.lm_loss.item():.3f}  aux {out.aux_loss.item():.3f}  "
                  f"{step / (time.time() - start):.1f} steps/s", flush=True)
    model.eval()
    correct = 0
    tests = arithmetic_examples(50, seed + 1)
    for question, answer in tests:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt")
        generated = model.generate(**ids, max_new_tokens=12, do_sample=False)
        text = tokenizer.decode(generated[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += text.strip() == answer
    print(f"held-out accuracy: {correct}/{len(tests)}  (e.g. {tests[0][0]} -> {answer})")
    out_dir = Path(output_dir)
    model.save_pretrained(out_dir / "model")
    tokenizer.save_pretrained(out_dir / "model")
    print(f"model saved to {out_dir / 'model'}")
    return out_dir
