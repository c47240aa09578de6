"""Configs of other fine-tuning tools, read as finetune recipes: axolotl's and LLaMA-Factory's SFT configs.

A recipe file is read as one tool's config when most of the keys that tell configs apart are keys only that tool
writes (axolotl's `base_model`, `sequence_len`, ...; LLaMA-Factory's `stage`, `cutoff_len`, ...) rather than
finetune's own (`read_as`); the console says which, either way. A finetune recipe carrying a stray key of another
tool's (`lora_rank`) reads that key through the tool's table, saying so, and keeps finetune's defaults. Each of the
tool's keys is renamed to ours (`sequence_len` → `max_seq_length`), turned into ours when its value needs reading
(`adapter: qlora` → `use_qlora: true`, `datasets:` → `dataset_mixture`, LLaMA-Factory's dataset names → the files
its `dataset_info.json` lists), accepted with a note when it changes nothing here, or refused naming the reason, through
the same table TRL's keys go through (finetune.recipe.aliases). Where the tool's default differs from ours and
decides what trains (LLaMA-Factory's LoRA alpha of twice the rank), the tool's default is applied, and said so.
`effective_config.json` lists every key so read under `foreign_keys`.

Keys are those of axolotl's config schema (src/axolotl/utils/schemas) and LLaMA-Factory's hparams
(src/llamafactory/hparams) as of 2026; Trainer's keys, which both pass through, keep Trainer's meaning.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import RecipeError
from finetune.recipe.aliases import AXOLOTL, LLAMA_FACTORY, TrlKey, held_out_size

RECIPE_DIR = "__recipe_dir__"  # the recipe file's folder, passed to the keys that read files beside it
TEMPLATE_NOTE = ("the tokenizer's own chat template renders the conversations (a template name here is the tool's "
                 "copy of a model family's template; finetune's default template when the tokenizer has none); give "
                 "the Jinja text, a file or `chatml` as `chat_template` to use another")


@dataclass(frozen=True)
class Reading:
    """Whose config a recipe file is, and why: the keys that tell a config's tool apart are the tool's own (its
    table's keys that finetune, Trainer and TRL do not name) and finetune's own (not Trainer's, which every tool
    passes through); the file is the tool's when most of those are the tool's."""

    tool: str | None
    """The tool the file is read as; None for a finetune or TRL recipe."""
    strays: tuple[str, ...] = ()
    """Another tool's keys in a finetune recipe (`lora_rank`), each read through that tool's table and said so."""
    stray_tool: str | None = None
    line: str | None = None
    """What the console says about it; None for a recipe with no other tool's key."""


def read_as(values: dict[str, Any], where: str, native: set[str]) -> Reading:
    """The tool whose config `values` is, by the keys only it writes against finetune's own (`native`: every key the
    recipe parser and TRL's tables know), or a finetune recipe carrying a few of another tool's keys."""
    from transformers import TrainingArguments

    trainer = {field.name for field in dataclasses.fields(TrainingArguments)}
    found = {tool: [key for key in values if key in table and key not in native] for tool, table in TOOL_KEYS.items()}
    tools = [tool for tool, keys in found.items() if keys]
    if len(tools) > 1:
        raise RecipeError(f"{where} mixes keys of {' and '.join(f'{tool} ({found[tool][0]})' for tool in tools)}; "
                          "write it in one tool's keys.")
    if not tools:
        return Reading(None)
    tool, theirs = tools[0], found[tools[0]]
    ours = [key for key in values if key in native and key not in trainer and key not in TOOL_KEYS[tool]]
    told = len(theirs) + len(ours)
    if 2 * len(theirs) > told:
        return Reading(tool, line=f"{where} is read as {ARTICLE[tool]} {tool} config ({len(theirs)} of the {told} "
                                  f"keys that are not Trainer's are {tool}'s)")
    return Reading(None, tuple(theirs), tool, line=f"{where} is read as a finetune recipe ({len(theirs)} of the {told} "
                                                  f"keys that are not Trainer's {'is' if len(theirs) == 1 else 'are'} "
                                                  f"{tool}'s)")


# ---------------------------------------------------------------------------------------------------------- axolotl

AXOLOTL_TYPES = {"alpaca": "alpaca", "chat_template": "messages", "completion": "text"}


def _axolotl_adapter(value: Any, values: dict) -> dict:
    if value in (None, ""):
        return {}  # full fine-tuning
    if value not in ("lora", "qlora"):
        raise ValueError(f"finetune trains LoRA (`lora`) and QLoRA (`qlora`) adapters or all weights (no "
                         f"`adapter`); `{value}` is not one of them")
    return {"use_qlora": True} if value == "qlora" else {"use_lora": True}


def _axolotl_dataset(entry: dict, values: dict) -> dict:
    if not isinstance(entry, dict) or not entry.get("path"):
        raise ValueError(f"each dataset needs a `path`, got {entry!r:.80}")
    unsupported = sorted(set(entry) & {"shards", "shards_idx", "revision", "roles", "message_field_training",
                                       "message_field_training_detail", "input_transform", "field_system"})
    if unsupported:
        raise ValueError(f"dataset `{entry['path']}`: `{unsupported[0]}` is not read here; prepare the data to the "
                         "shape wanted and give it as a file or `save_to_disk` folder")
    kind = entry.get("type") or "alpaca"
    if kind not in AXOLOTL_TYPES:
        raise ValueError(f"dataset `{entry['path']}` has `type: {kind}`; finetune reads "
                         f"{', '.join(AXOLOTL_TYPES)} (as its alpaca, messages and text formats): convert the data to "
                         "one of them")
    if entry.get("roles_to_train") not in (None, ["assistant"]) or entry.get("train_on_eos") not in (None, "turn"):
        raise ValueError(f"dataset `{entry['path']}`: finetune learns the assistant turns and the token that ends "
                         "each (axolotl's `roles_to_train: [assistant]`, `train_on_eos: turn`); other choices are not "
                         "supported")
    if entry.get("chat_template") not in (None, values.get("chat_template")):
        raise ValueError(f"dataset `{entry['path']}` has a chat template of its own; finetune renders every dataset "
                         "with one (`chat_template` at the top)")
    ours = {"path": entry["path"], "split": entry.get("split") or "train", "format": AXOLOTL_TYPES[kind]}
    if entry.get("name"):
        ours["config"] = entry["name"]
    if entry.get("data_files"):
        ours["data_files"] = entry["data_files"]
        if entry.get("ds_type"):
            ours["path"] = entry["ds_type"]  # the builder (`json`, `parquet`, ...) that reads the files
    rename = {}
    if kind == "chat_template":
        field = entry.get("field_messages") or "messages"
        mapping = entry.get("message_property_mappings") or {}
        if entry.get("message_field_role") or entry.get("message_field_content"):
            mapping = {"role": entry.get("message_field_role") or "role",
                       "content": entry.get("message_field_content") or "content"}
        if mapping.get("role", "role") == "from" and mapping.get("content", "content") == "value":
            ours["format"], target = "sharegpt", "conversations"  # ShareGPT turns: {from, value}
        elif mapping.get("role", "role") == "role" and mapping.get("content", "content") == "content":
            target = "messages"
        else:
            raise ValueError(f"dataset `{entry['path']}`: messages keyed {mapping} are read as `role`/`content` or "
                             "ShareGPT's `from`/`value` only")
        if field != target:
            rename[field] = target
    if kind == "completion" and entry.get("field") not in (None, "text"):
        rename[entry["field"]] = "text"
    if rename:
        ours["rename"] = rename
    return ours


def _axolotl_datasets(value: Any, values: dict) -> dict:
    if not isinstance(value, list) or not value:
        raise ValueError("`datasets` is a list of datasets, each with `path` and `type`")
    return {"dataset_mixture": {"datasets": [_axolotl_dataset(entry, values) for entry in value],
                                "seed": int(values.get("seed") or 42)}}


def _axolotl_chat_template(value: Any, values: dict) -> dict:
    if value in (None, "tokenizer_default"):
        return {}
    if "{{" in str(value) or "{%" in str(value) or Path(str(value)).is_file():
        return {"chat_template": value}  # a template written out, or its file, as finetune's own key takes
    if value == "jinja":
        if not values.get("chat_template_jinja"):
            raise ValueError("`chat_template: jinja` needs `chat_template_jinja` (the template or a file)")
        return {}  # chat_template_jinja carries it
    if value == "chatml" or str(value).startswith("tokenizer_default_fallback_chatml"):
        return {"chat_template": "chatml"} if value == "chatml" else {}
    return {}  # a model family's template: the tokenizer's own (noted by `_note`)


def _per_epoch(kind: str):
    """axolotl's `evals_per_epoch`/`saves_per_epoch` as Trainer's strategy: once an epoch is `epoch`; more often, a
    `steps` interval given as a fraction of the run (Trainer reads a value below 1 so)."""
    def expand(value: Any, values: dict) -> dict:
        if not value:
            return {}
        if float(value) == 1:
            return {f"{kind}_strategy": "epoch"}
        epochs = float(values.get("num_epochs") or 1)
        return {f"{kind}_strategy": "steps", f"{kind}_steps": round(1 / (float(value) * epochs), 6)}
    return expand


def _if_true(target: str, given: Any):
    def expand(value: Any, values: dict) -> dict:
        return {target: given} if value is True else {}
    return expand


def _special_tokens(value: Any, values: dict) -> dict:
    others = sorted(set(value or {}) - {"pad_token"})
    if others:
        raise ValueError(f"`{others[0]}` would add or change a special token and resize the embeddings; add it to the "
                         "tokenizer, save it, and give that folder as `tokenizer_name_or_path`")
    return {}


def _axolotl_flash(value: Any, values: dict) -> dict:
    import importlib.util

    if value is not True or importlib.util.find_spec("flash_attn") is None:
        return {}  # noted: the attention Transformers chooses (SDPA) computes the same exact attention
    return {"attn_implementation": "flash_attention_2"}


def _axolotl_tf32(value: Any, values: dict) -> dict:
    return {} if value in (None, "auto") else {"tf32": value}


def _auto_resume(value: Any, values: dict) -> dict:
    return {"resume_from_checkpoint": "auto"} if value is True else {}


def _note(name: str, why: str, kept: tuple = ()) -> TrlKey:
    return TrlKey(name, AXOLOTL, kept=kept, ignored=not kept, why=why)


AXOLOTL_KEYS = (
    TrlKey("base_model", AXOLOTL, ours="model_name_or_path"),
    TrlKey("tokenizer_config", AXOLOTL, ours="tokenizer_name_or_path"),
    TrlKey("sequence_len", AXOLOTL, ours="max_seq_length"),
    TrlKey("sample_packing", AXOLOTL, ours="packing"),
    TrlKey("micro_batch_size", AXOLOTL, ours="per_device_train_batch_size"),
    TrlKey("eval_batch_size", AXOLOTL, ours="per_device_eval_batch_size"),
    TrlKey("num_epochs", AXOLOTL, ours="num_train_epochs"),
    TrlKey("optimizer", AXOLOTL, ours="optim"),
    TrlKey("lr_scheduler", AXOLOTL, ours="lr_scheduler_type"),
    TrlKey("dataset_prepared_path", AXOLOTL, ours="preprocessed_dir"),
    TrlKey("dataset_processes", AXOLOTL, ours="dataset_num_proc"),
    TrlKey("lora_modules_to_save", AXOLOTL, ours="modules_to_save"),
    TrlKey("peft_use_dora", AXOLOTL, ours="use_dora"),
    TrlKey("peft_use_rslora", AXOLOTL, ours="use_rslora"),
    TrlKey("chat_template_jinja", AXOLOTL, ours="chat_template"),
    TrlKey("val_set_size", AXOLOTL, ours="eval_split_ratio", convert=held_out_size),
    TrlKey("adapter", AXOLOTL, expand=_axolotl_adapter, why="all weights are trained"),
    TrlKey("datasets", AXOLOTL, expand=_axolotl_datasets),
    TrlKey("chat_template", AXOLOTL, expand=_axolotl_chat_template, why=TEMPLATE_NOTE),
    TrlKey("lora_target_linear", AXOLOTL, expand=_if_true("lora_target_modules", ["all-linear"]),
           why="the adapters go where `lora_target_modules` says"),
    TrlKey("flash_attention", AXOLOTL, expand=_axolotl_flash,
           why="flash-attn is not installed here: Transformers chooses the attention (SDPA), which computes the same "
               "exact attention; install flash-attn on a CUDA machine to use its kernel"),
    TrlKey("evals_per_epoch", AXOLOTL, expand=_per_epoch("eval")),
    TrlKey("saves_per_epoch", AXOLOTL, expand=_per_epoch("save")),
    TrlKey("special_tokens", AXOLOTL, expand=_special_tokens,
           why="the tokenizer's pad token is used (its EOS when it has none)"),
    TrlKey("tf32", AXOLOTL, expand=_axolotl_tf32, why="TF32 matmuls follow PyTorch's default"),
    TrlKey("auto_resume_from_checkpoints", AXOLOTL, expand=_auto_resume, why="a run starts fresh"),
    _note("model_type", "the model class comes from the checkpoint's config.json (AutoModelForCausalLM)"),
    _note("tokenizer_type", "the tokenizer class comes from the checkpoint (AutoTokenizer)"),
    _note("base_model_config", "the model's config is read from `base_model`"),
    _note("load_in_4bit", "`adapter: qlora` decides the 4-bit base (our `use_qlora`)"),
    _note("load_in_8bit", "an 8-bit base is not supported; `adapter: qlora` trains on a 4-bit NF4 base", kept=(False,)),
    _note("eval_sample_packing", "eval data is packed exactly when training data is"),
    _note("pad_to_sequence_len", "each micro-batch is padded to its longest row (packed rows are nearly full)"),
    _note("strict", "unknown keys are always refused"),
    _note("loss_watchdog_threshold", "finetune stops a run whose loss diverges (NaN, or far above its start)"),
    _note("loss_watchdog_patience", "finetune stops a run whose loss diverges (NaN, or far above its start)"),
    _note("lora_model_dir", "training starts from fresh adapters; to continue a run, resume its checkpoint "
                            "(`resume_from_checkpoint`)", kept=(None, "")),
    _note("train_on_inputs", "finetune learns only the answers; to learn the prompt too, write the examples as one "
                             "`text` column", kept=(False,)),
    _note("shuffle_merged_datasets", "Trainer's sampler shuffles the training rows, seeded by `seed`", kept=(True,)),
    _note("wandb_project", "set `report_to: wandb` and the WANDB_PROJECT variable", kept=(None, "")),
    _note("wandb_entity", "set the WANDB_ENTITY variable", kept=(None, "")),
    _note("wandb_name", "set `run_name`", kept=(None, "")),
    _note("wandb_watch", "not supported", kept=(None, "", False)),
    _note("wandb_log_model", "not supported", kept=(None, "", False)),
    _note("lora_fan_in_fan_out", "peft finds layers stored transposed (GPT-2's Conv1D) itself", kept=(False,)),
    _note("group_by_length", "batches are drawn at random by Trainer's sampler; grouping rows by length is not "
                             "supported (packing fills rows instead: `sample_packing`)", kept=(False,)),
    TrlKey("early_stopping_patience", AXOLOTL, kept=(None,),
           why="training runs the steps it is given; stopping on the eval loss is not supported: set `num_epochs` or "
               "`max_steps`"),
    _note("xformers_attention", "Transformers chooses the attention (SDPA); xformers is not used", kept=(False,)),
    _note("s2_attention", "shifted sparse attention is not supported", kept=(False,)),
    *(_note(kernel, "axolotl's fused LoRA kernels (Triton, CUDA) are not used; peft's LoRA layers compute the same "
                    "outputs") for kernel in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")),
    _note("save_safetensors", "checkpoints are always saved as safetensors", kept=(True,)),
    _note("eval_table_size", "eval predictions are not logged as a table; `finetune eval` writes the answers",
          kept=(0,)),
    TrlKey("eval_max_new_tokens", AXOLOTL, ours="generation_max_new_tokens"),
    _note("rl", "preference training is a preference `method` with finetune's own pair formats (docs/preference.md)",
          kept=(None, "")),
    _note("test_datasets", "give the eval data as `eval_file`, or hold rows out with `val_set_size`",
          kept=(None, [])),
)


# ----------------------------------------------------------------------------------------------------- LLaMA-Factory

FACTORY_STAGES = {"rm": "reward"}  # LLaMA-Factory's stage names that differ from the method's


def _factory_stage(value: Any, values: dict) -> dict:
    from finetune.recipe.methods import all_methods

    names = [method.name for method in all_methods()]
    if value in (None, "sft", "pt"):  # pretraining: supervised fine-tuning on plain text (`_factory_entry`)
        return {}
    value = FACTORY_STAGES.get(value, value)
    if value in names:  # a stage finetune trains under the same name
        return {"method": value}
    raise ValueError(f"finetune trains {', '.join(f'`{name}`' for name in names)}; stage `{value}` is not supported")


def _factory_finetuning(value: Any, values: dict) -> dict:
    kind = value or "lora"  # LLaMA-Factory's default
    if kind == "full":
        return {}
    if kind != "lora":
        raise ValueError(f"finetune trains LoRA adapters or all weights (`lora`, `full`); `{kind}` is not supported")
    quantized = values.get("quantization_bit")
    if quantized not in (None, 4):
        raise ValueError(f"`quantization_bit: {quantized}`: the quantized base is 4-bit NF4 (QLoRA) only")
    return {"use_qlora": True} if quantized == 4 else {"use_lora": True}


def _factory_lora_target(value: Any) -> list[str]:
    names = [name.strip() for name in str(value).split(",") if name.strip()]
    return ["all-linear"] if names in (["all"], []) else names


def _factory_flash(value: Any, values: dict) -> dict:
    chosen = {"auto": None, "fa2": "flash_attention_2", "sdpa": "sdpa", "disabled": "eager"}
    if value not in chosen:
        raise ValueError(f"`flash_attn: {value}` is not one of {', '.join(chosen)}")
    return {} if chosen[value] is None else {"attn_implementation": chosen[value]}


def dataset_info(values: dict, recipe_dir: Path | None) -> tuple[dict, Path]:
    """LLaMA-Factory's `dataset_info.json` of `dataset_dir` (default `data`, from the working directory, else from the
    recipe's folder) and that folder."""
    folder = Path(values.get("dataset_dir") or "data")
    candidates = [folder] + ([recipe_dir / folder] if recipe_dir is not None and not folder.is_absolute() else [])
    for candidate in candidates:
        if (candidate / "dataset_info.json").is_file():
            return json.loads((candidate / "dataset_info.json").read_text(encoding="utf-8")), candidate
    raise ValueError(f"the dataset names need `{folder}/dataset_info.json` (LLaMA-Factory's `dataset_dir`), and "
                     "there is none; give `dataset_dir`, or the data as `train_file`")


def _factory_entry(name: str, info: dict, folder: Path, values: dict) -> dict:
    if name not in info:
        raise ValueError(f"dataset `{name}` is not in {folder}/dataset_info.json (it has {', '.join(info)})")
    spec = info[name]
    if spec.get("file_name"):
        ours = {"path": str(folder / spec["file_name"])}
    elif spec.get("hf_hub_url"):
        ours = {"path": spec["hf_hub_url"]}
    else:
        raise ValueError(f"dataset `{name}`: only `file_name` and `hf_hub_url` entries are read (not "
                         f"{', '.join(key for key in spec if key.endswith(('_url', '_name')))})")
    if spec.get("num_samples"):
        raise ValueError(f"dataset `{name}`: `num_samples` resamples rows with repeats, which is not supported; use "
                         "`max_samples` (the first rows)")
    ours["split"] = spec.get("split") or "train"
    if spec.get("subset"):
        ours["config"] = spec["subset"]
    if values.get("max_samples"):
        ours["rows"] = int(values["max_samples"])
    columns, rename = spec.get("columns") or {}, {}
    if spec.get("ranking"):
        raise ValueError(f"dataset `{name}` is a ranking (preference) dataset; preference pairs are read in "
                         "finetune's own formats (docs/preference.md)")
    if values.get("stage") == "pt":  # pretraining reads the `prompt` column as plain text (LLaMA-Factory's c4_demo)
        ours["format"] = "text"
        if columns.get("prompt", "text") != "text":
            rename[columns["prompt"]] = "text"
    elif (spec.get("formatting") or "alpaca") == "alpaca":
        ours["format"] = "alpaca"
        for theirs, column in (("prompt", "instruction"), ("query", "input"), ("response", "output")):
            if columns.get(theirs) not in (None, column):
                rename[columns[theirs]] = column
        for unsupported in ("history", "system", "tools"):
            if columns.get(unsupported):
                raise ValueError(f"dataset `{name}`: an alpaca `{unsupported}` column is not read; write such "
                                 "examples as conversations (`messages`)")
    else:
        tags = spec.get("tags") or {}
        role, content = tags.get("role_tag", "from"), tags.get("content_tag", "value")
        if (role, content) == ("role", "content"):
            ours["format"], target = "messages", "messages"
        elif (role, content) == ("from", "value"):
            ours["format"], target = "sharegpt", "conversations"
        else:
            raise ValueError(f"dataset `{name}`: turns keyed `{role}`/`{content}` are read as `role`/`content` or "
                             "ShareGPT's `from`/`value` only")
        if columns.get("messages", "conversations") != target:
            rename[columns.get("messages", "conversations")] = target
    if rename:
        ours["rename"] = rename
    return ours


def _factory_dataset(value: Any, values: dict) -> dict:
    names = [name.strip() for name in (value if isinstance(value, list) else str(value).split(",")) if name.strip()]
    info, folder = dataset_info(values, values.get(RECIPE_DIR))
    return {"dataset_mixture": {"datasets": [_factory_entry(name, info, folder, values) for name in names],
                                "seed": int(values.get("seed") or 42)}}


def _factory_note(name: str, why: str, kept: tuple = ()) -> TrlKey:
    return TrlKey(name, LLAMA_FACTORY, kept=kept, ignored=not kept, why=why)


LLAMA_FACTORY_KEYS = (
    TrlKey("cutoff_len", LLAMA_FACTORY, ours="max_seq_length"),
    TrlKey("lora_rank", LLAMA_FACTORY, ours="lora_r"),
    TrlKey("lora_target", LLAMA_FACTORY, ours="lora_target_modules", convert=_factory_lora_target),
    TrlKey("preprocessing_num_workers", LLAMA_FACTORY, ours="dataset_num_proc"),
    TrlKey("val_size", LLAMA_FACTORY, ours="eval_split_ratio", convert=held_out_size),
    TrlKey("neat_packing", LLAMA_FACTORY, ours="packing"),
    TrlKey("enable_liger_kernel", LLAMA_FACTORY, ours="use_liger_kernel"),
    TrlKey("pref_beta", LLAMA_FACTORY, ours="beta"),
    TrlKey("stage", LLAMA_FACTORY, expand=_factory_stage,
           why="`method: sft`, the default; `pt` reads each dataset's text as finetune's `text` format, every token "
               "learned"),
    TrlKey("finetuning_type", LLAMA_FACTORY, expand=_factory_finetuning, why="all weights are trained"),
    TrlKey("dataset", LLAMA_FACTORY, expand=_factory_dataset),
    TrlKey("flash_attn", LLAMA_FACTORY, expand=_factory_flash, why="Transformers chooses the attention"),
    _factory_note("template", TEMPLATE_NOTE),
    _factory_note("quantization_bit", "read with `finetuning_type` (4 → QLoRA)"),
    _factory_note("quantization_method", "the 4-bit base is bitsandbytes' NF4", kept=("bnb", None)),
    _factory_note("max_samples", "read with `dataset` (each dataset's first rows)"),
    _factory_note("dataset_dir", "read with `dataset` (where dataset_info.json is)"),
    _factory_note("do_train", "finetune train trains", kept=(True,)),
    _factory_note("overwrite_cache", "the tokenized data is cached by its content (a change is seen, nothing to "
                                     "overwrite)"),
    _factory_note("preprocessing_batch_size", "examples are tokenized one by one in `dataset_num_proc` processes"),
    _factory_note("plot_loss", "`finetune` records the losses in trainer_state.json; finetune.plots draws them"),
    _factory_note("train_on_prompt", "finetune learns only the answers; to learn the prompt too, write the "
                                     "examples as one `text` column", kept=(False,)),
    _factory_note("mask_history", "every assistant turn is learned", kept=(False,)),
    _factory_note("mix_strategy", "the datasets are concatenated", kept=("concat",)),
    _factory_note("eval_dataset", "hold rows out with `val_size`, or give the eval data as `eval_file`",
                  kept=(None, "")),
    _factory_note("pref_loss", "the preference method trains its default (sigmoid) loss unless its `loss_type` says "
                               "otherwise",
                  kept=("sigmoid",)),
)

TOOL_KEYS = {AXOLOTL: {key.name: key for key in AXOLOTL_KEYS},
             LLAMA_FACTORY: {key.name: key for key in LLAMA_FACTORY_KEYS}}
ARTICLE = {AXOLOTL: "an", LLAMA_FACTORY: "a"}


def tool_defaults(tool: str, values: dict) -> dict[str, Any]:
    """The tool's own defaults, where they differ from ours and decide what trains, for the keys the config leaves
    out (`{our key: value}`): LoRA rank 8, alpha twice the rank and no dropout (LLaMA-Factory); no LoRA dropout
    (axolotl)."""
    defaults = {}
    if tool == LLAMA_FACTORY and (values.get("finetuning_type") or "lora") == "lora":
        rank = int(values.get("lora_rank") or 8)
        defaults = {"lora_r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0}
        given = {"lora_r": "lora_rank", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
        defaults = {key: value for key, value in defaults.items() if given[key] not in values}
    if tool == AXOLOTL and values.get("adapter") in ("lora", "qlora") and "lora_dropout" not in values:
        defaults = {"lora_dropout": 0.0}
    return defaults
