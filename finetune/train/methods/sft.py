"""Supervised fine-tuning (`method: sft`, the default): learn the answers of the data.

The data pipeline (finetune.data.pipeline: formats, chat template, completion-only labels, packing, the `finetune
preprocess` cache), the toolkit's `FinetuneTrainer` (the loss in `compute_loss`), and the generation exact match
on held-out prompts that the before/after summary reports.
"""

from __future__ import annotations

from finetune.memory.estimate import MethodTerms
from finetune.recipe.methods import Method


class SupervisedFineTuning(Method):
    name = "sft"
    description = "learn the answers of the data (cross-entropy on the answer tokens)"
    # The loss from TRL's fused LM head (finetune.train.trainer.FinetuneTrainer): no full logits are held; a run
    # that needs them (label smoothing, sequence parallelism) counts them again (finetune.train.run)
    memory = MethodTerms(logits_held=False, fused_head=True)
    full_logits_on_request = True  # `fused_lm_head: false`: the model's own loss over the full logits

    def plan_data(self, sections):
        from finetune.data.pipeline import example_lengths

        return example_lengths(sections)

    def prepare_model(self, recipe, model):
        from finetune.models.loading import hold_trainable_parameters, trainable_dtype
        from finetune.models.lora import apply_lora

        args = recipe.training
        if recipe.lora.use_lora:
            model = apply_lora(model, recipe.lora)
        # after the adapters are added: a LoRA run's frozen base keeps its loaded dtype
        hold_trainable_parameters(model, trainable_dtype(recipe.strategy, args.mixed_precision, args.pure_bf16))
        return model

    def prepare_data(self, recipe, tokenizer, model):
        from finetune.data.pipeline import prepare_data

        return prepare_data(recipe, tokenizer, model)

    def callbacks(self, recipe, tokenizer, data) -> list:
        from finetune.train.evaluation import ExactMatchCallback

        return [ExactMatchCallback(tokenizer, data.generation_examples, recipe.data.generation_max_new_tokens)]

    def trainer_class(self) -> type:
        """The trainer: the toolkit's `FinetuneTrainer` (a method built on SFT may give a subclass)."""
        from finetune.train.trainer import FinetuneTrainer

        return FinetuneTrainer

    def trainer_options(self) -> dict:
        """Keyword arguments of its own that `trainer_class` takes."""
        return {}

    def build_trainer(self, recipe, model, tokenizer, data, callbacks):
        from finetune.axes import axes_collator
        from finetune.checkpoints.complete import recipe_values
        from finetune.data.collate import data_collator
        from finetune.models.vision import processor_of

        if recipe.data.streaming:  # each process reads its own rows of the stream (finetune.data.streaming)
            recipe.training.accelerator_config.dispatch_batches = False
        processor = processor_of(tokenizer)
        if processor is not None:  # rows with images: their pixels are computed as each batch is built
            from finetune.data.vision.collate import VisionCollator

            recipe.training.remove_unused_columns = False  # the collator reads the `images` column
            collator = VisionCollator(processor)
        else:
            collator = data_collator(tokenizer, recipe.data.packing, recipe.data.padding_free, model=model)
        return self.trainer_class()(
            model=model,
            args=recipe.training,
            train_dataset=data.train,
            eval_dataset=data.eval,
            data_collator=axes_collator(recipe, tokenizer, collator),
            processing_class=processor or tokenizer,  # saved with the model: the processor's files with a VLM's
            callbacks=callbacks,
            recipe_values=recipe_values(recipe),
            train_data=data.summary["train_fingerprint"],
            **self.trainer_options(),
        )

    def print_data_summary(self, summary: dict) -> None:
        from finetune.data.summary import print_data_summary

        print_data_summary(summary)
