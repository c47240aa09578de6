"""Kahneman-Tversky Optimization (`method: kto`): TRL's `KTOTrainer` on the toolkit's rails.

The same recipe, launchers, callbacks and checkpoint guarantees as the other methods. What differs:

- the data are unpaired examples: a prompt, a completion and a `label`, true where the completion is desirable
  (finetune.data.pairs `UNPAIRED`); every pair format the preference methods read is taken too, each pair as two
  examples (its chosen answer desirable, its rejected one not; `dataset: synthetic` gives pairs made from the
  synthetic tasks). They are shuffled once with the recipe's seed and read in that order (see the loss);
- a frozen reference model scores every completion, as the reference of the pair methods does
  (finetune.train.methods.trl_trainers), or under LoRA the policy with its adapters disabled;
- the loss is TRL's (`kto_loss_type`). `kto` (Ethayarajh et al. 2024, arXiv 2402.01306, eq. 7) weighs each
  completion's reward, β times how much more likely the policy makes it than the reference, against an estimate of
  the policy's KL divergence from the reference, taken on mismatched completions: each example's prompt with its
  micro-batch neighbour's completion. So TRL reads the examples in order (`train_sampling_strategy: sequential`) and
  needs 2 or more a micro-batch. `apo_zero_unpaired` (D'Oosterlinck et al. 2024) has no KL term;
- the evaluation reports the held-out reward margin (the mean reward of the desirable completions minus that of the
  undesirable ones; 0 before the first step, when the policy is the reference) and the KL estimate.

This module holds the method's keys and config and is read with the recipe; its trainer (`trainer.py`, TRL's
KTOTrainer) is imported only when a run builds it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from finetune.errors import RecipeError
from finetune.memory.estimate import MethodTerms
from finetune.recipe.aliases import TrlKey
from finetune.recipe.args import trl_config
from finetune.train.methods.pairs import PairMethod

KTO_CONFIG = "KTOConfig"
NO_KL_TERM = ("apo_zero_unpaired",)  # TRL's loss types without the KL term (kto_trainer.py, `calculate_kl`)


@functools.cache
def trl_kto_loss_types() -> tuple[str, ...]:
    """TRL's KTO loss types as the installed TRL declares them (`KTOConfig.loss_type`'s choices,
    trl/trainer/kto_config.py)."""
    from trl.trainer.kto_config import KTOConfig

    return tuple(next(f for f in dataclasses.fields(KTOConfig) if f.name == "loss_type").metadata["choices"])


@dataclass
class KTOArguments:
    """KTO's own keys (`method: kto`), under TRL's names."""

    beta: float = field(
        default=0.1,
        metadata={"help": "KTO: how far the policy may move from the reference (higher: closer). TRL's `beta`."},
    )
    kto_loss_type: str = field(
        default="kto",
        metadata={"help": "KTO: TRL's `loss_type`, one of the installed TRL's KTO losses (kto: with the KL term, "
                          "read from each micro-batch's other examples, so 2 or more a device; apo_zero_unpaired: "
                          "without it)."},
    )
    desirable_weight: float = field(
        default=1.0,
        metadata={"help": "KTO: the desirable examples' losses weigh this much (TRL's `desirable_weight`); with fewer "
                          "desirable than undesirable examples, raise it towards their ratio (TRL warns with a "
                          "range)."},
    )
    undesirable_weight: float = field(
        default=1.0,
        metadata={"help": "KTO: the undesirable examples' losses weigh this much (TRL's `undesirable_weight`)."},
    )

    def __post_init__(self):
        if self.beta <= 0:
            raise RecipeError(f"`beta` must be positive, got {self.beta}.")
        if self.kto_loss_type not in trl_kto_loss_types():
            raise RecipeError(f"`kto_loss_type: {self.kto_loss_type}` is not one of {', '.join(trl_kto_loss_types())}.")
        for key in ("desirable_weight", "undesirable_weight"):
            if getattr(self, key) <= 0:
                raise RecipeError(f"`{key}` must be positive, got {getattr(self, key)}.")

    @property
    def kl_term(self) -> bool:
        """Whether the loss estimates the KL term from each micro-batch's other examples."""
        return self.kto_loss_type not in NO_KL_TERM


