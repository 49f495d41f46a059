"""A model's own worked solutions to a data source's problems, as a JSONL that recipes train on.

Alignment teaches the converted layers on the text it shows them, and GSM8K train's rewritten solutions alone leave
the converted model reading other text worse than the Transformer it came from (docs/real_model.md). The source
model's own solutions to other problems are text from its own distribution, in whatever style each problem calls
for, and need no hub. The model is a recipe's starting model (the Transformer arm's recipe starts from the published
model, the converted arm's teacher) or ``--checkpoint``, served by the rollout engine as evaluation serves it
(``eval.engine``), sampled at temperature 1 by default (its own distribution).

    python -m scripts.sample_solutions smollm2-135m-transformer --data math_train --split 'train[:-500]' \\
        --max-tokens 512 --out runs/samples/math_train.jsonl
    sse-pipeline run smollm2-135m "align.data={source: gsm8k_train, split: 'train[:-500]', \\
        mix: [{source: runs/samples/math_train.jsonl}]}"

Each record holds ``messages`` (the prompt as the model saw it, with the recipe's instruction, and its solution),
``answer`` (the source's) and ``id``; distillation and alignment read such records as they are. Samples cut at
``--max-tokens`` are counted and left out (distillation on them would teach unfinished answers), unless
``--keep-cut`` (alignment learns from any of the model's text).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROGRESS_EVERY_S = 15


def sample_solutions(recipe_name: str, data: str, split: str, out: Path, checkpoint: str | None = None,
                     first: int | None = None, max_tokens: int = 512, temperature: float = 1.0, top_p: float = 1.0,
                     seed: int = 0, device: str | None = None, keep_cut: bool = False) -> dict:
    """Samples one solution per problem of ``data`` (``split``, its ``first`` records) and writes the finished ones
    (and the cut ones with ``keep_cut``) to ``out`` (JSONL, atomically); returns the counts and the rate."""
    from common.files import atomic_write
    from common.generation import request_seed
    from eval.generation import SamplingConfig

    from pipeline.data import prompt_dataset
    from pipeline.models import engine_options, load_model, resolve_device
    from pipeline.recipe import DataSpec, load_recipe
    from pipeline.rollout import create_engine
    from pipeline.rollout.backend import EngineBackend

    recipe = load_recipe(recipe_name)
    rows = prompt_dataset(DataSpec(source=data, split=split), recipe.prompt_instruction)  # bad data fails here
    if first is not None:
        rows = rows.select(range(min(first, len(rows))))
    model, tokenizer = load_model(recipe.model, checkpoint, seed=recipe.seed)
    model = model.to(resolve_device(device or recipe.device)).eval()
    prompts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
               for row in rows]
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    options = engine_options(recipe, recipe.eval.engine, longest + max_tokens)
    backend = EngineBackend(create_engine(model, tokenizer, **options))
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens, seed=seed)
    seeds = [request_seed(seed, i, 0) for i in range(len(prompts))]
    solutions: dict[int, str] = {}
    done = cut = tokens = 0
    start = last = time.perf_counter()
    for index, completion in backend.generate(prompts, sampling, seeds):
        done, tokens = done + 1, tokens + completion.num_tokens
        cut += completion.finish_reason == "length"
        if keep_cut or completion.finish_reason != "length":
            solutions[index] = completion.text
        now = time.perf_counter()
        if now - last > PROGRESS_EVERY_S or done == len(prompts):
            print(f"sample_solutions: {done}/{len(prompts)} ({tokens / (now - start):.0f} tok/s, ETA "
                  f"{(len(prompts) - done) * (now - start) / done:.0f} s, {cut} cut at {max_tokens} tokens)", flush=True)
            last = now
    lines = [json.dumps({"id": f"{Path(data).stem}-{i}", "answer": rows[i]["answer"],
                         "messages": [*rows[i]["prompt"], {"role": "assistant", "content": solutions[i]}]},
                        ensure_ascii=False) for i in sorted(solutions)]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, "".join(line + "\n" for line in lines))
    return {"problems": len(prompts), "written": len(lines), "cut": cut, "tokens": tokens,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="the recipe whose starting model (or --checkpoint) samples")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint folder to sample from instead")
    parser.add_argument("--data", required=True, help="a data source with problem + answer (as in recipes)")
    parser.add_argument("--split", default="train", help="a part of the data, as recipes' data.split")
    parser.add_argument("--first", type=int, default=None, help="only the first records")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: the recipe's")
    parser.add_argument("--keep-cut", action="store_true", help="also the samples cut at --max-tokens (alignment text)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    counts = sample_solutions(args.recipe, args.data, args.split, args.out, args.checkpoint, args.first,
                              args.max_tokens, args.temperature, args.top_p, args.seed, args.device, args.keep_cut)
    print(f"{args.out}: {counts['written']} solutions of {counts['problems']} problems ({counts['cut']} cut at "
          f"{args.max_tokens} tokens), {counts['tokens']} tokens in {counts['seconds']:.0f} s")


if __name__ == "__main__":
    main()
