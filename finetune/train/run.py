"""`finetune train`: recipe → tokenizer, model, data → Hugging Face `Trainer` → train, evaluate, save, report.

Run it under any launcher, e.g.
    accelerate launch --config_file accelerate_configs/cpu_deepspeed_zero2.yaml -m finetune train recipes/demo.yaml
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace
from pathlib import Path

import torch
from accelerate.utils import gather_object
from transformers import set_seed

from finetune import outputs
from finetune.checkpoints.complete import (
    agree_on_newest_complete,
    check_checkpoint_files,
    check_same_data,
    read_marker,
    recipe_changes,
    recipe_values,
    why_incomplete,
)
from finetune.checkpoints.preemption import PreemptionCallback, ending_in_one_line_on_signals, save_on_preemption
from finetune.checkpoints.run_lock import output_dir_lock
from finetune.configs.lint import lint_fsdp_wrap_classes
from finetune.data.summary import dropped_rows, trained_as_plain_text, write_data_summary
from finetune.errors import RecipeError
from finetune.launch.self_launch import launch_plan
from finetune.launch.watchdog import watching_ranks
from finetune.memory import MemoryReportCallback
from finetune.memory.ledger import HostLoadProbe
from finetune.models.experts import turn_on_load_balancing
from finetune.models.loading import (
    check_same_parameters_on_every_rank,
    load_model,
    load_tokenizer,
    materialize_empty_parameters,
    sharded_from_rank_zero,
    waiting_for_rank_zero_to_load,
)
from finetune.models.lora import FrozenWeightsCallback
from finetune.plan.launch import memory_against_plan, over_plan_warnings
from finetune.recipe.batch_plan import print_batch_plan, write_batch_plan
from finetune.recipe.parse import Recipe, parse_recipe
from finetune.recipe.preflight import check_eval_split
from finetune.train.compiled import CompileReportCallback
from finetune.train.divergence import NonFiniteLossCallback
from finetune.train.effective import report_and_guard_launch
from finetune.train.evaluation import ExactMatchCallback, print_before_after, record_stop_tokens, summarize_evaluations
from finetune.train.throughput import ThroughputCallback
from finetune.train.tracking import TrackedRunCallback, run_parameters


def train(recipe: Recipe) -> dict:
    """Runs the whole job on this rank and returns the summary written to `eval_results.json`. What differs between
    training methods (supervised, preference, ...) is asked of `recipe.method` (finetune.recipe.methods.Method), what
    differs between parallelism axes of `recipe.axes` (finetune.axes.Axis); `recipe.runner`, an axis Trainer
    cannot drive, takes the steps in its own loop."""
    args, method, axes, runner = recipe.training, recipe.method, recipe.axes, recipe.runner
    set_seed(args.seed)

    # a silent rank or a dead launcher ends this rank (finetune.launch.watchdog); one run per output_dir
    # (finetune.checkpoints.run_lock)
    with watching_ranks(args), output_dir_lock(args):
        for axis in axes:  # what must hold on every rank before hours of loading
            axis.before_loading(recipe)
        tokenizer = load_tokenizer(recipe.model)
        loading = HostLoadProbe()  # host RAM this rank takes until the model is ready for Trainer
        with waiting_for_rank_zero_to_load(args.model_load_timeout):  # not within ddp_timeout
            model = load_model(recipe.model, tokenizer, seed=args.seed, qlora=recipe.lora.use_qlora,
                               strategy=recipe.strategy, parallelism=recipe.parallelism,
                               shapes_only=sharded_from_rank_zero() or any(axis.loads_shapes_only(recipe)
                                                                           for axis in axes))
        turn_on_load_balancing(model, recipe.model.router_aux_loss_coef)  # experts: their router loss, as TRL
        model = method.prepare_model(recipe, model)  # adapters, trainable weights held as the method needs
        prepared = model
        for axis in axes:  # what this rank trains (a pipeline: its stage, the only weights it reads)
            prepared = axis.prepare_model(recipe, prepared)
        for axis in axes:  # what an axis sets before Trainer is built (Ulysses: the attention the model runs)
            axis.prepare_training(recipe, prepared)
        if runner is None:  # the model Trainer trains
            model = prepared
            materialize_empty_parameters(model)  # shapes only (FSDP2, ranks ≠ 0): Accelerate fills them from rank 0
            check_same_parameters_on_every_rank(model)  # rank 0's weights go into every rank's shards as they are
        loading.stop()
        data = method.prepare_data(recipe, tokenizer, model)
        # saved with the model: generate() elsewhere stops there too
        record_stop_tokens(model, tokenizer, trained_as_plain_text(data.summary))
        check_eval_split(args, data.eval is not None)  # before Trainer, which would raise a ValueError of its own
        # may stop: nothing written yet
        resume = checkpoint_to_resume(recipe, data.summary["train_fingerprint"], tokenizer.chat_template)
        if runner is not None:  # its own loop, writing the records a Trainer run writes
            if args.process_index == 0:
                method.print_data_summary(data.summary)
                write_data_summary(data.summary, args.output_dir)
                print_batch_plan(write_batch_plan(recipe.batch_plan, args.output_dir))
            return runner.run(recipe, model, prepared, tokenizer, data, resume, host_load_bytes=loading.bytes)
        if data.eval is None:
            args.eval_on_start = False  # nothing to evaluate on: no 'before' column

        check_fsdp_wrap_classes(model)
        # LoRA's base, a vision-language model's frozen tower: checked unchanged on every rank
        frozen_check = FrozenWeightsCallback() if recipe.lora.use_lora or any(
            not parameter.requires_grad for parameter in model.parameters()) else None
        memory_report = MemoryReportCallback(sequence_length=recipe.data.max_seq_length,
                                             method=method.terms()) if args.memory_report else None
        throughput = ThroughputCallback(peak_tflops=args.peak_tflops) if args.throughput_report else None
        divergence = NonFiniteLossCallback(fp16=args.fp16)
        preemption = PreemptionCallback() if save_on_preemption(args) else None  # SIGTERM saves: checkpoints.preemption
        compiled = CompileReportCallback() if args.torch_compile else None  # graphs and graph breaks: compile.json
        callbacks = [callback for callback in (*method.callbacks(recipe, tokenizer, data), memory_report, throughput,
                                               frozen_check, divergence, preemption, compiled) if callback is not None]
        trainer = method.build_trainer(recipe, model, tokenizer, data, callbacks)  # the data summary is now complete
        for axis in axes:  # a loss or gradient fix-up its engine needs
            axis.trainer_built(trainer)
        if memory_report is not None:
            if getattr(trainer, "full_logits_reason", None):  # the method's fused head given up for a feature
                memory_report.method = replace(memory_report.method, fused_head=False, logits_held=True)
            reference = getattr(trainer, "ref_model", None)  # TRL's name for a frozen reference
            memory_report.host_load_bytes = loading.bytes
            memory_report.reference_model = reference
            memory_report.reference_read_bytes = reference_read_bytes(reference)
            memory_report.reward_models = [reward for reward in getattr(trainer, "reward_funcs", ())
                                           if isinstance(reward, torch.nn.Module)]  # TRL's GRPO: reward models
            memory_report.generation_cache = getattr(trainer, "generation_cache", None)
        if trainer.is_world_process_zero():
            method.print_data_summary(data.summary)
            write_data_summary(data.summary, args.output_dir)
            print_batch_plan(write_batch_plan(recipe.batch_plan, args.output_dir))
        effective = report_and_guard_launch(trainer, recipe)  # effective_config.json; stops on a fallback
        trainer.add_callback(TrackedRunCallback(run_parameters(recipe, effective)))  # W&B's and MLflow's run parameters

        train_output = trainer.train(resume_from_checkpoint=resume)
        final_evaluation = trainer.evaluate() if data.eval is not None else None  # "after" is always of these weights
        trainer.save_model()
        trainer.save_state()

        since = evaluations_comparable_since(resume, data.summary["train_fingerprint"])
        scored = next((callback.history for callback in callbacks if isinstance(callback, ExactMatchCallback)), [])
        summary = summarize_evaluations(trainer.state.log_history, scored, final_evaluation, since)
        summary["method"] = method.name
        summary["world_size"] = args.world_size
        summary["deepspeed_zero_stage"] = recipe.strategy.zero_stage  # what ran: the strategy check stops otherwise
        summary["train_loss"] = train_output.training_loss
        summary["dropped_examples"] = dropped_rows(data.summary)
        if frozen_check is not None:
            summary["frozen_weights_unchanged"] = frozen_check.unchanged
        if trainer.is_world_process_zero():
            if memory_report is not None and memory_report.records:
                summary.update(learn_from_memory(memory_report.records, args, method.name))
            outputs.write_record(args.output_dir, outputs.EVAL_RESULTS, summary)
            print_before_after(summary)
            for warning in over_plan_warnings(summary.get("memory_against_plan")):
                print(f"warning: {warning}")
        # A clean shutdown: gloo's threads abort the interpreter at exit when the group is left alive, or when tensors
        # they still reference are freed during interpreter teardown; the trainer's reference cycles are collected here.
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()
        del trainer, model
        gc.collect()
        return summary


# Library warnings that tell a user of the run nothing, each silenced where it is raised (its category, module and
# message), never warnings at large: (category, module, message) as `warnings.filterwarnings` matches them.
KNOWN_LIBRARY_WARNINGS = (
    # DeepSpeed ZeRO-3 gathers and reduce-scatters through torch's renamed collectives, several times a step; torch's
    # `deprecated` wrapper attributes the warning to c10d_logger's exception wrapper
    (FutureWarning, r"torch\.distributed\.c10d_logger",
     r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    # PEFT asks every model `is_gradient_checkpointing` when it wraps it (peft_model.py), which Transformers renamed
    (FutureWarning, r"transformers\.modeling_utils", r"`is_gradient_checkpointing` is deprecated"),
)


def quiet_known_library_warnings() -> None:
    import warnings

    for category, module, message in KNOWN_LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def reference_read_bytes(reference) -> int | None:
    """The bytes of a frozen reference's weights this rank read from the checkpoint (`load_reference` records them on
    the model, which DeepSpeed's inference engine wraps as `module`); None without a reference."""
    for holder in (reference, getattr(reference, "module", None)):
        held = getattr(holder, "read_bytes", None) if holder is not None else None
        if isinstance(held, int):
            return held
    return None


