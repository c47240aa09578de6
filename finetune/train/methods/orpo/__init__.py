"""Odds Ratio Preference Optimization (`method: orpo`): TRL's experimental `ORPOTrainer` on the toolkit's rails,
without a reference model (finetune.train.methods.reference_free).

ORPO (Hong et al. 2024, arXiv 2403.07691) adds to the chosen answer's cross-entropy (prompt and answer) a term that
raises the odds of the chosen answer against the rejected one: −λ·log σ(log odds(chosen) − log odds(rejected)), the
odds of an answer p/(1 − p) with p its per-token mean probability, λ TRL's `beta`. So it fine-tunes and aligns in one
run, from a base model as well as from an SFT one.

This module holds the method's keys and config and is read with the recipe; its trainer (`trainer.py`) is imported
only when a run builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.errors import RecipeError
from finetune.recipe.aliases import TrlKey
from finetune.recipe.args import trl_config
from finetune.train.methods.reference_free import ReferenceFreePairMethod

ORPO_CONFIG = "ORPOConfig"


@dataclass
class ORPOArguments:
    """ORPO's own keys (`method: orpo`), under TRL's names."""

    beta: float = field(
        default=0.1,
        metadata={"help": "ORPO: λ, the weight of the odds-ratio term beside the chosen answer's cross-entropy "
                          "(TRL's `beta`)."},
    )

    def __post_init__(self):
        if self.beta <= 0:
            raise RecipeError(f"`beta` must be positive, got {self.beta}.")


# TRL's ORPOConfig and the recipe's training arguments in one dataclass, as ORPOTrainer reads them
finetune_orpo_config, __getattr__ = trl_config("trl.experimental.orpo.orpo_config:ORPOConfig", "FinetuneORPOConfig",
                                               __name__, "The recipe's training arguments and TRL's ORPO keys.")


class OddsRatioPreferenceOptimization(ReferenceFreePairMethod):
    name = "orpo"
    description = ("Odds Ratio Preference Optimization on prompt/chosen/rejected pairs (`dataset: synthetic` gives "
                   "pairs made from the synthetic tasks): the chosen answer's cross-entropy and an odds-ratio term, no "
                   "reference model, through TRL's experimental ORPOTrainer; reports the held-out reward accuracy and "
                   "margin")
    trainer_name = "ORPOTrainer"
    trainer_class = "finetune.train.methods.orpo.trainer:FinetuneORPOTrainer"
    training_config = staticmethod(finetune_orpo_config)
    arguments = ORPOArguments
    trl_keys = (
        TrlKey("max_completion_length", ORPO_CONFIG, ignored=True,
               why="TRL reads it for encoder-decoder models only; a pair is cut to `max_seq_length` keeping its "
                   "start"),
    )
    preprocess_refusal = ("under `method: orpo`, TRL's ORPOTrainer tokenizes the preference pairs itself when "
                          "training starts and would never read a cache")

    def trl_values(self):
        return {"beta": self.settings.beta}
