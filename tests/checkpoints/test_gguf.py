"""`finetune export --gguf`: the GGUF file read back by Transformers' own GGUF reader gives the same tokens, chat
template and logits (Qwen2 with an untied head, Llama with a tied one and its q/k permutation, Mistral, Qwen3, q8_0);
the demo tokenizer, adapters not merged, other architectures and mistaken flags are refused by name."""

import json

import pytest
import torch
from hub_fixtures import build_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune import presets
from finetune.cli import main
from finetune.models.gguf import write_gguf
from finetune.models.loading import load_tokenizer
from finetune.recipe.args import ModelArguments

# Against the original's weights rounded as the file rounds them (f16, or Q8_0 and back), the read-back logits differ
# by float32 summation order only (measured 0.0 for every model here): any tensor misplaced, unpermuted or mis-typed
# shows far above this (a missing q/k permutation moves the tiny Llama's logits by 0.025).
ROUNDED_ATOL = 1e-4
# Against the unrounded original, Q8_0's own error: each block of 32 weights becomes int8 steps of (block's largest
# |w|) / 127, moving a weight by up to 0.4% of its block's largest magnitude; over these few layers the logits move by
# about 1% of their largest magnitude (measured 1.1% for Qwen2, 0.9% for Llama); 3% leaves room for other seeds.
Q8_0_RELATIVE_ATOL = 0.03

CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What's the weather in Paris? Réponds en français, s'il te plaît."},
                {"role": "assistant", "content": "Il fait beau à Paris : 21 °C ☀️."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}]
TEXTS = ["Hello, world! It's 2024 and the answer is 42.", "  leading spaces\n\n\tnew lines and tabs  ",
         "naïve café — 東京の天気 🙂 Ünïcödé ñ", '{"name": "get_weather", "arguments": {"city": "Paris"}}']


def rendered(tokenizer) -> list[str]:
    """The texts, and conversations as the chat template renders them (with tools where the template takes them)."""
    conversations = [tokenizer.apply_chat_template(CONVERSATION, tokenize=False),
                     tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)]
    if "tools" in (tokenizer.chat_template or ""):
        conversations.append(tokenizer.apply_chat_template(CONVERSATION[1:2], tools=TOOLS, tokenize=False))
    return TEXTS + conversations


def logits(model, input_ids) -> torch.Tensor:
    """In float32: a model read from GGUF is loaded so, the others are cast by the callers."""
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor([input_ids])).logits


def as_stored(model, gguf_type: str = "f16"):
    """The model with its weights rounded as the GGUF file stores them (matrices in f16, or Q8_0 and back where rows
    split into blocks of 32; 1-D tensors as they are), computing in float32. Parameters only: a buffer such as the
    rotary frequencies is computed in float32 by the model read back too."""
    from gguf import GGMLQuantizationType, quants

    for parameter in model.parameters():
        weight = parameter.data.float()
        if weight.ndim == 2 and gguf_type == "q8_0" and weight.shape[-1] % 32 == 0:
            packed = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
            weight = torch.from_numpy(quants.dequantize(packed, GGMLQuantizationType.Q8_0))
        elif weight.ndim == 2:
            weight = weight.to(torch.float16).float()
        parameter.data = weight
    return model


def assert_rounding_only(read, original, input_ids, gguf_type: str):
    """`read`'s logits are `original`'s with its weights rounded as the file stores them; for Q8_0, also within
    the quantization's error of the unrounded original, and not equal to it (the weights were quantized)."""
    unrounded = logits(original.float(), input_ids)
    expected = logits(as_stored(original, gguf_type), input_ids)
    torch.testing.assert_close(logits(read, input_ids), expected, atol=ROUNDED_ATOL, rtol=0)
    if gguf_type == "q8_0":
        difference = (logits(read, input_ids) - unrounded).abs().max().item()
        assert 1e-3 < difference < Q8_0_RELATIVE_ATOL * unrounded.abs().max().item()


