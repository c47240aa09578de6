"""TRL's GRPOTrainer with the toolkit's guarantees (`FinetuneGRPOTrainer`), and how a run builds it (`grpo_trainer`):
the rewards resolved, the reference built as the policy was loaded, each generation round's KV cache measured."""

from __future__ import annotations

from contextlib import contextmanager

import trl.trainer.grpo_trainer as trl_grpo
from trl import GRPOTrainer

from finetune.checkpoints.complete import recipe_values
from finetune.errors import launched_rank
from finetune.memory.generation import CacheMeter
from finetune.train.methods.grpo.rewards import code_notice, resolve_rewards
from finetune.train.methods.trl_trainers import (
    load_reference,
    prepare_reference_for_zero3,
    reference_filled_from_rank_zero,
    trl_refusals,
)
from finetune.train.trainer import FinetuneTrainerMixin


@contextmanager
def reference_loaded_as_the_policy(recipe, tokenizer):
    """TRL builds GRPO's reference (`beta` > 0) by reloading the policy's checkpoint by name, which the embedded model
    has none of: while the trainer is built, it is loaded as `finetune train` loaded the policy, and frozen."""
    original, trl_grpo.create_model_from_path = trl_grpo.create_model_from_path, lambda *_, **__: load_reference(
        recipe, tokenizer)
    try:
        with reference_filled_from_rank_zero(trl_grpo):
            yield
    finally:
        trl_grpo.create_model_from_path = original


def grpo_trainer(recipe, model, tokenizer, data, callbacks):
    args, settings = recipe.training, recipe.method.settings
    evaluation = args.per_device_eval_batch_size * args.world_size
    if data.eval is not None and evaluation % settings.num_generations:
        # the run's final evaluation generates whole groups too, whatever `eval_strategy` says (TRL checks this
        # only when evaluating during training): said now, not after the training
        from finetune.errors import RecipeError

        raise RecipeError(f"`num_generations: {settings.num_generations}` does not divide an eval batch of "
                          f"{evaluation} completions (`per_device_eval_batch_size: "
                          f"{args.per_device_eval_batch_size}` × {args.world_size} process(es)), which the run's "
                          "final evaluation generates: make the eval batch a multiple of it.")
    prepare_reference_for_zero3(args, model)
    notice = code_notice(settings.reward_funcs)
    if notice and launched_rank() == 0:
        print(notice)
    rewards = resolve_rewards(settings.reward_funcs, settings.reward_timeout)
    with trl_refusals("GRPOTrainer"), reference_loaded_as_the_policy(recipe, tokenizer):
        return FinetuneGRPOTrainer(model=model, reward_funcs=rewards, args=args,
                                   train_dataset=data.train, eval_dataset=data.eval, processing_class=tokenizer,
                                   callbacks=callbacks, recipe_values=recipe_values(recipe),
                                   train_data=data.summary["train_fingerprint"])


class FinetuneGRPOTrainer(FinetuneTrainerMixin, GRPOTrainer):
    """TRL's GRPOTrainer with the toolkit's checkpoints, resume, rotation and saving (`FinetuneTrainerMixin`); the
    KV cache of each training round's generation is measured (`generation_cache`) for the memory report."""

    def __init__(self, *args, **kwargs):
        self.generation_cache = CacheMeter()
        super().__init__(*args, **kwargs)

    def _generate_single_turn(self, *args, **kwargs):
        """A training round's generation, its KV cache measured (an evaluation's rounds are sized by the eval batch,
        which the ledger does not predict)."""
        if not self.model.training:
            return super()._generate_single_turn(*args, **kwargs)
        with self.generation_cache.watching(self.accelerator.unwrap_model(self.model)):
            return super()._generate_single_turn(*args, **kwargs)

    def _send_telemetry(self):
        """No usage pings: nothing leaves the machine unless the user asks (`report_to`)."""

    def create_model_card(self, *args, **kwargs):
        """TRL writes a README.md model card into every checkpoint; the run's own records say what was trained."""
