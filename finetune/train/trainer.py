"""`FinetuneTrainerMixin`: the toolkit's guarantees for a Hugging Face `Trainer`, each in the method a reader looks in;
`FinetuneTrainer` is Trainer with them; each training method's trainer (finetune/train/methods/) is TRL's with them.

- `FinetuneTrainer.compute_loss`: how the loss of a micro-batch is normalised (`loss_normalization`).
- `FinetuneTrainer._set_signature_columns_if_needed`: packed rows keep their `seq_lengths`, which the collator turns
  into `position_ids` (Trainer drops the columns the model's forward does not name).
- `_save_checkpoint`: a checkpoint counts as complete only once every rank saved it; rotation then keeps the
  `save_total_limit` newest complete ones and the best one (finetune.checkpoints.complete), on every node's disk under
  `save_on_each_node`.
- `save_model`: weights `from_pretrained` loads under FSDP's sharded state dict too, and with `save_on_each_node`
  on every node, not only global rank 0.
- `train`: resuming checks the checkpoint's layout first, and continues a DeepSpeed checkpoint saved with another
  world size through DeepSpeed's universal format.
- `_load_optimizer_and_scheduler`: a resumed schedule runs at this run's `learning_rate` and warmup from the resume
  step, and `effective_config.json` says so.
- the DDP communication hook (`ddp_comm_hook`) is registered when Trainer wraps the model; a LoRA model is wrapped
  without DDP's search for unused parameters, as Trainer wraps a plain model (`every_trainable_weight_is_used`).
- `create_accelerator_and_postprocess`: FSDP2 mixed precision computes in bf16/fp16 but reduces gradients and returns
  the loss in fp32, as autocast does under DDP (Accelerate's policy casts both to the half dtype).
- `__init__`: the callbacks that add figures to the logs (memory, throughput) run before `report_to`'s integrations,
  so TensorBoard, W&B and MLflow receive them (`log_metrics_first`).
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path

from accelerate.utils import DDPCommunicationHookType
from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from finetune import outputs
from finetune.checkpoints.complete import (
    checkpoint_layout,
    continue_schedule_at_this_runs_rate,
    mark_complete,
    name_deepspeed_tag_on_this_node,
    prepare_resume,
    rotate_complete_checkpoints,
)
from finetune.checkpoints.disk import needed_checkpoint_bytes, saving_within_free_space, trainable_parameter_bytes
from finetune.checkpoints.sharded_state import load_sharded_model, load_sharded_optimizer, save_sharded_state
from finetune.launch.strategies import loaded_sharded
from finetune.memory.estimate import liger_config_given
from finetune.memory.ledger import optimizer_chain
from finetune.models.loading import dtype_name, saved_dtype
from finetune.recipe.batch_plan import BatchPlan, data_parallel_size

# Config keys that count a model's routed experts: an expert no token was routed to leaves its weights unused.
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def every_trainable_weight_is_used(model) -> bool:
    """A PEFT model whose trainable weights are its adapters, every one used in each forward pass, so DDP need not
    search for unused ones. Trainer asks DDP to search for any model not a `PreTrainedModel` (trainer.py,
    `_build_accelerator_args`), which costs a walk of the autograd graph a step and makes torch's reducer warn on
    every rank that it found none. Not for mixture-of-experts models, whose unrouted experts' adapters go unused."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return False
    config = getattr(model.get_base_model(), "config", None)
    return not any((getattr(config, key, None) or 0) > 1 for key in EXPERT_COUNTS)


def log_metrics_first(trainer: Trainer) -> None:
    """Moves the callbacks that add figures to a log (`adds_logged_metrics`) ahead of all others. Trainer calls its
    callbacks' `on_log` in order with one `logs` dict, and puts `report_to`'s integrations before the callbacks it is
    given: a TensorBoard writer would otherwise have written the step's scalars before memory and throughput join."""
    callbacks = trainer.callback_handler.callbacks
    callbacks.sort(key=lambda callback: not getattr(callback, "adds_logged_metrics", False))  # stable: order kept


