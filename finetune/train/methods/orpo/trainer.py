"""TRL's experimental ORPOTrainer with the toolkit's guarantees (`FinetuneORPOTrainer`); a run builds it as every
reference-free pair trainer (finetune.train.methods.reference_free_trainer)."""

from __future__ import annotations

from finetune.recipe.args import quiet_trl_experimental
from finetune.train.methods.reference_free_trainer import ReferenceFreePairTrainer

with quiet_trl_experimental():
    from trl.experimental.orpo import ORPOTrainer


class FinetuneORPOTrainer(ReferenceFreePairTrainer, ORPOTrainer):
    """TRL's ORPOTrainer with the toolkit's checkpoints, resume, rotation, saving and length policies."""
