"""Loading the model and tokenizer a stage starts from."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from .known_models import resolve
from .recipe import ModelSpec
from .tokenizer import build_char_tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("recipe asks for device=cuda but no CUDA device is available")
    return torch.device(name)


def local_model(name_or_path: str | Path) -> str:
    """Where a model a recipe names loads from: a known model's cached file (:func:`resolve`), and a GGUF file as
    the transformers folder unpacked from it (:func:`unpacked`); anything else unchanged."""
    source = resolve(str(name_or_path))
    return str(unpacked(Path(source))) if source.endswith(".gguf") else source


# a GGUF file's special tokens (llama.cpp's metadata keys) by the tokenizer attribute each one sets
GGUF_SPECIAL_TOKENS = {"eos_token": "tokenizer.ggml.eos_token_id", "bos_token": "tokenizer.ggml.bos_token_id",
                       "pad_token": "tokenizer.ggml.padding_token_id"}
UNPACKED_FORMAT = 2  # part of an unpacked folder's name: 2 = special tokens as the GGUF file says


def gguf_special_tokens(gguf_file: Path) -> dict[str, int]:
    """``{"eos_token": id, ...}`` as the GGUF file's metadata gives them (those it gives)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_file)).fields
    found = {}
    for name, key in GGUF_SPECIAL_TOKENS.items():
        if key in fields and fields[key].data:
            field = fields[key]
            found[name] = int(field.parts[field.data[0]][0])
    return found


def repair_special_tokens(tokenizer, gguf_file: Path) -> dict[str, tuple[str | None, str]]:
    """Sets the tokenizer's end, start and padding tokens to the GGUF file's where they differ; returns what
    changed (``{name: (was, now)}``). transformers 5.17 reads SmolLM2-135M-Instruct's GGUF with ``<|im_start|>`` as its
    end of sequence (the file says ``<|im_end|>``; 5.24 reads it right): every model trained from it then stopped
    generating only at the start of a next turn, not at the end of its own."""
    changed = {}
    for name, token_id in gguf_special_tokens(gguf_file).items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is not None and getattr(tokenizer, name) != token:
            changed[name] = (getattr(tokenizer, name), token)
            setattr(tokenizer, name, token)
    return changed


