"""Recipes: YAML files validated into typed configs, with ``key=value`` command-line overrides.

Every unknown key and every wrongly typed value is an error that names the key path and the file, e.g.
``recipes/demo.yaml: grpo.num_generaitons: unknown key (did you mean num_generations?)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eval.generation import INSTRUCTION

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class RecipeError(ValueError):
    pass


@dataclass
class ModelSpec:
    """Where the starting model comes from: a checkpoint ``path`` (local or hub), a ``preset`` of
    ``SSEConfig`` built with random weights, or ``convert_from`` a Llama/Qwen2 checkpoint."""

    path: str | None = None
    preset: str | None = None
    convert_from: str | None = None
    config_overrides: dict = field(default_factory=dict)
    tokenizer: str | None = None  # a path or hub name; "char" builds the offline character tokenizer
    dtype: str = "float32"


@dataclass
class DataSpec:
    """A dataset: ``builtin:arithmetic`` (synthetic), a packaged benchmark/training set name, a local
    JSONL/JSON/parquet path, or a Hugging Face hub name. ``fields`` maps our names to the source's."""

    source: str = "builtin:arithmetic"
    split: str = "train"
    fields: dict = field(default_factory=dict)
    max_samples: int | None = None
    seed: int = 0


@dataclass
class DistillConfig:
    enabled: bool = True
    data: DataSpec = field(default_factory=DataSpec)
    epochs: float = 5.0
    max_steps: int = -1
    learning_rate: float = 1e-5
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_length: int = 32768
    packing: bool = True
    gradient_checkpointing: bool = False
    logging_steps: int = 10
    save_steps: int = 500
    save_total_limit: int | None = 3


@dataclass
class EngineConfig:
    max_slots: int | None = None
    memory_budget_gb: float | None = None
    prefill_chunk_size: int = 2048
    use_cuda_graphs: bool | None = None
    dtype: str | None = None  # the engine's weights (float32, bfloat16, float16); default: the model's
    sleep: bool | None = None  # free the engine's memory between rollouts; default: when it shares the trainer's GPU


@dataclass
class RewardConfig:
    accuracy: float = 1.0
    format: float = 0.0
    format_min_reasoning_chars: int = 20  # non-space characters the format reward wants before the box
    overlong: float = 0.0
    overlong_cache: int = 4096
    strict_boxed: bool = False
    timeout: float = 5.0
    workers: int | None = None


@dataclass
class GRPOStageConfig:
    enabled: bool = True
    data: DataSpec = field(default_factory=lambda: DataSpec(source="math_train"))
    steps: int = 230
    prompts_per_step: int = 32
    num_generations: int = 8
    max_prompt_length: int = 1024
    max_completion_length: int = 32768
    temperature: float = 1.0
    top_p: float = 1.0
    learning_rate: float = 1e-6
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = 0.28
    beta: float = 0.0
    mask_truncated_completions: bool = True
    dynamic_filtering: bool = True
    importance_sampling: str = "sequence_mask"  # TRL's vllm_importance_sampling_mode; "none" turns it off
    importance_sampling_clip: float = 3.0
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    rewards: RewardConfig = field(default_factory=RewardConfig)
    num_engines: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    logging_steps: int = 1
    save_steps: int = 10
    save_total_limit: int | None = 3


@dataclass
class EvalStageConfig:
    enabled: bool = True
    benchmarks: list = field(default_factory=lambda: ["aime24", "aime25", "math500", "amc23", "olympiadbench"])
    repeats: int | None = 32
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: int = 32768
    max_prompt_length: int = 2048
    limit: int | None = None
    num_workers: int = 1
    backend: str = "engine"  # "engine" (the rollout engine) or "hf" (model.generate)
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class RayConfig:
    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None


