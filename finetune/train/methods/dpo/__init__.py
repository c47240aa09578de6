"""Direct Preference Optimization (`method: dpo`): TRL's `DPOTrainer` on the toolkit's rails.

The same recipe, launchers and generated configs as supervised fine-tuning, the same callbacks (memory report,
throughput, divergence stop) and the same checkpoint and resume guarantees (`FinetuneTrainerMixin`). What differs:

- the data are preference pairs (finetune.data.pairs): a prompt, a chosen answer and a rejected one;
- a frozen reference model scores both answers: a second copy of the starting model, which TRL prepares as the
  strategy says (DeepSpeed ZeRO-3 shards it like the policy, ZeRO-0/1/2 keep it whole in the half dtype, DDP keeps it
  whole), or, under LoRA, the policy itself with its adapters disabled (no copy);
- the loss is TRL's (`dpo_loss_type`, `beta`), and the evaluation reports TRL's reward accuracy and margin: how often,
  and by how much, the policy prefers the chosen answer more than the reference did.

This module holds the method's keys and config and is read with the recipe; its trainer (`trainer.py`, TRL's
DPOTrainer) is imported only when a run builds it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field

from finetune.errors import RecipeError
from finetune.memory.estimate import MethodTerms
from finetune.recipe.aliases import TrlKey
from finetune.recipe.args import trl_config
from finetune.train.methods.pairs import PairMethod

DPO_CONFIG = "DPOConfig"


@functools.cache
def trl_dpo_loss_types() -> tuple[str, ...]:
    """TRL's DPO loss types as the installed TRL declares them: TRL keeps no list but the one in the help of
    `DPOConfig.loss_type` (trl/trainer/dpo_config.py, "Possible values are: `'sigmoid'`, ..."), which its trainer's
    loss dispatch mirrors. Read when a DPO recipe is: importing TRL costs every rank of every run a quarter second."""
    from trl.trainer.dpo_config import DPOConfig

    help_text = next(f for f in dataclasses.fields(DPOConfig) if f.name == "loss_type").metadata["help"]
    values = help_text.split("Possible values are:", 1)[-1].split(". ", 1)[0]
    return tuple(re.findall(r"`'(\w+)'`", values))



@dataclass
class DPOArguments:
    """DPO's own keys (`method: dpo`)."""

    beta: float = field(
        default=0.1,
        metadata={"help": "DPO: how far the policy may move from the reference (higher: closer). TRL's `beta`."},
    )
    dpo_loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": "DPO: TRL's `loss_type`, one or several of the installed TRL's DPO losses (sigmoid: DPO; "
                          "ipo: IPO; sigmoid + sft: RPO; a name TRL lacks is refused with the list)."},
    )
    dpo_loss_weights: list[float] | None = field(
        default=None,
        metadata={"help": "DPO: a weight per `dpo_loss_type` when several are combined (TRL's `loss_weights`)."},
    )

    def __post_init__(self):
        if isinstance(self.dpo_loss_type, str):  # one loss given alone, as TRL's DPOConfig takes it
            self.dpo_loss_type = [self.dpo_loss_type]
        if isinstance(self.dpo_loss_weights, (int, float)):
            self.dpo_loss_weights = [float(self.dpo_loss_weights)]
        if self.beta <= 0:
            raise RecipeError(f"`beta` must be positive, got {self.beta}.")
        unknown = [name for name in self.dpo_loss_type if name not in trl_dpo_loss_types()]
        if unknown or not self.dpo_loss_type:
            raise RecipeError(f"`dpo_loss_type: {unknown[0] if unknown else '[]'}` is not one of "
                              f"{', '.join(trl_dpo_loss_types())}.")
        if self.dpo_loss_weights is not None and len(self.dpo_loss_weights) != len(self.dpo_loss_type):
            raise RecipeError(f"`dpo_loss_weights` gives {len(self.dpo_loss_weights)} weight(s) for "
                              f"{len(self.dpo_loss_type)} `dpo_loss_type`(s): give one per loss.")


# TRL's DPOConfig and the recipe's training arguments in one dataclass, as DPOTrainer reads them
finetune_dpo_config, __getattr__ = trl_config("trl.trainer.dpo_config:DPOConfig", "FinetuneDPOConfig", __name__,
                                              "The recipe's training arguments and TRL's DPO keys.")


class DirectPreferenceOptimization(PairMethod):
    name = "dpo"
    description = ("Direct Preference Optimization on prompt/chosen/rejected pairs (`dataset: synthetic` gives pairs "
                   "made from the synthetic tasks), against a frozen reference copy of the starting model (the "
                   "adapter-disabled base under LoRA), through TRL's DPOTrainer")
    trainer_name = "DPOTrainer"
    arguments = DPOArguments
    trl_keys = (
        TrlKey("loss_type", DPO_CONFIG, ours="dpo_loss_type"),
        TrlKey("loss_weights", DPO_CONFIG, ours="dpo_loss_weights",
               why="a weight per DPO loss type, our `dpo_loss_weights` under `method: dpo`"),
        TrlKey("max_prompt_length", f"{DPO_CONFIG} (older TRL)", ignored=True,
               why="TRL 1.16 has no separate prompt limit (its own scripts ignore the key): a pair is cut to "
                   "`max_seq_length` (TRL's `max_length`) keeping its start, a pair whose prompt alone fills it is "
                   "dropped, both counted (`overlong_policy`, `unlabeled_policy`)"),
    )
    # TRL concatenates chosen and rejected in one forward and projects only the answer positions (its fused head)
    memory = MethodTerms(reference_model=True, sequences_per_example=2, logits_held=False,
                         fused_head=True)
    preprocess_refusal = ("under `method: dpo`, TRL's DPOTrainer tokenizes the preference pairs itself when training "
                          "starts and would never read a cache")

    def training_arguments(self, data_args):
        """TRL's DPOConfig and ours in one, with TRL's keys from the recipe: `beta`, the loss, and `max_length` from
        `max_seq_length`."""
        settings = self.settings
        return finetune_dpo_config(), {"beta": settings.beta, "loss_type": list(settings.dpo_loss_type),
                                   "loss_weights": settings.dpo_loss_weights, "max_length": data_args.max_seq_length}

    def prepare_model(self, recipe, model):
        return model  # TRL applies any adapters (build_trainer), after which the trainable weights are held in fp32

    def build_trainer(self, recipe, model, tokenizer, data, callbacks):
        from finetune.train.methods.dpo.trainer import dpo_trainer

        return dpo_trainer(recipe, model, tokenizer, data, callbacks)
