"""Contrastive Preference Optimization (`method: cpo`), and SimPO as its `simpo` loss: TRL's experimental
`CPOTrainer` on the toolkit's rails, without a reference model (finetune.train.methods.reference_free).

CPO (Xu et al. 2024, arXiv 2401.08417) is the sigmoid preference loss on the policy's own log-probabilities, where the
reference methods take their ratio to a reference's, plus the chosen answer's cross-entropy weighted by `cpo_alpha`.
SimPO (Meng et al. 2024, arXiv 2405.14734) is `cpo_loss_type: simpo` with `cpo_alpha: 0`: −log σ(β·(mean log
p(chosen) − mean log p(rejected)) − γ), the means per answer token and γ the target margin (`simpo_gamma`). TRL's other
CPO losses (hinge, ipo) are offered as its `loss_type`.

This module holds the method's keys and config and is read with the recipe; its trainer (`trainer.py`) is imported
only when a run builds it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from finetune.errors import RecipeError
from finetune.recipe.aliases import TrlKey
from finetune.recipe.args import trl_config, trl_config_module
from finetune.train.methods.reference_free import ReferenceFreePairMethod

CPO_CONFIG = "CPOConfig"
CONFIG_MODULE = "trl.experimental.cpo.cpo_config"


@functools.cache
def trl_cpo_loss_types() -> tuple[str, ...]:
    """TRL's CPO loss types as the installed TRL declares them (`CPOConfig.loss_type`'s choices,
    trl/experimental/cpo/cpo_config.py)."""
    config = trl_config_module(CONFIG_MODULE).CPOConfig
    return tuple(next(f for f in dataclasses.fields(config) if f.name == "loss_type").metadata["choices"])


@dataclass
class CPOArguments:
    """CPO's own keys (`method: cpo`), under TRL's names."""

    beta: float = field(
        default=0.1,
        metadata={"help": "CPO: how sharply the loss separates the chosen answer from the rejected one: β times the "
                          "difference of their log-probabilities (per-token means under simpo and ipo) goes into the "
                          "sigmoid. TRL's `beta`; SimPO's paper uses 2 to 2.5."},
    )
    cpo_loss_type: str = field(
        default="sigmoid",
        metadata={"help": "CPO: TRL's `loss_type`, one of the installed TRL's CPO losses (sigmoid: CPO; simpo: SimPO "
                          "with `cpo_alpha: 0`; hinge; ipo; a name TRL lacks is refused with the list)."},
    )
    cpo_alpha: float = field(
        default=1.0,
        metadata={"help": "CPO: the weight of the chosen answer's cross-entropy beside the preference term (TRL's "
                          "`cpo_alpha`); 0 with `cpo_loss_type: simpo` is SimPO."},
    )
    simpo_gamma: float = field(
        default=0.5,
        metadata={"help": "CPO: SimPO's target margin γ between the answers' rewards (TRL's `simpo_gamma`), read "
                          "under `cpo_loss_type: simpo` only."},
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "CPO: how likely a pair's preference is taken to be flipped, in [0, 0.5) (TRL's "
                          "`label_smoothing`; sigmoid and simpo only)."},
    )

    def __post_init__(self):
        if self.beta <= 0:
            raise RecipeError(f"`beta` must be positive, got {self.beta}.")
        if self.cpo_loss_type not in trl_cpo_loss_types():
            raise RecipeError(f"`cpo_loss_type: {self.cpo_loss_type}` is not one of "
                              f"{', '.join(trl_cpo_loss_types())}.")
        for key in ("cpo_alpha", "simpo_gamma"):
            if getattr(self, key) < 0:
                raise RecipeError(f"`{key}` must be ≥ 0, got {getattr(self, key)}.")
        if not 0 <= self.label_smoothing < 0.5:
            raise RecipeError(f"`label_smoothing` is a probability in [0, 0.5), got {self.label_smoothing}.")


# TRL's CPOConfig and the recipe's training arguments in one dataclass, as CPOTrainer reads them
finetune_cpo_config, __getattr__ = trl_config(f"{CONFIG_MODULE}:CPOConfig", "FinetuneCPOConfig", __name__,
                                              "The recipe's training arguments and TRL's CPO keys.")


class ContrastivePreferenceOptimization(ReferenceFreePairMethod):
    name = "cpo"
    description = ("Contrastive Preference Optimization on prompt/chosen/rejected pairs (`dataset: synthetic` gives "
                   "pairs made from the synthetic tasks), and SimPO as its `simpo` loss with `cpo_alpha: 0`: no "
                   "reference model, through TRL's experimental CPOTrainer; reports the held-out reward accuracy and "
                   "margin")
    trainer_name = "CPOTrainer"
    trainer_class = "finetune.train.methods.cpo.trainer:FinetuneCPOTrainer"
    training_config = staticmethod(finetune_cpo_config)
    arguments = CPOArguments
    trl_keys = (
        TrlKey("loss_type", CPO_CONFIG, ours="cpo_loss_type"),
        TrlKey("max_completion_length", CPO_CONFIG, ignored=True,
               why="TRL reads it for encoder-decoder models only; a pair is cut to `max_seq_length` keeping its "
                   "start"),
    )
    preprocess_refusal = ("under `method: cpo`, TRL's CPOTrainer tokenizes the preference pairs itself when training "
                          "starts and would never read a cache")

    def trl_values(self):
        settings = self.settings
        return {"beta": settings.beta, "loss_type": settings.cpo_loss_type, "cpo_alpha": settings.cpo_alpha,
                "simpo_gamma": settings.simpo_gamma, "label_smoothing": settings.label_smoothing}
