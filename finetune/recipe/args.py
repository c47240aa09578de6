"""The recipe's sections as dataclasses, each field documented where it is declared.

A recipe is flat YAML, as with TRL: model, data, LoRA, the training method (and its own keys, declared by the method:
finetune.recipe.methods) and `TrainingArguments` keys side by side, every Trainer flag under its own name.
`finetune.recipe.parse` parses a file and `--key value` overrides onto these sections.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch
from transformers import TrainingArguments

from finetune import presets
from finetune.errors import RecipeError
from finetune.launch.devices import without_deepspeeds_cpu_inference_collective
from finetune.launch.strategies import is_true
from finetune.launch.watchdog import start_process_group
from finetune.recipe.methods import METHODS


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
    chat_template: str | None = field(
        default=None,
        metadata={"help": "The chat template conversations are rendered with, instead of the tokenizer's own: the "
                          "Jinja text, a file holding it, `chatml`, or `tokenizer_default`. Saved with the "
                          "tokenizer and recorded in effective_config.json."},
    )
    freeze_vision_tower: bool = field(
        default=True,
        metadata={"help": "A vision-language model's vision tower keeps its weights (frozen), as in TRL's and "
                          "LLaMA-Factory's recipes; false trains it too."},
    )
    freeze_projector: bool = field(
        default=False,
        metadata={"help": "A vision-language model's projector (the layers mapping image features into the language "
                          "model: Qwen2-VL's merger, LLaVA's multi_modal_projector) keeps its weights; by default it "
                          "trains, in full, under LoRA too."},
    )
    min_pixels: int | None = field(
        default=None, metadata={"help": "Fewest pixels an image is resized to (Qwen2-VL's family); None: the "
                                        "processor's own."})
    max_pixels: int | None = field(
        default=None, metadata={"help": "Most pixels an image is resized to (Qwen2-VL's family): fewer pixels, fewer "
                                        "image tokens (about one per 28 × 28 pixels for Qwen2-VL); None: the "
                                        "processor's own."})
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "Weight of a mixture-of-experts model's load-balancing loss, added to the loss (TRL's "
                          "SFTConfig key). The loss is on for every architecture that has one (Mixtral, Qwen2-MoE, "
                          "...), as in TRL; None keeps the checkpoint's own weight, 0 turns the loss off. Refused "
                          "for a model without experts (finetune.models.experts)."},
    )

    def __post_init__(self):
        if self.router_aux_loss_coef is not None and not 0 <= self.router_aux_loss_coef < float("inf"):
            raise RecipeError(f"`router_aux_loss_coef: {self.router_aux_loss_coef}`: a weight of 0 or more (0 turns "
                              "the load-balancing loss off).")
        if self.chat_template is not None:
            from finetune.models.loading import chat_template_text

            chat_template_text(self.chat_template)  # a bad value stops here, before any process starts
        if self.torch_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise RecipeError(
                f"`torch_dtype: {self.torch_dtype}` is not one of auto, float32, bfloat16, float16."
            )


# Eval examples scored by generation when the data are the embedded synthetic tasks and the recipe does not say.
SYNTHETIC_GENERATION_SAMPLES = 300


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
    dataset_config: str | None = field(
        default=None,
        metadata={"help": "The configuration (subset) of `dataset` to load (`load_dataset(dataset, name=...)`); the "
                          "dataset's default when unset; a local file or saved dataset has none. With `dataset: "
                          "synthetic`: the tasks to keep (`add`, or `sort,add`)."},
    )
    dataset_split: str = field(
        default="train",
        metadata={"help": "The split of `dataset` to train on (`train_sft`, a slice such as `train[:1000]`, ...); "
                          "a local file's rows are its `train` split, which may be sliced."},
    )
    eval_split: str | None = field(
        default=None,
        metadata={"help": "The split of `dataset` to evaluate on; unset: the first of `eval`, `validation`, `test` "
                          "the dataset has. `none` evaluates on no split of it."},
    )
    dataset_mixture: str | None = field(
        default=None,
        metadata={"help": "Several datasets mixed, as the alignment-handbook writes it: `datasets:` (each `id` or "
                          "`path`, `config`, `split`, `columns`, `data_files`, and one of `weight` (the fraction of "
                          "its rows kept, shuffled with `seed`), `fraction` (its share of the mixture) or `rows`), "
                          "`seed` and `test_split_size` (a fraction, or a count of rows held out for eval). A mapping "
                          "in the recipe, or a YAML/JSON file."},
    )
    mix_files: list[str] | None = field(
        default=None, metadata={"help": "Several local training files to mix (each may have its own format)."}
    )
    mix_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Sampling weight of each of `mix_files` (normalised; equal when unset). Examples are "
                          "drawn with these probabilities until one file runs out."},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "Read the training data as a stream (`load_dataset(..., streaming=True)`): tokenized and "
                          "packed as it is read, never whole on disk or in memory, each process reading its own rows "
                          "(Accelerate shards it). Needs `max_steps` or `max_tokens`; the data summary describes the "
                          "first rows; eval comes from `eval_split` or `eval_file`."},
    )
    max_tokens: int | None = field(
        default=None,
        metadata={"help": "A token budget instead of epochs or `max_steps`: the steps it takes with every row holding "
                          "max_seq_length tokens (packed rows nearly do), global_batch_size rows a step; on a "
                          "stream it needs `packing`."},
    )
    eval_split_ratio: float = field(
        default=0.0,
        metadata={"help": "Hold out this fraction of train (or, 1 and more, this many rows) for evaluation when no "
                          "eval split exists."},
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
    packing_strategy: Literal["bfd", "bfd_split"] = field(
        default="bfd",
        metadata={"help": "With `packing`: bfd keeps every example whole (over-long ones follow `overlong_policy`); "
                          "bfd_split cuts an example longer than max_seq_length into row-long pieces packed like "
                          "examples, so no token is lost (continued pre-training)."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Flatten each micro-batch into one row without padding (Transformers' "
                          "DataCollatorWithFlattening); per_device_train_batch_size still counts examples."},
    )
    dataset_num_proc: int | None = field(
        default=None,
        metadata={"help": "Processes that tokenize (datasets' `map(num_proc=...)`, as TRL's key); one when unset. Pays "
                          "on large data, not on a few thousand rows (start-up of each process)."},
    )
    max_seq_length: int = field(
        default=1024, metadata={"help": "Examples are truncated to this many tokens (prompt and response)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many examples (all when unset)."}
    )
    generation_eval_samples: int | None = field(
        default=None,
        metadata={"help": "Eval examples scored by greedy generation (exact match per task); 0 turns it off. Default: "
                          "300 on the embedded synthetic tasks, whose answers are exact; off on your data, where "
                          "an exact match of open-ended answers means nothing and generating costs minutes."},
    )
    generation_max_new_tokens: int = field(
        default=32, metadata={"help": "Longest answer generated when scoring exact match."}
    )
    eval_harness_tasks: list[str] | None = field(
        default=None,
        metadata={"help": "Score the final model with lm-evaluation-harness when training ends, as the eval command's "
                          "--tasks does: lm-eval task names, `synthetic`, or JSONL files of yours "
                          "(results under <output_dir>/eval_harness/; needs the `eval` extra)."},
    )
    preprocessed_dir: str | None = field(
        default=None,
        metadata={"help": "Where `finetune preprocess` writes the tokenized (and packed) data, and where `finetune "
                          "train` reads it on every rank instead of tokenizing, while its key (data bytes, tokenizer, "
                          "chat template, data keys) matches (default: <output_dir>/preprocessed)."},
    )

    def __post_init__(self):
        paths = [("train_file", self.train_file), ("eval_file", self.eval_file)]
        paths += [("mix_files", path) for path in self.mix_files or []]
        for key, path in paths:
            if path is not None and not Path(path).is_file():
                raise RecipeError(f"`{key}: {path}` does not exist or is not a file.")
        if self.mix_files and self.train_file:
            raise RecipeError("give either `train_file` or `mix_files`, not both.")
        from finetune.data.mixture import check_mix_weights

        check_mix_weights(self.mix_files, self.mix_weights)
        if self.packing_strategy != "bfd" and not self.packing:
            raise RecipeError(f"`packing_strategy: {self.packing_strategy}` needs `packing: true`.")
        if self.packing_strategy == "bfd_split" and self.overlong_policy != "truncate":
            # bfd_split keeps every token of an over-long example in pieces (finetune.data.tokenize.splits_overlong):
            # a policy that drops or refuses it would be skipped without a word
            action = "refuse" if self.overlong_policy == "error" else "drop"
            raise RecipeError(f"`packing_strategy: bfd_split` cuts an example longer than `max_seq_length` into "
                              f"row-long pieces, so `overlong_policy: {self.overlong_policy}` would never apply: use "
                              f"`packing_strategy: bfd` to {action} over-long examples, or leave `overlong_policy` "
                              "unset to train on the pieces.")
        if self.packing and self.padding_free:
            raise RecipeError("choose `packing` (rows of max_seq_length) or `padding_free` (one row per micro-batch).")
        if self.eval_split_ratio < 0 or (self.eval_split_ratio >= 1 and self.eval_split_ratio != int(
                self.eval_split_ratio)):
            raise RecipeError(f"`eval_split_ratio` is a fraction in [0, 1) or a whole count of rows, got "
                              f"{self.eval_split_ratio}.")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise RecipeError(f"`max_tokens` must be positive, got {self.max_tokens}.")
        if self.streaming:
            given = [key for key in ("dataset_mixture", "mix_files") if getattr(self, key)]
            if given or self.eval_split_ratio:
                key = given[0] if given else "eval_split_ratio"
                raise RecipeError(f"`streaming: true` reads one dataset in order and cannot count it, so `{key}` "
                                  "cannot be honoured; mix or split the data ahead of time, or drop `streaming`.")
            if self.max_tokens is not None and not self.packing:
                # The steps of a budget are fixed before the stream is read (finetune.recipe.parse), as rows of
                # max_seq_length tokens: only packed rows hold that many; unpacked ones trained 30-69% of it.
                raise RecipeError(f"`max_tokens: {self.max_tokens}` on a stream counts rows of `max_seq_length` "
                                  "tokens, which only packed rows fill: an unpacked stream would train on a fraction "
                                  "of the budget. Set `packing: true`, or give `max_steps` instead.")
        if self.dataset_mixture is not None:
            from finetune.data.mixture import parse_mixture

            self.mixture = parse_mixture(self.dataset_mixture)
            if self.train_file or self.mix_files or self.dataset != presets.SYNTHETIC_DATASET:
                raise RecipeError("give `dataset_mixture` or one of `dataset`, `train_file`, `mix_files`, not both.")
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            raise RecipeError(f"`dataset_num_proc` must be 1 or more, got {self.dataset_num_proc}.")
        if self.max_seq_length <= 0:
            raise RecipeError(f"`max_seq_length` must be positive, got {self.max_seq_length}.")
        if self.generation_eval_samples is None:
            self.generation_eval_samples = SYNTHETIC_GENERATION_SAMPLES if self.uses_synthetic_tasks else 0
        if self.generation_eval_samples < 0:
            raise RecipeError(f"`generation_eval_samples` must be 0 or more, got {self.generation_eval_samples}.")
        if isinstance(self.eval_harness_tasks, str):
            self.eval_harness_tasks = [self.eval_harness_tasks]

    mixture = None  # the parsed `dataset_mixture` (finetune.data.mixture.Mixture), set by __post_init__

    @property
    def uses_synthetic_tasks(self) -> bool:
        """Training and evaluating on the embedded tasks (reverse, sort, add), whose answers can be matched exactly."""
        return self.dataset == presets.SYNTHETIC_DATASET and not (self.train_file or self.mix_files or self.eval_file
                                                                  or self.dataset_mixture)


@dataclass
class LoraArguments:
    # `lora_target_modules` values that name a set of layers rather than layers
    # (finetune.models.lora.lora_target_modules)
    target_presets = ("all-linear", "attention")

    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names to adapt (e.g. `[q_proj, v_proj]`), or one preset: `all-linear` (peft's: every "
                          "linear layer but the output head; the default when unset) or `attention` (the attention "
                          "projections only, q/k/v/o, found in the model's attention modules)."},
    )
    use_dora: bool = field(
        default=False,
        metadata={"help": "DoRA (Liu et al. 2024): each adapted weight split into a trained magnitude vector and a "
                          "LoRA-updated direction; better at low rank, slower per step (merge it for inference)."},
    )
    use_rslora: bool = field(
        default=False,
        metadata={"help": "Rank-stabilized LoRA (Kalajdzievski 2023): scale = alpha / sqrt(r) instead of alpha / r, "
                          "so higher ranks keep learning."},
    )
    modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Modules trained in full and saved with the adapter, by name (e.g. `[embed_tokens, "
                          "lm_head]` after adding tokens); each must name a module of the model."},
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
                raise RecipeError("`use_qlora: true` needs bitsandbytes: pip install bitsandbytes "
                                  "(the `qlora` extra of finetune-kit).")
            self.use_lora = True
        self._check_adapter_keys()

    def _check_adapter_keys(self) -> None:
        """Adapter keys without `use_lora` would do nothing, and a preset mixed with names is ambiguous."""
        asked = [key for key in ("use_dora", "use_rslora", "modules_to_save") if getattr(self, key)]
        if asked and not self.use_lora:
            raise RecipeError(f"`{asked[0]}` configures LoRA adapters but `use_lora` is false: set `use_lora: true` "
                              f"(or drop `{asked[0]}`).")
        targets = self.lora_target_modules or []
        presets_named = [name for name in targets if name in self.target_presets]
        if presets_named and len(targets) > 1:
            raise RecipeError(f"`lora_target_modules: {targets}` mixes the preset `{presets_named[0]}` with other "
                              "names: give the preset alone, or a list of module names.")


@dataclass
class MethodArguments:
    """What is trained for: the training method (finetune.recipe.methods); each method documents its own keys."""

    method: str = field(
        default="sft",
        metadata={"help": f"The training method: {', '.join(METHODS)} (finetune.recipe.methods; each method's own "
                          "keys are listed under it)."},
    )


# The trackers' packages, where their names differ from the integration's or are worth naming in the install hint.
TRACKER_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard", "comet_ml": "comet_ml",
                    "clearml": "clearml", "neptune": "neptune", "dvclive": "dvclive", "swanlab": "swanlab",
                    "trackio": "trackio", "codecarbon": "codecarbon"}


def check_trackers(report_to: list[str]) -> None:
    """Each tracker `report_to` names is one Trainer has and is installed, said while the recipe is read (Trainer
    would stop with a traceback once the model is loaded)."""
    import importlib.util

    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    from finetune.errors import did_you_mean

    known = list(INTEGRATION_TO_CALLBACK)
    for name in report_to:
        if name not in known:
            raise RecipeError(f"`report_to: {name}` is not a tracker Trainer knows{did_you_mean(name, known)}: one or "
                              f"more of {', '.join(known)}, or all, or none.")
        package = TRACKER_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            extra = " (pip install 'finetune-kit[tracking]')" if name in ("wandb", "mlflow") else ""
            raise RecipeError(f"`report_to: {name}` needs the {package} package, which is not installed: pip install "
                              f"{package}{extra}, or leave {name} out of report_to.")
    if "wandb" in report_to:
        check_wandb_login(os.environ)
    if "mlflow" in report_to:
        check_mlflow_store(os.environ)


def check_wandb_login(environ) -> None:
    """W&B logs in with WANDB_API_KEY or the key `wandb login` wrote to the netrc file (NETRC, else ~/.netrc:
    wandb/sdk/lib/wbauth/wbnetrc.py), for the host of WANDB_BASE_URL; offline or disabled runs need none. Without
    any, `wandb.init` fails once the model and data are loaded, or waits for a key on the terminal."""
    import netrc
    from urllib.parse import urlparse

    if environ.get("WANDB_API_KEY") or environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") \
            or environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = Path(environ["NETRC"]).expanduser() if environ.get("NETRC") else next(
        (candidate for candidate in (Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser())
         if candidate.exists()), None)
    try:
        if path is not None and path.is_file() and netrc.netrc(path).authenticators(host):
            return
    except (netrc.NetrcParseError, OSError):
        pass  # as wandb reads it: no key
    raise RecipeError(f"`report_to: wandb` but W&B has no key for {host} (no WANDB_API_KEY, nothing in "
                      f"{path or '~/.netrc'}): run `wandb login`, or set WANDB_MODE=offline to keep the run on disk "
                      "(`wandb sync` later).")


def check_mlflow_store(environ) -> None:
    """MLflow logs to MLFLOW_TRACKING_URI; without it, to `sqlite:///mlflow.db` in the working directory (MLflow 3:
    mlflow/store/tracking/__init__.py, DEFAULT_TRACKING_URI), or `./mlruns` where one already holds runs. A SQLite
    store needs SQLAlchemy and Alembic, which mlflow-skinny lacks; a file store is refused by MLflow 3 unless
    MLFLOW_ALLOW_FILE_STORE is set. Either ends in a traceback once the model and data are loaded."""
    import importlib.util

    from mlflow.tracking._tracking_service.utils import _get_default_tracking_uri

    given = environ.get("MLFLOW_TRACKING_URI")
    uri = given or _get_default_tracking_uri()
    where = f"MLFLOW_TRACKING_URI={uri}" if given else f"MLflow's default store, {uri} (no MLFLOW_TRACKING_URI)"
    scheme = uri.split(":", 1)[0] if "://" in uri or uri.startswith("file:") else "file"
    if scheme in ("sqlite", "postgresql", "mysql", "mssql"):
        missing = [package for package in ("sqlalchemy", "alembic") if importlib.util.find_spec(package) is None]
        if missing:
            raise RecipeError(f"`report_to: mlflow` logs to {where}, which needs {' and '.join(missing)} (not "
                              "installed: mlflow-skinny): pip install mlflow, or set MLFLOW_TRACKING_URI to a "
                              "tracking server (http://HOST:5000).")
    if scheme == "file" and environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        raise RecipeError(f"`report_to: mlflow` logs to {where}, a file store, which MLflow 3 refuses unless "
                          "MLFLOW_ALLOW_FILE_STORE=true: set it, or set MLFLOW_TRACKING_URI to a tracking server "
                          "(http://HOST:5000) or a sqlite:/// database.")


@dataclass
class FinetuneTrainingArguments(TrainingArguments):
    """Hugging Face `TrainingArguments`, with defaults suited to fine-tuning and the demo's before/after report."""

    output_dir: str | None = field(
        default="outputs/run",
        metadata={"help": "Where checkpoints and reports go; a default, so that a recipe may leave it out."},
    )
    report_to: list[str] | None = field(
        default_factory=lambda: ["tensorboard"],
        metadata={"help": "Where the training logs go, as Trainer takes it (tensorboard, wandb, mlflow, ..., all or "
                          "none; several: `--report_to wandb mlflow`). TensorBoard by default: an event file under "
                          "<output_dir>/runs with the loss, learning rate, memory/* and throughput/* (`tensorboard "
                          "--logdir <output_dir>/runs`), nothing to sign up for. A W&B or MLflow run also gets the "
                          "effective configuration (effective_config.json's values and the model, data, LoRA and "
                          "method keys) as parameters named finetune/*."},
    )
    ddp_comm_hook: Literal["no", "fp16", "bf16"] = field(
        default="no",
        metadata={"help": "Compress DDP gradient all-reduce to fp16/bf16 (a DDP communication hook): halves the "
                          "bytes moved per step on PCIe-linked GPUs. Accelerate configs cannot carry this."},
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "Sequences per optimizer step over all processes; micro-batch and accumulation are "
                          "planned for whatever world size is launched (per_device_train_batch_size caps the "
                          "micro-batch)."},
    )
    max_micro_batch_size: int | None = field(
        default=None,
        metadata={"help": "Largest micro-batch that fits in memory (default: per_device_train_batch_size)."},
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
    pure_bf16: bool = field(
        default=False,
        metadata={"help": "Hold trainable weights, gradients and Adam states in bf16 (8 bytes/param instead of 16): "
                          "less memory, but updates smaller than half a bf16 step are rounded away. Off: trainable "
                          "weights are fp32 masters whatever the checkpoint's dtype (single process and DDP only)."},
    )
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata={"help": "dtype of the final model's weights (a full fine-tune; checkpoints keep the training "
                          "precision for an exact resume): auto saves them in the checkpoint's own dtype, bf16 in, "
                          "bf16 out (fp32 for the tiny model built in code); float32 keeps the fp32 masters' every "
                          "digit at twice the size."},
    )
    loss_normalization: Literal["tokens", "micro_batch_mean"] = field(
        default="tokens",
        metadata={"help": "tokens: every answer token weighs the same across accumulation steps and ranks "
                          "(Trainer's num_items_in_batch). micro_batch_mean: the classic per-micro-batch mean, "
                          "which changes the gradient when the GPU count changes; kept for comparison."},
    )
    fused_lm_head: bool = field(
        default=True,
        metadata={"help": "Score the tokens through TRL's fused LM head (`add_fused_lm_head`): only the positions "
                          "with a label are projected, in tiles, and the (batch, sequence, vocabulary) logits are "
                          "never built. false: the loss from the full logits, for comparison, where the method's "
                          "trainer has that path (the recipe reference says which); the others refuse it."},
    )
    strategy: str | None = field(
        default=None,
        metadata={"help": "How `finetune train` launches itself when no launcher started it: a shipped strategy (ddp, "
                          "zero1, zero2, zero2_offload, zero3, zero3_offload, zero3_nvme, fsdp_full_shard, "
                          "fsdp_shard_grad_op; `--dry-run` prints the launch without running it), or auto: "
                          "the first in the decision tree that `finetune plan` finds fits this recipe, its data and "
                          "these GPUs. Default: auto on GPUs, one process without. Under `accelerate launch` the "
                          "launch decides, and a strategy named here must be the one it runs."},
    )
    dp_shard_size: int | None = field(
        default=None,
        metadata={"help": "Beside an axis of Accelerate's mesh (tensor, sequence or context parallelism): the "
                          "processes each group's parameters, gradients and optimizer states are sharded over "
                          "(FSDP2). Default: the processes the other axes leave."},
    )
    dp_replicate_size: int | None = field(
        default=None,
        metadata={"help": "Beside an axis of Accelerate's mesh (tensor, sequence or context parallelism): full "
                          "replicas of the sharded model (HSDP; e.g. the node count), only the gradient all-reduce "
                          "crossing them. Default 1."},
    )
    save_calibration: bool = field(
        default=True,
        metadata={"help": "On GPUs, a finished run stores how far its peak exceeded the prediction, as a share of "
                          "it, in the calibration store (per GPU model, strategy, method and model size class), which "
                          "later plans of that class on that GPU add; CPU runs and models under 1B parameters store "
                          "nothing (finetune.plan.calibration)."},
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
        metadata={"help": "Trainer's default (true) logs a NaN/inf step loss as the running average, hiding it; "
                          "here it is logged as it is, and a non-finite loss or grad_norm stops the run with what to "
                          "change."},
    )
    include_num_input_tokens_seen: Literal["all", "non_padding", "no"] = field(
        default="non_padding",
        metadata={"help": "Trainer's count of input tokens (all, non_padding or no), summed over ranks when a log or "
                          "a checkpoint reads it, not at every micro-step; the throughput report needs it."},
    )
    model_load_timeout: float = field(
        default=7200,
        metadata={"help": "Seconds the other ranks wait for global rank 0 to read the checkpoint (or first download "
                          "it) under FSDP2's rank-0 loading, apart from `ddp_timeout`, which bounds training's "
                          "collectives: a 70B's 141 GB at 20 MB/s takes 2 hours."},
    )
    save_on_preemption: bool | None = field(
        default=None,
        metadata={"help": "On SIGTERM (a preemption, or a SLURM job's end), every rank saves a complete checkpoint "
                          "at the step it is at and the run exits, to be resumed with `resume_from_checkpoint: "
                          "auto`. Off: SIGTERM stops the run and the newest complete checkpoint stays as it was. "
                          "Default: on under SLURM (SLURM_JOB_ID set), off otherwise."},
    )

    def __post_init__(self):
        if isinstance(self.report_to, (list, tuple)):  # `--report_to wandb,mlflow` is one word: two trackers
            self.report_to = [name.strip() for entry in self.report_to for name in str(entry).split(",")
                              if name.strip()]
        super().__post_init__()
        check_trackers(self.report_to)

    @cached_property
    def _setup_devices(self):
        without_deepspeeds_cpu_inference_collective(bool(self.deepspeed) or is_true(os.environ.get(
            "ACCELERATE_USE_DEEPSPEED")))  # before DeepSpeed's backend starts with the process group
        start_process_group(self)  # with ddp_timeout, which Transformers leaves out on CPU (finetune.launch.watchdog)
        return super()._setup_devices