class FinetuneTrainerMixin:
    """The toolkit's guarantees for any `Trainer` subclass: `class X(FinetuneTrainerMixin, SomeTrainer)`.
    `FinetuneTrainer` (supervised fine-tuning) and each training method's TRL trainer (finetune/train/methods/) are
    such.

    `recipe_values` (finetune.checkpoints.complete.recipe_values) and `train_data` (the training rows' fingerprint,
    finetune.data.summary.fingerprint) are recorded in every checkpoint, so that a resumed run can name what
    changed."""

    def __init__(self, *args, recipe_values: dict[str, str] | None = None, train_data: str | None = None, **kwargs):
        # Trainer refuses to checkpoint a model Transformers loaded sharded unless only the model is saved; this class
        # saves its optimizer's slices itself (finetune.checkpoints.sharded_state).
        training_args = kwargs.get("args")
        sharded = getattr(kwargs.get("model"), "is_distributed_loading_by_transformers", False) \
            and training_args is not None and not training_args.save_only_model
        if sharded:
            training_args.save_only_model = True
        if training_args is not None and training_args.ddp_find_unused_parameters is None \
                and every_trainable_weight_is_used(kwargs.get("model")):
            training_args.ddp_find_unused_parameters = False  # Trainer's default for a PEFT model is True
        try:
            super().__init__(*args, **kwargs)
        finally:
            if sharded:
                training_args.save_only_model = False
        log_metrics_first(self)
        self.recipe_values = recipe_values or {}
        self.train_data = train_data
        # Rotated here once every rank has saved (see _save_checkpoint), not by Trainer as soon as rank 0 has.
        self.save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        if self.args.ddp_comm_hook != "no":  # Trainer builds the DDP kwargs handler; the hook goes on at wrapping
            self.accelerator.ddp_handler.comm_hook = DDPCommunicationHookType(self.args.ddp_comm_hook)

    @property
    def global_batch_size(self) -> int:
        """Sequences a step: micro-batch × processes × accumulation, as the arguments run it (recipe.batch_plan)."""
        return BatchPlan.running(self.args).global_batch_size

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        plugin = self.accelerator.state.fsdp_plugin if self.is_fsdp_enabled else None
        if plugin is not None and plugin.fsdp_version == 2 and self.accelerator.mixed_precision in ("bf16", "fp16"):
            import torch
            from torch.distributed.fsdp import MixedPrecisionPolicy

            # Accelerate's FSDP2 policy also reduce-scatters gradients and casts the model's outputs (the loss among
            # them) to the half dtype: a loss logged to 3 significant digits and half-precision gradient sums.
            compute = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else torch.float16
            plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)

    def _save_checkpoint(self, model, trial):
        self._sum_tokens_seen()  # the checkpoint's trainer_state.json holds the count a resume continues from
        folder = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        # A full disk stops in one line, before the save where it can be foreseen (finetune.checkpoints.disk).
        with saving_within_free_space(folder, needed_checkpoint_bytes(folder.parent, trainable_parameter_bytes(model))):
            super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()  # every rank has written its part
        # `should_save`: global rank 0, or with `save_on_each_node` each node's first process, which marks and
        # rotates its own node's disk (the other nodes' checkpoints would otherwise stay unmarked and pile up).
        if self.args.should_save and folder.is_dir():
            peft_config = getattr(self.accelerator.unwrap_model(model), "peft_config", {}).get("default")
            if self._fsdp_sharded() and peft_config is not None:
                # The shards hold the adapters but Trainer writes no adapter_config.json beside them: `finetune
                # export` needs it to rebuild the adapted model.
                peft_config.save_pretrained(folder)
            if self.is_deepspeed_enabled and self.args.save_on_each_node:
                name_deepspeed_tag_on_this_node(folder)
            # the dtype the run's final weights are written in, for `finetune export` of this checkpoint
            final_dtype = saved_dtype(self.accelerator.unwrap_model(self.model), self.args.save_dtype)
            layout = {**checkpoint_layout(self), "final_weights_dtype": final_dtype and dtype_name(final_dtype)}
            mark_complete(folder, self.state.global_step, layout, self.recipe_values, self.train_data)
            rotate_complete_checkpoints(folder.parent, self.save_total_limit, self.state.best_model_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        # A checkpoint's weights (`_internal_call`) are checked with the whole checkpoint in _save_checkpoint, and
        # keep the training precision: resuming reads them. The final model is written in `save_dtype` (_save).
        final_save = nullcontext() if _internal_call else saving_within_free_space(
            Path(output_dir or self.args.output_dir), trainable_parameter_bytes(self.model), what="the model")
        self.final_weights_dtype = None if _internal_call else saved_dtype(
            self.accelerator.unwrap_model(self.model), self.args.save_dtype)
        try:
            with final_save:
                super().save_model(output_dir, _internal_call)
            if not _internal_call:
                self._save_final_weights_elsewhere(output_dir or self.args.output_dir)
        finally:
            self.final_weights_dtype = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's save, the final weights of a full fine-tune cast to `final_weights_dtype` (a bf16 checkpoint
        comes out bf16, not in its fp32 masters at twice the size); adapters are saved as peft saves them."""
        dtype, state_dict = self._final_weights(state_dict)
        super()._save(output_dir, state_dict)
        if dtype is not None and self.args.should_save:
            record_config_dtype(Path(output_dir or self.args.output_dir), dtype)

    def _final_weights(self, state_dict: dict | None) -> tuple[object, dict | None]:
        """`(dtype, state_dict)` a final save writes: a full fine-tune's weights cast to `final_weights_dtype`;
        `(None, state_dict)` as given for a checkpoint, adapters (saved as peft saves them) or nothing to cast."""
        dtype, model = getattr(self, "final_weights_dtype", None), self.accelerator.unwrap_model(self.model)
        if dtype is None or not isinstance(model, PreTrainedModel):
            return None, state_dict
        return dtype, cast_state_dict(model.state_dict() if state_dict is None else state_dict, dtype)

    def _save_final_weights_elsewhere(self, output_dir: str) -> None:
        other_node = self.args.save_on_each_node and self.args.should_save and self.args.process_index != 0
        state_dict = None
        if self.is_fsdp_enabled and self.args.save_on_each_node:
            state_dict = self._gather_full_state_dict(keep=self.args.should_save)  # a collective: every rank
        if self._fsdp_sharded():
            # With a sharded state dict Trainer writes no weights at all: save the full one as any model is saved,
            # loadable by from_pretrained (gathered above, or by Accelerate on rank 0: a collective too).
            if not self.args.save_on_each_node:
                state_dict = self.accelerator.get_state_dict(self.model)
            self._save(output_dir, state_dict=state_dict)
        if other_node:
            self._save_weights_on_this_node(output_dir, state_dict)

    def _fsdp_sharded(self) -> bool:
        """FSDP saving a sharded state dict: Trainer then writes no weights of its own."""
        return self.is_fsdp_enabled and "SHARDED" in str(self.accelerator.state.fsdp_plugin.state_dict_type)

    def _gather_full_state_dict(self, keep: bool) -> dict | None:
        """FSDP2's parameters gathered whole one at a time (a collective, on every rank), kept in host memory where
        `keep`: each node's first process then holds one copy (Accelerate's gather keeps it on rank 0 only)."""
        from torch.distributed.tensor import DTensor

        state_dict = {}
        for name, tensor in self.accelerator.unwrap_model(self.model).state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keep:
                state_dict[name] = full.detach().cpu()
        return state_dict if keep else None

    def _save_weights_on_this_node(self, output_dir: str, state_dict: dict | None) -> None:
        """`save_on_each_node` is for nodes without a shared filesystem, but Transformers' `save_pretrained` writes
        weights on global rank 0 only: the other nodes would get a tokenizer and no model. Their local main process
        writes the weights too (whole on every rank under DDP and ZeRO-0/1/2, gathered under FSDP), through the same
        `save_pretrained`."""
        model = self.accelerator.unwrap_model(self.model)
        if state_dict is None and self.is_deepspeed_enabled:  # what Trainer.save_model gives save_pretrained on rank 0
            state_dict = self.accelerator.get_state_dict(self.deepspeed)
        dtype, state_dict = self._final_weights(state_dict)  # the final weights, as on rank 0 (_save)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.should_save_on_this_rank = lambda is_main_process: is_main_process  # this instance, this call only
        try:
            model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)
        finally:
            del base.should_save_on_this_rank
        if dtype is not None:
            record_config_dtype(Path(output_dir), dtype)

    def _track_num_input_tokens(self, inputs) -> None:
        """Trainer's count of input tokens (`include_num_input_tokens_seen`), without its gather and `.item()` on
        every micro-step (a collective and a host sync each, across the network on a multi-node run): each rank adds
        its own count on its device, and the ranks' counts are summed into the state once a log or a save reads it
        (`_sum_tokens_seen`). The cases Trainer only warns about (no input ids, no way to tell padding) stay its."""
        mode, name = self.args.include_num_input_tokens_seen, getattr(self.model, "main_input_name", "input_ids")
        pad = getattr(self.processing_class, "pad_token_id", None)
        if mode == "no" or name not in inputs or (mode == "non_padding" and "attention_mask" not in inputs
                                                  and pad is None):
            return super()._track_num_input_tokens(inputs)
        if mode == "all":
            tokens = inputs[name].numel()
        else:
            tokens = inputs["attention_mask"].sum() if "attention_mask" in inputs else (inputs[name] != pad).sum()
        self._tokens_not_summed = getattr(self, "_tokens_not_summed", 0) + tokens

    def _sum_tokens_seen(self) -> None:
        """Adds every rank's tokens counted since the last sum to `state.num_input_tokens_seen`: one all-reduce. Called
        where Trainer reads the count (a log, a checkpoint's state), which every rank reaches at the same step. The
        ranks of a tensor (sequence, context) parallel group share one batch: it is counted once."""
        if self.args.include_num_input_tokens_seen == "no":
            return
        import torch

        tokens, self._tokens_not_summed = getattr(self, "_tokens_not_summed", 0), 0
        tokens = torch.as_tensor(tokens, device=self.args.device, dtype=torch.int64)
        sharing = self.args.world_size // data_parallel_size(self.args)
        self.state.num_input_tokens_seen += int(self.accelerator.reduce(tokens, reduction="sum").item()) // sharing

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        self._sum_tokens_seen()
        super().log(logs, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._loaded_sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        import torch
        from transformers.trainer import SCHEDULER_NAME

        save_sharded_state(self.model, optimizer_chain(self.optimizer)[-1], Path(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._loaded_sharded():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_sharded_model(self.model, Path(resume_from_checkpoint))

    def _loaded_sharded(self) -> bool:
        """The model was loaded sharded by Transformers (tensor parallel): its state is saved as slices. Read off the
        model, as the strategy check and the ledger read it (finetune.launch.strategies.loaded_sharded)."""
        return loaded_sharded(self.model) is not None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._loaded_sharded():
            import torch
            from transformers.trainer import SCHEDULER_NAME

            load_sharded_optimizer(self.model, optimizer_chain(self.optimizer)[-1], Path(checkpoint))
            self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_NAME, weights_only=True))
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        change = continue_schedule_at_this_runs_rate(self.lr_scheduler, self.args.learning_rate)
        if self.is_world_process_zero():
            if change:
                print(f"resuming from {checkpoint}: {change}")
            effective = outputs.read_record(self.args.output_dir, outputs.EFFECTIVE_CONFIG, missing={})
            effective["resumed"] = {"checkpoint": str(checkpoint), "step": self.state.global_step,
                                    "schedule": change or "the checkpoint's, unchanged"}
            outputs.write_record(self.args.output_dir, outputs.EFFECTIVE_CONFIG, effective)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        size_nvme_param_buffer(self)  # before DeepSpeed starts: it would assert on a partition the buffer cannot hold
        if self.is_deepspeed_enabled:  # ZeRO++'s "auto" hpZ group: the processes of one node, as launched
            from finetune.configs.deepspeed import fill_hpz_partition_size

            fill_hpz_partition_size(self.accelerator.state.deepspeed_plugin.deepspeed_config,
                                    int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if isinstance(resume_from_checkpoint, str):
            prepare_resume(self, resume_from_checkpoint)  # stops, or converts a checkpoint saved with another layout
        return super().train(resume_from_checkpoint, *args, **kwargs)


class FinetuneTrainer(FinetuneTrainerMixin, Trainer):
    """Supervised fine-tuning: Trainer with the toolkit's guarantees and its loss normalisation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.full_logits_reason = full_logits_reason(self)
        if self.full_logits_reason is None:  # the loss from TRL's fused LM head: no (batch, sequence, vocab) logits
            from trl.trainer.utils import add_fused_lm_head

            keep_the_fused_head_under_liger(self.args)

            model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            add_fused_lm_head(model)  # generation and any other call without `fused_lm_head` keep the model's forward
        if self.args.loss_normalization == "micro_batch_mean":
            # compute_loss returns each micro-batch's own mean and training_step divides it by the accumulation steps;
            # Trainer then need not count (and all-reduce) the step's answer tokens before every step.
            self.loss_is_scaled_for_ga = False
            self.model_accepts_loss_kwargs = False

    def _set_signature_columns_if_needed(self) -> None:
        """The model's inputs, and the packed rows' `seq_lengths` that the collator turns into `position_ids`
        (finetune.data.collate): Trainer would drop a column the model's forward does not name."""
        super()._set_signature_columns_if_needed()
        if "seq_lengths" not in self._signature_columns:
            self._signature_columns.append("seq_lengths")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of one micro-batch.

        `tokens` (default): every answer token of the optimizer step weighs the same, whatever the micro-batch, the
        accumulation step or the rank it falls in. Trainer counts the answer tokens of the whole step over every
        micro-batch and rank (`num_items_in_batch`); the model sums its token losses and divides by that count, and
        Trainer multiplies by the number of processes, which DDP's and DeepSpeed's gradient averaging divide out.
        So 1 process × 4 accumulation steps and 2 processes × 2 give the same update.

        `micro_batch_mean`: the classic mean over this micro-batch's answer tokens, divided by the accumulation steps
        (`loss_is_scaled_for_ga` False); a micro-batch with few answer tokens then weighs as much as a full one, and
        the update changes with the GPU count. Kept for comparison.

        Either way the token losses come from TRL's fused LM head (`add_fused_lm_head`): the head projects only the
        positions with a label, in tiles, and the (batch, sequence, vocab) logits and their fp32 copies are never
        built; where a feature needs the full logits (`full_logits_reason`), the model's own loss computes them.
        """
        if self.args.loss_normalization == "micro_batch_mean":
            num_items_in_batch = None
        if self.full_logits_reason is None:
            inputs = {**inputs, "fused_lm_head": True}
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        excess = self._gradient_excess if model.training else 1
        if excess == 1:
            return result
        loss, outputs = result if return_outputs else (result, None)
        loss = loss.detach() + (loss - loss.detach()) / excess  # the same loss, its gradient divided back
        return (loss, outputs) if return_outputs else loss

    # set by an axis whose engine applies the gradient more than once (finetune.axes, `Axis.trainer_built`):
    # a function of the trainer giving how many times, read at the first training step (the engine is built by then)
    gradient_excess = None

    @cached_property
    def _gradient_excess(self) -> int:
        """How many times the one-process gradient the run would apply; the loss's gradient is divided by it."""
        return 1 if self.gradient_excess is None else self.gradient_excess(self)


FULL_LOGITS_ASKED = "`fused_lm_head: false`"
LIGER_LOSS = "Liger's fused linear cross-entropy (`liger_kernel_config`) computes the loss from the head's input"


def liger_loss_asked(args) -> bool:
    """Whether the recipe asks by name for Liger's fused linear cross-entropy (`liger_kernel_config`)."""
    config = liger_config_given(args.liger_kernel_config)
    return bool(args.use_liger_kernel and config.get("fused_linear_cross_entropy"))


def keep_the_fused_head_under_liger(args) -> None:
    """Liger's patch, which Trainer applies as training starts (`use_liger_kernel`), replaces the model's forward with
    its fused linear cross-entropy by default, silently dropping TRL's fused head: that kernel is turned off, as TRL's
    own trainers turn it off, unless the recipe names it (then it computes the loss: `full_logits_reason`)."""
    if args.use_liger_kernel:
        args.liger_kernel_config = {**liger_config_given(args.liger_kernel_config), "fused_linear_cross_entropy": False}


def full_logits_reason(trainer) -> str | None:
    """Why this trainer computes the loss from the full logits rather than TRL's fused LM head (None: fused), as the
    effective config records it."""
    args = trainer.args
    if not args.fused_lm_head:
        return FULL_LOGITS_ASKED
    if liger_loss_asked(args):
        return LIGER_LOSS
    if args.label_smoothing_factor:
        return "label smoothing (`label_smoothing_factor`) weighs every logit"
    if trainer.compute_loss_func is not None or trainer.compute_metrics is not None \
            or trainer.preprocess_logits_for_metrics is not None:
        return "a loss function or metrics given to the trainer read the logits"
    if trainer.get_sp_size() > 1 or trainer.get_cp_size() > 1:
        return "sequence or context parallelism computes the loss on its own (Transformers' sharded loss)"
    if type(trainer).compute_loss is not FinetuneTrainer.compute_loss:
        return f"{type(trainer).__name__} computes its own loss"
    return None


def cast_state_dict(state_dict: dict, dtype) -> dict:
    """The floating tensors cast to `dtype`, tied ones (one storage under two names) still one tensor, so
    save_pretrained still writes a tied weight once. A DTensor (a tensor-parallel slice) stays one, cast where it lies:
    save_pretrained gathers it."""
    from torch.distributed.tensor import DTensor

    cast, done = {}, {}
    for name, tensor in state_dict.items():
        if not tensor.is_floating_point() or tensor.dtype == dtype:
            cast[name] = tensor
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape))
        if key not in done:
            done[key] = tensor.to(dtype)
        cast[name] = done[key]
    return cast


