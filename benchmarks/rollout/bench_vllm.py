"""Rollout throughput against vLLM, the engine GRPO pipelines roll out with; prints one markdown table.

    PYTHONPATH=/tmp/vllm-site:$PWD python -m benchmarks.rollout.bench_vllm [--new-tokens 1024 8192 32768]

(vLLM on the path: ``python -m scripts.vllm_site``.) Per generation length, three rows on the shapes of
``benchmarks.rollout.benchmark`` (``--prompts`` prompts of ``--prompt-len`` random tokens x ``--samples`` samples,
EOS ignored, temperature 1): vLLM serving ``transformer-2b`` (random weights, exported as a Llama checkpoint by
:func:`sse_model.convert.export_to_llama`, bf16), our engine on ``transformer-2b`` and on ``sse-h-2b``;
``--systems ... vllm:sse-h-2b`` adds SSE-H served by vLLM through :mod:`pipeline.rollout.vllm.plugin`. Each runs
in a fresh process, one after another (vLLM reserves most of the GPU for its KV cache); peak = the most device
memory in use while it generated, polled, whichever process held it. Goals: our engine on SSE-H >= 1.5x vLLM's
tokens/s at 8k new tokens and >= 3x at 32k; our engine on the Transformer within 1.3x of vLLM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SYSTEMS = [("vllm", "transformer-2b"), ("engine", "transformer-2b"), ("engine", "sse-h-2b")]
PEER = SYSTEMS[0]  # every row's "vs vLLM": vLLM serving the same-size Transformer


class PeakMemory:
    """The most device memory in use (all processes) while the context runs, polled every 50 ms."""

    def __enter__(self):
        import torch

        self.peak, self._stop = 0, threading.Event()
        total = torch.cuda.mem_get_info()[1]

        def poll():
            while not self._stop.is_set():
                self.peak = max(self.peak, total - torch.cuda.mem_get_info()[0])
                time.sleep(0.05)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def prompts(args) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 1000, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts[0])]


def export(path: str, preset: str, max_len: int) -> None:
    """``preset`` with random weights as a bf16 checkpoint vLLM serves: attention-only models as Llama, SSE models
    as ``SSEForCausalLM`` (served through :mod:`pipeline.rollout.vllm.plugin`). Its ``max_position_embeddings``
    covers ``max_len``: vLLM sizes its rotary table by it, and a prompt of 512 + 32768 new tokens runs past the
    presets' 32768 (a device-side assert at the last positions)."""
    import torch

    from sse_model.convert import export_to_llama

    from .benchmark import build
    from pipeline.rollout.vllm.plugin import linear_kind

    model = build(preset)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings or 0, max_len)
    (model if linear_kind(model.config) else export_to_llama(model)).save_pretrained(path)
    torch.cuda.empty_cache()


def run_vllm(path: str, args, new_tokens: int) -> dict:
    from pipeline.rollout.vllm.plugin import register
    from pipeline.rollout.vllm.engine import vllm_environment

    vllm_environment()
    register()
    from vllm import LLM, SamplingParams

    sse = "SSEForCausalLM" in json.loads(Path(path, "config.json").read_text()).get("architectures", [])
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=args.prompt_len + new_tokens, gpu_memory_utilization=args.vllm_memory,
              enforce_eager=args.vllm_eager, **(dict(enable_prefix_caching=False) if sse else {}))
    batch = [{"prompt_token_ids": p} for p in prompts(args)]
    llm.generate(batch[:2], SamplingParams(n=2, max_tokens=8, ignore_eos=True))  # warm-up
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    with PeakMemory() as peak:
        start = time.perf_counter()
        outs = llm.generate(batch, params)
        elapsed = time.perf_counter() - start
    return dict(tokens=sum(len(c.token_ids) for o in outs for c in o.outputs), seconds=elapsed, peak=peak.peak)


def run_engine(preset: str, args, new_tokens: int) -> dict:
    import kernels

    from .benchmark import build
    from pipeline.rollout.engine import Engine
    from pipeline.rollout.sampling import SamplingParams

    kernels.register()
    engine = Engine(build(preset), None, max_model_len=args.prompt_len + new_tokens, prefill_chunk_size=8192)
    batch = prompts(args)
    engine.generate(batch[:2], SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=0))  # warm-up, graphs
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    with PeakMemory() as peak:
        start = time.perf_counter()
        outs = engine.generate(batch, params)
        elapsed = time.perf_counter() - start
    return dict(tokens=sum(len(c.token_ids) for o in outs for c in o.outputs), seconds=elapsed, peak=peak.peak,
                max_slots=engine.max_slots)


