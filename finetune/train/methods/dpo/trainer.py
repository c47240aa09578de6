"""TRL's DPOTrainer with the toolkit's guarantees (`FinetuneDPOTrainer`), and how a run builds it (`dpo_trainer`):
the reference model, ZeRO-3's buckets filled before TRL builds the reference engine, TRL's refusals in one line."""

from __future__ import annotations

from trl import DPOTrainer

from finetune.checkpoints.complete import recipe_values
from finetune.data.pairs import SOURCE_COLUMN, apply_pair_length_policies
from finetune.errors import RecipeError
from finetune.models.loading import hold_trainable_parameters, load_model, trainable_dtype
from finetune.models.lora import lora_config
from finetune.train.trainer import FinetuneTrainerMixin


def dpo_trainer(recipe, model, tokenizer, data, callbacks):
    """The reference is a second copy of the starting model, frozen, or under LoRA the policy with its adapters
    disabled (TRL applies the adapters from `lora_config`, so no reference adapter is copied). The pairs TRL tokenizes
    go through the length policies, completing the data summary."""
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
    # fp32 master weights under mixed precision, whatever dtype the checkpoint was stored in (the adapters TRL added,
    # or every weight of a full run); the frozen base and the reference keep the loaded dtype
    hold_trainable_parameters(trainer.model, trainable_dtype(recipe.strategy, args.mixed_precision, args.pure_bf16))
    return trainer


class FinetuneDPOTrainer(FinetuneTrainerMixin, DPOTrainer):
    """TRL's DPOTrainer with the toolkit's checkpoints, resume, rotation and saving (`FinetuneTrainerMixin`).
    `ref_model` is always given, or None under LoRA: TRL would otherwise reload the reference by the model's name
    (a hub download, or nothing for the embedded model). With `data_args` and the data's `summary`, the pairs TRL
    tokenizes go through the recipe's length policies and are counted there (`apply_pair_length_policies`)."""

    def __init__(self, *args, data_args=None, summary: dict | None = None, **kwargs):
        self.data_args, self.data_summary = data_args, summary
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        tokenized = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if self.data_args is None or SOURCE_COLUMN not in dataset.column_names:
            return tokenized
        split = "train" if dataset_name == "train" else "eval"
        return apply_pair_length_policies(dataset, tokenized, self.data_args, split, self.data_summary)

    def _send_telemetry(self):
        """No usage pings: nothing leaves the machine unless the user asks (`report_to`)."""

    def create_model_card(self, *args, **kwargs):
        """TRL writes a README.md model card into every checkpoint; the run's own records say what was trained."""


def prepare_reference_for_zero3(args, model) -> None:
    """ZeRO-3 fills its "auto" bucket sizes from the model only when training starts, but TRL builds the reference
    engine when the trainer is constructed, from the config as it is then: fill them now with the values Transformers
    would (hidden², 0.9·hidden², 10·hidden), so the reference is partitioned like the policy."""
    config = getattr(args, "hf_deepspeed_config", None)
    hidden = getattr(model.config, "hidden_size", None)
    if config is None or hidden is None or config.get_value("zero_optimization.stage") != 3:
        return
    config.fill_only("zero_optimization.reduce_bucket_size", hidden * hidden)
    config.fill_only("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
    config.fill_only("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)


def frozen_reference(model) -> None:
    model.requires_grad_(False)
    model.eval()
