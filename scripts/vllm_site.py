"""vLLM for a GPU machine that cannot reach a package index: pack it here, carry it in parts, check it there.

vLLM 0.25.1 pins exactly the GPU image's torch (2.11), but its wheel is 250 MB and each device call carries
64 MiB. ``pack`` downloads vLLM, flashinfer and the pure-Python dependencies vLLM imports (for CPython 3.12,
manylinux x86_64, no dependency resolution: the image's torch, transformers, numpy... are used as they are),
unpacks them into one site folder, drops what an H100 run never loads (:data:`DROP`: the FlashAttention-2
library, sm100 sources, the other Pythons' builds, the Rust frontend, FlashInfer's JIT sources...), and writes an
``.tar.xz`` split into parts:

    python -m scripts.vllm_site pack [--out .device-vllm] [--part-mb 45]

It prints one device command per part (send them one right after another: a warm machine keeps ``/tmp``), then
the command that joins the parts, unpacks them to ``/tmp/vllm-site`` and runs the check:

    PYTHONPATH=/tmp/vllm-site:$PWD python -m scripts.vllm_site check

``check`` imports vLLM (naming every module still missing, so that ``pack --extra`` can add it), saves a tiny
random Llama, generates greedily with ``vllm.LLM`` and with transformers, and says whether the tokens agree;
``check-plugin`` does the same for a small SSE-H served through :mod:`pipeline.rollout.vllm.plugin` against the
rollout engine. Both run vLLM as :func:`vllm_environment` sets it up for such a site.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pipeline.rollout.vllm.engine import vllm_environment

VLLM = "vllm==0.25.1"
# vLLM's requirements that the GPU image lacks, for CPython 3.12: flashinfer (vLLM's FlashInfer paths; FA3
# serves attention on Hopper), the modules ``from vllm import LLM`` found missing when imported on a CPU machine
# (cbor2 ... partial-json-parser), and the rest of vLLM's METADATA that the image does not list. What the image
# has (aiohttp, numba, pillow, protobuf, requests, tiktoken, uvloop...) is used as it is; ``check`` names
# anything still missing. xgrammar: the last release that works with the apache-tvm-ffi vLLM pins (0.1.9).
DEPENDENCIES = [
    "flashinfer-python==0.6.13", "apache-tvm-ffi==0.1.9", "cbor2", "pyzmq", "openai-harmony", "openai", "msgspec",
    "pybase64", "cachetools", "llguidance<1.8.0,>=1.7.0", "xgrammar==0.2.5.post1", "fastapi<0.137.0,>=0.133.0",
    "starlette>=1.0.1", "opentelemetry-api>=1.27.0", "partial-json-parser", "blake3", "diskcache==5.6.3",
    "lark==1.2.2", "outlines_core==0.2.14", "gguf", "depyf==0.20.0", "compressed-tensors==0.17.0",
    "pydantic>=2.12.0", "pydantic-core", "annotated-types", "typing-inspection", "sniffio", "distro", "jiter",
    "setproctitle", "watchfiles", "python-json-logger", "ijson", "mistral_common>=1.11.5", "jsonschema",
    "jsonschema-specifications", "referencing", "rpds-py", "astor", "dill", "httpx2",
]
# Paths (globs, relative to the site) an H100 run of ``vllm.LLM`` never loads.
DROP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention 2: vLLM takes FA3 on Hopper
    "vllm/third_party/fmha_sm100", "vllm/entrypoints/serve/instrumentator/static",
    "vllm/third_party/deep_gemm/_C.cpython-31[013-9]-*.so", "vllm/third_party/deep_gemm/include",
    "vllm/vllm-rs",  # the Rust serving frontend (38 MB); ``vllm.LLM`` runs in Python
    "flashinfer/data",  # FlashInfer's JIT sources (74 MB): only its JIT-compiled kernels need them
    "mistral_common/data",  # Mistral tokenizer files (36 MB); the checks skip tokenizer initialisation
    "**/*.pyi", "**/__pycache__",
]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            "--platform", "manylinux_2_35_x86_64", "--platform", "manylinux_2_34_x86_64",  # llguidance: 2.31
            "--platform", "manylinux_2_31_x86_64", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_5_x86_64", "--platform", "any"]


def drop_unused(site: Path, patterns: list[str] = DROP) -> int:
    """Removes what matches ``patterns`` under ``site``; returns the bytes freed."""
    freed = 0
    for pattern in patterns:
        for path in sorted(site.glob(pattern), reverse=True):
            if path.is_dir():
                freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path)
            elif path.exists():
                freed += path.stat().st_size
                path.unlink()
    return freed


def split(archive: Path, part_mb: int) -> list[Path]:
    """``archive`` cut into ``partNN`` files of at most ``part_mb`` MiB beside it (the archive is removed)."""
    parts, size = [], part_mb * 2**20
    with archive.open("rb") as f:
        while chunk := f.read(size):
            part = archive.parent / f"part{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    archive.unlink()
    return parts


def pack(out: Path, part_mb: int, extra: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp, "wheels"), Path(tmp, "site")
        for spec in [VLLM, *DEPENDENCIES, *extra]:
            print(f"download {spec}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(wheels),
                            spec], check=True)
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        freed = drop_unused(site)
        print(f"dropped {freed / 2**20:.0f} MiB; packing (xz, a few minutes)", flush=True)
        for old in out.glob("part*"):
            old.unlink()
        archive = out / "vllm-site.tar.xz"
        tar = subprocess.Popen(["tar", "cf", "-", "-C", str(site), "."], stdout=subprocess.PIPE)
        with archive.open("wb") as f:
            subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=f, check=True)
        tar.wait()
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    parts = split(archive, part_mb)
    (out / "SHA256").write_text(digest + "\n")
    print(f"\n{len(parts)} parts in {out} (sha256 {digest}); one device call each, back to back:\n")
    for part in parts:
        print(f'carry: ["{part}"]\ncommand: mkdir -p /tmp/vllm-parts && cp {part} /tmp/vllm-parts/\n')
    print("then:\n  cat /tmp/vllm-parts/part* > /tmp/vllm-site.tar.xz && "
          f'[ "$(sha256sum /tmp/vllm-site.tar.xz | cut -d" " -f1)" = {digest} ] && '
          "mkdir -p /tmp/vllm-site && tar xJf /tmp/vllm-site.tar.xz -C /tmp/vllm-site && "
          "PYTHONPATH=/tmp/vllm-site:$PWD python -m scripts.vllm_site check")


def missing_module() -> str | None:
    """The first module ``from vllm import LLM`` lacks here (None: it imports), tried in a fresh process."""
    probe = subprocess.run([sys.executable, "-c", "from vllm import LLM"], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    last = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit status {probe.returncode}"
    if "No module named" not in last:
        raise RuntimeError(f"importing vLLM failed: {last}")
    return last.split("'")[1].split(".")[0]


def check(new_tokens: int = 16) -> None:
    """Greedy tokens of a tiny random Llama, from ``vllm.LLM`` and from transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vllm_environment()
    missing = missing_module()
    if missing:
        raise SystemExit(f"vLLM needs the module {missing!r}, which the site lacks: add its package to pack --extra")
    from vllm import LLM, SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (7, 33, 100)]
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                  gpu_memory_utilization=0.3, max_model_len=1024)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    model = model.cuda()
    agree = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        ref = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):].tolist()
        got = list(out.outputs[0].token_ids)
        agree += sum(a == b for a, b in zip(got, ref))
        print(f"prompt {len(prompt)} tokens: vllm {got}\n{'':>17}hf   {ref}")
    total = new_tokens * len(prompts)
    print(f"vLLM {__import__('vllm').__version__} generated; greedy tokens equal to transformers': {agree}/{total}")


