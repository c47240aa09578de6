"""Recipe sections as dataclasses, and the parser that maps a YAML recipe plus `--key value` overrides onto them.

The YAML is flat, as with TRL: model, data, LoRA and `TrainingArguments` keys side by side. Every Trainer
flag keeps its name and meaning; unknown keys and bad values stop with a `RecipeError` before any
process group is started.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from transformers import HfArgumentParser, TrainingArguments

from finetune import presets
from finetune.errors import RecipeError, did_you_mean
from finetune.scaling import BatchPlan, plan_from_recipe


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=presets.TINY_MODEL,
        metadata={"help": "`tiny` (the embedded preset), a local directory, or a hub id loaded with from_pretrained."},
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer location when it differs from the model's."}
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": "Dtype the weights are loaded in: auto, float32, bfloat16 or float16."},
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "eager, sdpa or flash_attention_2; None lets Transformers choose."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run model code shipped with a hub repository. Off unless you trust it."}
    )

    def __post_init__(self):
        if self.torch_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise RecipeError(
                f"`torch_dtype: {self.torch_dtype}` is not one of auto, float32, bfloat16, float16."
            )


@dataclass
class DataArguments:
    dataset: str = field(
        default=presets.SYNTHETIC_DATASET,
        metadata={"help": "`synthetic` (the embedded dataset), a local file or directory, or a hub dataset id."},
    )
    train_file: str | None = field(
        default=None, metadata={"help": "Local training file (.jsonl, .json, .csv, .parquet); overrides `dataset`."}
    )
    eval_file: str | None = field(default=None, metadata={"help": "Local evaluation file, same formats."})
    mix_files: list[str] | None = field(
        default=None, metadata={"help": "Several local training files to mix (each may have its own format)."}
    )
    mix_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Sampling weight of each of `mix_files` (normalised; equal when unset). Examples are "
                          "drawn with these probabilities until one file runs out."},
    )
    eval_split_ratio: float = field(
        default=0.0, metadata={"help": "Hold out this fraction of train for evaluation when no eval split exists."}
    )
    dataset_format: Literal["auto", "alpaca", "sharegpt", "messages", "prompt_completion", "text"] = field(
        default="auto",
        metadata={"help": "auto (from the columns), alpaca, sharegpt, messages, prompt_completion or text."},
    )
    overlong_policy: Literal["truncate", "drop", "error"] = field(
        default="truncate",
        metadata={"help": "An example longer than max_seq_length: truncate (counted), drop (counted) or error."},
    )
    unlabeled_policy: Literal["drop", "error"] = field(
        default="drop",
        metadata={"help": "An example with no answer token left after truncation: drop (counted) or error."},
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Pack whole examples into rows of up to max_seq_length tokens (best-fit decreasing) with "
                          "position_ids restarting per example, no padding inside a row; attention stays within "
                          "each example. per_device_train_batch_size then counts rows."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Flatten each micro-batch into one row without padding (Transformers' "
                          "DataCollatorWithFlattening); per_device_train_batch_size still counts examples."},
    )
    max_seq_length: int = field(
        default=1024, metadata={"help": "Examples are truncated to this many tokens (prompt and response)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many examples (all when unset)."}
    )
    generation_eval_samples: int = field(
        default=300,
        metadata={"help": "Eval examples scored by greedy generation (exact match per task); 0 turns it off."},
    )
    generation_max_new_tokens: int = field(
        default=32, metadata={"help": "Longest answer generated when scoring exact match."}
    )

    def __post_init__(self):
        paths = [("train_file", self.train_file), ("eval_file", self.eval_file)]
        paths += [("mix_files", path) for path in self.mix_files or []]
        for key, path in paths:
            if path is not None and not Path(path).is_file():
                raise RecipeError(f"`{key}: {path}` does not exist or is not a file.")
        if self.mix_files and self.train_file:
            raise RecipeError("give either `train_file` or `mix_files`, not both.")
        if self.mix_weights is not None and (len(self.mix_weights) != len(self.mix_files or [])
                                             or min(self.mix_weights) <= 0):
            raise RecipeError(f"`mix_weights` needs one positive weight per file of `mix_files` "
                              f"({len(self.mix_files or [])}), got {self.mix_weights}.")
        if self.packing and self.padding_free:
            raise RecipeError("choose `packing` (rows of max_seq_length) or `padding_free` (one row per micro-batch).")
        if not 0 <= self.eval_split_ratio < 1:
            raise RecipeError(f"`eval_split_ratio` must be in [0, 1), got {self.eval_split_ratio}.")
        if self.max_seq_length <= 0:
            raise RecipeError(f"`max_seq_length` must be positive, got {self.max_seq_length}.")
        if self.generation_eval_samples < 0:
            raise RecipeError(f"`generation_eval_samples` must be 0 or more, got {self.generation_eval_samples}.")


@dataclass
class LoraArguments:
    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Module names to adapt; all linear layers of the model when unset."}
    )

    use_qlora: bool = field(
        default=False,
        metadata={"help": "QLoRA: LoRA adapters on a 4-bit NF4 base (bitsandbytes, CUDA only); implies use_lora. "
                          "Pair it with `optim: paged_adamw_8bit` to page optimizer states."},
    )

    def __post_init__(self):
        if self.lora_r <= 0:
            raise RecipeError(f"`lora_r` must be positive, got {self.lora_r}.")
        if self.use_qlora:
            if not torch.cuda.is_available():
                raise RecipeError("`use_qlora: true` needs a CUDA GPU (bitsandbytes' 4-bit kernels) and none is "
                                  "visible; use `use_lora: true` without QLoRA here, or run on a GPU.")
            import importlib.util

            if importlib.util.find_spec("bitsandbytes") is None:
                raise RecipeError("`use_qlora: true` needs bitsandbytes: pip install 'finetune[qlora]'.")
            self.use_lora = True


@dataclass
class FinetuneTrainingArguments(TrainingArguments):
    """Hugging Face `TrainingArguments`, with defaults suited to fine-tuning and the demo's before/after report."""

    output_dir: str | None = field(default="outputs/run", metadata={"help": "Where checkpoints and reports go."})
    ddp_comm_hook: Literal["no", "fp16", "bf16"] = field(
        default="no",
        metadata={"help": "Compress DDP gradient all-reduce to fp16/bf16 (a DDP communication hook): halves the "
                          "bytes moved per step on PCIe-linked GPUs. Accelerate configs cannot carry this."},
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "Sequences per optimizer step over all processes; micro-batch and accumulation are "
                          "planned for whatever world size is launched (per_device_train_batch_size caps the micro-batch)."},
    )
    max_micro_batch_size: int | None = field(
        default=None, metadata={"help": "Largest micro-batch that fits in memory (default: per_device_train_batch_size)."}
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = field(
        default="none", metadata={"help": "Scale base_learning_rate from base_batch_size to the global batch."}
    )
    base_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate tuned at base_batch_size (default: learning_rate)."}
    )
    base_batch_size: int | None = field(
        default=None, metadata={"help": "Global batch at which base_learning_rate was tuned (default: this run's)."}
    )
    warmup_tokens: int | None = field(
        default=None, metadata={"help": "Warm up over this many tokens (sets warmup_steps from the batch plan)."}
    )
    loss_normalization: Literal["tokens", "micro_batch_mean"] = field(
        default="tokens",
        metadata={"help": "tokens: every answer token weighs the same across accumulation steps and ranks "
                          "(Trainer's num_items_in_batch). micro_batch_mean: the classic per-micro-batch mean, "
                          "which changes the gradient when the GPU count changes; kept for comparison."},
    )
    eval_on_start: bool = field(
        default=True, metadata={"help": "Evaluate once before the first step, so the report has a 'before'."}
    )
    memory_report: bool = field(
        default=True,
        metadata={"help": "Measure each rank's parameters, gradients, optimizer states and peak memory next to the "
                          "estimator's prediction; writes memory_report.json/.md/.png to output_dir."},
    )
    throughput_report: bool = field(
        default=True,
        metadata={"help": "Log non-pad tokens/s, step time, model TFLOP/s and MFU with the training logs; writes "
                          "throughput.json to output_dir."},
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "Peak TFLOP/s of one device for MFU (default: looked up for known GPUs; none on CPU)."},
    )
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={"help": "Trainer's default (true) logs a NaN/inf step loss as the running average, hiding it; here it "
                          "is logged as it is, and a non-finite loss or grad_norm stops the run with what to change."},
    )
    include_num_input_tokens_seen: Literal["all", "non_padding", "no"] = field(
        default="non_padding",
        metadata={"help": "Trainer's count of input tokens (all, non_padding or no); the throughput report needs it."},
    )