def learn_from_memory(records: list[dict], args, method: str | None = None) -> dict:
    """What the memory report says against the plan (`memory_against_plan`, flagging a rank above it by more than
    the plan's margin) and, on a GPU, the calibration this run (of `method`) stored for the next plans on that GPU."""
    from finetune.launch.devices import visible_gpu
    from finetune.plan.calibration import learn_from_run

    learned = {"memory_against_plan": memory_against_plan(records, launch_plan())}
    gpu = visible_gpu()
    saved = learn_from_run(args.output_dir, gpu.name, records, method) \
        if args.save_calibration and gpu is not None else None
    if saved is not None:
        learned["calibration_saved"] = str(saved)
        print(f"calibration: this run's overhead beyond the prediction is stored for {gpu.name} in {saved}; "
              "`finetune plan` on that GPU adds it to plans of the same strategy, method and model size.")
    return learned


def checkpoint_to_resume(recipe: Recipe, train_data: str, chat_template: str | None = None) -> str | None:
    """`resume_from_checkpoint: auto` resumes from the newest checkpoint complete and whole on every node (a
    collective: with `save_on_each_node` each node reads its own disk), or starts fresh; rank 0 names skipped
    half-written or damaged checkpoints and recipe keys that changed since the checkpoint. A checkpoint holding a file
    that could run code when loaded is refused by name on every rank. Changed training data is refused unless
    `ignore_data_skip` (finetune.checkpoints.complete.check_same_data; a changed `chat_template` is named as the
    cause)."""
    args = recipe.training
    wanted, skipped = args.resume_from_checkpoint, []
    if wanted in (None, "", "false", "False"):
        return None
    if wanted == "auto":
        last, skipped = agree_on_newest_complete(args.output_dir, args.world_size)
        wanted = None if last is None else str(last)
    if args.process_index == 0:
        for folder in skipped:
            print(f"warning: skipping {folder}: {why_incomplete(folder, args.process_index)}")
    if wanted is None:
        return None
    # On every rank, before anything is unpickled (each node reads its own disk); all stop if one refuses
    try:
        check_checkpoint_files(wanted)
        refusal = None
    except RecipeError as error:
        refusal = str(error)
    refusals = gather_object([refusal]) if args.world_size > 1 else [refusal]
    if any(refusals):
        raise RecipeError(next(text for text in refusals if text))
    changes = recipe_changes(Path(wanted), recipe_values(recipe))
    if args.lr_scheduler_type == "reduce_lr_on_plateau" and any(c.startswith("learning_rate:") for c in changes):
        raise RecipeError("`lr_scheduler_type: reduce_lr_on_plateau` keeps its learning rate in the checkpoint, so a "
                          "changed `learning_rate` cannot apply on resume: resume with the rate it was saved with, "
                          "or start afresh from its weights (`finetune export`).")
    data_note = check_same_data(wanted, train_data, args.ignore_data_skip, chat_template)
    if args.process_index == 0:
        print(f"resuming from {wanted}")
        if changes:
            print(f"warning: the recipe differs from the one {wanted} was trained with: {'; '.join(changes)}")
        if data_note:
            print(f"warning: {data_note}")
    return wanted


