"""Recipes: YAML files validated into typed configs, with ``key=value`` command-line overrides.

Every unknown key and every wrongly typed value is an error that names the key path and the file, e.g.
``recipes/demo.yaml: grpo.num_generaitons: unknown key (did you mean num_generations?)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common.generation import INSTRUCTION

from .errors import RecipeError
from .rollout.options import ENGINE_BACKENDS, EngineOptions

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


DTYPES = ("float32", "bfloat16", "float16")
MAX_SAMPLING_ROUNDS = 16  # each round of a GRPO step samples with its own seeds (pipeline.stages.grpo.sampling_key)


def bounded(default=None, *, ge=None, gt=None, le=None, choices=None):
    """A recipe field with the range or the values it accepts, checked when the recipe loads (``None`` is
    always accepted where the field's type allows it)."""
    rules = {k: v for k, v in dict(ge=ge, gt=gt, le=le, choices=choices).items() if v is not None}
    return field(default=default, metadata={"rules": rules})


def _check_rules(value, rules: dict, key: str, where: str) -> None:
    if value is None:
        return
    if "choices" in rules and value not in rules["choices"]:
        close = difflib.get_close_matches(str(value), [str(c) for c in rules["choices"]], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise RecipeError(f"{where}: {key}: {value!r} is not one of {list(rules['choices'])}{hint}")
    for name, ok, text in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                           ("le", lambda v, b: v <= b, "<=")):
        if name in rules and not ok(value, rules[name]):
            raise RecipeError(f"{where}: {key}: must be {text} {rules[name]}, got {value!r}")


def fail(key: str, message: str):
    """A recipe error at ``key`` (the file is named by :meth:`Recipe.validate`)."""
    raise RecipeError(f"{key}: {message}")


def did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, [str(k) for k in known], n=1)
    return f"; did you mean {close[0]}?" if close else ""


def check_output_dir(output_dir: str) -> None:
    """A run's folder, refused where a run's outputs would mix with other files: empty (the working directory), or
    the working directory or a folder above it (where ``--redo`` would move the checkout's own folders aside)."""
    if not output_dir.strip():
        fail("output_dir", "empty: the run would be written into the working directory; name a folder of its own")
    here, where = Path.cwd().resolve(), Path(output_dir).expanduser().resolve()
    if where == here or where in here.parents:
        fail("output_dir", f"{output_dir!r} is the working directory or a folder above it ({here}); a run needs a "
             "folder of its own (e.g. runs/<name>)")


def check_scheduler(section: str, scheduler: str) -> None:
    if scheduler not in _schedulers():
        fail(f"{section}.lr_scheduler", f"unknown scheduler {scheduler!r} (known: {list(_schedulers())})"
             + did_you_mean(scheduler, _schedulers()))


def _schedulers() -> tuple[str, ...]:
    from transformers import SchedulerType

    return tuple(s.value for s in SchedulerType)


@dataclass
class ModelSpec:
    """Where the starting model comes from: a checkpoint ``path`` (local or hub), a ``preset`` of
    ``SSEConfig`` built with random weights, or ``convert_from`` a Llama/Qwen2 checkpoint. ``path`` and
    ``convert_from`` also take a ``.gguf`` file or a known model's name (``sse-pipeline models list``)."""

    path: str | None = None
    preset: str | None = None
    convert_from: str | None = None
    config_overrides: dict = field(default_factory=dict)
    # how converted SSE layers start: "fresh" gates (as trained from scratch) or "attention_like" (decays near 1;
    # sse_model.convert.CONVERT_STARTS)
    convert_start: str = bounded("fresh", choices=("fresh", "attention_like"))
    tokenizer: str | None = None  # a path or hub name; "char" builds the offline character tokenizer
    # the weights as stored and served (the engines' default); training always upcasts to float32 master weights
    dtype: str = bounded("float32", choices=DTYPES)

    def check(self, recipe: "Recipe") -> None:
        if sum(x is not None for x in (self.path, self.preset, self.convert_from)) != 1:
            fail("model", "give exactly one of path, preset, convert_from")
        if self.preset is not None:
            from sse_model.configuration_sse import PRESETS

            if self.preset not in PRESETS:
                fail("model.preset", f"unknown preset {self.preset!r} (known: {sorted(PRESETS)})"
                     + did_you_mean(self.preset, PRESETS))

    def converts_layers(self) -> bool:
        """Whether the model is converted with some layers turned into linear mixers (what the align stage aligns);
        a conversion that keeps every layer as attention computes what its source computes."""
        from sse_model.configuration_sse import ATTENTION_MIXERS

        mixers = self.config_overrides.get("mixer_types")
        return self.convert_from is not None and (mixers is None or any(k not in ATTENTION_MIXERS for k in mixers))