RECIPE_SECTIONS = (ModelArguments, DataArguments, LoraArguments, FinetuneTrainingArguments)


@dataclass
class Recipe:
    """A parsed recipe: one instance per section, in the order the sections are built."""

    model: ModelArguments
    data: DataArguments
    lora: LoraArguments
    training: FinetuneTrainingArguments
    # Where each key given by the user came from: "recipe <path>", "command line" or "batch plan".
    sources: dict[str, str] = field(default_factory=dict)
    batch_plan: BatchPlan | None = None


class RecipeParser(HfArgumentParser):
    """`HfArgumentParser` that raises `RecipeError` instead of printing usage and exiting."""

    def __init__(self):
        super().__init__(RECIPE_SECTIONS, prog="finetune train", allow_abbrev=False)

        # Without an accelerator, Trainer must be told `use_cpu`: otherwise a launcher's DeepSpeed or
        # multi-process config silently trains as ONE process per rank (world size 1).
        self.set_defaults(use_cpu=not torch.accelerator.is_available())

    def error(self, message):
        raise RecipeError(message)

    def known_keys(self) -> set[str]:
        return {action.dest for action in self._actions if action.dest != "help"}


def load_recipe_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file `{path}` does not exist.")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise RecipeError(f"recipe `{path}` is not valid YAML: {error}") from None
    if not isinstance(values, dict):
        raise RecipeError(f"recipe `{path}` must be a mapping of keys to values, got {type(values).__name__}.")
    return values


