"""What every method trained on preference pairs shares: the pairs, read, checked and counted the same way
(finetune.data.pairs), with the fingerprint resumes compare, and their summary. TRL's trainer (`trainer_name`)
tokenizes them itself when training starts. A method that reads unpaired examples (`unpaired`) takes every pair as
two, beside rows that are unpaired already."""

from __future__ import annotations

from typing import ClassVar

from finetune.recipe.methods import Method


class PairMethod(Method):
    trainer_name: ClassVar[str]
    """TRL's trainer, as refusals name it."""
    unpaired: ClassVar[bool] = False
    """Whether it trains on unpaired examples (a prompt, a completion, a desirable-or-not `label`) instead of pairs."""

    def check_data_keys(self, data_args) -> None:
        from finetune.data.pairs import check_pair_data_keys

        check_pair_data_keys(data_args, self.name, self.trainer_name)

    def plan_data(self, sections):
        """The pairs, loaded, checked and counted as `finetune train` loads them; TRL tokenizes them only when
        training starts, so each is planned at `max_seq_length`."""
        from finetune.data.pairs import load_preference_data

        seed = int(sections.training_inputs.get("seed") or 42)
        return None, load_preference_data(sections.data, seed, unpaired=self.unpaired).summary

    def prepare_data(self, recipe, tokenizer, model):
        """The preference pairs, with the fingerprint checkpoints record (of the pairs' text). TRL tokenizes them when
        the trainer is built, which completes their summary."""
        from finetune.data.pairs import SOURCE_COLUMN, load_preference_data
        from finetune.data.summary import fingerprint

        data = load_preference_data(recipe.data, recipe.training.seed, unpaired=self.unpaired)
        data.summary["train_fingerprint"] = fingerprint(data.train.remove_columns(SOURCE_COLUMN))
        return data

    def print_data_summary(self, summary: dict) -> None:
        from finetune.data.pairs import print_preference_summary

        print_preference_summary(summary)
