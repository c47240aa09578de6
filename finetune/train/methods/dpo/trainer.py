"""TRL's DPOTrainer with the toolkit's guarantees (`FinetuneDPOTrainer`), and how a run builds it (`dpo_trainer`),
as every trainer against a frozen reference is built (finetune.train.methods.trl_trainers)."""

from __future__ import annotations

from trl import DPOTrainer

from finetune.data.pairs import SOURCE_COLUMN, apply_pair_length_policies
from finetune.train.methods.trl_trainers import trainer_against_a_reference
from finetune.train.trainer import FinetuneTrainerMixin


def dpo_trainer(recipe, model, tokenizer, data, callbacks):
    return trainer_against_a_reference(FinetuneDPOTrainer, "DPOTrainer", recipe, model, tokenizer, data, callbacks)


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