# In the order they are built: the training section last, since constructing it starts the process group.
RECIPE_SECTIONS = (ModelArguments, DataArguments, LoraArguments, MethodArguments,
                   FinetuneTrainingArguments)



def trl_config(trl_class: str, name: str, module: str, doc: str):
    """A method's TRL config and ours in one dataclass (`trl_class`: "trl.module:Class"), built when first asked for,
    and the `__getattr__` its method module answers with: Trainer pickles its arguments into training_args.bin and
    unpickling finds the class by `module` and `name`. Every Trainer key keeps the value the recipe gave (or Trainer's
    default): TRL's own defaults for them (bf16, gradient checkpointing, its learning rate, logging every 10 steps) do
    not apply, so a method's recipe reads as an SFT one. Importing TRL is left to the first use: it costs every rank
    of every run a quarter second."""
    import functools

    @functools.cache
    def config() -> type:
        where, class_name = trl_class.split(":")
        combined = dataclass(type(name, (FinetuneTrainingArguments, getattr(trl_config_module(where), class_name)),
                                  {"__doc__": doc}))
        combined.__qualname__, combined.__module__ = name, module
        return combined

    def module_getattr(attribute: str):
        if attribute == name:
            return config()
        raise AttributeError(f"module {module!r} has no attribute {attribute!r}")

    return config, module_getattr


