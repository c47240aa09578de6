"""Pipeline parallelism: the model's layers split into consecutive stages, one a process, and each optimizer step's
batch cut into micro-batches that flow through them (GPipe: all forwards, then all backwards; 1F1B: one forward,
one backward, which holds fewer micro-batches' activations at once). The schedules, the send/recv between stages and
the chunking are PyTorch's (`torch.distributed.pipelining`); `stages` cuts a Transformers decoder into stages, and
this module runs the loop Trainer cannot (neither Trainer nor Accelerate drive a pipeline), with Trainer's own pieces
where they apply: its data order, optimizer, parameter groups and learning-rate schedule, and its log and checkpoint
files.

Each step's micro-batches are padded to the step's longest row, rounded up to a multiple of 8 (torch's schedule
cuts a step into micro-batches of one shape, and shapes its receive buffers by the first it runs), and a step of
another length gets a new stage and schedule over the same module (`pipeline_step_length: max_seq_length` keeps one
shape). Padding follows every real token and carries no label, so no real token's loss changes.

What the loop does that a one-process Trainer run does:
- the loss of a step is the sum of its answer tokens' losses over the step's answer-token count, whatever the
  micro-batch (the toolkit's `tokens` normalisation), logged from the last stage;
- the gradient of a tied embedding, held by the first stage (input) and the last (output head), is summed between
  them, so both copies take the same update;
- gradient clipping uses the norm over every stage (the tied weight counted once);
- checkpoints hold each stage's weights (safetensors, named as in the whole model) and its optimizer and schedule;
  `finetune export` consolidates a checkpoint's stages into one model `from_pretrained` loads.

What it does at scale:
- each rank reads only its stage's tensors from the checkpoint (the model is built on the meta device, cut, and the
  stage filled by name from the safetensors files, cast to fp32 one tensor at a time): a 70B cut 8 ways takes one
  eighth of it per rank, not the whole model upcast on every rank (3.4 TB on a node);
- the final model is written by every rank at once, its stage as one safetensors shard of `output_dir` in the
  dtype the run saves in (`save_dtype`), with the index `from_pretrained` reads: no rank gathers the model, and
  none waits for another's save;
- every stage writes into one `output_dir`, so before loading the ranks check that they all see it (node-local
  disks on several nodes are refused by name, before any hour is spent).

What it does as Trainer does, through Trainer's own callbacks (`CallbackHandler`): the trackers `report_to` names
(TensorBoard, W&B, ...) get every log; a non-finite loss or gradient norm stops the run on every rank
(finetune.train.divergence); under `save_on_preemption` SIGTERM saves the step every rank agrees on and ends the run
there, to be resumed (finetune.checkpoints.preemption's callback, called at each step's end); the eval split is
evaluated at `eval_on_start`, at `eval_strategy`'s steps or epochs and
on the final weights (the run summary's before/after), its loss the answer tokens' summed loss over their count, run
through the stages forward only (torch's `eval`) in batches of the training step's shape.

LoRA (`use_lora`, PP alone or PP × DP): peft wraps the model before it is cut, so each stage holds its layers'
adapted linears, trains their adapters only (fp32, as the one-process run holds them) and keeps its frozen base in the
dtype it was loaded in, read from the checkpoint under the base's own names (peft's `base_model.model.` prefix and
`base_layer` dropped). peft draws every adapter on the CPU and drops the values on the meta device, so each stage
draws them again from the run's seed in the whole model's order (`initialise_adapters`): the adapters start as a
one-process run's. Checkpoints hold each stage's adapters and their optimizer states (a resume reads the base again);
the final save is one `adapter_model.safetensors` for the whole model beside its `adapter_config.json`, gathered on
rank 0 (the adapters are small), and `finetune export --merge-lora` merges a stage checkpoint into its base. With
`lora_dropout` the masks are drawn per rank, so the losses are not a one-process run's to the last digit.

Tensor and data parallelism beside it (3D): a launch of r × p × t processes (t: tensor parallelism's size) runs r
replicas of the p-stage pipeline, each stage split over t ranks, on a (`dp`, `pp`, `tp`) device mesh, TP innermost.
Within a stage the decoder layers are tensor parallel as the model's TP plan names each linear
(`base_model_tp_plan`), with torch's DTensor styles (`ColwiseParallel`, `RowwiseParallel`: Megatron-LM's split, as
torchtitan composes it with pipelining); the embedding, norms and head stay whole on every TP rank, so the stages
pass whole hidden states between ranks of the same tensor rank, as plain tensors. Each rank reads only its slices
of the checkpoint. Each replica takes every r-th micro-batch, as DDP's ranks do, the step's answer tokens are
counted over all of them, and each stage's gradients (a TP rank's slices) are summed over its replicas before
clipping; the gradient norm counts each slice once and each whole weight once. The update is one process's at the
same global batch. Tensor rank 0 of replica 0 writes the checkpoints and the final model, whole (the slices
gathered, `DTensor.full_tensor`), so a checkpoint, its resume and `finetune export` do not depend on t.

Not supported here (refused before training starts): QLoRA (its 4-bit base is quantized while the whole model loads
onto each GPU), DoRA (its magnitudes come from base weights a stage reads only after peft builds the adapters),
LoRA's `modules_to_save`, LoRA with TP inside the stages (torch's TP styles split plain linears, not peft's wrappers),
DeepSpeed or FSDP configs, sequence or context parallelism and data-shard sizes beside the pipeline (they need their
own engines), a TP size that does not split every head, key-value head and the MLP's width evenly, a TP plan style
other than colwise/rowwise (or Qwen3's whole q/k norms), packing and padding-free batches, methods other than SFT,
`torch_compile` (dynamo cannot trace the DTensor weights: pytorch/pytorch#119071), interleaved and zero-bubble
schedules (one stage a rank). The generation exact match (`generation_eval_samples`) is not run. The embedding and
head are not vocab-parallel, and the norms and the hidden states between layers are not sequence parallel: every TP
rank holds them whole.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME as FINAL_INDEX
from transformers.utils import SAFE_WEIGHTS_NAME

from finetune import outputs
from finetune.checkpoints.pipeline_stages import STAGE_STATE, STAGE_WEIGHTS, stage_checkpoint_files
from finetune.errors import RecipeError
from finetune.train.axes.pipeline.layout import (
    STEP_LENGTH_MULTIPLE,
    pipeline_bubble_fraction,
    pipeline_recv_buffer_bytes,
)
from finetune.train.axes.pipeline.stages import (
    Stage,
    local,
    pipeline_mesh,
    placed_like,
    stage_layers,
    whole,
)
from finetune.train.axes.tensor import KEY as TENSOR_KEY
from finetune.train.tracking import TrackedRunCallback, run_parameters

FINAL_SHARD = "model-{stage:05d}-of-{stages:05d}.safetensors"  # the final model: one shard a stage, as Transformers
# names the shards of a sharded save; its index and single-file names are Transformers' own


def check_shared_output_dir(output_dir: str) -> None:
    """Every stage writes its part of each checkpoint and of the final model into `output_dir`, so every rank must
    see the same folder: on several nodes with node-local disks the model would be split across them. Each rank
    writes a file there named by a token of rank 0's and looks for the others' (waiting a few seconds for a network
    filesystem); where one is missing, every rank stops here, before loading, saying which ranks see which."""
    import uuid

    from accelerate.utils import broadcast_object_list, gather_object

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    token = broadcast_object_list([uuid.uuid4().hex if rank == 0 else None])[0]
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    mine = folder / f".pipeline-rank-{token}-{rank}"
    mine.touch()
    dist.barrier()
    deadline = time.monotonic() + 10
    while True:
        seen = [other for other in range(world) if (folder / f".pipeline-rank-{token}-{other}").exists()]
        if len(seen) == world or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    import socket

    views = gather_object([(rank, socket.gethostname(), str(folder.resolve()), seen)])
    dist.barrier()  # every rank has looked before any file goes
    mine.unlink(missing_ok=True)
    blind = [view for view in views if len(view[3]) < world]
    if blind:
        said = "; ".join(f"rank {rank} on {host} ({path}) sees rank(s) {', '.join(map(str, seen))}"
                         for rank, host, path, seen in blind)
        raise RecipeError(f"pipeline parallelism writes every stage into one output_dir, but the ranks do not share "
                          f"it: {said}. Give `output_dir` on a filesystem every node mounts (NFS, Lustre, ...).")


def step_token_count(labels: torch.Tensor) -> int:
    """Answer tokens a step predicts (a causal LM's loss shifts the labels: position 0 is never a target)."""
    return int((labels[:, 1:] != -100).sum())


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of the answer tokens, as Transformers' causal-LM loss computes it (fp32 logits,
    labels shifted by one)."""
    logits = logits.float()
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                       ignore_index=-100, reduction="sum")


def step_length(batches: list[dict], cap: int, fixed: bool = False) -> int:
    """The length a step's micro-batches are padded to, one for all (torch's schedule cuts the step's batch into
    micro-batches of one shape): `cap` (`max_seq_length`) where `fixed`, else the step's longest row rounded up to
    `STEP_LENGTH_MULTIPLE`, at most `cap`. A one-process Trainer run pads each micro-batch to its own longest row;
    the padding's tokens are masked out of attention by causality (they follow every real token) and carry no
    label."""
    longest = max(batch["input_ids"].shape[1] for batch in batches)
    if fixed:
        return max(cap, longest)
    return max(longest, min(-(-longest // STEP_LENGTH_MULTIPLE) * STEP_LENGTH_MULTIPLE, cap))


def padded_to(batch: dict, length: int, pad_id: int) -> dict:
    """`batch`'s token ids and labels, its rows filled on the right to `length` with pad tokens without labels."""
    fill = max(length - batch["input_ids"].shape[1], 0)
    if not fill:
        return {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    return {"input_ids": nn.functional.pad(batch["input_ids"], (0, fill), value=pad_id),
            "labels": nn.functional.pad(batch["labels"], (0, fill), value=-100)}


def row_tokens(batch: dict) -> int:
    """The tokens of a micro-batch's rows, without their padding (its attention mask; every token without one)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if torch.is_tensor(mask) else batch["input_ids"].numel()


def filled(batch: dict | None, rows: int, pad_id: int, like: dict | None = None) -> dict:
    """`batch` with unlabelled padding rows up to `rows` (a micro-batch of the schedule's shape); None: all padding,
    shaped as `like`."""
    template = batch if batch is not None else like
    have = 0 if batch is None else batch["input_ids"].shape[0]
    if have == rows:
        return batch
    length = template["input_ids"].shape[1]
    padding = {"input_ids": torch.full((rows - have, length), pad_id, dtype=template["input_ids"].dtype),
               "labels": torch.full((rows - have, length), -100, dtype=template["labels"].dtype)}
    if batch is None:
        return padding
    return {key: torch.cat([batch[key], padding[key]]) for key in ("input_ids", "labels")}


class PipelineTrainer:
    """The training loop of one stage. `recipe.training` are Trainer's arguments; `data` the method's prepared data."""

    def __init__(self, recipe, model, tokenizer, data, stage: Stage, resume: str | None, step_length: str = "longest"):
        self.recipe, self.args, self.tokenizer, self.data = recipe, recipe.training, tokenizer, data
        self.step_length = step_length  # "longest": each step its longest row's length; "max_seq_length": one shape
        self.model, self.stage, self.resume = model, stage, resume
        self.schedule_name = recipe.strategy.axis.schedule  # the launch's layout: gpipe or 1f1b
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tensor_parallel, self.tensor_rank = stage.tensor_parallel, self.rank % stage.tensor_parallel
        ranks_of_a_replica = stage.count * stage.tensor_parallel
        self.replicas, self.replica = self.world // ranks_of_a_replica, self.rank // ranks_of_a_replica
        self.micro_batches = self.args.gradient_accumulation_steps
        self.device = self.args.device  # as Trainer places the model: this rank's GPU, or the CPU
        self.pipeline_group, self.replica_group, self.tensor_group, self.tied_group = self._groups()
        stage.module.to(self.device)
        self.step_tokens = 1
        # torch's stage and schedule for the current step length (`_schedule_for`), the longest a step ran at and the
        # most its receive buffers held; the tokens the steps computed and the rows' own
        self.pipe_stage, self.schedule, self.length = None, None, None
        self.longest_step, self.recv_buffers_peak, self.computed_tokens, self.row_tokens = 0, 0, 0, 0
        self.optimizer, self.lr_scheduler = self._optimizer_and_schedule()
        self.global_step, self.log_history, self.epoch = 0, [], 0.0
        self.state, self.control, self.callbacks = self._callbacks()

    def _groups(self):
        """The process groups of the (`dp`, `pp`, `tp`) mesh (`pipeline_mesh`): this rank's pipeline (its replica's
        stages at its tensor rank), its stage's replicas (their gradients summed), its stage's TP group, and the
        first and last stage of its pipeline, which both hold a tied embedding (every rank takes part in creating
        every group)."""
        size, tensor = self.stage.count, self.tensor_parallel
        mesh = self.stage.mesh or pipeline_mesh(self.device.type, size, tensor)
        tied = None
        for replica in range(self.replicas):
            for tensor_rank in range(tensor):
                first = replica * size * tensor + tensor_rank
                group = dist.new_group(sorted({first, first + (size - 1) * tensor})) if size > 1 else None
                if (replica, tensor_rank) == (self.replica, self.tensor_rank):
                    tied = group
        return mesh["pp"].get_group(), mesh["dp"].get_group(), mesh["tp"].get_group(), tied

    def _callbacks(self):
        """Trainer's state, control and callback handler, holding the trackers `report_to` names and the divergence
        stop, called where Trainer calls them (train begin and end, every log, every evaluation)."""
        from transformers.integrations import get_reporting_integration_callbacks
        from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

        from finetune.train.divergence import NonFiniteLossCallback

        state = TrainerState(is_local_process_zero=self.args.local_process_index == 0,
                             is_world_process_zero=self.rank == 0)
        trackers = [callback() for callback in get_reporting_integration_callbacks(self.args.report_to)]
        handler = CallbackHandler([*trackers, NonFiniteLossCallback(fp16=False)], self.model, self.tokenizer,
                                  self.optimizer, self.lr_scheduler)
        return state, TrainerControl(), handler

    # -- pieces of Trainer ---------------------------------------------------------------------------------------
    def _optimizer_and_schedule(self):
        from torch.distributed.tensor import DTensor
        from transformers import Trainer, get_scheduler

        decay = set(Trainer.get_decay_parameter_names(None, self.model))
        # TP slices and whole weights in groups of their own: torch's fused and foreach kernels take no mix of
        # DTensors and plain tensors in one call ("got mixed torch.Tensor and DTensor"; fused Adam's tensors must
        # share one mesh: pytorch/pytorch#153268)
        groups = [{"params": [p for n, p in self.stage.trained
                              if (n in decay) == decayed and isinstance(p, DTensor) == split],
                   "weight_decay": self.args.weight_decay if decayed else 0.0}
                  for decayed in (True, False) for split in (False, True)]
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
        optimizer = optimizer_cls([group for group in groups if group["params"]], **optimizer_kwargs)
        steps = self.max_steps()
        scheduler = get_scheduler(self.args.lr_scheduler_type, optimizer,
                                  num_warmup_steps=self.args.get_warmup_steps(steps), num_training_steps=steps,
                                  scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
        return optimizer, scheduler

    def max_steps(self) -> int:
        if self.args.max_steps > 0:
            return self.args.max_steps
        per_epoch = max(len(self.train_loader()) // self.micro_batches, 1)
        return math.ceil(self.args.num_train_epochs * per_epoch)

    def train_loader(self):
        """Micro-batches in the order a one-process Trainer run sees them: Trainer's random sampler, seeded by
        Accelerate as Trainer prepares it (`use_seedable_sampler`), each padded to its longest row (a step's
        micro-batches then to the step's length, `_run_schedule`). With several replicas each takes every `replicas`-th
        micro-batch, as DDP's ranks do: a step's micro-batches over all replicas are a one-process step's."""
        if getattr(self, "_loader", None) is None:
            from accelerate.data_loader import prepare_data_loader
            from torch.utils.data import DataLoader, RandomSampler

            from finetune.data.collate import SequenceShardedCollator, data_collator

            dataset = self.data.train.select_columns(["input_ids", "labels"])
            collate = SequenceShardedCollator(data_collator(self.tokenizer), 1, self.tokenizer.pad_token_id,
                                              length=self.fixed_length)
            loader = DataLoader(dataset, batch_size=self.args.per_device_train_batch_size,
                                sampler=RandomSampler(dataset), collate_fn=collate, drop_last=True)
            self._loader = prepare_data_loader(loader, num_processes=self.replicas, process_index=self.replica,
                                               put_on_device=False,
                                               use_seedable_sampler=self.args.accelerator_config.use_seedable_sampler,
                                               data_seed=self.args.data_seed)
        return self._loader

    @property
    def fixed_length(self) -> int | None:
        """The one length every micro-batch is padded to (`step_length: max_seq_length`), else None."""
        return self.recipe.data.max_seq_length if self.step_length == "max_seq_length" else None

    def _schedule_for(self, length: int):
        """torch's stage and schedule for steps of `length` tokens a row. Its receive buffers are shaped by the first
        micro-batch it runs (torch's runtime shape inference), so a step of another length gets a new stage and
        schedule over the same module, on every rank of the pipeline at once (they see the same micro-batches); the
        old ones, and their buffers, are dropped."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if length != self.length:
            if self.pipe_stage is not None:
                self.recv_buffers_peak = max(self.recv_buffers_peak, recv_buffer_bytes(self.pipe_stage))
            self.pipe_stage = PipelineStage(self.stage.module, self.stage.index, self.stage.count, self.device,
                                            group=self.pipeline_group)
            engine = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule_name]
            self.schedule = engine(self.pipe_stage, n_microbatches=self.micro_batches, loss_fn=self._loss,
                                   scale_grads=False)
            self.length = length
        self.longest_step = max(self.longest_step, length)
        return self.schedule

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) / self.step_tokens

    # -- one step ------------------------------------------------------------------------------------------------
    def _run_schedule(self, batches: list[dict], forward_only: bool = False) -> float:
        """One pass of the schedule over a step's micro-batches; the sum of the losses the last stage computed, on
        every rank of the pipeline, and over the replicas when training (their micro-batches make the step).
        `forward_only`: torch's `eval`, no backward (every replica evaluates the same rows)."""
        length = step_length(batches, self.recipe.data.max_seq_length, fixed=self.fixed_length is not None)
        if not forward_only:
            self.row_tokens += sum(row_tokens(batch) for batch in batches)
        batches = [padded_to(batch, length, self.tokenizer.pad_token_id) for batch in batches]
        input_ids = torch.cat([batch["input_ids"] for batch in batches]).to(self.device)
        labels = torch.cat([batch["labels"] for batch in batches]).to(self.device)
        schedule = self._schedule_for(length)
        if not forward_only:
            self.computed_tokens += input_ids.numel()
        run = schedule.eval if forward_only else schedule.step
        losses: list[torch.Tensor] = []
        # bf16 mixed precision as Trainer runs it: autocast over the forward, fp32 weights, gradients and states
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bool(self.args.bf16)):
            if self.stage.index == 0:
                run(input_ids, target=labels if self.stage.count == 1 else None, losses=losses)
            elif self.stage.index == self.stage.count - 1:
                run(target=labels, losses=losses)
            else:
                run()
        loss = torch.tensor([float(sum(loss.detach() for loss in losses)) if losses else 0.0], dtype=torch.float64,
                            device=self.device)  # where the backend communicates (NCCL: the GPU)
        dist.broadcast(loss, group_src=self.stage.count - 1, group=self.pipeline_group)  # from the last stage
        if not forward_only and self.replicas > 1:
            dist.all_reduce(loss, group=self.replica_group)
        return float(loss)

    def _step(self, batches: list[dict]) -> tuple[float, float]:
        tokens = torch.tensor([sum(step_token_count(batch["labels"]) for batch in batches)],
                              dtype=torch.int64, device=self.device)
        if self.replicas > 1:  # every answer token of the step weighs the same, whichever replica saw it
            dist.all_reduce(tokens, group=self.replica_group)
        self.step_tokens = max(int(tokens), 1)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._run_schedule(batches)
        with torch.no_grad():
            if self.replicas > 1:  # each replica's gradient of its share of the step's token-loss sum: summed
                for _, parameter in self.stage.trained:
                    if parameter.grad is not None:
                        dist.all_reduce(local(parameter.grad), group=self.replica_group)
            for parameter in self.stage.summed_over_tp:  # each TP rank's heads' share of a whole weight's gradient
                if parameter.grad is not None:
                    dist.all_reduce(parameter.grad, group=self.tensor_group)
        if self.stage.tied is not None and self.stage.tied.grad is not None:
            dist.all_reduce(self.stage.tied.grad, group=self.tied_group)
        norm = self._clip()
        self.optimizer.step()
        return loss, norm

    # -- evaluation ----------------------------------------------------------------------------------------------
    def eval_loader(self):
        """The eval split in order, padded as the training micro-batches are."""
        from torch.utils.data import DataLoader

        from finetune.data.collate import SequenceShardedCollator, data_collator

        dataset = self.data.eval.select_columns(["input_ids", "labels"])
        collate = SequenceShardedCollator(data_collator(self.tokenizer), 1, self.tokenizer.pad_token_id,
                                          length=self.fixed_length)
        return DataLoader(dataset, batch_size=self.args.per_device_train_batch_size, collate_fn=collate)

    def evaluate(self) -> dict:
        """The eval split's loss (its answer tokens' summed loss over their count), logged as Trainer logs
        `eval_loss`; the last step's micro-batches are filled with unlabelled padding rows."""
        self.stage.module.eval()
        self.step_tokens = 1  # the schedule's losses are sums: the mean is taken over the whole split
        total, tokens, pending = 0.0, 0, []
        batches = list(self.eval_loader())
        with torch.no_grad():
            for index, batch in enumerate(batches):
                pending.append(batch)
                if len(pending) < self.micro_batches and index < len(batches) - 1:
                    continue
                pending = [filled(part, self.args.per_device_train_batch_size, self.tokenizer.pad_token_id)
                           for part in pending]
                pending += [filled(None, self.args.per_device_train_batch_size, self.tokenizer.pad_token_id,
                                   like=pending[0]) for _ in range(self.micro_batches - len(pending))]
                tokens += sum(step_token_count(part["labels"]) for part in pending)
                total += self._run_schedule(pending, forward_only=True)
                pending = []
        self.stage.module.train()
        metrics = {"eval_loss": total / max(tokens, 1)}
        self._log(dict(metrics))
        self.callbacks.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def _evaluate_now(self, per_epoch: int) -> bool:
        strategy = str(getattr(self.args.eval_strategy, "value", self.args.eval_strategy))
        if self.data.eval is None:
            return False
        if strategy == "steps":
            return self.global_step % max(int(self.args.eval_steps or self.args.logging_steps), 1) == 0
        return strategy == "epoch" and self.global_step % per_epoch == 0

    def _clip(self) -> float:
        """The gradient norm over every stage, and clipping by it, with torch's own pieces of `clip_grad_norm_`: each
        stage's norm, summed in squares over the stages. Under TP a split gradient's slices are summed in squares
        over the TP group (each slice once) and a whole one, the same on every TP rank, is counted once. torch's
        `get_total_norm` takes no mix of DTensors and plain tensors (its foreach kernels refuse it), so the slices
        go in as the local tensors they are."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import implicit_replication

        grads = [parameter.grad for parameter in self.stage.counted_in_norm if parameter.grad is not None]
        split = self._squares([local(grad) for grad in grads if isinstance(grad, DTensor)])
        if self.tensor_parallel > 1:
            dist.all_reduce(split, group=self.tensor_group)
        squares = split + self._squares([grad for grad in grads if not isinstance(grad, DTensor)])
        dist.all_reduce(squares, group=self.pipeline_group)  # the replicas hold the same gradients by now
        norm = squares.sqrt()[0]  # 0-dim, as clip_grads_with_norm_ takes it
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            with implicit_replication():  # the plain norm scales DTensor gradients as a replicated scalar
                torch.nn.utils.clip_grads_with_norm_([p for _, p in self.stage.trained], self.args.max_grad_norm, norm)
        return float(norm)

    def _squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.get_total_norm(grads).to(self.device, torch.float64).pow(2).reshape(1)

    # -- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        from accelerate.data_loader import skip_first_batches

        max_steps, loader = self.max_steps(), self.train_loader()
        if len(loader) < self.micro_batches:
            raise RecipeError(f"the training data makes {len(loader)} micro-batch(es) of "
                              f"{self.args.per_device_train_batch_size}, fewer than one step's "
                              f"{self.micro_batches} (`gradient_accumulation_steps`): give more data or smaller "
                              "micro-batches.")
        per_epoch = len(loader) // self.micro_batches
        if self.resume is not None:
            self._load(Path(self.resume))
        self.state.max_steps, self.state.global_step = max_steps, self.global_step
        self.callbacks.on_train_begin(self.args, self.state, self.control)
        if self.args.eval_on_start and self.resume is None and self.data.eval is not None:
            self.evaluate()
        started, running_loss, steps_run, logged = time.time(), 0.0, 0, []
        while self.global_step < max_steps:
            loader.set_epoch(self.global_step // per_epoch)
            done = self.global_step % per_epoch  # steps of this epoch a resumed run already took
            pending: list[dict] = []
            for batch in skip_first_batches(loader, done * self.micro_batches) if done else loader:
                pending.append(batch)
                if len(pending) < self.micro_batches:
                    continue
                learning_rate = self.lr_scheduler.get_last_lr()[0]  # the rate this step trains at, as Trainer logs it
                loss, norm = self._step(pending)
                self.lr_scheduler.step()
                pending = []
                self.global_step += 1
                steps_run += 1
                self.epoch = self.global_step / per_epoch
                running_loss += loss
                logged.append(loss)
                if self.global_step % max(int(self.args.logging_steps), 1) == 0 or self.global_step == max_steps:
                    self._log({"loss": sum(logged) / len(logged), "grad_norm": norm, "learning_rate": learning_rate,
                               "epoch": self.epoch})
                    logged = []
                if self._evaluate_now(per_epoch):
                    self.evaluate()
                saved = self._save_now()
                if saved:
                    self.save_checkpoint()
                self._step_end(saved)
                if self.global_step >= max_steps or self.global_step % per_epoch == 0:
                    break  # the run's end, or the epoch's (a last partial step's micro-batches are dropped)
        summary = {"train_runtime": round(time.time() - started, 4),
                   "train_loss": running_loss / max(steps_run, 1), "step": self.global_step, "epoch": self.epoch}
        self.log_history.append(summary)
        self.callbacks.on_train_end(self.args, self.state, self.control)
        return summary

    def _step_end(self, saved: bool) -> None:
        """Trainer's step end for the callbacks: under `save_on_preemption` every rank agrees whether any got SIGTERM
        (finetune.checkpoints.preemption.PreemptionCallback); if so this step is saved on every rank and the run
        ends there (`on_save` raises `Preempted`), to be resumed with `resume_from_checkpoint: auto`."""
        self.state.global_step, self.state.epoch = self.global_step, self.epoch
        self.control = self.callbacks.on_step_end(self.args, self.state, self.control)
        if self.control.should_save:
            if not saved:
                self.save_checkpoint()
            self.callbacks.on_save(self.args, self.state, self.control)
            self.control.should_save = False

    def _log(self, entry: dict) -> None:
        """Into the run's log history, and to the callbacks as Trainer logs: the trackers, the divergence stop (every
        rank holds the same loss and norm, so every rank stops at the same step)."""
        self.state.global_step, self.state.epoch = self.global_step, self.epoch
        entry = {**entry, "step": self.global_step}
        if self.rank == 0:
            print({key: (f"{value:.4g}" if isinstance(value, float) else value) for key, value in entry.items()},
                  flush=True)
        self.log_history.append(entry)
        self.state.log_history = self.log_history
        self.callbacks.on_log(self.args, self.state, self.control, logs=dict(entry))

    def _save_now(self) -> bool:
        strategy = str(getattr(self.args.save_strategy, "value", self.args.save_strategy))
        if strategy != "steps" or not self.args.save_steps:
            return False
        return self.global_step % int(self.args.save_steps) == 0

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        return {"global_step": self.global_step, "max_steps": self.max_steps(), "epoch": self.epoch,
                "log_history": self.log_history, "logging_steps": self.args.logging_steps,
                "train_batch_size": self.args.per_device_train_batch_size}

    def save_stage(self, folder: Path, with_state: bool) -> None:
        """The stage's weights and optimizer states whole (a TP group's slices gathered, `whole`: every rank of the
        group calls it), written by its tensor rank 0: the files of a stage without TP, which `finetune export` and
        a resume read whatever the TP size."""
        from safetensors.torch import save_file

        writes = self.tensor_rank == 0

        def kept(tensor: torch.Tensor) -> torch.Tensor | None:  # gathered one at a time, kept by the writer only
            gathered = whole(tensor.detach())
            return gathered.to("cpu").contiguous() if writes else None

        weights = {name: kept(parameter) for name, parameter in self.stage.trained}
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {index: {key: kept(value) for key, value in values.items()}
                              for index, values in optimizer["state"].items()}
        if not writes:
            return
        folder.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(folder / STAGE_WEIGHTS.format(stage=self.stage.index)), metadata={"format": "pt"})
        if with_state:
            torch.save({"optimizer": optimizer, "lr_scheduler": self.lr_scheduler.state_dict(),
                        "global_step": self.global_step},
                       folder / STAGE_STATE.format(stage=self.stage.index))

    def save_checkpoint(self) -> None:
        from finetune.checkpoints.complete import mark_complete, recipe_values, rotate_complete_checkpoints

        folder = Path(self.args.output_dir) / f"checkpoint-{self.global_step}"
        if self.replica == 0:  # the replicas hold the same stages and optimizer states
            self.save_stage(folder, with_state=True)
        dist.barrier()
        if self.rank == 0:
            self.model.config.save_pretrained(folder)
            if self.adapted:  # the stage files hold the adapters: `finetune export` rebuilds them on the base
                self.adapter_config().save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)
            outputs.write_record(folder, "trainer_state.json", self.trainer_state())
            mark_complete(folder, self.global_step, self.layout(), recipe_values(self.recipe),
                          self.data.summary.get("train_fingerprint"))
            rotate_complete_checkpoints(self.args.output_dir, self.args.save_total_limit)
        dist.barrier()

    def layout(self) -> dict:
        from finetune.models.loading import dtype_name

        final = self.final_dtype()
        return {"world_size": self.world, "strategy": "pipeline", "zero_stage": None,
                "pipeline_parallel_size": self.stage.count, TENSOR_KEY: self.tensor_parallel,
                "pipeline_schedule": self.schedule_name, "pipeline_replicas": self.replicas,
                "sequences_per_step": self.args.per_device_train_batch_size * self.micro_batches * self.replicas,
                "final_weights_dtype": final and dtype_name(final),  # what `finetune export` writes by default
                "files": stage_checkpoint_files(self.stage.count)}  # what a resume needs (checkpoints.complete)

    def _load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        self.check_resumed_layout(folder)
        weights = load_file(str(folder / STAGE_WEIGHTS.format(stage=self.stage.index)))
        with torch.no_grad():
            for name, parameter in self.stage.trained:
                parameter.copy_(placed_like(parameter, weights[name].to(self.device)))
        state = torch.load(folder / STAGE_STATE.format(stage=self.stage.index), weights_only=True)
        held = [parameter for group in self.optimizer.param_groups for parameter in group["params"]]
        for index, values in state["optimizer"]["state"].items():  # whole moments, cut as their weights are
            for key, value in values.items():
                if torch.is_tensor(value) and value.shape == held[index].shape and value.dim() > 0:
                    values[key] = placed_like(held[index], value.to(self.device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_step = int(state["global_step"])
        history = json.loads((folder / "trainer_state.json").read_text())
        self.log_history = [entry for entry in history["log_history"] if entry.get("step", 0) <= self.global_step]

    def check_resumed_layout(self, folder: Path) -> None:
        """A checkpoint's stages are this run's: as many, split as many ways. Its weights and moments are whole, but
        each stage's optimizer file lists them in the order of the stage's parameter groups, which the TP split
        shapes (`_optimizer_and_schedule`): another split would load the moments onto the wrong weights."""
        from finetune.checkpoints.complete import read_marker

        saved = read_marker(folder)
        was = (saved.get("pipeline_parallel_size", self.stage.count), saved.get(TENSOR_KEY, 1))
        now = (self.stage.count, self.tensor_parallel)
        if was != now:
            raise RecipeError(f"{folder} holds {was[0]} stage(s) split over {was[1]} TP rank(s), and this run has "
                              f"{now[0]} split over {now[1]}: resume with `pipeline_parallel_size: {was[0]}` and "
                              f"`{TENSOR_KEY}: {was[1]}`, or start afresh from its weights (`finetune export "
                              f"{folder} WEIGHTS_DIR`, then `model_name_or_path: WEIGHTS_DIR`).")

    @property
    def adapted(self) -> bool:
        """LoRA: the stages train peft's adapters on a frozen base."""
        return hasattr(self.model, "peft_config")

    def adapter_config(self):
        """The adapter's `LoraConfig` as `PeftModel.save_pretrained` writes it: the base it was trained on named, and
        marked for inference."""
        from dataclasses import replace

        config = self.model.peft_config["default"]
        base = config.base_model_name_or_path or self.recipe.model.model_name_or_path
        return replace(config, base_model_name_or_path=base, inference_mode=True)

    def save_adapters(self) -> None:
        """The final adapters of every stage in one `adapter_model.safetensors` beside its `adapter_config.json`, as
        a one-process LoRA run writes them (peft loads them onto the base; `finetune export --merge-lora` merges
        them): the adapters are a small fraction of the model, so rank 0 gathers them from the stages' first replica
        and writes them with peft's own names."""
        from accelerate.utils import gather_object
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        mine = {name: parameter.detach().to("cpu").contiguous() for name, parameter in self.stage.trained} \
            if self.replica == 0 else {}
        every = gather_object([mine])
        if self.rank != 0:
            return
        state = {name: tensor for part in every for name, tensor in part.items()}
        output_dir = Path(self.args.output_dir)
        saved = get_peft_model_state_dict(self.model, state_dict=state, adapter_name="default")
        save_file(saved, str(output_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        self.adapter_config().save_pretrained(output_dir)
        self.tokenizer.save_pretrained(output_dir)
        outputs.write_record(output_dir, "trainer_state.json", self.trainer_state())
        print(f"pipeline: the adapters of {self.stage.count} stages are saved in {output_dir}", flush=True)

    def final_dtype(self) -> torch.dtype | None:
        """The dtype the final model is written in (`save_dtype`: `auto` is the checkpoint's own); None keeps fp32."""
        from finetune.models.loading import saved_dtype

        return saved_dtype(self.model, self.args.save_dtype)

    def save_final(self) -> None:
        """The final model in output_dir, written by every rank at once: its stage as one shard, in `final_dtype`
        (a tied embedding by the first stage only), then, once every shard is written, rank 0 writes the index
        `from_pretrained` reads, the config and the tokenizer. No rank holds more than its stage, and no rank waits
        for more than the slowest shard's write."""
        from accelerate.utils import gather_object
        from safetensors.torch import save_file

        from finetune.models.loading import dtype_name
        from finetune.train.trainer import record_config_dtype

        if self.adapted:
            return self.save_adapters()
        output_dir, dtype = Path(self.args.output_dir), self.final_dtype()
        shard = FINAL_SHARD.format(stage=self.stage.index + 1, stages=self.stage.count)
        writes = self.replica == 0 and self.tensor_rank == 0  # the other replicas hold the same stages
        weights = {}
        for name, parameter in self.stage.named:  # a TP group gathers one weight at a time, its rank 0 keeps it
            if self.replica == 0 and not (self.stage.index > 0 and parameter is self.stage.tied):
                gathered = whole(parameter.detach())
                if writes:
                    weights[name] = gathered.to("cpu", dtype or parameter.dtype).contiguous()
        if writes:
            save_file(weights, str(output_dir / shard), metadata={"format": "pt"})
        written = {name: (shard, tensor.numel() * tensor.element_size()) for name, tensor in weights.items()}
        del weights
        every = gather_object([written])  # also: every shard is written before the index names it
        if self.rank != 0:
            return
        weight_map = {name: file for part in every for name, (file, _) in sorted(part.items())}
        total = sum(size for part in every for _, size in part.values())
        outputs.write_record(output_dir, FINAL_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        # an earlier final save in this output_dir (another stage count, or one file), as save_pretrained clears it
        ours = set(weight_map.values())
        for stale in (*output_dir.glob("model-*-of-*.safetensors"), output_dir / SAFE_WEIGHTS_NAME):
            if stale.name not in ours:
                stale.unlink(missing_ok=True)
        self.model.config.save_pretrained(output_dir)
        written = dtype or self.stage.named[0][1].dtype
        record_config_dtype(output_dir, written)  # the dtype of the shards, not the one the model was built in
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(output_dir)
        self.tokenizer.save_pretrained(output_dir)
        outputs.write_record(output_dir, "trainer_state.json", self.trainer_state())
        print(f"pipeline: the model is saved in {output_dir} in {dtype_name(written)}, one shard a stage", flush=True)


def stage_memory(trainer: PipelineTrainer) -> dict[str, int]:
    """What this rank's stage holds: its parameters, their gradients and the optimizer's states, in bytes."""
    parameters = [parameter for _, parameter in trainer.stage.named]
    states = [value for state in trainer.optimizer.state.values() for value in state.values()
              if torch.is_tensor(value) and value.dim() > 0]

    def held(tensor: torch.Tensor) -> int:  # this rank's slice of a DTensor
        return local(tensor).numel() * tensor.element_size()

    return {"params_bytes": sum(held(p) for p in parameters),
            "grads_bytes": sum(held(p.grad) for p in parameters if p.grad is not None),
            "optimizer_bytes": sum(held(value) for value in states),
            "recv_buffers_bytes": max(trainer.recv_buffers_peak, recv_buffer_bytes(trainer.pipe_stage))}


def recv_buffer_bytes(pipe_stage) -> int:
    """What torch's stage holds to receive the hidden states and their gradients, every micro-batch's buffers."""
    infos = [info for chunk in (*pipe_stage.args_recv_info.values(), *pipe_stage.grad_recv_info.values())
             for info in (chunk if isinstance(chunk, tuple) else ())]
    buffers = {id(info.buffer): info.buffer for info in infos if torch.is_tensor(getattr(info, "buffer", None))}
    return sum(buffer.numel() * buffer.element_size() for buffer in buffers.values())


def predicted_memory(trainer: PipelineTrainer, shape) -> dict:
    """The estimator's terms for this rank's stage (`pipeline_stage_elements` and the rest of
    finetune.train.axes.pipeline.layout) at the shapes it ran: its longest step's length, which the plan bounds by
    `max_seq_length`."""
    from finetune.memory import Setup, estimate
    from finetune.memory.callback import optimizer_kind

    args, lora = trainer.args, trainer.recipe.lora
    layout = trainer.recipe.strategy.axis
    setup = Setup(strategy=layout.name, num_gpus=trainer.world, axis=layout, rank=trainer.stage.index,
                  precision="bf16" if args.bf16 else "fp32",
                  optimizer=optimizer_kind(args.optim) or "adamw", micro_batch_size=args.per_device_train_batch_size,
                  lora_rank=lora.lora_r if lora.use_lora else 0,
                  lora_dropout=lora.lora_dropout if lora.use_lora else 0.0,
                  lora_target_modules=tuple(lora.lora_target_modules or ()) or None if lora.use_lora else None,
                  sequence_length=trainer.longest_step or trainer.recipe.data.max_seq_length,  # the shapes it ran
                  gradient_accumulation_steps=trainer.micro_batches)
    predicted = estimate(shape, setup)
    return {"params_bytes": predicted.params_bytes, "grads_bytes": predicted.grads_bytes,
            "optimizer_bytes": predicted.optimizer_bytes, "activations_bytes": predicted.activations_bytes,
            "host_load_bytes": predicted.host_load_bytes_of_rank(trainer.rank),
            "recv_buffers_bytes": pipeline_recv_buffer_bytes(shape, setup),
            "estimate": {"setup": {"strategy": setup.strategy, "num_gpus": setup.num_gpus,
                                   "pipeline_parallel_size": layout.stages, "pipeline_schedule": layout.schedule,
                                   "pipeline_hand_off_dtype": layout.hand_off,
                                   TENSOR_KEY: layout.tensor, "rank": setup.rank}}}


def report_effective_config(trainer: PipelineTrainer, recipe, pipeline: dict) -> dict:
    """The effective configuration a Trainer run writes and prints (finetune.train.effective), every value with its
    source, plus the strategy running (the recipe's: the loop runs what it asks) and the pipeline's shape."""
    from finetune.train.effective import describe_effective_config, print_effective_config

    effective = describe_effective_config(trainer, recipe)
    effective["strategy"]["running"] = recipe.strategy.to_dict()
    effective["pipeline"] = pipeline
    if trainer.rank == 0:
        outputs.write_record(trainer.args.output_dir, outputs.EFFECTIVE_CONFIG, effective)
        print_effective_config(effective)
    return effective


def train_pipeline(recipe, model, stage: Stage, tokenizer, data, resume: str | None,
                   host_load_bytes: int | None = None, step_length: str = "longest") -> dict:
    """The whole run of this rank's stage (`cut_stage`): train, checkpoint, write the final model into output_dir;
    rank 0 writes the records a Trainer run writes (trainer_state.json, effective_config.json, memory_report.json,
    eval_results.json). Returns the summary. `host_load_bytes`: host RAM this rank took to load its stage."""
    from accelerate.utils import gather_object

    from finetune.checkpoints.preemption import PreemptionCallback, save_on_preemption
    from finetune.train.evaluation import print_before_after, summarize_evaluations

    args = recipe.training
    size, rank = recipe.strategy.axis.stages, dist.get_rank()
    if recipe.data.generation_eval_samples and data.eval is not None and rank == 0:
        print("warning: pipeline parallelism evaluates the eval loss, not the generation exact match "
              "(`generation_eval_samples`): score the model it writes with `finetune eval`.", flush=True)
    trainer = PipelineTrainer(recipe, model, tokenizer, data, stage, resume, step_length)
    if save_on_preemption(args):  # on by default under SLURM: SIGTERM saves the step every rank agrees on
        trainer.callbacks.add_callback(PreemptionCallback())
    pipeline = {"stages": [[layers.start, layers.stop] for layers in stage_layers(stage.shape.num_layers, size)],
                "schedule": trainer.schedule_name, TENSOR_KEY: trainer.tensor_parallel,
                "micro_batches": trainer.micro_batches, "replicas": trainer.replicas, "step_length": step_length,
                "hand_off_dtype": recipe.strategy.axis.hand_off,
                "bubble_fraction": pipeline_bubble_fraction(size, trainer.micro_batches)}
    effective = report_effective_config(trainer, recipe, pipeline)
    trainer.callbacks.add_callback(TrackedRunCallback(run_parameters(recipe, effective)))  # W&B's, MLflow's params
    result = trainer.train()
    final_evaluation = trainer.evaluate() if data.eval is not None else None  # "after" is of the final weights
    measured, predicted = stage_memory(trainer), predicted_memory(trainer, stage.shape)
    if host_load_bytes is not None:
        measured["host_load_bytes"] = host_load_bytes
    memory = {"rank": rank, "world_size": trainer.world, "strategy": recipe.strategy.label,
              "layers": [stage.layers.start, stage.layers.stop], "measured": measured, "predicted": predicted,
              # what the steps computed against their rows' own tokens (the rest is padding), this rank's replica
              "tokens": {"computed": trainer.computed_tokens, "rows": trainer.row_tokens,
                         "longest_step": trainer.longest_step}}
    ranks = gather_object([memory])
    trainer.save_final()
    summary = summarize_evaluations(trainer.log_history, [], final_evaluation)  # a resume keeps its log's evaluations
    summary.update({"method": recipe.method.name, "world_size": trainer.world, "strategy": recipe.strategy.to_dict(),
                    "deepspeed_zero_stage": None, "train_loss": result["train_loss"],
                    "global_step": trainer.global_step})
    if rank == 0:
        output_dir = Path(args.output_dir)
        outputs.write_record(output_dir, outputs.MEMORY_REPORT, {"ranks": ranks})
        outputs.write_record(output_dir, outputs.EVAL_RESULTS, summary)
        split = f", each split over {trainer.tensor_parallel} TP ranks" if trainer.tensor_parallel > 1 else ""
        print(f"pipeline: {size} stages (layers {pipeline['stages']}){split} × {trainer.replicas} replica(s), "
              f"{trainer.schedule_name}, "
              f"{trainer.micro_batches} micro-batches a step, bubble {pipeline['bubble_fraction']:.0%}", flush=True)
        if summary.get("after"):
            print_before_after(summary)
    return summary