def evaluations_comparable_since(checkpoint: str | None, train_data: str) -> int:
    """The first step whose evaluation compares with the final one: the resume step when the data changed since the
    checkpoint (the evaluations before it were of other data), else 0."""
    if checkpoint is None or read_marker(checkpoint).get("train_data") in (None, train_data):
        return 0
    return read_marker(checkpoint)["step"]


def check_fsdp_wrap_classes(model) -> None:
    """The FSDP wrap classes an Accelerate config names must exist in the model, or nothing is sharded."""
    names = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and names:
        problems = lint_fsdp_wrap_classes([name.strip() for name in names.split(",")], model)
        if problems:
            raise RecipeError(" ".join(problems))


def train_command(recipe_path: str | None, overrides: list[str]) -> dict:
    quiet_known_library_warnings()
    recipe = parse_recipe(recipe_path, overrides)
    harness_tasks = recipe.data.eval_harness_tasks
    if harness_tasks:  # a task lm-eval does not know stops here, before hours of training
        from finetune.train.harness import check_installed, evaluate_run, print_scores, select_tasks

        check_installed()
        selection = select_tasks(harness_tasks)
    # Ctrl-C and SIGTERM end in one line naming the checkpoint to resume from, not a traceback from every rank
    with ending_in_one_line_on_signals(recipe.training.output_dir, recipe.training.process_index):
        summary = train(recipe)
    if harness_tasks and recipe.training.process_index == 0:  # the other ranks are done: the saved model, on one
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # else from_pretrained would build the model under ZeRO-3's partitioning again
        record = evaluate_run(recipe.training.output_dir, selection)
        print_scores(record)
        summary["eval_harness"] = {"results_file": record["results_file"], "scores": record["scores"]}
    return summary
