"""Generated documentation, written by `finetune configs write` and checked by `finetune configs check` like the
configs: `docs/recipes.md` (every recipe key with its default and help, from the recipe dataclasses) and
`docs/from_other_tools.md` (what becomes of each key of TRL, the alignment-handbook, axolotl and LLaMA-Factory, from
`finetune.recipe.aliases` and `finetune.recipe.peers`)."""

from __future__ import annotations

import dataclasses
import enum

from transformers import TrainingArguments

from finetune.axes import all_axes
from finetune.recipe.aliases import TRL_KEYS, TrlKey, shown
from finetune.recipe.args import (
    DataArguments,
    FinetuneTrainingArguments,
    LoraArguments,
    MethodArguments,
    ModelArguments,
)
from finetune.recipe.methods import all_methods

RECIPE_REFERENCE = "docs/recipes.md"
FROM_TOOLS = "docs/from_other_tools.md"
# Trainer's keys a fine-tuning recipe sets most often, shown with Trainer's defaults; all others keep them too.
COMMON_TRAINER_KEYS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "num_train_epochs", "max_steps",
    "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "optim", "bf16", "fp16",
    "gradient_checkpointing", "per_device_eval_batch_size", "eval_strategy", "eval_steps", "logging_steps",
    "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint", "load_best_model_at_end", "seed",
    "data_seed", "full_determinism", "deepspeed", "ddp_timeout", "dataloader_num_workers",
    "train_sampling_strategy", "torch_compile", "use_liger_kernel",
)
# Trainer's help for these quotes what the toolkit has not measured, or says less than what the toolkit does with them
TRAINER_HELP_HERE = {
    "torch_compile": "Compile the model with `torch.compile` (Accelerate compiles it after DDP, FSDP2 or DeepSpeed "
                     "wrap it; `torch_compile_backend`, `torch_compile_mode`). The run writes compile.json: graphs, "
                     "graph breaks by reason, seconds spent compiling; `finetune bench` measures it against eager. "
                     "The pipeline loop refuses it.",
    "use_liger_kernel": "Patch the model with Liger's fused Triton kernels (CUDA GPUs with the `liger-kernel` "
                        "package; refused elsewhere in one line). Off by default until measured on a GPU here "
                        "(docs/strategies.md).",
}
SECTIONS = (
    ("Model", ModelArguments, "What to load: the embedded tiny default, a local directory or a hub id."),
    ("Data", DataArguments, "Formats, mixes, packing and what happens to rows that do not fit."),
    ("LoRA and QLoRA", LoraArguments, "Adapters (peft) instead of all weights; QLoRA on a 4-bit base."),
    ("Method", MethodArguments, "What is trained for: each method (finetune/train/methods/) is listed below with its "
     "own keys (preference methods: docs/preference.md)."),
)