def table(results: list[dict]) -> str:
    """Markdown rows of ``results`` (``new_tokens, system, model, tokens, seconds, peak``), each against the
    :data:`PEER` row of the same length."""
    lines = ["| new tokens | sequences | system | model | tokens/s | vs vLLM | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    vllm = {r["new_tokens"]: r["tokens"] / r["seconds"] for r in results if (r["system"], r["model"]) == PEER}
    for r in results:
        tps = r["tokens"] / r["seconds"]
        ref = vllm.get(r["new_tokens"])
        ratio = f"{tps / ref:.2f}x" if ref else "-"
        seqs = f"{r.get('prompts', '?')} x {r.get('samples', '?')}"
        lines.append(f"| {r['new_tokens']} | {seqs} | {r['system']} | {r['model']} | {tps:,.0f} | {ratio} | "
                     f"{r['peak'] / 2**30:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, nargs="*", default=[1024, 8192, 32768])
    parser.add_argument("--prompts", type=int, nargs="*", default=[32],
                        help="prompts per generation length (one value: the same for every length)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--vllm-memory", type=float, default=0.9, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without CUDA graphs (enforce_eager)")
    parser.add_argument("--systems", nargs="*", default=[f"{s}:{m}" for s, m in SYSTEMS])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the checkpoints vLLM serves are kept, one folder per preset (reused when there; "
                             "default: a temporary folder)")
    parser.add_argument("--results", type=Path, default=None,
                        help="JSON lines: each row is appended as it finishes and the table covers the whole file; "
                             "each run's own log is written beside it")
    parser.add_argument("--child", nargs=4, metavar=("SYSTEM", "MODEL", "NEW_TOKENS", "CHECKPOINT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if len(args.prompts) not in (1, len(args.new_tokens)):
        parser.error(f"--prompts takes one value or one per --new-tokens ({len(args.new_tokens)})")
    if args.child:
        system, model, new_tokens, path = args.child
        if system == "export":
            export(path, model, int(new_tokens))
            return
        run = run_vllm(path, args, int(new_tokens)) if system == "vllm" else run_engine(model, args, int(new_tokens))
        print("RESULT " + json.dumps(run), flush=True)
        return

    def child(system, model, new_tokens, path, prompts=1) -> dict | None:
        common = ["--prompts", str(prompts), "--samples", str(args.samples), "--prompt-len", str(args.prompt_len),
                  "--vllm-memory", str(args.vllm_memory), *(["--vllm-eager"] if args.vllm_eager else [])]
        fields = (system, model, new_tokens, path)
        cmd = [sys.executable, "-m", "benchmarks.rollout.bench_vllm", *common, "--child", *map(str, fields)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if args.results is not None:  # vLLM's own log says how it ran (CUDA graphs, KV cache size, concurrency)
            log = args.results.with_name(f"{args.results.stem}-{system}-{model}-{new_tokens}.log")
            log.write_text(out.stdout + out.stderr)
        found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or (fields[0] != "export" and not found):
            print(f"{' '.join(map(str, fields[:3]))} failed (exit {out.returncode}):\n{out.stderr[-3000:]}", flush=True)
            return None
        return json.loads(found[-1][7:]) if found else {}

    results = [json.loads(line) for line in args.results.read_text().splitlines()] \
        if args.results is not None and args.results.exists() else []
    per_length = dict(zip(args.new_tokens, args.prompts * len(args.new_tokens) if len(args.prompts) == 1
                          else args.prompts))
    with tempfile.TemporaryDirectory() as tmp:
        systems = [s.split(":") for s in args.systems]
        checkpoints = {model: str(Path(args.model_dir or tmp, model)) for system, model in systems if system == "vllm"}
        longest = args.prompt_len + max(args.new_tokens)
        for model, path in checkpoints.items():
            config = Path(path, "config.json")
            if config.exists() and json.loads(config.read_text()).get("max_position_embeddings", 0) >= longest:
                continue
            if child("export", model, longest, path) is None:
                raise SystemExit(f"saving {model} for vLLM failed")
        for new_tokens, n_prompts in per_length.items():
            for system, model in systems:
                run = child(system, model, new_tokens, checkpoints.get(model, "-"), n_prompts)
                if run is None:
                    continue
                row = dict(run, system=system, model=model, new_tokens=new_tokens, prompts=n_prompts,
                           samples=args.samples, prompt_len=args.prompt_len)
                results.append(row)
                if args.results is not None:
                    with args.results.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                print(f"{system} {model} {new_tokens}: {run['tokens'] / run['seconds']:,.0f} tok/s", flush=True)
    print(f"\n### Rollout: prompts of {args.prompt_len} tokens x {args.samples} samples, EOS ignored\n")
    print(table(results))


if __name__ == "__main__":
    main()