@dataclass
class DataSpec:
    """A dataset: ``builtin:arithmetic`` (synthetic), a packaged benchmark/training set name, a local
    JSONL/JSON/parquet path, or a Hugging Face hub name. ``fields`` maps our names to the source's. ``mix``: more
    datasets whose rows join this one's (each with its own source, fields and sample count), e.g. synthetic
    problems beside a real training set; the trainers shuffle the union."""

    source: str = "builtin:arithmetic"
    split: str = "train"
    fields: dict = field(default_factory=dict)
    max_samples: int | None = bounded(None, ge=1)
    seed: int = bounded(0, ge=0)
    mix: list[DataSpec] = field(default_factory=list)


@dataclass
class DistillConfig:
    enabled: bool = True
    data: DataSpec = field(default_factory=DataSpec)
    epochs: float = bounded(5.0, gt=0)
    max_steps: int = bounded(-1, ge=-1)  # -1: train for ``epochs``; 0 is refused (an untrained model)
    learning_rate: float = bounded(1e-5, gt=0)
    lr_scheduler: str = "cosine"  # one of transformers' SchedulerType values (checked in validate)
    warmup_ratio: float = bounded(0.03, ge=0, le=1)
    weight_decay: float = bounded(0.0, ge=0)
    batch_size: int = bounded(8, ge=1)  # rows per optimizer step, over all workers together (the global batch)
    # rows one worker runs through one forward (a memory setting); the rest is accumulated. None: a worker's whole
    # share of the batch at once. How many workers share the batch is where the run is (pipeline/placement.py)
    micro_batch_size: int | None = bounded(None, ge=1)
    max_length: int = bounded(32768, ge=1)
    packing: bool = True
    num_workers: int | None = bounded(None, ge=1)  # data-parallel processes; None: one per GPU (1 on CPU)
    gradient_checkpointing: bool = False
    # converted models: the source Transformer's next-token distributions as a second target, weighted teacher_kl:
    # loss = (1 - teacher_kl) * CE + teacher_kl * T^2 * KL(teacher_T || student_T) (0: supervised only)
    teacher_kl: float = bounded(0.0, ge=0, le=1)
    kd_temperature: float = bounded(1.0, gt=0)
    # what trains: every weight, or (a converted model) only its SSE layers' token mixers, the rest of the
    # Transformer it came from frozen, as alignment trains (sse_model/align.py): less of the source to forget
    train: str = bounded("all", choices=("all", "sse"))
    logging_steps: int = bounded(10, ge=1)
    save_steps: int = bounded(500, ge=1)
    save_total_limit: int | None = bounded(3, ge=1)
    # held-out solutions scored with teacher forcing during training (``eval_loss`` in metrics.jsonl: the mean over
    # solutions of each one's CE per completion token), where settings are chosen: apart from training (e.g. a slice
    # of its source, ``split: train[-500:]`` beside ``train[:-500]``) and from the test sets. Every eval_steps and at
    # the end (transformers evaluates the last step too)
    eval_data: DataSpec | None = None
    eval_steps: int | None = bounded(None, ge=1)  # None: every save_steps

    def check(self, recipe: "Recipe") -> None:
        from .batching import distill_batching

        if self.eval_steps is not None and self.eval_data is None:
            fail("distill.eval_steps", "no distill.eval_data to score; give its held-out solutions, or leave it out")
        if self.max_steps == 0:
            fail("distill.max_steps", "0 would mark an untrained model done; use -1 (train for epochs) or >= 1")
        if self.teacher_kl and recipe.model.convert_from is None:
            fail("distill.teacher_kl", "the teacher is the Transformer the recipe converts: set model.convert_from, "
                 "or teacher_kl: 0")
        check_scheduler("distill", self.lr_scheduler)
        distill_batching(recipe, self.num_workers or 1)  # the GPUs a run has are checked at its start


