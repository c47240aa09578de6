"""TRL's DPOTrainer with the toolkit's guarantees (`FinetuneDPOTrainer`), and how a run builds it (`dpo_trainer`):
the reference model (finetune.train.methods.trl_trainers), TRL's refusals in one line."""

from __future__ import annotations

from trl import DPOTrainer

from finetune.checkpoints.complete import recipe_values
from finetune.data.pairs import SOURCE_COLUMN, apply_pair_length_policies
from finetune.models.loading import hold_trainable_parameters, trainable_dtype
from finetune.train.methods.trl_trainers import reference_and_adapters, trl_refusals
from finetune.train.trainer import FinetuneTrainerMixin


def dpo_trainer(recipe, model, tokenizer, data, callbacks):
    """The reference is a second copy of the starting model, frozen, or under LoRA the policy with its adapters
    disabled (finetune.train.methods.trl_trainers). The pairs TRL tokenizes go through the length policies, completing
    the data summary."""
    args = recipe.training
    reference, peft_config = reference_and_adapters(recipe, model, tokenizer)
    with trl_refusals("DPOTrainer"):
        trainer = FinetuneDPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data.train,
                                     eval_dataset=data.eval, processing_class=tokenizer, callbacks=callbacks,
                                     peft_config=peft_config, recipe_values=recipe_values(recipe),
                                     train_data=data.summary["train_fingerprint"], data_args=recipe.data,
                                     summary=data.summary)
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