@dataclass
class Recipe:
    name: str = "recipe"
    output_dir: str = "runs/recipe"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    prompt_instruction: str = INSTRUCTION  # appended to every problem, in training and evaluation
    bf16: bool | None = None  # bf16 autocast in training (TRL's ``bf16``); default: on CUDA unless model.dtype is float16
    model: ModelSpec = field(default_factory=ModelSpec)
    distill: DistillConfig = field(default_factory=DistillConfig)
    grpo: GRPOStageConfig = field(default_factory=GRPOStageConfig)
    eval: EvalStageConfig = field(default_factory=EvalStageConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def validate(self, where: str = "recipe") -> None:
        def fail(key, message):
            raise RecipeError(f"{where}: {key}: {message}")

        m = self.model
        if sum(x is not None for x in (m.path, m.preset, m.convert_from)) != 1:
            fail("model", "give exactly one of path, preset, convert_from")
        for key, dtype in (("model.dtype", m.dtype), ("grpo.engine.dtype", self.grpo.engine.dtype or m.dtype),
                           ("eval.engine.dtype", self.eval.engine.dtype or m.dtype)):
            if dtype not in ("float32", "bfloat16", "float16"):
                fail(key, f"expected float32, bfloat16 or float16, got {dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            fail("device", f"expected auto, cpu or cuda, got {self.device!r}")
        g = self.grpo
        if g.num_generations < 2:
            fail("grpo.num_generations", "GRPO needs at least 2 generations per prompt")
        if g.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            fail("grpo.loss_type", f"expected grpo, bnpo, dr_grpo or dapo, got {g.loss_type!r}")
        if g.importance_sampling not in ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
            fail("grpo.importance_sampling", f"unknown mode {g.importance_sampling!r}")
        if not 0 < g.top_p <= 1:
            fail("grpo.top_p", f"must be in (0, 1], got {g.top_p}")
        if g.steps < 1 or g.prompts_per_step < 1:
            fail("grpo.steps", "steps and prompts_per_step must be >= 1")
        if self.eval.backend not in ("engine", "hf"):
            fail("eval.backend", f"expected engine or hf, got {self.eval.backend!r}")
        if not 0 < self.eval.top_p <= 1:
            fail("eval.top_p", f"must be in (0, 1], got {self.eval.top_p}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _convert(value, tp, key: str, where: str):
    """Checks ``value`` against the annotation ``tp`` (dataclass, Optional, primitives, list, dict)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key, where)
            except RecipeError as err:
                errors.append(err)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: {key}: expected a mapping, got {type(value).__name__}")
        return build(tp, value, where, key)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise RecipeError(f"{where}: {key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return value
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where}: {key}: expected a list, got {type(value).__name__}")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: {key}: expected a mapping, got {type(value).__name__}")
        return value
    return value


def build(cls, data: dict, where: str, prefix: str = ""):
    """``cls(**data)`` with every key and type checked."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(names)})"
            raise RecipeError(f"{where}: {path}: unknown key{hint}")
        kwargs[key] = _convert(value, hints[key], path, where)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], object]:
    """``"grpo.steps=50"`` -> (["grpo", "steps"], 50); values parse as YAML (numbers, bools, lists, null)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    if not key:
        raise RecipeError(f"override {text!r}: empty key")
    return key.split("."), yaml.safe_load(raw) if raw != "" else ""


def resolve_recipe_path(name: str) -> Path:
    """A file path, or a recipe shipped in ``recipes/`` (``demo``, ``paper-2b``)."""
    path = Path(name)
    if path.exists():
        return path / "recipe.yaml" if path.is_dir() else path
    for candidate in (RECIPES_DIR / f"{name}.yaml", RECIPES_DIR / name / "recipe.yaml"):
        if candidate.exists():
            return candidate
    available = sorted(p.stem if p.suffix else p.name for p in RECIPES_DIR.iterdir() if p.name != "__init__.py"
                       and not p.name.startswith("_"))
    raise RecipeError(f"recipe {name!r} not found (not a file; built-in recipes: {available})")


def load_recipe(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    path = resolve_recipe_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: invalid YAML: {err}") from err
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: the recipe must be a mapping at the top level")
    for override in overrides:
        keys, value = parse_override(override)
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {override!r}: {key} is not a mapping")
        node[keys[-1]] = value
    where = str(path) + (f" (with overrides {' '.join(overrides)})" if overrides else "")
    recipe = build(Recipe, data, where)
    recipe.validate(where)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)