def _default(value) -> str:
    if value is None or value is dataclasses.MISSING:
        return "unset"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _field_default(field: dataclasses.Field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("%%", "%").replace("|", "\\|")  # help texts escape % for argparse


def _row(field: dataclasses.Field, default: str | None = None, help: str | None = None) -> str:
    value = default if default is not None else _default(_field_default(field))
    return f"| `{field.name}` | `{value}` | {_cell(help or field.metadata.get('help', ''))} |"


def _table(rows: list[str]) -> list[str]:
    return ["| key | default | what it does |", "| --- | --- | --- |", *rows, ""]


def toolkit_training_fields() -> tuple[list[tuple[dataclasses.Field, dataclasses.Field]], list[dataclasses.Field]]:
    """The training keys the toolkit gives another default than `TrainingArguments` (each with Trainer's field), and
    those it adds."""
    trainer = {field.name: field for field in dataclasses.fields(TrainingArguments)}
    changed, added = [], []
    for field in dataclasses.fields(FinetuneTrainingArguments):
        base = trainer.get(field.name)
        if base is None:
            added.append(field)
        elif _default(_field_default(base)) != _default(_field_default(field)):
            changed.append((field, base))
    return changed, added


def recipe_reference() -> str:
    lines = [
        "# Recipe reference",
        "",
        "Generated from the recipe dataclasses in `finetune/recipe/args.py` by `finetune configs write`; `finetune "
        "configs",
        "check` fails when this file differs. A recipe is a flat YAML mapping of these keys; `--key value` after the",
        "recipe on the command line wins over the file, and an unknown key stops the run with the closest known one.",
        "",
        "```yaml",
        "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct",
        "train_file: data/train.jsonl",
        "max_seq_length: 2048",
        "use_lora: true",
        "global_batch_size: 64",
        "learning_rate: 2.0e-4",
        "bf16: true",
        "output_dir: outputs/qwen-lora",
        "```",
        "",
    ]
    for title, section, about in SECTIONS:
        lines += [f"## {title}", "", about, ""]
        lines += _table([_row(field) for field in dataclasses.fields(section) if field.init])
    for method in all_methods():
        lines += [f"### `method: {method.name}`", "", _cell(method.description[:1].upper() + method.description[1:])
                  + ".", ""]
        if method.arguments is not None:
            lines += _table([_row(field) for field in dataclasses.fields(method.arguments) if field.init])
    lines += ["## Parallelism axes", "", "Each axis beside data parallelism, with its own keys: on when its size is "
              "above 1.", ""]
    for axis in all_axes():
        lines += [f"### `{axis.size_key}`", "", _cell(axis.description[:1].upper() + axis.description[1:]) + ".", ""]
        lines += _table([_row(field) for field in dataclasses.fields(axis.arguments) if field.init])
    changed, added = toolkit_training_fields()
    lines += ["## Training: Trainer's keys with another default here", "",
              "Every other Trainer key keeps Trainer's default. Each of these says why it differs.", "",
              "| key | Trainer's default | here | why |", "| --- | --- | --- | --- |"]
    lines += [f"| `{field.name}` | `{_default(_field_default(base))}` | `{_default(_field_default(field))}` | "
              f"{_cell(field.metadata.get('help', ''))} |" for field, base in changed]
    lines += ["| `use_cpu` | `false` | `true when no GPU is visible` | Without it, Trainer on a machine without a GPU "
              "quietly trains one process per rank under a multi-process launch. |", ""]
    lines += ["## Training: the toolkit's keys", "", "Keys added to Hugging Face `TrainingArguments`.", ""]
    lines += _table([_row(field) for field in added])
    trainer = {field.name: field for field in dataclasses.fields(TrainingArguments)}
    lines += ["## Training: Trainer's keys most recipes set", "",
              "Every other `TrainingArguments` key is accepted too, with Trainer's name, meaning and default;",
              "`finetune train --help-keys` lists all of them for the installed Transformers.", ""]
    lines += _table([_row(trainer[name], help=TRAINER_HELP_HERE.get(name)) for name in COMMON_TRAINER_KEYS])
    return "\n".join(lines).rstrip() + "\n"


def _answer(key: TrlKey, method: str | None = None) -> str:
    under = f"under `method: {method}`: " if method is not None else ""
    if key.expand is not None:
        return under + "read into our keys (the note or `effective_config.json` says which)"
    if key.ours is not None:
        converted = {"warmup_fraction": " (a fraction below 1)", "held_out_size": " (a fraction below 1, or a count)"}
        return under + f"renamed to `{key.ours}`" + converted.get(getattr(key.convert, "__name__", ""), "")
    if key.ignored:
        return under + "any value: noted and ignored"
    if not key.kept:
        return under + "refused, naming what to do instead"
    return under + "accepted with " + " or ".join(f"`{shown(value)}`" for value in key.kept) + ", refused otherwise"


def _key_table(rows) -> list[str]:
    return ["| key | from | answer | what finetune does |", "| --- | --- | --- | --- |",
            *[f"| `{key.name}` | {key.origin} | {_answer(key, method)} | {_cell(key.why) or '–'} |"
              for key, method in rows], ""]


def from_tools_guide() -> str:
    """docs/from_other_tools.md: what becomes of each key of TRL, the alignment-handbook, axolotl and LLaMA-Factory."""
    from finetune.recipe.peers import AXOLOTL_KEYS, LLAMA_FACTORY_KEYS

    lines = [
        "# Coming from TRL, the alignment-handbook, axolotl or LLaMA-Factory",
        "",
        "Generated from `finetune/recipe/aliases.py` and `finetune/recipe/peers.py` by `finetune configs write`;",
        "`finetune configs check` fails when this file differs.",
        "",
        "`finetune train` (and `finetune preprocess`) take another tool's config as it is, after `--config` (as `trl "
        "sft`",
        "does) or as their first argument; `--key value` pairs after it win over the file either way, in finetune's "
        "names.",
        "Each key of the other tool is renamed to ours, read into ours when its value needs reading (`adapter: qlora` "
        "→",
        "`use_qlora: true`), accepted with a note when it asks for what finetune does anyway, or refused in one line "
        "that",
        "names the key and the fix. `effective_config.json` lists every such key under `foreign_keys` (`renamed`,",
        "`read_into`, `tool_defaults`, `noted`), and the source of each value says `given as axolotl's sequence_len`. "
        "A",
        "key given under both names is refused. A key given as null (`key:` with nothing after it) is unset: it keeps "
        "its",
        "default, as TRL and the other tools read it.",
        "",
        "A file is read as another tool's config when most of the keys that tell configs apart (the tool's own, and",
        "finetune's that are not Trainer's) are that tool's, and the console says so: `read as a LLaMA-Factory config",
        "(13 of the 15 keys that are not Trainer's are LLaMA-Factory's)`. A finetune recipe carrying a stray key of",
        "another tool's is read as finetune's, with finetune's defaults, and the key is read as ours, said in one line",
        "(`lora_rank` is LLaMA-Factory's name for `lora_r`: read as lora_r). The tool's renamed keys are read on the",
        "command line too (`--sequence_len 512` after an axolotl config).",
        "",
        "## TRL and the alignment-handbook",
        "",
        "A `trl sft --config` recipe, or an alignment-handbook recipe, is read in TRL's names (its `SFTConfig`,",
        "methods' configs, `ModelConfig`, `ScriptArguments`, `DatasetMixtureConfig`, `TrlParser`, as of trl 1.16) and",
        "Trainer's; a key means what the config of the recipe's `method` says (a method's own rows, last). The",
        "handbook's own keys are finetune's too: `dataset_mixture` (its `datasets` with `id`, `config`, `split`,",
        "`columns`, `weight`, and `seed`, `test_split_size`: docs/recipes.md) and `chat_template` (the Jinja text,",
        "applied to the tokenizer, saved with it, recorded in `effective_config.json`). Trainer keys that",
        "Transformers 5 removed are answered here too.",
        "",
        *_key_table([(key, None) for key in TRL_KEYS]
                    + [(key, method.name) for method in all_methods() for key in method.trl_keys]),
        "Recipes in these shapes that train with only the model and the data overridden: "
        "`tests/fixtures/trl_sft_recipe.yaml`,",
        "`tests/fixtures/peers/handbook_*.yaml` (tests/recipe/test_peer_recipes.py); the handbook's published",
        "`recipes/smollm2/sft/config.yaml` as it is (`handbook_smollm2_sft_published.yaml`), where its",
        "`push_to_hub: true` offline, `report_to: wandb` without a login and `flash_attention_2` without flash-attn",
        "are each refused in one line before anything loads.",
        "",
        "## axolotl",
        "",
        "A config whose keys are mostly axolotl's (`base_model`, `sequence_len`, `micro_batch_size`, ...) is read as",
        "axolotl's. Its",
        "`datasets:` become a `dataset_mixture` (`type: alpaca`, `chat_template` (with `field_messages` and ShareGPT's",
        "`from`/`value`), `completion` → finetune's alpaca, messages, sharegpt and text formats); `val_set_size` up",
        "to 1 is a fraction, above 1 a count of rows; `lora_dropout` left out is 0, as in axolotl.",
        "",
        *_key_table([(key, None) for key in AXOLOTL_KEYS]),
        "A key given as null is unset, as axolotl reads it. Its published `examples/llama-3/lora-1b.yml` trains as it",
        "is, with only the model and the data replaced (`tests/fixtures/peers/axolotl_llama3_lora_1b.yml`; without",
        "bitsandbytes, its `optimizer: adamw_8bit` is refused in one line and `--optimizer adamw_torch` given), as",
        "does `tests/fixtures/peers/axolotl_lora.yml`.",
        "",
        "## LLaMA-Factory",
        "",
        "A config whose keys are mostly LLaMA-Factory's (`stage`, `finetuning_type`, `cutoff_len`, ...) is read as",
        "LLaMA-Factory's. Its `dataset` names are looked up in `dataset_dir`'s `dataset_info.json` (from the",
        "working directory, as LLaMA-Factory reads it, else beside the config): `file_name` or `hf_hub_url`,",
        "`subset`, `split`, `formatting` alpaca (its `columns` renamed to `instruction`, `input`, `output`) or",
        "sharegpt (`from`/`value`, or `role`/`content` tags as messages); `max_samples` keeps each dataset's first",
        "rows. Where its defaults decide what trains and differ from ours, its defaults apply: LoRA",
        "(`finetuning_type` left out), rank 8, alpha twice the rank, no dropout.",
        "",
        *_key_table([(key, None) for key in LLAMA_FACTORY_KEYS]),
        "Its published `examples/train_lora/llama3_lora_sft.yaml` and `llama3_lora_pretrain.yaml` (`stage: pt`: each",
        "dataset's text read as finetune's `text` format) train as they are, with only the model and the data",
        "replaced: `tests/fixtures/peers/llamafactory_llama3_*.yaml`.",
    ]
    return "\n".join(lines).rstrip() + "\n"
