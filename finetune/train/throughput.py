"""Training throughput as it happens: useful (non-pad) tokens a second, sequences a second, step time, model FLOP/s
and MFU, added to Trainer's logs and summarised in `output_dir/throughput.json`.

Tokens are Trainer's own count (`include_num_input_tokens_seen: non_padding`), summed over ranks once a log reads it
rather than at every micro-step: a window's tokens are those counted since the last log. FLOPs per token
follow nanoGPT's `estimate_mfu` (PaLM appendix B): 6 per matmul parameter, 4 for a frozen one (no weight gradient),
plus 12·L·H·Q·T for attention, T the context a token attends over: the training examples' token-weighted mean length,
each packed example apart (`attention_span`). A 4-bit QLoRA weight counts the elements it stands for. Recomputation
under gradient checkpointing is not counted (that is HFU, not MFU).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow.compute as pc
import torch
from transformers import TrainerCallback

from finetune import outputs
from finetune.launch.devices import known_gpu
from finetune.recipe.batch_plan import BatchPlan


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def peak_tflops_of(name: str) -> float | None:
    """The dense bf16 peak of a known accelerator, its name matched exactly (`finetune.launch.devices.KNOWN_GPUS`),
    or None (a CPU, a GPU without a published figure or not in the table: pass `peak_tflops`)."""
    gpu = known_gpu(name)
    return gpu.peak_tflops if gpu is not None else None


def stored_numel(parameter) -> int:
    """Elements of the weight a parameter stands for: a ZeRO-3 partition by its full size (`ds_numel`), a 4-bit
    QLoRA weight (bitsandbytes' `Params4bit`, whose storage packs two or four values a byte) by the shape its
    `quant_state` records."""
    if hasattr(parameter, "ds_numel"):
        return parameter.ds_numel
    shape = getattr(getattr(parameter, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else parameter.numel()


@dataclass(frozen=True)
class FlopsModel:
    """Training FLOPs per token of a decoder: 6·trainable + 4·frozen matmul parameters + 12·L·H·Q·T."""

    trainable_matmul_parameters: int
    frozen_matmul_parameters: int
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def of(cls, model) -> FlopsModel:
        """Counts the model's parameters by the weights they stand for (`stored_numel`); the input embedding is a
        lookup, not a matmul, unless the output head shares it."""
        config = model.config.get_text_config()  # a vision-language model: its language model's
        embedding = model.get_input_embeddings().weight
        tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embedding
        trainable = frozen = 0
        for parameter in model.parameters():  # parameters() yields a tied weight once
            if parameter is embedding and not tied:
                continue
            size = stored_numel(parameter)
            if parameter.requires_grad:
                trainable += size
            else:
                frozen += size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(trainable, frozen, config.num_hidden_layers, heads, head_dim)

    def per_token(self, sequence_length: float) -> float:
        matmuls = 6 * self.trainable_matmul_parameters + 4 * self.frozen_matmul_parameters
        return matmuls + 12 * self.layers * self.heads * self.head_dim * sequence_length


# Rows read to find the attention span of the training data: enough for a stable mean, cheap on millions of rows.
ATTENTION_SAMPLE_ROWS = 10_000


def attention_span(dataset, rows: int = ATTENTION_SAMPLE_ROWS) -> float | None:
    """The token-weighted mean example length ΣL²/ΣL of (the first `rows` rows of) a tokenized training set: the
    context a token's attention FLOPs grow with. A packed row holds several examples, each attending only to itself
    (its `seq_lengths` list them), so a row's length would overcount them. None for data it cannot read. Read from
    the Arrow columns, not row by row: a rank's start-up pays milliseconds for it."""
    columns = getattr(dataset, "column_names", None) or []
    column = "seq_lengths" if "seq_lengths" in columns else "input_ids" if "input_ids" in columns else None
    if column is None or not hasattr(dataset, "with_format") or not hasattr(dataset, "__getitem__"):
        return None  # a stream (finetune.data.streaming) is not read twice for it
    values = dataset.with_format("arrow")[:rows][column].combine_chunks()
    if column == "seq_lengths":  # a packed row: the length of each example in it
        lengths = values.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        lengths = pc.list_value_length(values).fill_null(0).to_numpy().astype(np.int64)
    tokens = int(lengths.sum())
    return float((lengths * lengths).sum()) / tokens if tokens else None


@dataclass
class Window:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    sequences: int = 0

    def add(self, seconds: float, tokens: int, sequences: int) -> None:
        self.steps, self.seconds = self.steps + 1, self.seconds + seconds
        self.tokens, self.sequences = self.tokens + tokens, self.sequences + sequences


class ThroughputCallback(TrainerCallback):
    """Times each optimizer step (data loading included; evaluation and saving left out), skips the first
    `warmup_steps`, and adds `throughput/*` to every training log; rank 0 writes `throughput.json` at the end.

    `peak_tflops` overrides the accelerator table (per device); without a peak, MFU is left out. In a plain `Trainer`,
    `finetune.train.trainer.log_metrics_first(trainer)` lets `report_to` (TensorBoard, W&B, MLflow) see the figures."""

    adds_logged_metrics = True  # finetune.train.trainer.log_metrics_first: runs before the reporting integrations

    def __init__(self, peak_tflops: float | None = None, warmup_steps: int = 1):
        self.peak_tflops = peak_tflops
        self.warmup_steps = warmup_steps
        self.flops: FlopsModel | None = None
        self.attention_span: float | None = None  # ΣL²/ΣL of the training examples; None: the window's mean row
        self.window, self.total = Window(), Window()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.flops = FlopsModel.of(model)
        self.attention_span = attention_span(getattr(kwargs.get("train_dataloader"), "dataset", None))
        self.device = device_name()
        self.peak = self.peak_tflops or peak_tflops_of(self.device)
        if self.peak is None and self.device != "cpu" and state.is_world_process_zero:
            print(f"warning: no dense bf16 peak is known for `{self.device}`: MFU is left out; set `peak_tflops` "
                  "(TFLOP/s of one device, from its datasheet) to have it.")
        self.sequences_per_step = BatchPlan.running(args).global_batch_size
        self.first_step = state.global_step
        self.mark(state)
        self.clock = time.perf_counter()

    def mark(self, state) -> None:
        """Where the token count stood when tokens were last given to a window: the count is summed over ranks when
        a log reads it, not at every step (finetune.train.trainer.FinetuneTrainerMixin._track_num_input_tokens)."""
        self.tokens_seen, self.step_seen = state.num_input_tokens_seen, state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        seconds, self.clock = now - self.clock, now
        if state.global_step - self.first_step > self.warmup_steps:
            self.window.add(seconds, 0, self.sequences_per_step)
            self.total.add(seconds, 0, self.sequences_per_step)

    def count_tokens(self, state) -> None:
        """Gives the window the tokens of its steps: the tokens counted since the mark, less the warm-up steps'
        share among them (exact when a log falls at the warm-up's end, as with `logging_steps: 1`)."""
        tokens, steps = state.num_input_tokens_seen - self.tokens_seen, state.global_step - self.step_seen
        if steps and self.window.steps:
            share = round(tokens * min(self.window.steps, steps) / steps)
            self.window.tokens += share
            self.total.tokens += share
        self.mark(state)

    def restart_clock(self, *args, **kwargs):
        self.clock = time.perf_counter()

    on_evaluate = on_save = on_predict = restart_clock

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        self.count_tokens(state)
        if not self.window.steps:
            return
        measured = {f"throughput/{key}": value for key, value in self.summary(self.window, args).items()
                    if key in ("tokens_per_second", "step_seconds", "tflops_per_device", "mfu") and value is not None}
        logs.update(measured)
        if state.log_history:
            state.log_history[-1].update(measured)
        self.window = Window()

    def on_train_end(self, args, state, control, **kwargs):
        self.count_tokens(state)  # the steps after the last training log
        if state.is_world_process_zero and self.flops is not None:
            record = {**self.summary(self.total, args), "device": self.device, "world_size": args.world_size,
                      "warmup_steps_skipped": self.warmup_steps, "flops_model": asdict(self.flops)}
            outputs.write_record(args.output_dir, outputs.THROUGHPUT, record)

    def summary(self, window: Window, args) -> dict:
        """Rates over `window`; tokens are non-pad tokens over all ranks (None if Trainer does not count them)."""
        counted = args.include_num_input_tokens_seen != "no" and window.tokens > 0
        result = {"steps": window.steps, "seconds": round(window.seconds, 4),
                  "step_seconds": window.seconds / window.steps if window.steps else None,
                  "sequences_per_second": window.sequences / window.seconds if window.seconds else None,
                  "tokens": window.tokens if counted else None, "tokens_per_second": None,
                  "tflops_per_device": None, "mfu": None, "peak_tflops": self.peak}
        if counted and window.seconds:
            span = self.attention_span or window.tokens / window.sequences  # examples' lengths, not packed rows'
            result["tokens_per_second"] = window.tokens / window.seconds
            result["attention_span"] = span
            result["flops_per_token"] = self.flops.per_token(span)
            flops_per_second = result["tokens_per_second"] * result["flops_per_token"]
            result["tflops_per_device"] = flops_per_second / args.world_size / 1e12
            if self.peak:
                result["mfu"] = result["tflops_per_device"] / self.peak
        return result