TRL_EXPERIMENTAL_SILENCE = "TRL_EXPERIMENTAL_SILENCE"


@contextmanager
def quiet_trl_experimental():
    """TRL's experimental trainers, imported without the notice `trl.experimental` prints on import unless
    TRL_EXPERIMENTAL_SILENCE is set (trl/experimental/__init__.py): set for the import only. What is used of them is
    pinned with TRL (pyproject.toml) and tested (tests/train/test_cpo.py)."""
    before = os.environ.get(TRL_EXPERIMENTAL_SILENCE)
    os.environ[TRL_EXPERIMENTAL_SILENCE] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[TRL_EXPERIMENTAL_SILENCE]
        else:
            os.environ[TRL_EXPERIMENTAL_SILENCE] = before


def trl_config_module(where: str):
    """TRL's config module `where`. A config of trl.experimental is read from its own file: its package imports the
    trainer beside it (trl/experimental/cpo/__init__.py), and reading a recipe loads no trainer. It is registered under
    its name, so the package takes this one when a run imports the trainer."""
    import importlib
    import importlib.util
    import sys

    if not where.startswith("trl.experimental.") or where in sys.modules:
        return importlib.import_module(where)
    trl_folder = Path(importlib.util.find_spec("trl").origin).parent
    spec = importlib.util.spec_from_file_location(where, trl_folder.joinpath(*where.split(".")[1:]).with_suffix(".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[where] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[where]
        raise
    return module