def check_plugin(new_tokens: int = 32) -> None:
    """Greedy tokens and their log-probabilities from a small random SSE-H, served by vLLM through this package's
    plugin (:mod:`pipeline.rollout.vllm.plugin`) and generated by the rollout engine."""
    import gc

    import torch

    import kernels
    from sse_model import SSEConfig, SSEForCausalLM

    from pipeline.rollout.engine import Engine
    from pipeline.rollout.sampling import SamplingParams as EngineParams
    from pipeline.rollout.vllm.plugin import register

    vllm_environment()
    register()  # what the vllm.general_plugins entry point does where this package is installed
    from vllm import LLM, SamplingParams

    torch.manual_seed(0)
    # 5 SSE layers and 1 attention layer; 128-wide heads (vLLM's attention kernels take 64 and up)
    config = SSEConfig.from_preset("sse-h-tiny", vocab_size=512, hidden_size=512, num_heads=4, head_dim=128,
                                   num_attention_heads=4, intermediate_size=1024)
    model = SSEForCausalLM(config).to(torch.bfloat16)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (7, 33, 100, 300)]
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, seed=0,
                  enable_prefix_caching=False, gpu_memory_utilization=0.3, max_model_len=1024)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    kernels.register()
    engine = Engine(model.cuda(), None, max_model_len=1024)
    refs = engine.generate(prompts, EngineParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    agree, worst = 0, 0.0
    for prompt, out, ref in zip(prompts, outs, refs):
        got, want = list(out.outputs[0].token_ids), ref.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        agree += same
        got_lp = [step[token].logprob for step, token in zip(out.outputs[0].logprobs, got)]
        gap = max((abs(a - b) for a, b in zip(got_lp[:same], ref.outputs[0].logprobs[:same])), default=0.0)
        worst = max(worst, gap)
        print(f"prompt {len(prompt)} tokens: vllm {got}\n{'':>17}engine {want}\n{'':>17}"
              f"same up to {same}/{len(want)}, log-prob gap {gap:.2e}")
    total = new_tokens * len(prompts)
    print(f"SSE-H in vLLM {__import__('vllm').__version__}: greedy tokens equal to the engine's: {agree}/{total} "
          f"(up to each first difference); largest log-prob gap there {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, default=Path(".device-vllm"))
    p.add_argument("--part-mb", type=int, default=45, help="a call carries 64 MiB with the working tree (~12 MB)")
    p.add_argument("--extra", nargs="*", default=[], help="more packages (what check said was missing)")
    sub.add_parser("check")
    sub.add_parser("check-plugin")
    args = parser.parse_args()
    if args.cmd == "pack":
        pack(args.out, args.part_mb, args.extra)
    elif args.cmd == "check":
        check()
    else:
        check_plugin()


if __name__ == "__main__":
    main()
