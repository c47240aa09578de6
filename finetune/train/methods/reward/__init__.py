"""Reward modelling (`method: reward`): TRL's `RewardTrainer` on the toolkit's rails.

The same recipe, launchers, callbacks and checkpoint guarantees as the other methods. What differs:

- the data are preference pairs, read as every preference method reads them (finetune.data.pairs, every pair
  format; `dataset: synthetic` gives pairs made from the synthetic tasks);
- the model is a scorer: the starting causal LM's decoder with a one-output head (`score`) in place of the
  vocabulary head (Transformers' `...ForSequenceClassification`, `num_labels: 1`), the head initialised from the
  recipe's seed;
- the loss is TRL's Bradley-Terry loss, −log σ(r_chosen − r_rejected), and the evaluation reports the held-out pair
  accuracy (how often the chosen answer scores above the rejected one) and the mean score margin.

This module holds the method's keys and config and is read with the recipe; its trainer (`trainer.py`) is imported
only when a run builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.errors import RecipeError
from finetune.memory.estimate import MethodTerms
from finetune.recipe.args import trl_config
from finetune.train.methods.pairs import PairMethod


@dataclass
class RewardArguments:
    """Reward modelling's own keys (`method: reward`), under TRL's names."""

    center_rewards_coefficient: float | None = field(
        default=None,
        metadata={"help": "Reward modelling: weight of a penalty on the squared mean score, which keeps the scores "
                          "centred on 0 (TRL's `center_rewards_coefficient`; 0.01 is the value its docs suggest)."},
    )

    def __post_init__(self):
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise RecipeError(f"`center_rewards_coefficient` must be ≥ 0, got {self.center_rewards_coefficient}.")


# TRL's RewardConfig and the recipe's training arguments in one dataclass, as RewardTrainer reads them
finetune_reward_config, __getattr__ = trl_config("trl.trainer.reward_config:RewardConfig", "FinetuneRewardConfig",
                                                 __name__, "The recipe's training arguments and TRL's reward keys.")


class RewardModelling(PairMethod):
    name = "reward"
    description = ("A reward model trained on prompt/chosen/rejected pairs (`dataset: synthetic` gives pairs made "
                   "from the synthetic tasks): the starting model's decoder with a one-score head, TRL's "
                   "RewardTrainer; reports the held-out pair accuracy")
    trainer_name = "RewardTrainer"
    arguments = RewardArguments
    # Chosen and rejected in one forward; a score per sequence, no vocabulary logits
    memory = MethodTerms(reference_model=False, sequences_per_example=2, logits_held=False)
    preprocess_refusal = ("under `method: reward`, TRL's RewardTrainer tokenizes the preference pairs itself when "
                          "training starts and would never read a cache")

    def training_arguments(self, data_args):
        return finetune_reward_config(), {"max_length": data_args.max_seq_length,
                                          "center_rewards_coefficient": self.settings.center_rewards_coefficient}

    def prepare_model(self, recipe, model):
        from finetune.train.methods.reward.trainer import scorer_from

        if recipe.lora.use_lora:
            raise RecipeError("`method: reward` trains the whole scorer here; LoRA on a reward model is not wired up "
                              "yet: drop `use_lora`.")
        if recipe.strategy.shards_parameters:
            raise RecipeError(f"`method: reward` under {recipe.strategy.describe()}: the scorer is built from the "
                              "loaded weights, which this strategy shards while loading; train it under DDP, ZeRO-1 "
                              "or ZeRO-2.")
        return scorer_from(model, seed=recipe.training.seed)

    def build_trainer(self, recipe, model, tokenizer, data, callbacks):
        from finetune.train.methods.reward.trainer import reward_trainer

        return reward_trainer(recipe, model, tokenizer, data, callbacks)