def parse_recipe(recipe_path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """YAML values become the parser's defaults, then `overrides` (`--key value` strings) win over them.

    Scalars from YAML are passed as strings so that argparse converts and checks them exactly as it
    would on the command line: `learning_rate: abc` fails the same way `--learning_rate abc` does.
    Sections are built in order and the launch configs are linted before `TrainingArguments`, whose
    construction starts the process group.
    """
    parser = RecipeParser()
    values = load_recipe_file(recipe_path) if recipe_path is not None else {}
    overrides = list(overrides or [])
    known = parser.known_keys()
    source = f"recipe `{recipe_path}`" if recipe_path is not None else "the recipe"
    for key in values:
        if key not in known:
            raise RecipeError(f"unknown key `{key}` in {source}{did_you_mean(key, known)}.")
    parser.set_defaults(**{key: _as_argparse_default(value) for key, value in values.items()})
    namespace, remaining = parser.parse_known_args(args=overrides)
    if remaining:
        name = remaining[0].lstrip("-").replace("-", "_")
        raise RecipeError(f"unknown option `{remaining[0]}`{did_you_mean(name, known)}.")
    sources = {key: f"recipe {recipe_path}" for key in values}
    sources.update({_option_name(token): "command line" for token in overrides if token.startswith("--")})
    sections = []
    for section_type in RECIPE_SECTIONS:
        names = {f.name for f in dataclasses.fields(section_type) if f.init}
        inputs = {name: value for name, value in vars(namespace).items() if name in names}
        if section_type is FinetuneTrainingArguments:
            preflight_launch(inputs)
            batch_plan = plan_from_recipe(inputs, sections[1].max_seq_length, int(os.environ.get("WORLD_SIZE", "1")))
            _apply_batch_plan(batch_plan, inputs, sources)
        try:
            sections.append(section_type(**inputs))
        except RecipeError:
            raise
        except (ValueError, TypeError) as error:  # TrainingArguments' own checks
            raise RecipeError(_name_the_culprit(str(error), values, overrides)) from None
    return Recipe(*sections, sources=sources, batch_plan=batch_plan)


def _apply_batch_plan(plan: BatchPlan, training_inputs: dict[str, Any], sources: dict[str, str]) -> None:
    """Writes the planned values into the training section, noting where each changed value came from."""
    planned = {
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "learning_rate": plan.learning_rate,
    }
    if plan.warmup_steps is not None:
        planned["warmup_steps"] = plan.warmup_steps
    for key, value in planned.items():
        if training_inputs.get(key) != value:
            training_inputs[key] = value
            sources[key] = "batch plan (global_batch_size, lr_scaling, warmup_tokens)"


def _option_name(token: str) -> str:
    return token[2:].split("=", 1)[0].replace("-", "_")


def preflight_launch(training_inputs: dict[str, Any]) -> None:
    """Lints the DeepSpeed JSON this process will use and the process count against visible GPUs."""
    from finetune.configs.lint import lint_deepspeed
    from finetune.strategy import launch_deepspeed_config

    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    try:
        config_file, config = launch_deepspeed_config(training_inputs.get("deepspeed"))
    except FileNotFoundError as error:
        raise RecipeError(f"DeepSpeed config `{error.filename}` does not exist (relative to {Path.cwd()}).") from None
    except json.JSONDecodeError as error:
        raise RecipeError(f"the DeepSpeed config is not valid JSON: {error}") from None
    if config is not None:
        problems = lint_deepspeed(config, world_size, source=config_file or "DeepSpeed config")
        if problems:
            raise RecipeError(" ".join(problems))
        save_on_each_node = str(training_inputs.get("save_on_each_node")).lower() == "true"
        if save_on_each_node and config.get("zero_optimization", {}).get("stage") == 3:
            raise RecipeError("`save_on_each_node: true` with ZeRO-3: DeepSpeed gathers the partitioned weights on "
                              "global rank 0 only; save to a filesystem shared by the nodes, or use ZeRO-2, or "
                              "`finetune export` on node 0.")
    resume = training_inputs.get("resume_from_checkpoint")
    if resume not in (None, "", "auto", "false", "False"):
        from finetune.checkpoints import check_explicit_checkpoint

        check_explicit_checkpoint(resume)
    if training_inputs.get("ddp_comm_hook") == "bf16" and not torch.cuda.is_available():
        raise RecipeError("`ddp_comm_hook: bf16` needs CUDA GPUs with NCCL; use fp16 (works over gloo) or no.")
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cpu = str(training_inputs.get("use_cpu")).lower() == "true"
    if not use_cpu and torch.cuda.is_available() and local_processes > torch.cuda.device_count():
        raise RecipeError(f"{local_processes} processes per machine but {torch.cuda.device_count()} visible GPU(s); "
                          "launch with --num_processes equal to the GPU count or fix CUDA_VISIBLE_DEVICES.")


def _name_the_culprit(message: str, values: dict[str, Any], overrides: list[str]) -> str:
    """Prefixes `key: value` to a Trainer error that quotes the value but not the key."""
    given = dict(values)
    given.update({key.lstrip("-"): value for key, value in zip(overrides, overrides[1:]) if key.startswith("--")})
    culprits = [f"`{key}: {value}`" for key, value in given.items() if str(value) and str(value) in message]
    return f"{', '.join(culprits)}: {message}" if len(culprits) == 1 else message


def _as_argparse_default(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return str(value)
    return value
