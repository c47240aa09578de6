import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from finetune import presets


def test_tokenizer_round_trips_any_text_and_keeps_special_tokens_whole():
    tokenizer = presets.build_tokenizer()
    text = "Grüße, 3+4=7 ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert tokenizer.decode(ids) == text
    for token in presets.SPECIAL_TOKENS:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|end|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_chat_template_renders_turns_and_generation_prompt():
    tokenizer = presets.build_tokenizer()
    messages = [{"role": "user", "content": "reverse\n\nabc"}, {"role": "assistant", "content": "cba"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|user|>reverse\n\nabc<|end|><|assistant|>cba<|end|>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>reverse\n\nabc<|end|><|assistant|>"


def test_tiny_model_is_a_small_llama_and_seeded():
    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer, seed=0)
    assert isinstance(model, LlamaForCausalLM)
    assert 300_000 < model.num_parameters() < 1_000_000
    same = presets.build_model(tokenizer, seed=0)
    other = presets.build_model(tokenizer, seed=1)
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[weight], same.state_dict()[weight])
    assert not torch.equal(model.state_dict()[weight], other.state_dict()[weight])


def test_save_pretrained_directory_loads_through_auto_classes(tmp_path):
    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"

    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    loaded_model = AutoModelForCausalLM.from_pretrained(tmp_path)
    text = "<|user|>sort\n\ndcba<|end|><|assistant|>"
    assert loaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(model(**inputs).logits, loaded_model(**inputs).logits)
