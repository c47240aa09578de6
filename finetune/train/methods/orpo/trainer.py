"""TRL's experimental ORPOTrainer with the toolkit's guarantees (`FinetuneORPOTrainer`); a run builds it as every
reference-free pair trainer (finetune.train.methods.reference_free_trainer)."""

from __future__ import annotations

from finetune.recipe.args import quiet_trl_experimental
from finetune.train.methods.reference_free_trainer import ReferenceFreePairTrainer

with quiet_trl_experimental():
    from trl.experimental.orpo import ORPOTrainer


class FinetuneORPOTrainer(ReferenceFreePairTrainer, ORPOTrainer):
    """TRL's ORPOTrainer with the toolkit's checkpoints, resume, rotation, saving and length policies."""

    average_log_prob = True  # the odds ratio compares per-token mean log-probabilities

    def padding(self) -> int:
        return self.padding_value  # TRL's ORPOTrainer pads with its own key's value

    def nll_labels(self, concatenated: dict):
        """ORPO's NLL term is over the whole chosen sequence, prompt included (TRL's ORPOTrainer): every attended
        token."""
        import torch

        return torch.where(concatenated["concatenated_attention_mask"] == 1, concatenated["concatenated_input_ids"],
                           -100)