@dataclass
class AlignConfig:
    """Attention transfer (:mod:`sse_model.align`) for a converted model (``model.convert_from``); a recipe that does
    not convert has no attention to transfer and skips the stage. Packed rows of the distillation data by default."""

    enabled: bool = True
    data: DataSpec | None = None  # default: distill.data
    train: str = bounded("all", choices=("new", "all"))  # see sse_model.align.TRAINABLE
    steps: int = bounded(300, ge=1)
    batch_size: int = bounded(8, ge=1)  # packed rows per optimizer step
    micro_batch_size: int | None = bounded(None, ge=1)  # packed rows per forward; None: the whole batch
    max_length: int = bounded(2048, ge=16)  # tokens per packed row
    learning_rate: float = bounded(1e-3, gt=0)
    lr_scheduler: str = "cosine"
    warmup_ratio: float = bounded(0.05, ge=0, le=1)
    weight_decay: float = bounded(0.0, ge=0)
    logging_steps: int = bounded(10, ge=1)
    save_steps: int = bounded(100, ge=1)
    save_total_limit: int | None = bounded(2, ge=1)

    def check(self, recipe: "Recipe") -> None:
        from .batching import align_batching

        check_scheduler("align", self.lr_scheduler)
        align_batching(recipe)


@dataclass
class EngineConfig(EngineOptions):
    """An engine of a stage: :class:`~pipeline.rollout.options.EngineOptions` (capacity and scheduling) and which
    engine, in which dtype, and whether it sleeps."""

    backend: str = bounded("sse", choices=ENGINE_BACKENDS)
    dtype: str | None = bounded(None, choices=DTYPES)  # the engine's weights; default: the model's
    residual_dtype: str | None = bounded(None, choices=DTYPES)  # float32: skip connections as in training (ours only)
    sleep: bool | None = None  # free the engine's memory between rollouts; default: when it shares the trainer's GPU

    def check(self, stage: str) -> None:
        if self.residual_dtype is not None and self.backend != "sse":
            fail(f"{stage}.engine.residual_dtype", f"is an option of this package's engine (backend: sse); "
                 f"{self.backend} runs the model its own way")
        if self.state_cache_dtype != "float32" and self.backend != "sse":
            fail(f"{stage}.engine.state_cache_dtype", f"is an option of this package's engine (backend: sse); "
                 f"{self.backend} keeps the states in float32")


@dataclass
class RewardConfig:
    accuracy: float = bounded(1.0, ge=0)
    format: float = bounded(0.0, ge=0)
    format_min_reasoning_chars: int = bounded(20, ge=0)  # non-space characters the format reward wants before the box
    overlong: float = bounded(0.0, ge=0)
    overlong_cache: int = bounded(4096, ge=0)
    strict_boxed: bool = True  # only a boxed answer earns accuracy (false: the last stated answer too, which GRPO learned to game)
    timeout: float = bounded(5.0, ge=0.1)  # seconds per answer; below it every answer timed out and scored 0
    workers: int | None = bounded(None, ge=1)


