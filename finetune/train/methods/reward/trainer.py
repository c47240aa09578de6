"""TRL's RewardTrainer with the toolkit's guarantees (`FinetuneRewardTrainer`), the scorer built from the starting
causal LM (`scorer_from`), and how a run builds the trainer (`reward_trainer`)."""

from __future__ import annotations

import copy

import torch
from trl import RewardTrainer

from finetune.checkpoints.complete import recipe_values
from finetune.data.pairs import SOURCE_COLUMN
from finetune.errors import RecipeError
from finetune.models.loading import hold_trainable_parameters, trainable_dtype
from finetune.train.trainer import FinetuneTrainerMixin


def scorer_from(causal, seed: int):
    """The starting model's decoder under a one-output head: Transformers' `...ForSequenceClassification` of the same
    architecture (`num_labels: 1`), its decoder weights those of `causal`, its `score` head drawn from `seed`. The
    vocabulary head is dropped. A sequence is scored at its last token that is not padding (`pad_token_id`)."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(causal.config)
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    dtype = next(causal.parameters()).dtype
    torch.manual_seed(seed)
    try:
        scorer = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    except ValueError as error:  # an architecture without a sequence-classification class in this Transformers
        raise RecipeError(f"`method: reward` needs a scoring head for {type(causal).__name__}, which this "
                          f"Transformers has no ...ForSequenceClassification for ({str(error).splitlines()[0]}).") \
            from None
    missing, unexpected = scorer.load_state_dict(causal.state_dict(), strict=False)
    head = {name for name, _ in scorer.named_parameters() if not name.startswith(scorer.base_model_prefix + ".")}
    dropped = {name for name in unexpected if "lm_head" not in name}
    if set(missing) - head or dropped:
        raise RecipeError(f"the scorer for {type(causal).__name__} does not take its decoder's weights (missing "
                          f"{sorted(set(missing) - head)[:3]}, unexpected {sorted(dropped)[:3]}).")
    scorer.config.name_or_path = causal.config.name_or_path
    return scorer


def reward_trainer(recipe, model, tokenizer, data, callbacks):
    args = recipe.training
    train, evaluation = data.train.remove_columns(SOURCE_COLUMN), data.eval
    if evaluation is not None:
        evaluation = evaluation.remove_columns(SOURCE_COLUMN)
    try:
        trainer = FinetuneRewardTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                        processing_class=tokenizer, callbacks=callbacks,
                                        recipe_values=recipe_values(recipe),
                                        train_data=data.summary["train_fingerprint"])
    except RecipeError:
        raise
    except (ValueError, NotImplementedError, TypeError) as error:  # TRL's refusals of a setting, in one line
        raise RecipeError(f"TRL's RewardTrainer refuses this recipe: {str(error).splitlines()[0]}") from None
    hold_trainable_parameters(trainer.model, trainable_dtype(recipe.strategy, args.mixed_precision, args.pure_bf16))
    return trainer


class FinetuneRewardTrainer(FinetuneTrainerMixin, RewardTrainer):
    """TRL's RewardTrainer with the toolkit's checkpoints, resume, rotation and saving (`FinetuneTrainerMixin`)."""

    def _send_telemetry(self):
        """No usage pings: nothing leaves the machine unless the user asks (`report_to`)."""

    def create_model_card(self, *args, **kwargs):
        """TRL writes a README.md model card into every checkpoint; the run's own records say what was trained."""