def read_back(out_dir, gguf_file):
    model = AutoModelForCausalLM.from_pretrained(out_dir, gguf_file=gguf_file, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(out_dir, gguf_file=gguf_file)


def assert_same_tokenizer(read, original):
    texts = rendered(original)
    assert len(texts) >= 6
    for text in texts:
        ids = original(text)["input_ids"]
        assert read(text)["input_ids"] == ids, text
        assert read.decode(ids) == original.decode(ids)
    assert read.chat_template == original.chat_template
    assert rendered(read) == texts
    assert (read.eos_token_id, read.pad_token_id, read.bos_token_id) == (
        original.eos_token_id, original.pad_token_id, original.bos_token_id)


def tensor_types(path) -> dict[str, str]:
    from gguf import GGUFReader

    return {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(path).tensors}


def saved_llama(directory, tokenizer, dtype=torch.float32, **sizes):
    """A tiny Llama shaped as the demo model (tied head), with grouped-query attention, for `tokenizer`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **{**presets.TINY_MODEL_CONFIG, "num_key_value_heads": 2, **sizes})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(dtype).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def qwen2_exports(hub_model_dir, tmp_path_factory):
    """The bf16 hub-like Qwen2 checkpoint exported through the CLI as f16 and as q8_0."""
    out = tmp_path_factory.mktemp("gguf_qwen2")
    for gguf_type in ("f16", "q8_0"):
        assert main(["export", str(hub_model_dir), str(out / gguf_type), "--gguf", "--gguf-type", gguf_type]) == 0
    return out


def test_qwen2_f16_reads_back_with_the_same_tokens_template_and_logits(hub_model_dir, qwen2_exports):
    out_dir = qwen2_exports / "f16"
    assert sorted(path.name for path in out_dir.iterdir()) == ["f16-f16.gguf", "finetune_export.json"]
    record = json.loads((out_dir / "finetune_export.json").read_text())
    assert (record["format"], record["dtype"], record["files"]) == ("gguf", "f16", ["f16-f16.gguf"])
    types = tensor_types(out_dir / "f16-f16.gguf")
    assert types["output.weight"] == types["blk.0.attn_q.weight"] == "F16"  # the untied head is written
    assert types["blk.0.attn_q.bias"] == types["output_norm.weight"] == "F32"
    model, tokenizer = read_back(out_dir, "f16-f16.gguf")
    original = load_tokenizer(ModelArguments(model_name_or_path=str(hub_model_dir)))
    assert_same_tokenizer(tokenizer, original)
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.config.tie_word_embeddings
    exported = AutoModelForCausalLM.from_pretrained(hub_model_dir)
    assert exported.dtype == torch.bfloat16  # what the GGUF was converted from
    input_ids = original.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert_rounding_only(model, exported, input_ids, "f16")


def test_qwen2_q8_0_logits_within_quantization_error(hub_model_dir, qwen2_exports):
    path = qwen2_exports / "q8_0" / "q8_0-q8_0.gguf"
    types = tensor_types(path)
    assert {types[name] for name in ("token_embd.weight", "output.weight", "blk.1.ffn_down.weight")} == {"Q8_0"}
    assert types["blk.1.attn_norm.weight"] == "F32"
    assert path.stat().st_size < 0.7 * (qwen2_exports / "f16" / "f16-f16.gguf").stat().st_size
    model, tokenizer = read_back(path.parent, path.name)
    input_ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert_rounding_only(model, AutoModelForCausalLM.from_pretrained(hub_model_dir), input_ids, "q8_0")


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_llama_with_a_bpe_tokenizer_round_trips_tied_and_permuted(tmp_path, gguf_type):
    """The demo model's architecture (tied head) with a real BPE tokenizer (Llama-3 style, BOS in the template):
    q and k are permuted into llama.cpp's rotary order, and Transformers' reader undoes it."""
    source = saved_llama(tmp_path / "llama", build_tokenizer("llama3"))
    assert main(["export", str(source), str(tmp_path / "out"), "--gguf", "--gguf-type", gguf_type]) == 0
    path = tmp_path / "out" / f"out-{gguf_type}.gguf"
    assert "output.weight" not in tensor_types(path)  # tied: llama.cpp reads the embedding as the head
    model, tokenizer = read_back(path.parent, path.name)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    original = load_tokenizer(ModelArguments(model_name_or_path=str(source)))
    assert_same_tokenizer(tokenizer, original)
    exported = AutoModelForCausalLM.from_pretrained(source)
    input_ids = original.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert_rounding_only(model, exported, input_ids, gguf_type)


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Qwen3ForCausalLM"])
def test_mistral_and_qwen3_take_the_same_path(tmp_path, architecture):
    """Mistral is written as llama (its q/k permuted), Qwen3 as qwen3 with its q/k norms; head_dim 128 is the one
    Transformers' qwen3 reader assumes (it reads no key length)."""
    import transformers

    tokenizer = build_tokenizer("chatml")
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                          **({"head_dim": 128} if architecture == "Qwen3ForCausalLM" else {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, architecture)(config)
    for parameter in model.parameters():  # bf16 weights, as a checkpoint holds them (rotary buffers stay float32)
        parameter.data = parameter.data.to(torch.bfloat16)
    path = write_gguf(model, tokenizer, tmp_path / "model.gguf")
    if architecture == "Qwen3ForCausalLM":
        assert tensor_types(path)["blk.0.attn_k_norm.weight"] == "F32"
    read, _ = read_back(tmp_path, path.name)
    input_ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert_rounding_only(read, model, input_ids, "f16")


def in_memory_gguf(model, tokenizer, path, gguf_type: str, name: str) -> None:
    """The same file through gguf's own in-memory path: every encoded tensor added (`add_tensor` keeps it), then
    `write_tensors_to_file`."""
    import gguf

    from finetune.models import gguf as ours

    layout, tokenizer_json = ours.check_convertible(model, tokenizer, gguf_type)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, layout.arch)])
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if gguf_type == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
    ours.write_hyperparameters(writer, model.config, name, file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    ours.write_tokenizer(writer, tokenizer, tokenizer_json, model.config.vocab_size)
    with torch.no_grad():
        for tensor_name, shape, weight in ours.gguf_tensors(model, layout):
            ggml_type = ours.ggml_type_of(shape, gguf_type)
            writer.add_tensor(tensor_name, ours.encoded(weight(), ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def peak_rss_growth(write) -> int:
    """Bytes the process's resident memory grew by at most while `write()` ran (sampled every 2 ms). glibc's mmap
    threshold is fixed at 128 KiB meanwhile, so that a freed array goes back to the system rather than staying in the
    heap (its default threshold grows to 32 MiB as large blocks are freed); then set to that 32 MiB."""
    import ctypes
    import threading
    import time

    import psutil

    libc, M_MMAP_THRESHOLD = ctypes.CDLL("libc.so.6"), -3
    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    before = process.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        write()
    finally:
        done.set()
        sampler.join()
        libc.mallopt(M_MMAP_THRESHOLD, 32 * 1024**2)
    return peak[0] - before


def test_the_file_is_streamed_one_tensor_at_a_time_and_is_what_ggufs_own_writer_writes(tmp_path):
    """At 1024 wide (4 layers, 4096 intermediate: 64M weights, 128 MB of f16 data) the export's resident memory grows
    by a few tensors, not by the encoded model as gguf's in-memory path does (at 70B: 141 GB more); the two files are
    the same bytes, f16 and q8_0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer("llama3")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    f16_bytes = 2 * sum(weight.numel() for weight in model.parameters() if weight.ndim > 1)
    streamed, whole = tmp_path / "streamed.gguf", tmp_path / "whole.gguf"
    streamed_growth = peak_rss_growth(lambda: write_gguf(model, tokenizer, streamed, name="m"))
    whole_growth = peak_rss_growth(lambda: in_memory_gguf(model, tokenizer, whole, "f16", name="m"))
    assert whole_growth > 0.9 * f16_bytes, (whole_growth, f16_bytes)  # the measurement sees the held data
    assert streamed_growth < 0.2 * f16_bytes, (streamed_growth, f16_bytes)  # largest tensor: 8 MB of f16
    assert streamed.read_bytes() == whole.read_bytes()
    # q8_0, where ffn_down's rows of 200 do not split into blocks of 32 and fall back to f16
    small = saved_llama(tmp_path / "llama", build_tokenizer("llama3"), intermediate_size=200)
    model = AutoModelForCausalLM.from_pretrained(small)
    tokenizer = AutoTokenizer.from_pretrained(small)
    write_gguf(model, tokenizer, streamed, gguf_type="q8_0", name="m")
    in_memory_gguf(model, tokenizer, whole, "q8_0", name="m")
    assert streamed.read_bytes() == whole.read_bytes()
    types = tensor_types(streamed)
    assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"


def test_the_demo_tokenizer_is_refused_with_its_reason(tmp_path, capsys):
    tokenizer = presets.build_tokenizer()
    presets.build_model(tokenizer, seed=0).save_pretrained(tmp_path / "demo")
    tokenizer.save_pretrained(tmp_path / "demo")
    assert main(["export", str(tmp_path / "demo"), str(tmp_path / "out"), "--gguf"]) == 2
    error = capsys.readouterr().err
    assert "byte-level BPE with no merges" in error and "llama.cpp needs the merges list" in error
    assert not (tmp_path / "out").exists()  # refused before the destination was touched


def test_a_lora_adapter_needs_merge_lora(hub_model_dir, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(hub_model_dir)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        adapted = get_peft_model(base, config)
    adapted.save_pretrained(tmp_path / "adapter")
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--gguf"]) == 2
    assert "is a LoRA adapter, and a GGUF file holds whole weights: pass --merge-lora" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--gguf", "--merge-lora"]) == 0
    model, tokenizer = read_back(tmp_path / "out", "out-f16.gguf")
    input_ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert_rounding_only(model, adapted.merge_and_unload(), input_ids, "f16")


@pytest.mark.parametrize("architecture, reason", [
    ("GPT2LMHeadModel", "GPT2LMHeadModel is not an architecture this export writes"),
    ("Qwen2ForSequenceClassification", "(Qwen2ForSequenceClassification, a reward model or classifier): it scores"),
])
def test_other_architectures_are_refused(tmp_path, capsys, architecture, reason):
    import transformers

    tokenizer = build_tokenizer("chatml")
    if architecture == "GPT2LMHeadModel":
        config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)
    else:
        config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                          num_labels=1, pad_token_id=tokenizer.pad_token_id)
    getattr(transformers, architecture)(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    assert main(["export", str(tmp_path / "model"), str(tmp_path / "out"), "--gguf"]) == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_destination_rules_hold_and_gguf_types_sit_side_by_side(hub_model_dir, tmp_path, capsys):
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    assert main(["export", str(hub_model_dir), str(users), "--gguf"]) == 2
    assert "is not empty and holds no earlier export" in capsys.readouterr().err
    assert [path.name for path in users.iterdir()] == ["notes.txt"]
    out = tmp_path / "out"
    assert main(["export", str(hub_model_dir), str(out), "--gguf"]) == 0
    assert capsys.readouterr().out.strip() == f"exported {hub_model_dir} to {out / 'out-f16.gguf'}"
    assert main(["export", str(hub_model_dir), str(out), "--gguf", "--gguf-type", "q8_0"]) == 0
    assert "replacing" not in capsys.readouterr().out
    assert sorted(path.name for path in out.iterdir()) == ["finetune_export.json", "out-f16.gguf", "out-q8_0.gguf"]
    assert json.loads((out / "finetune_export.json").read_text())["files"] == ["out-f16.gguf", "out-q8_0.gguf"]
    assert tensor_types(out / "out-f16.gguf")["blk.0.attn_q.weight"] == "F16"  # the first export, whole
    assert main(["export", str(hub_model_dir), str(out), "--gguf"]) == 0  # the same type again: named
    assert capsys.readouterr().out.strip().endswith("(replacing the earlier out-f16.gguf)")
    assert sorted(path.name for path in out.iterdir()) == ["finetune_export.json", "out-f16.gguf", "out-q8_0.gguf"]
    assert main(["export", str(hub_model_dir), str(out)]) == 0  # a safetensors export replaces them: named too
    assert capsys.readouterr().out.strip() == (f"exported {hub_model_dir} to {out} (replacing the earlier "
                                               "out-f16.gguf, out-q8_0.gguf)")
    assert not list(out.glob("*.gguf"))
    assert main(["export", str(hub_model_dir), str(hub_model_dir / "inside"), "--gguf"]) == 2
    assert "is inside the source" in capsys.readouterr().err


def test_a_full_disk_is_one_line_and_leaves_nothing_partial(hub_model_dir, tmp_path, capsys, monkeypatch):
    """numpy's short write (GGUF's tensors; an OSError without errno) mid-file, and too little space seen before."""
    import gguf

    from finetune.checkpoints import disk

    def short_write(writer, tensor):
        writer.fout[0].write(b"x" * 2000)
        raise OSError("4096 requested and 2000 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", short_write)
    out = tmp_path / "out"
    assert main(["export", str(hub_model_dir), str(out), "--gguf"]) == 2
    output = capsys.readouterr().err
    error = output.strip().splitlines()[-1]  # after the progress of loading the weights
    assert "Traceback" not in output and error.startswith(f"finetune: error: no space left on {out}: ")
    assert "the f16 GGUF file needs ~" in error and "nothing partial was left there" in error
    assert not out.exists()  # the folder it made, and the half-written file in it, are gone
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 1000)
    assert main(["export", str(hub_model_dir), str(out), "--gguf", "--gguf-type", "q8_0"]) == 2
    assert "1000 bytes free, the q8_0 GGUF file needs ~" in capsys.readouterr().err
    assert not out.exists()


def test_gguf_help_and_flag_mistakes(hub_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--help"])
    help_text = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--gguf" in help_text and "--gguf-type" in help_text
    for flags, message in ((["--gguf-type", "q8_0"], "--gguf-type q8_0 is the type of a GGUF export: add --gguf"),
                           (["--gguf", "--gguf-type", "q4_0"], "--gguf-type q4_0 is not one of f16, q8_0"),
                           (["--gguf", "--dtype", "bf16"], "--dtype bf16 casts a safetensors export")):
        assert main(["export", str(hub_model_dir), str(tmp_path / "out"), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