@dataclass
class GRPOStageConfig:
    enabled: bool = True
    data: DataSpec = field(default_factory=lambda: DataSpec(source="math_train"))
    # optimizer steps (TRL's global step): generation batches x mini_batches x num_iterations
    steps: int = bounded(230, ge=1)
    prompts_per_batch: int = bounded(32, ge=1)  # prompts in one generation batch (each sampled num_generations times)
    # PPO updates per generation batch: the batch is split into mini_batches optimizer steps (verl's
    # ppo_mini_batch_size), so later steps train on rollouts of an older policy and the clip acts
    mini_batches: int = bounded(1, ge=1)
    num_iterations: int = bounded(1, ge=1)  # passes over each generation batch (GRPO's mu)
    num_generations: int = bounded(8, ge=2)  # GRPO compares the generations of a prompt
    max_prompt_length: int = bounded(1024, ge=1)
    max_completion_length: int = bounded(32768, ge=1)
    temperature: float = bounded(1.0, gt=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    learning_rate: float = bounded(1e-6, gt=0)
    loss_type: str = bounded("dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    epsilon: float = bounded(0.2, gt=0)
    epsilon_high: float | None = bounded(0.28, gt=0)
    beta: float = bounded(0.0, ge=0)
    # truncated completions unscored and out of the loss (DAPO's overlong filtering); with the overlong penalty on it
    # must be false: the penalty is for the long ones, and masked, running past the limit would escape it
    mask_truncated_completions: bool = True
    # weight of the SSE partition-balance loss in GRPO's loss; None: the model's aux_loss_coef (the paper's 0.01), as
    # in distillation. Its gradient reaches every layer below the routers, and a policy gradient from few
    # informative groups is small beside it
    balance_loss_coef: float | None = bounded(None, ge=0)
    # DAPO dynamic sampling: resample until the batch holds prompts_per_batch groups whose accuracy varies
    dynamic_sampling: bool = True
    max_sampling_rounds: int = bounded(3, ge=1, le=MAX_SAMPLING_ROUNDS)  # generation rounds per batch at most
    scale_rewards: str = bounded("group", choices=("group", "batch", "none"))  # advantage = (r - mean) / std of ...
    # engine -> trainer correction per token: truncated (TIS, ratio capped) or masked (MIS, outside [1/cap, cap])
    importance_sampling: str = bounded("token_truncate", choices=("none", "token_truncate", "token_mask"))
    importance_sampling_cap: float = bounded(2.0, gt=1)
    # the PPO ratio's old policy: trainer, the trainer's log-probs of the sampled tokens (a no-grad pass over each
    # generation batch; importance_sampling then corrects for the engine); engine, the engine's own log-probs of them
    # (verl's bypass mode: no pass, and the clip bounds pi / pi_engine; needs importance_sampling: none, top_p: 1)
    old_logprobs: str = bounded("trainer", choices=("trainer", "engine"))
    # log-prob and loss passes on packed rows of real tokens, at most max_tokens_per_microbatch per forward
    # (default: the padded micro-batch's size); padding_free: false is TRL's padded pass
    padding_free: bool = True
    max_tokens_per_microbatch: int | None = bounded(None, ge=1)
    # rollouts one trainer worker runs through one forward and backward (a memory setting); the rest of an optimizer
    # step's rollouts are accumulated. None: a worker's whole share of the step at once
    micro_batch_size: int | None = bounded(None, ge=1)
    gradient_checkpointing: bool = False
    rewards: RewardConfig = field(default_factory=RewardConfig)
    # colocated: a trainer worker on every GPU, its engines beside it (sleeping while it trains); split: trainers and
    # engines on GPUs of their own; auto: colocated (pipeline/placement.py)
    placement: str = bounded("auto", choices=("auto", "colocated", "split"))
    num_workers: int | None = bounded(None, ge=1)  # data-parallel trainer processes; None: by placement and GPUs
    num_engines: int | None = bounded(None, ge=1)  # rollout engines per trainer worker; None: by placement and GPUs
    max_engine_restarts: int = bounded(3, ge=0)  # dead rollout engines replaced (requests resubmitted) per stage
    # generation batches the engines generate ahead of the trainer: 0, each batch generated by the policy it trains
    # (the trainer and the engines take turns); k, the engines generate the next k batches while the trainers train
    # on this one, with weights up to k batches old (the importance correction weighs the difference). A batch's
    # rollout takes as many decode steps as its longest sequence has tokens: batches ahead put more sequences into
    # each of those steps
    max_staleness: int = bounded(0, ge=0, le=4)
    # generating ahead: the next batches are submitted before this one is collected and the weights are pushed while
    # sequences run, which continue under them from the states and KV they hold (this package's engine)
    partial_rollouts: bool = False
    engine_resources: dict = field(default_factory=dict)  # extra Ray resources each engine asks for (its nodes)
    # trainer -> engines: through Ray's object store, broadcast over a process group (NCCL when the engines have
    # GPUs of their own, gloo on CPU; not with engines on the trainer's GPU), or cuda_ipc: engines on the
    # trainer's GPU (placement colocated, engine.backend sse) copy them from its memory, no trip through the host;
    # auto: the fastest the placement serves (stages/grpo.py::weight_sync_method)
    weight_sync: str = bounded("auto", choices=("auto", "object_store", "broadcast", "cuda_ipc"))
    engine: EngineConfig = field(default_factory=EngineConfig)
    logging_steps: int = bounded(1, ge=1)
    save_steps: int = bounded(10, ge=1)
    save_total_limit: int | None = bounded(3, ge=1)

    def check(self, recipe: "Recipe") -> None:
        from .batching import grpo_batching

        if self.prompts_per_batch % self.mini_batches:
            fail("grpo.mini_batches", f"must divide grpo.prompts_per_batch ({self.prompts_per_batch}), got "
                 f"{self.mini_batches}")
        grpo_batching(recipe, self.num_workers or 1)  # the GPUs a run has are checked at its start
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            fail("grpo.epsilon_high", f"must be >= grpo.epsilon ({self.epsilon}), got {self.epsilon_high}")
        if self.partial_rollouts and (not self.max_staleness or self.engine.backend != "sse"):
            fail("grpo.partial_rollouts", "continues sequences under new weights while it generates ahead: it needs "
                 "grpo.max_staleness >= 1 and grpo.engine.backend: sse")
        if self.max_staleness > 1 and not self.partial_rollouts:
            fail("grpo.max_staleness", f"{self.max_staleness} needs grpo.partial_rollouts: true: without it each "
                 "batch is one blocking call per engine, so a weight sync would wait behind the batches generating")
        if self.old_logprobs == "engine" and self.importance_sampling != "none":
            fail("grpo.old_logprobs", "engine divides by the engine's log-probs already; importance_sampling would "
                 "correct for the engine a second time: set grpo.importance_sampling: none")
        if self.old_logprobs == "engine" and self.top_p < 1:
            fail("grpo.old_logprobs", f"engine needs grpo.top_p: 1 (got {self.top_p}): under top-p the engine's "
                 "log-probs are of the truncated distribution, not of the policy")
        if self.max_staleness and self.dynamic_sampling:
            fail("grpo.max_staleness", "dynamic sampling's extra rounds generate inside a step, behind the batch "
                 "generated ahead; set grpo.dynamic_sampling: false")
        r = self.rewards
        if self.enabled and not (r.accuracy or r.format or r.overlong):
            fail("grpo.rewards", "every reward weight (accuracy, format, overlong) is 0: GRPO would learn nothing")
        if self.enabled and r.overlong and not 0 < r.overlong_cache <= self.max_completion_length:
            fail("grpo.rewards.overlong_cache", f"the penalty ramps over the last overlong_cache tokens of "
                 f"grpo.max_completion_length ({self.max_completion_length}): need 0 < overlong_cache <= it, got "
                 f"{r.overlong_cache}")
        if self.enabled and r.overlong and self.mask_truncated_completions:
            fail("grpo.mask_truncated_completions", "true beside grpo.rewards.overlong > 0 rewards running past "
                 "the limit: the penalty lowers a completion that ends in the last overlong_cache tokens, while one "
                 "cut at grpo.max_completion_length is unscored and out of the loss, so ending late is punished and "
                 "never ending is not (DAPO's punishment gives it -1). Set grpo.mask_truncated_completions: false "
                 "(the cut ones scored -1 and trained on), or grpo.rewards.overlong: 0")
        if self.dynamic_sampling and self.loss_type != "dapo":
            # a batch still short after max_sampling_rounds is filled with groups masked out of the loss; dapo divides
            # by the batch's real tokens, the others by rows or per micro-batch, where the filler shrinks the step
            fail("grpo.dynamic_sampling", f"needs grpo.loss_type: dapo (the loss DAPO defines it with), got "
                 f"{self.loss_type!r}: a short batch is filled with groups masked out of the loss, which "
                 f"{self.loss_type} counts in its normalisation (the step shrinks by the informative fraction); or "
                 "set grpo.dynamic_sampling: false")
        if self.weight_sync in ("cuda_ipc", "broadcast") and self.engine.backend != "sse":
            fail("grpo.weight_sync", f"{self.weight_sync} hands the weights to this package's engine "
                 "(grpo.engine.backend: sse); vLLM's engine runs its model in processes of its own: use object_store")
        self.engine.check("grpo")


@dataclass
class EvalStageConfig:
    enabled: bool = True
    benchmarks: list = field(default_factory=lambda: ["aime24", "aime25", "math500", "amc23", "olympiadbench"])
    repeats: int | None = bounded(32, ge=1)  # samples per problem; None: each benchmark's default
    temperature: float = bounded(1.0, ge=0)
    top_p: float = bounded(0.7, gt=0, le=1)
    max_new_tokens: int = bounded(32768, ge=1, le=2**20)
    max_prompt_length: int = bounded(2048, ge=1)
    long_prompts: str = bounded("skip", choices=("skip", "truncate"))  # a problem over max_prompt_length
    limit: int | None = bounded(None, ge=1)  # the first ``limit`` problems of each benchmark
    # whose models to score: "last" the model the run hands on (into eval/), and any of the training stages'
    # final models or the "initial" one before training (each into eval/<name>/), so a run reports every step
    models: list = field(default_factory=lambda: ["last"])
    num_workers: int | None = bounded(None, ge=1)  # generation workers, each a shard; None: one per GPU (1 on CPU)
    backend: str = bounded("engine", choices=("engine", "hf"))  # the rollout engine or model.generate
    engine: EngineConfig = field(default_factory=EngineConfig)


    def check(self, recipe: "Recipe") -> None:
        from eval.benchmarks import BENCHMARKS

        self.engine.check("eval")
        if not self.enabled:
            return
        known = ("last", "initial", "align", "distill", "grpo")
        if not self.models:
            fail("eval.models", "names no model to score; give at least one of "
                 f"{list(known)}, or disable the stage with eval.enabled=false")
        for name in self.models:
            if name not in known:
                fail("eval.models", f"{name!r} is not one of {list(known)}" + did_you_mean(str(name), known))
            if name in ("align", "distill", "grpo") and not getattr(recipe, name).enabled:
                fail("eval.models", f"{name!r}: the {name} stage is disabled, so it leaves no model to score")
            if name == "align" and not recipe.model.converts_layers():
                fail("eval.models", "'align': the recipe converts no layer into SSE, so there is no align stage")
            if name == "initial" and recipe.model.path is not None:
                fail("eval.models", "'initial': the recipe starts from model.path; score it as 'last' of a run whose "
                     "stages are off, or evaluate that path with --checkpoint")
        if len(set(self.models)) != len(self.models):
            fail("eval.models", f"names a model twice: {self.models}")
        if not self.benchmarks:
            fail("eval.benchmarks", "no benchmark to evaluate (disable the stage with eval.enabled=false)")
        for name in self.benchmarks:
            # a registered benchmark, a local file, or a hub dataset (owner/name)
            if not isinstance(name, str) or not (name in BENCHMARKS or Path(name).exists() or "/" in name):
                fail("eval.benchmarks", f"{name!r} is not a registered benchmark ({sorted(BENCHMARKS)}), a local file "
                     "or a hub dataset name" + did_you_mean(str(name), BENCHMARKS))

@dataclass
class RayConfig:
    address: str | None = None
    num_cpus: int | None = bounded(None, ge=1)
    num_gpus: int | None = bounded(None, ge=0)
    # joining an existing cluster: Ray's runtime_env for every worker (pip, env_vars, ...); ship_project adds
    # this checkout's packages (py_modules), so that nodes need only the dependencies installed
    runtime_env: dict = field(default_factory=dict)
    ship_project: bool = True


# the recipe sections whose values change what a stage computes (ray, device, output_dir, name do not)
STAGE_SETTINGS = {
    "align": ("model", "align", "distill.data", "seed", "prompt_instruction", "precision"),
    "distill": ("model", "distill", "seed", "prompt_instruction", "precision"),
    "grpo": ("model", "grpo", "seed", "prompt_instruction", "precision"),
    "eval": ("eval", "seed", "prompt_instruction"),
}
# settings of where and on how many processes a stage runs, of what an engine holds at once and how it schedules,
# and of which models the evaluation scores: changing them never refuses a re-run, so that a stage resumes on
# another number of workers or a GPU of another size (the same steps; GRPO's samples are seeded per worker, each
# request's draws by its own seed, pipeline/rollout/sampling.py, whatever else runs beside it), and a model added to
# eval.models or a benchmark to eval.benchmarks is evaluated beside the ones scored already (each model's generations
# in a folder of its own, each benchmark's in a file of its own)
# (the KV cache's and the states' dtypes change what the engine computes: part of the experiment, not of where it runs)
ENGINE_CAPACITY = (*(f.name for f in dataclasses.fields(EngineOptions)
                     if f.name not in ("kv_cache_dtype", "state_cache_dtype")), "sleep")
OPERATIONAL = ("grpo.max_engine_restarts", "grpo.engine_resources", "grpo.weight_sync", "grpo.placement",
               "grpo.num_workers", "grpo.num_engines", "grpo.micro_batch_size", "distill.num_workers",
               "distill.micro_batch_size", "distill.eval_data", "distill.eval_steps", "align.micro_batch_size",
               "eval.models", "eval.benchmarks", "eval.num_workers",
               *(f"{stage}.engine.{key}" for stage in ("grpo", "eval") for key in ENGINE_CAPACITY))


def _flat(data, prefix=""):
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: data}


def stage_settings(resolved: dict, stage: str) -> dict:
    """The settings of ``stage`` in a resolved recipe (:func:`recipe_to_dict`), flat (``grpo.rewards.accuracy``),
    the operational ones left out: what the stage computes, and so what it may resume from."""
    def value(key):  # a section ("model") or a key inside one ("distill.data")
        node = resolved
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    flat = _flat({k: value(k) for k in STAGE_SETTINGS[stage]})
    return {k: v for k, v in flat.items() if not any(k == o or k.startswith(o + ".") for o in OPERATIONAL)}


@dataclass
class Recipe:
    name: str = "recipe"
    output_dir: str = "runs/recipe"
    seed: int = bounded(0, ge=0)
    device: str = bounded("auto", choices=("auto", "cpu", "cuda"))
    prompt_instruction: str = INSTRUCTION  # appended to every problem, in training and evaluation
    # training: bf16 autocast over float32 master weights ("bf16-mixed"), or "fp32"; auto: bf16-mixed on CUDA
    precision: str = bounded("auto", choices=("auto", "bf16-mixed", "fp32"))
    # training meant to repeat bit for bit with one seed (transformers' ``full_determinism``: deterministic algorithms
    # only, among them flash attention's backward, which otherwise sums a query's gradient over key blocks in the
    # order the GPU finishes them); it may cost speed, so off by default. Changes no stage's result in
    # expectation: a re-run may flip it
    deterministic: bool = False
    # experiment trackers of the training stages, as transformers names them (tensorboard, wandb, mlflow, trackio...;
    # wandb offline: WANDB_MODE=offline in ray.runtime_env.env_vars or the environment)
    report_to: list = field(default_factory=lambda: ["tensorboard"])
    # how data-parallel training workers hold the model: ddp (a whole copy each, gradients all-reduced) or fsdp
    # (FSDP2 through accelerate: parameters, gradients and optimizer state sharded over the workers, gathered a
    # layer at a time); auto: fsdp where one copy's training state would not fit a GPU (pipeline/models.py)
    sharding: str = bounded("auto", choices=("auto", "ddp", "fsdp"))
    # where stages hand models on when nodes share no filesystem: a folder or a pyarrow.fs URI (s3://...)
    storage: str | None = None
    # names this run's entries in storage (default: a hash of each stage's settings): runs of one recipe with
    # other settings never share checkpoints, models or generations; a run_id shares them on purpose
    run_id: str | None = None
    model: ModelSpec = field(default_factory=ModelSpec)
    align: AlignConfig = field(default_factory=AlignConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    grpo: GRPOStageConfig = field(default_factory=GRPOStageConfig)
    eval: EvalStageConfig = field(default_factory=EvalStageConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def stored_at(self, stage: str, *parts: str) -> str | None:
        """The storage URI of ``parts`` of ``stage`` (None without ``storage``): ``<name>/<stage>@<key>/...``, the key
        ``run_id`` or a hash of the stage's settings. Runs of other settings sharing a storage location never take
        each other's checkpoints, models or generations; the same run on another node finds them."""
        if self.storage is None:
            return None
        from .storage import storage_uri

        key = self.run_id or hashlib.sha1(json.dumps(stage_settings(recipe_to_dict(self), stage), sort_keys=True,
                                                     default=str).encode()).hexdigest()[:12]
        return storage_uri(self.storage, self.name, f"{stage}@{key}", *parts)

    def validate(self, where: str = "recipe") -> None:
        """Each section checks itself (:meth:`check`, given the whole recipe where a check reads another section);
        an error names ``where`` (the file and overrides), the key and what would work."""
        try:
            check_output_dir(self.output_dir)
            from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

            for tracker in self.report_to:
                if tracker not in INTEGRATION_TO_CALLBACK and tracker != "none":
                    fail("report_to", f"{tracker!r} is not one of {sorted(INTEGRATION_TO_CALLBACK)}"
                         + did_you_mean(str(tracker), INTEGRATION_TO_CALLBACK))
            if self.storage is not None and not self.storage.strip():
                fail("storage", "empty (it would store models under the working directory); give a folder or a "
                     "pyarrow.fs URI, or leave it out")
            if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", self.run_id):
                fail("run_id", f"letters, digits, '.', '_' and '-' only (it names a folder in storage), got "
                     f"{self.run_id!r}")
            for section in (self.model, self.align, self.distill, self.grpo, self.eval):
                section.check(self)
        except RecipeError as error:
            raise RecipeError(f"{where}: {error}") from None


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
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, float) and not math.isfinite(value):  # .inf epochs, timeouts: late crashes
        raise RecipeError(f"{where}: {key}: must be a finite number, got {value}")
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise RecipeError(f"{where}: {key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return value
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where}: {key}: expected a list, got {type(value).__name__}")
        item = (typing.get_args(tp) or (None,))[0]
        if dataclasses.is_dataclass(item):
            return [_convert(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: {key}: expected a mapping, got {type(value).__name__}")
        return value
    return value


# keys a recipe does not take (no longer, or named otherwise than TRL names them), and what to write instead
REMOVED = {"max_steps": "the GRPO section counts optimizer steps in `steps` (TRL's max_steps)",
           "num_train_epochs": "distillation counts them in `epochs`",
           "per_device_train_batch_size": "a section's `micro_batch_size` (rows one worker runs through a forward; "
                                          "`batch_size` is the whole optimizer step's)",
           "report_to": "the recipe's top-level `report_to`",
           "gradient_accumulation_steps": "the accumulation follows from batch_size (rows per optimizer step, all "
                                         "workers together), micro_batch_size (rows per forward on one worker) and "
                                         "the workers the run has (pipeline/placement.py)"}


def build(cls, data: dict, where: str, prefix: str = ""):
    """``cls(**data)`` with every key and type checked."""
    if cls is DataSpec and "source" not in data:  # e.g. align.data.mix=[...] where align.data is unset
        raise RecipeError(f"{where}: {prefix}: a dataset without its source (keys given: {', '.join(map(str, data))}); "
                          f"an override of one of its keys where the recipe sets none makes a new one: give it whole, "
                          f"{prefix}={{source: ..., mix: [...]}}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names and key in REMOVED and not (key == "max_steps" and prefix != "grpo"):
            raise RecipeError(f"{where}: {path}: not a recipe key: {REMOVED[key]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(names)})"
            raise RecipeError(f"{where}: {path}: unknown key{hint}")
        kwargs[key] = _convert(value, hints[key], path, where)
    instance = cls(**kwargs)
    for f in dataclasses.fields(cls):  # defaults and given values alike
        _check_rules(getattr(instance, f.name), f.metadata.get("rules", {}), f"{prefix}.{f.name}" if prefix else f.name,
                     where)
    return instance


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
        if path.is_dir():
            if not (path / "recipe.yaml").exists():
                raise RecipeError(f"{path}: a folder without recipe.yaml (give the recipe file, or a folder holding "
                                  "recipe.yaml)")
            return path / "recipe.yaml"
        return path
    for candidate in (RECIPES_DIR / f"{name}.yaml", RECIPES_DIR / name / "recipe.yaml"):
        if candidate.exists():
            return candidate
    available = sorted(p.stem if p.suffix else p.name for p in RECIPES_DIR.iterdir() if p.name != "__init__.py"
                       and not p.name.startswith("_"))
    raise RecipeError(f"recipe {name!r} not found (not a file; built-in recipes: {available})"
                      + did_you_mean(name, available))


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
