"""TRL's experimental CPOTrainer with the toolkit's guarantees (`FinetuneCPOTrainer`); a run builds it as every
reference-free pair trainer (finetune.train.methods.reference_free_trainer)."""

from __future__ import annotations

import torch

from finetune.recipe.args import quiet_trl_experimental
from finetune.train.methods.reference_free_trainer import ReferenceFreePairTrainer

with quiet_trl_experimental():
    from trl.experimental.cpo import CPOTrainer


class FinetuneCPOTrainer(ReferenceFreePairTrainer, CPOTrainer):
    """TRL's CPOTrainer with the toolkit's checkpoints, resume, rotation, saving and length policies."""

    @property
    def average_log_prob(self) -> bool:
        return self.loss_type in ("ipo", "simpo")  # TRL's CPOTrainer.concatenated_forward

    def nll_term(self, nll):
        return nll if self.cpo_alpha else torch.zeros((), device=nll.device)  # SimPO: no NLL term
