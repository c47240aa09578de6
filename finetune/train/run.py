"""`finetune train`: recipe → tokenizer, model, data → Hugging Face `Trainer` → train, evaluate, save, report.

Run it under any launcher, e.g.
    accelerate launch --config_file accelerate_configs/cpu_deepspeed_zero2.yaml -m finetune train recipes/demo.yaml
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

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
from finetune.checkpoints.preemption import PreemptionCallback, save_on_preemption
from finetune.checkpoints.run_lock import output_dir_lock
from finetune.configs.lint import lint_fsdp_wrap_classes
from finetune.data import load_raw_data, prepare_datasets
from finetune.data.cache import cache_dir, load_preprocessed
from finetune.data.collate import data_collator, pack_prepared, prepare_model_for_packing
from finetune.data.summary import dropped_rows, fingerprint, print_data_summary, write_data_summary
from finetune.data.tokenize import PreparedData
from finetune.errors import RecipeError
from finetune.launch.watchdog import watching_ranks
from finetune.memory import MemoryReportCallback
from finetune.models.loading import (
    FrozenWeightsCallback,
    apply_lora,
    hold_trainable_parameters,
    load_model,
    load_tokenizer,
    trainable_dtype,
)
from finetune.recipe.batch_plan import print_batch_plan, write_batch_plan
from finetune.recipe.parse import Recipe, parse_recipe
from finetune.recipe.preflight import check_eval_split
from finetune.train.divergence import NonFiniteLossCallback
from finetune.train.effective import report_and_guard_launch
from finetune.train.evaluation import ExactMatchCallback, print_before_after, record_stop_tokens, summarize_evaluations
from finetune.train.throughput import ThroughputCallback
from finetune.train.trainer import FinetuneTrainer


def train(recipe: Recipe) -> dict:
    """Runs the whole job on this rank and returns the summary written to `eval_results.json`."""
    args = recipe.training
    set_seed(args.seed)

    dpo = recipe.preference.method == "dpo"
    # a silent rank or a dead launcher ends this rank (finetune.launch.watchdog); one run per output_dir
    # (finetune.checkpoints.run_lock)
    with watching_ranks(args), output_dir_lock(args):
        tokenizer = load_tokenizer(recipe.model)
        model = load_model(recipe.model, tokenizer, seed=args.seed, qlora=recipe.lora.use_qlora,
                           strategy=recipe.strategy)
        if recipe.lora.use_lora and not dpo:  # DPO: TRL applies the adapters (finetune.train.preference.dpo_trainer)
            model = apply_lora(model, recipe.lora)
        if not dpo:  # DPO: once TRL has applied any adapters, or a LoRA run's frozen base would be cast too
            hold_trainable_parameters(model, trainable_dtype(recipe.strategy, args.mixed_precision, args.pure_bf16))

        data = prepare_preference_data(recipe) if dpo else prepare_data(recipe, tokenizer, model)
        record_stop_tokens(model, tokenizer, data.summary)  # saved with the model: generate() elsewhere stops there too
        check_eval_split(args, data.eval is not None)  # before Trainer, which would raise a ValueError of its own
        resume = checkpoint_to_resume(recipe, data.summary["train_fingerprint"])  # may stop: nothing written yet
        if args.process_index == 0 and not dpo:  # DPO: once TRL has tokenized the pairs (dpo_trainer)
            write_data_summary(data.summary, args.output_dir)
        if data.eval is None:
            args.eval_on_start = False  # nothing to evaluate on: no 'before' column

        check_fsdp_wrap_classes(model)
        exact_match = None if dpo else ExactMatchCallback(tokenizer, data.generation_examples,
                                                          recipe.data.generation_max_new_tokens)
        frozen_check = FrozenWeightsCallback() if recipe.lora.use_lora else None
        memory_report = MemoryReportCallback(sequence_length=recipe.data.max_seq_length) if args.memory_report else None
        throughput = ThroughputCallback(peak_tflops=args.peak_tflops) if args.throughput_report else None
        divergence = NonFiniteLossCallback(fp16=args.fp16)
        preemption = PreemptionCallback() if save_on_preemption(args) else None  # SIGTERM saves: checkpoints.preemption
        callbacks = [callback for callback in (exact_match, memory_report, throughput, frozen_check, divergence,
                                               preemption) if callback is not None]
        if dpo:
            trainer = dpo_trainer(recipe, model, tokenizer, data, callbacks)
            if memory_report is not None:
                memory_report.reference_model = trainer.ref_model
        else:
            trainer = FinetuneTrainer(
                model=model,
                args=args,
                train_dataset=data.train,
                eval_dataset=data.eval,
                data_collator=data_collator(tokenizer, recipe.data.packing, recipe.data.padding_free, model=model),
                processing_class=tokenizer,
                callbacks=callbacks,
                recipe_values=recipe_values(recipe),
                train_data=data.summary["train_fingerprint"],
            )
        if trainer.is_world_process_zero():
            print_batch_plan(write_batch_plan(recipe.batch_plan, args.output_dir))
        report_and_guard_launch(trainer, recipe)  # effective_config.json; stops on a fallback

        train_output = trainer.train(resume_from_checkpoint=resume)
        final_evaluation = trainer.evaluate() if data.eval is not None else None  # "after" is always of these weights
        trainer.save_model()
        trainer.save_state()

        since = evaluations_comparable_since(resume, data.summary["train_fingerprint"])
        scored = [] if exact_match is None else exact_match.history
        summary = summarize_evaluations(trainer.state.log_history, scored, final_evaluation, since)
        summary["world_size"] = args.world_size
        summary["deepspeed_zero_stage"] = recipe.strategy.zero_stage  # what ran: the strategy check stops otherwise
        summary["train_loss"] = train_output.training_loss
        summary["dropped_examples"] = dropped_rows(data.summary)
        if dpo:
            summary["method"] = "dpo"
        if frozen_check is not None:
            summary["frozen_weights_unchanged"] = frozen_check.unchanged
        if trainer.is_world_process_zero():
            outputs.write_record(args.output_dir, outputs.EVAL_RESULTS, summary)
            print_before_after(summary)
        # A clean shutdown: gloo's threads abort the interpreter at exit when the group is left alive, or when tensors
        # they still reference are freed during interpreter teardown; the trainer's reference cycles are collected here.
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()
        del trainer, model
        gc.collect()
        return summary


def prepare_data(recipe: Recipe, tokenizer, model) -> PreparedData:
    """Tokenized (and, if asked, packed) data and its summary, which rank 0 prints: read from the cache `finetune
    preprocess` wrote when its key matches (finetune.data.cache), else tokenized here."""
    args = recipe.training
    if recipe.data.packing or recipe.data.padding_free:
        prepare_model_for_packing(model)
    data = read_preprocessed(recipe, tokenizer) or tokenize_data(recipe, tokenizer)
    # Which ranks read tokenized data (the preprocessed cache, or the `datasets` cache rank 0 wrote under
    # main_process_first) instead of tokenizing.
    from_cache = "preprocessed" in data.summary or all(source["train"]["from_cache"]
                                                       for source in data.summary["sources"])
    data.summary["train_from_cache_by_rank"] = gather_object([from_cache]) if args.world_size > 1 else [from_cache]
    if args.process_index == 0:
        print_data_summary(data.summary)
    return data


def prepare_preference_data(recipe: Recipe):
    """DPO's preference pairs (finetune.train.preference), with the fingerprint checkpoints record (of the pairs' text).
    TRL tokenizes them when the trainer is built (dpo_trainer), which completes and prints their summary."""
    from finetune.train.preference import SOURCE_COLUMN, load_preference_data

    data = load_preference_data(recipe.data, recipe.training.seed)
    data.summary["train_fingerprint"] = fingerprint(data.train.remove_columns(SOURCE_COLUMN))
    return data


def dpo_trainer(recipe: Recipe, model, tokenizer, data, callbacks):
    """TRL's DPOTrainer with the toolkit's guarantees (finetune.train.preference.FinetuneDPOTrainer): the reference is a
    second copy of the starting model, frozen, or under LoRA the policy with its adapters disabled (TRL applies the
    adapters from `lora_config`, so no reference adapter is copied). The pairs TRL tokenizes go through the length
    policies; rank 0 then prints and writes the data summary with what TRL truncated or dropped."""
    from finetune.models.loading import lora_config
    from finetune.train.preference import (
        FinetuneDPOTrainer,
        frozen_reference,
        prepare_reference_for_zero3,
        print_preference_summary,
    )

    args = recipe.training
    reference, peft_config = None, None
    if recipe.lora.use_lora:
        peft_config = lora_config(model, recipe.lora)
    else:
        reference = load_model(recipe.model, tokenizer, seed=args.seed, strategy=recipe.strategy)
        frozen_reference(reference)
    prepare_reference_for_zero3(args, model)
    try:
        trainer = FinetuneDPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data.train,
                                     eval_dataset=data.eval, processing_class=tokenizer, callbacks=callbacks,
                                     peft_config=peft_config, recipe_values=recipe_values(recipe),
                                     train_data=data.summary["train_fingerprint"], data_args=recipe.data,
                                     summary=data.summary)
    except RecipeError:
        raise
    except (ValueError, NotImplementedError) as error:  # TRL's refusals of a setting, said in one line
        raise RecipeError(f"TRL's DPOTrainer refuses this recipe: {str(error).splitlines()[0]}") from None
    if args.process_index == 0:
        print_preference_summary(data.summary)
        write_data_summary(data.summary, args.output_dir)
    # fp32 master weights under mixed precision, whatever dtype the checkpoint was stored in (the adapters TRL added,
    # or every weight of a full run); the frozen base and the reference keep the loaded dtype
    hold_trainable_parameters(trainer.model, trainable_dtype(recipe.strategy, args.mixed_precision, args.pure_bf16))
    return trainer


def tokenize_data(recipe: Recipe, tokenizer) -> PreparedData:
    """The data pipeline, load → tokenize → pack, and the fingerprint checkpoints record (resumes compare it);
    `finetune preprocess` runs this same function ahead of a launch."""
    data = prepare_datasets(load_raw_data(recipe.data), tokenizer, recipe.data, recipe.training)
    if recipe.data.packing:
        data = pack_prepared(data, recipe.data.max_seq_length)
    data.summary["train_fingerprint"] = fingerprint(data.train)
    return data


def read_preprocessed(recipe: Recipe, tokenizer) -> PreparedData | None:
    """The cache `finetune preprocess` wrote, memory-mapped on every rank, when its key matches on every rank (were
    one rank to tokenize alone, under main_process_first, the others would wait for it at a barrier); rank 0 says
    which data it reads, or why it tokenizes instead."""
    args = recipe.training
    directory = cache_dir(recipe.data, args.output_dir)
    data, why_not = load_preprocessed(directory, recipe.data, tokenizer, args.seed)
    if data is None and not why_not and recipe.data.preprocessed_dir is not None:
        why_not = f"`preprocessed_dir: {directory}` holds no preprocessed data (`finetune preprocess` writes it)"
    ranks = gather_object([(data is not None, why_not)]) if args.world_size > 1 else [(data is not None, why_not)]
    reasons = [f"{f'rank {rank}: ' if args.world_size > 1 else ''}{why}" for rank, (_, why) in enumerate(ranks) if why]
    if not all(usable for usable, _ in ranks):
        data = None
    if args.process_index == 0 and data is not None:
        print(f"reading the preprocessed data in {directory} (key {data.summary['preprocessed']['key']}) on every "
              "rank: no tokenizing")
    elif args.process_index == 0 and reasons:
        print(f"warning: {reasons[0]}; tokenizing as usual (`finetune preprocess` with this recipe refreshes it)")
    return data


def checkpoint_to_resume(recipe: Recipe, train_data: str) -> str | None:
    """`resume_from_checkpoint: auto` resumes from the newest checkpoint complete and whole on every node (a
    collective: with `save_on_each_node` each node reads its own disk), or starts fresh; rank 0 names skipped
    half-written or damaged checkpoints and recipe keys that changed since the checkpoint. A checkpoint holding a file
    that could run code when loaded is refused by name on every rank. Changed training data is refused unless
    `ignore_data_skip` (finetune.checkpoints.complete.check_same_data)."""
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
    data_note = check_same_data(wanted, train_data, args.ignore_data_skip)
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
    return train(parse_recipe(recipe_path, overrides))