def record_config_dtype(output_dir: Path, dtype) -> None:
    """save_pretrained records the dtype of the model's first parameter (the fp32 masters); config.json must name
    the dtype the weights were written in."""

    config_file = output_dir / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        if config.get("dtype") != dtype_name(dtype):
            config["dtype"] = dtype_name(dtype)
            config_file.write_text(json.dumps(config, indent=2) + "\n")


def size_nvme_param_buffer(trainer) -> None:
    """ZeRO-3 with parameters offloaded to NVMe: a `buffer_size` of "auto" becomes this model's largest partition at
    this world size (finetune.configs.deepspeed); a number too small stops here, naming both numbers."""
    from finetune.configs.deepspeed import (
        fill_nvme_param_buffer,
        nvme_buffer_problem,
        nvme_param_buffer,
        partition_elements,
    )
    from finetune.errors import RecipeError
    from finetune.train.throughput import stored_numel

    if not trainer.is_deepspeed_enabled:
        return
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    if nvme_param_buffer(config) is None:
        return
    world_size = trainer.args.world_size
    largest = max(partition_elements(stored_numel(parameter), world_size) for parameter in trainer.model.parameters())
    problem = nvme_buffer_problem(config, largest, source="the DeepSpeed config")
    if problem is not None:
        raise RecipeError(problem)
    fill_nvme_param_buffer(config, largest)
