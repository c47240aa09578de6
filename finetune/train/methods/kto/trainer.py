"""TRL's KTOTrainer with the toolkit's guarantees (`FinetuneKTOTrainer`), and how a run builds it (`kto_trainer`),
as every trainer against a frozen reference is built (finetune.train.methods.trl_trainers)."""

from __future__ import annotations

from collections import Counter

from trl import KTOTrainer

from finetune.data.pairs import SOURCE_COLUMN, apply_pair_length_policies
from finetune.train.methods.trl_trainers import trainer_against_a_reference
from finetune.train.trainer import FinetuneTrainerMixin


def kto_trainer(recipe, model, tokenizer, data, callbacks):
    return trainer_against_a_reference(FinetuneKTOTrainer, "KTOTrainer", recipe, model, tokenizer, data, callbacks)


class FinetuneKTOTrainer(FinetuneTrainerMixin, KTOTrainer):
    """TRL's KTOTrainer with the toolkit's checkpoints, resume, rotation and saving (`FinetuneTrainerMixin`).
    `ref_model` is always given, or None under LoRA: TRL would otherwise reload the reference by the model's name.
    With `data_args` and the data's `summary`, the examples TRL tokenizes go through the recipe's length policies and
    are counted there (`apply_pair_length_policies`)."""

    def __init__(self, *args, data_args=None, summary: dict | None = None, **kwargs):
        self.data_args, self.data_summary = data_args, summary
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """TRL has dropped the examples whose prompt fills `max_length`, and its collator keeps the first
        `max_length` tokens of a longer one, as for pairs. An example `overlong_policy: drop` removes here has already
        lent its completion to a neighbour's KL term, so the KL completions are drawn again from what is kept."""
        tokenized = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if self.data_args is None or SOURCE_COLUMN not in dataset.column_names:
            return tokenized
        split = "train" if dataset_name == "train" else "eval"
        kept = apply_pair_length_policies(dataset, tokenized, self.data_args, split, self.data_summary,
                                          answers=("completion_ids",), unit="example")
        desirable = Counter(source for source, label in zip(kept[SOURCE_COLUMN], kept["label"]) if label)
        for index, source in enumerate(self.data_summary["sources"]):
            if source[split] is not None:
                source[split]["desirable"] = desirable[index]
        if self.calculate_KL and len(kept) < len(tokenized):
            kept = kept.map(kl_completions, batched=True, batch_size=args.per_device_train_batch_size)
        return kept

    def _send_telemetry(self):
        """No usage pings: nothing leaves the machine unless the user asks (`report_to`)."""

    def create_model_card(self, *args, **kwargs):
        """TRL writes a README.md model card into every checkpoint; the run's own records say what was trained."""


def kl_completions(examples: dict) -> dict:
    """Each example's KL completion: its micro-batch neighbour's, the completions rotated by one within each batch of
    `per_device_train_batch_size` (TRL's `_prepare_dataset`, trl/trainer/kto_trainer.py), so that the mismatched
    completions of a batch are the same set as its own."""
    examples["KL_completion_ids"] = [examples["completion_ids"][-1]] + examples["completion_ids"][:-1]
    return examples