def unpacked(gguf_file: Path) -> Path:
    """A GGUF file as a transformers folder (float32 safetensors, config, tokenizer), written once into the cache.
    transformers parses and dequantises a GGUF at every load, and a run loads its source several times
    (conversion, teacher, tokenizers, the evaluation's initial model: three parses, ~30 s, in SmolLM2-135M's run
    on the GPU machine); a folder of safetensors loads without either. Its special tokens are the file's
    (:func:`repair_special_tokens`). Named by the file's path, size and modification time (and
    :data:`UNPACKED_FORMAT`), so a replaced file is unpacked again; written under a temporary name and renamed, so a
    reader never sees half of it."""
    import hashlib
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sse_model.checkpoint import load_pretrained

    from .storage import cache_home

    stat = gguf_file.stat()
    key = hashlib.sha1(f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{UNPACKED_FORMAT}".encode()
                       ).hexdigest()[:16]
    folder = cache_home() / "unpacked" / f"{gguf_file.stem}-{key}"
    from .checkpoints import COMPLETE, broken_file

    if (folder / "config.json").exists():
        damaged = broken_file(folder) if (folder / COMPLETE).exists() else f"{folder / COMPLETE} (missing)"
        if damaged is None:
            return folder
        logger.warning("%s: the unpacked copy of %s is damaged (%s); unpacking it again", folder, gguf_file.name,
                       damaged)
        shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        # transformers marks a model read from GGUF as quantised and will not save it: the same weights, dequantised,
        # go into a plain model of its config (a weight still in GGUF blocks would not load into it: loud, not wrong)
        source = load_pretrained(gguf_file, torch.float32)
        if hasattr(source.config, "quantization_config"):
            del source.config.quantization_config
        plain = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32)
        plain.load_state_dict(source.state_dict())
        plain.save_pretrained(partial)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        for name, (was, now) in repair_special_tokens(tokenizer, gguf_file).items():
            logger.warning("%s: the tokenizer read %s %r where the file says %r; using the file's", gguf_file.name,
                           name, was, now)
        tokenizer.save_pretrained(partial)
        sizes = {str(f.relative_to(partial)): f.stat().st_size for f in partial.rglob("*") if f.is_file()}
        (partial / COMPLETE).write_text(json.dumps(sizes))  # last: a copy cut short or damaged later is unpacked again
        os.replace(partial, folder)
    except OSError:
        if not (folder / "config.json").exists():  # not a concurrent unpacking that finished first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def load_tokenizer(name: str | None, fallback: str | Path | None = None):
    from transformers import AutoTokenizer

    if name == "char":
        return build_char_tokenizer()
    source = name or fallback
    if source is None:
        raise ValueError("model.tokenizer is needed to build a model from a preset (a path, hub name, or 'char')")
    try:
        tokenizer = AutoTokenizer.from_pretrained(local_model(source))
    except (OSError, ValueError) as error:  # transformers' own message runs to a page
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{source}: no tokenizer could be read there ({first}); give model.tokenizer, or copy the "
                         "tokenizer files (tokenizer.json, tokenizer_config.json) beside the model") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(spec: ModelSpec, checkpoint: str | Path | None = None, seed: int = 0,
               dtype: torch.dtype | None = None):
    """``(model, tokenizer)``: from ``checkpoint`` (a previous stage) if given, else from ``spec``; weights in
    ``dtype`` (default ``model.dtype``). Training passes float32: see :func:`training_dtype`."""
    from sse_model import SSEConfig, SSEForCausalLM
    from sse_model.checkpoint import load_pretrained
    from sse_model.convert import convert_to_sse

    dtype = dtype or DTYPES[spec.dtype]
    path = checkpoint or (local_model(spec.path) if spec.path else None)
    if path is not None:
        return load_pretrained(path, dtype), load_tokenizer(spec.tokenizer if checkpoint is None else None, path)
    if spec.convert_from is not None:
        source = local_model(spec.convert_from)
        torch.manual_seed(seed)
        model = convert_to_sse(load_pretrained(source, dtype), start=spec.convert_start, **spec.config_overrides)
        return model, load_tokenizer(spec.tokenizer, source)
    tokenizer = load_tokenizer(spec.tokenizer)
    config = SSEConfig.from_preset(spec.preset, **{
        "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **spec.config_overrides})
    torch.manual_seed(seed)
    return SSEForCausalLM(config).to(dtype), tokenizer


def load_teacher(spec: ModelSpec, dtype: torch.dtype = torch.float32):
    """The Transformer a converted model came from (``model.convert_from``), frozen, as an all-attention model of
    this package: it computes what the source computes and reads packed batches as the student does. The teacher
    of alignment and of logit distillation."""
    from sse_model.checkpoint import load_pretrained
    from sse_model.convert import convert_to_sse

    if spec.convert_from is None:
        raise ValueError("a teacher is the Transformer a recipe converts: set model.convert_from")
    source = load_pretrained(local_model(spec.convert_from), dtype)
    teacher = convert_to_sse(source, mixer_types=["attn"] * source.config.num_hidden_layers)
    return teacher.eval().requires_grad_(False)


def in_ray_worker() -> bool:
    """Inside a Ray task or actor, where terminal progress bars print a new line per refresh: the stages then
    turn the trainer's bars off and log a progress line with rate and ETA instead."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


# Training keeps float32 master weights and float32 optimizer state in every recipe: bf16 weights round away
# most updates at the learning rates of fine-tuning (at lr 1e-6 about 2% of them change per step). ``precision``
# chooses whether the forward and backward run under bf16 autocast; the rollout engines keep their own dtype.
TRAINING_DTYPE = torch.float32


def autocast_bf16(recipe, device: torch.device) -> bool:
    """TRL's ``bf16`` flag (bf16 autocast over float32 weights) for ``recipe.precision`` on ``device``:
    ``auto`` is ``bf16-mixed`` on CUDA and ``fp32`` elsewhere."""
    if recipe.precision == "auto":
        return device.type == "cuda"
    return recipe.precision == "bf16-mixed"


def precision_name(recipe, device: torch.device) -> str:
    return ("bf16-mixed" if autocast_bf16(recipe, device) else "fp32") + " (float32 master weights and optimizer)"


def training_device(recipe) -> torch.device:
    """This process's training device: on CUDA the GPU its ``LOCAL_RANK`` picks (a data-parallel worker sees every
    training GPU of its node, :mod:`pipeline.distributed`), made current, so that nothing of it lands on GPU 0."""
    device = resolve_device(recipe.device)
    if device.type != "cuda":
        return device
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


# FSDP's share of a GPU: training state above this fraction of one GPU's memory leaves too little for a long row's
# activations under DDP
FSDP_STATE_FRACTION = 0.4


def training_state_bytes(model) -> int:
    """What training keeps of a whole model: float32 weights, gradients and two AdamW moments, 16 bytes a trainable
    parameter."""
    return 16 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def uses_fsdp(recipe, model, device: torch.device, workers: int) -> bool:
    """Whether training shards the model over its ``workers`` (``recipe.sharding``; auto: FSDP where a whole copy's
    training state would take more than :data:`FSDP_STATE_FRACTION` of the GPU). Every worker decides alike."""
    if recipe.sharding == "ddp" or workers < 2 or device.type != "cuda":
        if recipe.sharding == "fsdp" and (workers < 2 or device.type != "cuda"):
            logger.warning("sharding: fsdp needs two or more GPU workers (accelerate shards on GPUs only); this stage "
                           "has %d on %s, so each holds the whole model", workers, device.type)
        return False
    if recipe.sharding == "fsdp":
        return True
    return training_state_bytes(model) > FSDP_STATE_FRACTION * torch.cuda.get_device_properties(device).total_memory


# recipe keys that TRL's configs name otherwise (a readable recipe; TRL's names inside)
TRL_NAMES = {"steps": "max_steps", "epochs": "num_train_epochs", "lr_scheduler": "lr_scheduler_type",
             "warmup_ratio": "warmup_steps"}  # a float warmup_steps below 1 is a fraction of the steps


def trainer_options(recipe, stage_config, config_cls, out_dir, device: torch.device, batch, fsdp: bool = False) -> dict:
    """The keyword arguments of a stage's TRL config (``config_cls``: ``SFTConfig``, ``GRPOConfig``...): every setting
    of the recipe's section that the config takes, by TRL's name (:data:`TRL_NAMES`), plus what the stages share:
    where checkpoints and TensorBoard logs go, the micro-batch and accumulation of this process (``batch``,
    :class:`pipeline.batching.Batching`), precision, seeds and determinism, data parallelism (DDP, or FSDP2 with
    ``fsdp``)."""
    import dataclasses

    # transformers' TensorBoard callback reads its folder from the environment (``logging_dir`` is deprecated)
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out_dir / "tensorboard")
    takes = {f.name for f in dataclasses.fields(config_cls)}
    options = {TRL_NAMES.get(f.name, f.name): getattr(stage_config, f.name) for f in dataclasses.fields(stage_config)
               if TRL_NAMES.get(f.name, f.name) in takes}
    # alignment has none: its student runs only the SSE layers, on the teacher's inputs
    checkpointing = getattr(stage_config, "gradient_checkpointing", False)
    options.update(
        output_dir=str(out_dir / "checkpoints"),
        per_device_train_batch_size=batch.micro,
        gradient_accumulation_steps=batch.accumulation,
        gradient_checkpointing=checkpointing and not fsdp,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=autocast_bf16(recipe, device),
        use_cpu=device.type == "cpu",
        report_to=list(recipe.report_to),
        seed=recipe.seed,
        data_seed=recipe.seed,
        full_determinism=recipe.deterministic,
        dataloader_num_workers=0,
        disable_tqdm=in_ray_worker(),
        ddp_find_unused_parameters=False,  # every parameter takes part in every forward: no extra graph traversal
    )
    if fsdp:  # FSDP2 through accelerate: a unit per block; checkpointing as FSDP's own wrapper (not transformers')
        from sse_model import SSEForCausalLM

        options.update(fsdp=True, fsdp_config={
            "version": 2, "reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": list(SSEForCausalLM._no_split_modules),
            # checkpoints as DCP shards, which load on any number of workers
            "state_dict_type": "SHARDED_STATE_DICT", "activation_checkpointing": checkpointing})
    return options


def fsdp_precision(args) -> None:
    """Under FSDP2 with bf16: bf16 parameters for the forward (gathered in bf16) but gradients reduced in float32
    over the float32 sharded masters, as verl does (accelerate's default reduces in bf16)."""
    if getattr(args, "fsdp_plugin_args", None) and args.bf16:
        args.fsdp_plugin_args["mixed_precision_policy"] = {
            "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.bfloat16}


def engine_options(recipe, engine_config, max_model_len: int) -> dict:
    """The rollout engine's construction options for a stage (GRPO's fleet, evaluation's engine): one place,
    so that both stages serve a recipe's model the same way."""
    budget = engine_config.memory_budget_gb
    return dict(backend=engine_config.backend, max_slots=engine_config.max_slots,
                memory_budget=int(budget * 1024**3) if budget else None, max_model_len=max_model_len,
                prefill_chunk_size=engine_config.prefill_chunk_size, block_size=engine_config.block_size,
                use_cuda_graphs=engine_config.use_cuda_graphs, overlap=engine_config.overlap,
                refill_fraction=engine_config.refill_fraction, kv_cache_dtype=engine_config.kv_cache_dtype,
                state_cache_dtype=engine_config.state_cache_dtype,
                dtype=DTYPES[engine_config.dtype or recipe.model.dtype],
                residual_dtype=DTYPES.get(engine_config.residual_dtype), seed=recipe.seed)