# TRL's KTOConfig and the recipe's training arguments in one dataclass, as KTOTrainer reads them
finetune_kto_config, __getattr__ = trl_config("trl.trainer.kto_config:KTOConfig", "FinetuneKTOConfig", __name__,
                                              "The recipe's training arguments and TRL's KTO keys.")


class KahnemanTverskyOptimization(PairMethod):
    name = "kto"
    description = ("Kahneman-Tversky Optimization on unpaired examples (prompt, completion, a true/false `label`: "
                   "desirable or not) or on preference pairs, each pair as two examples (`dataset: synthetic` gives "
                   "pairs made from the synthetic tasks), against a frozen reference copy of the starting model (the "
                   "adapter-disabled base under LoRA), through TRL's KTOTrainer; reports the held-out reward margin")
    trainer_name = "KTOTrainer"
    unpaired = True
    arguments = KTOArguments
    trl_keys = (TrlKey("loss_type", KTO_CONFIG, ours="kto_loss_type"),)
    # The reference scores every completion. One sequence per example keeps activations for the backward: TRL runs the
    # KL term's mismatched completions, and the reference, without gradients (kto_trainer.py `_compute_kl_logps`), so
    # their activations come and go before the example's own forward. Log-probabilities come from TRL's fused head,
    # which projects only the completion positions in tiles: no vocabulary logits are held.
    memory = MethodTerms(reference_model=True, sequences_per_example=1, logits_held=False,
                         fused_head=True)
    preprocess_refusal = ("under `method: kto`, TRL's KTOTrainer tokenizes the examples itself when training starts "
                          "and would never read a cache")

    def training_arguments(self, data_args):
        """TRL's KTOConfig and ours in one, with TRL's keys from the recipe, `max_length` from `max_seq_length`, and
        the examples read in the order they were shuffled in where the KL term needs it."""
        settings = self.settings
        keys = {"beta": settings.beta, "loss_type": settings.kto_loss_type,
                "desirable_weight": settings.desirable_weight, "undesirable_weight": settings.undesirable_weight,
                "max_length": data_args.max_seq_length}
        if settings.kl_term:
            keys["train_sampling_strategy"] = "sequential"
        return finetune_kto_config(), keys

    def check_training_keys(self, training_inputs, sources):
        """The KL term is read from a micro-batch's other examples, in the order they were shuffled in: a micro-batch
        of one, or another sampling order, would break it (TRL refuses both, once the processes have started)."""
        if not self.settings.kl_term:
            return
        micro = int(training_inputs["per_device_train_batch_size"])
        if micro < 2:
            raise RecipeError(f"`method: kto` estimates its KL term from each micro-batch's other examples, so it "
                              f"needs 2 or more examples a device; `per_device_train_batch_size` is {micro} "
                              f"({sources.get('per_device_train_batch_size', 'default')}): raise it (or "
                              "`max_micro_batch_size`), or use `kto_loss_type: apo_zero_unpaired`, which has no KL "
                              "term.")
        strategy = training_inputs.get("train_sampling_strategy")
        if "train_sampling_strategy" in sources and strategy != "sequential":
            raise RecipeError(f"`train_sampling_strategy: {strategy}` with `method: kto`: TRL's KL term pairs each "
                              "example with its micro-batch neighbours' completions, so the examples are read in the "
                              "order they were shuffled in with `seed`; drop the key (or use `kto_loss_type: "
                              "apo_zero_unpaired`, which has no KL term).")

    def prepare_model(self, recipe, model):
        return model  # TRL applies any adapters (build_trainer), after which the trainable weights are held in fp32

    def build_trainer(self, recipe, model, tokenizer, data, callbacks):
        from finetune.train.methods.kto.trainer import kto_trainer

        return kto_trainer(recipe, model, tokenizer, data, callbacks)
