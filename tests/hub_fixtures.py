"""Hub-like checkpoints built locally: what a user's `from_pretrained` really meets, without a download.

A small Qwen2-shaped model saved in bf16 safetensors (as hub checkpoints are), with a byte-level BPE tokenizer trained
here (real merges, special tokens) and the chat template of one of the families people fine-tune: ChatML (Qwen, with
tool calls), ChatML opening the answer with `<think>` (reasoning models), ChatML writing an empty `<think>`
block before the latest answers only (Qwen3), Llama-3, Mistral, Gemma, or none (a base
model). The templates are written for these fixtures in the style of each family; the token layout (role headers,
end-of-turn tokens, BOS in the template) is what matters to label masking.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# ChatML with tools, Qwen2.5-style: a system block lists the tools, calls are JSON inside <tool_call>, tool results
# come back as a user turn inside <tool_response>.
CHATML = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\nYou may call one or more functions. Their signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{%- endfor %}"
    "{{ '\\n</tools>\\nFor each call, answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.'"
    " + '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{%- if message['content'] %}{{ message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{{ function['arguments'] if function['arguments'] is string else function['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Reasoning models: the generation prompt opens the answer with <think>, but earlier answers are rendered without it,
# so the prompt is not a prefix of the rendered turn.
CHATML_THINK = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

# Qwen3-style: the answers after the last user turn open with an empty <think></think> block, earlier answers do
# not; so a turn renders differently once the conversation goes on.
CHATML_THINK_LATEST = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Mistral: no generation prompt of its own (the prompt ends with [/INST]); a system prompt joins the first user turn.
MISTRAL = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system' else '' %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{%- else %}{{ raise_exception('roles must be user/assistant/system') }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Gemma: the assistant is `model`, turns end with <end_of_turn>, and there is no system role.
GEMMA = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Family:
    """A tokenizer family: its chat template (None: a base model), special tokens and which is which."""

    template: str | None
    special_tokens: tuple[str, ...]
    eos: str
    bos: str | None = None
    pad: str | None = None


FAMILIES = {
    "chatml": Family(CHATML, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>", pad="<|endoftext|>"),
    "chatml_think": Family(CHATML_THINK, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
                           eos="<|im_end|>", pad="<|endoftext|>"),
    "chatml_think_latest": Family(CHATML_THINK_LATEST, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                         "</think>"), eos="<|im_end|>", pad="<|endoftext|>"),
    "llama3": Family(LLAMA3, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                              "<|eot_id|>"), eos="<|eot_id|>", bos="<|begin_of_text|>"),
    "mistral": Family(MISTRAL, ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), eos="</s>", bos="<s>"),
    "gemma": Family(GEMMA, ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), eos="<eos>", bos="<bos>",
                    pad="<pad>"),
    "base": Family(None, ("<|endoftext|>",), eos="<|endoftext|>"),
}

# What the BPE merges are learned from: the synthetic tasks' text and some chat and tool-calling vocabulary.
EXTRA_CORPUS = [
    "You are a helpful assistant. The answer is",
    "system user assistant model tool function arguments name call response",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "The weather in Paris is sunny and 21 degrees.",
]


def corpus() -> list[str]:
    import json

    from finetune.presets import synthetic_data_dir

    lines = (synthetic_data_dir() / "train.jsonl").read_text().splitlines()[:2000]
    texts = [json.dumps(json.loads(line)) for line in lines]
    return texts + EXTRA_CORPUS * 20


def build_tokenizer(family: str = "chatml", vocab_size: int = 600):
    """A byte-level BPE tokenizer with learned merges (as GPT-2, Llama-3 and Qwen ship), the family's special tokens
    and chat template; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=spec.eos,
        bos_token=spec.bos,
        pad_token=spec.pad,
        chat_template=spec.template,
        model_max_length=4096,
    )


def save_hub_model(directory: Path, family: str = "chatml", dtype: str = "bfloat16", seed: int = 0,
                   **widths) -> Path:
    """A small Qwen2-shaped causal LM (grouped-query attention, untied head) saved as hub checkpoints are: weights in
    `dtype` safetensors, `config.json` saying so, the tokenizer files beside them. `widths` overrides the config's
    sizes (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads) or ties the
    head to the embedding (tie_word_embeddings=True)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(family)
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": False, **widths}
    config = Qwen2Config(
        vocab_size=len(tokenizer), max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, **sizes,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def save_hub_dataset(directory: Path, configs: dict[str, dict[str, list[dict]]]) -> Path:
    """A dataset repository as the hub serves one, on disk: JSONL files per configuration and split, named in the
    README's `configs:` header, so `load_dataset(directory, name=config, split=split)` reads it as it would read the
    hub id (no script, no download)."""
    import json

    import yaml

    header = []
    for config, splits in configs.items():
        files = []
        for split, rows in splits.items():
            path = Path("data", config, f"{split}.jsonl")
            (directory / path).parent.mkdir(parents=True, exist_ok=True)
            (directory / path).write_text("".join(json.dumps(row) + "\n" for row in rows))
            files.append({"split": split, "path": str(path)})
        default = {"default": True} if config == "default" else {}
        header.append({"config_name": config, "data_files": files, **default})
    (directory / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': header}, sort_keys=False)}---\n")
    return directory


def conversation_rows(count: int, start: int = 0, tag: str = "") -> list[dict]:
    """`messages` rows whose answers can be told apart: row i reverses a word naming i (and `tag`)."""
    rows = []
    for index in range(start, start + count):
        word = f"{tag}w{index}"
        rows.append({"messages": [{"role": "user", "content": f"reverse {word}"},
                                  {"role": "assistant", "content": word[::-1]}]})
    return rows


def alpaca_rows(count: int, start: int = 0) -> list[dict]:
    return [{"instruction": f"sort the letters of a{index}cb", "input": "", "output": "".join(sorted(f"a{index}cb"))}
            for index in range(start, start + count)]


def preference_rows(count: int, start: int = 0) -> list[dict]:
    """Conversational pairs in the shape of UltraFeedback's binarized splits: `chosen` and `rejected` conversations
    sharing their user turn."""
    rows = []
    for index in range(start, start + count):
        user = {"role": "user", "content": f"reverse w{index}"}
        rows.append({"prompt": user["content"],
                     "chosen": [user, {"role": "assistant", "content": f"w{index}"[::-1]}],
                     "rejected": [user, {"role": "assistant", "content": f"w{index}"}]})
    return rows


# Qwen2-VL's hub template, written from its documented ChatML format: images as
# `<|vision_start|><|image_pad|><|vision_end|>` inside the user turn, every turn `<|im_start|>ROLE\n...<|im_end|>\n`.
VL_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
