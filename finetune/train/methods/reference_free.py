"""What the reference-free preference methods share: CPO (and SimPO, its `simpo` loss without the cross-entropy term)
and ORPO, through TRL's experimental CPOTrainer and ORPOTrainer, which are built alike and differ in their loss.

- the data are the preference pairs every pair method reads (finetune.data.pairs);
- no reference model: the preference term compares the policy's own log-probabilities of the chosen and rejected
  answers (their per-token means for SimPO and ORPO), so a run holds one model;
- chosen and rejected run as one forward of two sequences a pair, scored through TRL's fused LM head: TRL's trainers
  keep the logits over the whole vocabulary (`concatenated_forward`: `outputs.logits`, then a log-softmax), which the
  toolkit's never builds (finetune.train.methods.reference_free_trainer); `fused_lm_head: false` keeps TRL's path,
  and the memory estimate then counts the logits again;
- TRL tokenizes the pairs when the trainer is built and cuts only the answers; here they are cut as the other pair
  methods' are, keeping each sequence's start, under the same length policies (finetune.train.methods.
  reference_free_trainer);
- the evaluation reports TRL's reward accuracy and margin, a reward being β times the answer's log-probability (no
  reference: after SFT the chosen answers are already the likelier, so the accuracy starts high and the margin grows).

Each method's module holds its keys and config; its trainer (`trainer.py`) is imported only when a run builds it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, ClassVar

from finetune.memory.estimate import MethodTerms
from finetune.train.methods.pairs import PairMethod


class ReferenceFreePairMethod(PairMethod):
    trainer_class: ClassVar[str]
    """The toolkit's subclass of TRL's trainer, "module:class", imported when a run builds it."""
    training_config: ClassVar[Callable[[], type]]
    """TRL's config joined with ours, built when first asked for (finetune.recipe.args.trl_config)."""
    # Chosen and rejected in one forward, scored through TRL's fused head: no logits over the vocabulary are held
    memory = MethodTerms(reference_model=False, sequences_per_example=2, logits_held=False, fused_head=True)
    full_logits_on_request = True  # `fused_lm_head: false`: TRL's own forward over the full logits

    def trl_values(self) -> dict[str, Any]:
        """The method's keys as TRL's config names them."""
        raise NotImplementedError

    def training_arguments(self, data_args):
        """TRL's config and ours in one, with the method's keys and `max_length` from `max_seq_length`."""
        return self.training_config(), {**self.trl_values(), "max_length": data_args.max_seq_length}

    def prepare_model(self, recipe, model):
        return model  # TRL applies any adapters (build_trainer), after which the trainable weights are held in fp32

    def build_trainer(self, recipe, model, tokenizer, data, callbacks):
        from finetune.train.methods.reference_free_trainer import reference_free_trainer

        module, _, name = self.trainer_class.partition(":")
        trainer_class = getattr(importlib.import_module(module), name)
        return reference_free_trainer(trainer_class, self.trainer_name, recipe, model, tokenizer, data, callbacks)
