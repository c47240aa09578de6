"""What the methods built on TRL's trainers share, in one home: TRL's refusals of a setting said in one line
(`trl_refusals`), and the frozen reference model of the methods that train against one (`reference_and_adapters`),
which TRL prepares as the strategy says (trl/models/utils.py `prepare_deepspeed`)."""

from __future__ import annotations

from contextlib import contextmanager

from finetune.errors import RecipeError
from finetune.models.loading import load_model
from finetune.models.lora import lora_config


@contextmanager
def trl_refusals(trainer_name: str):
    """TRL's trainers refuse a setting with a ValueError (or NotImplementedError) while they are built: said as the
    one-line user error it is, naming the trainer; the toolkit's own refusals pass as they are."""
    try:
        yield
    except RecipeError:
        raise
    except (ValueError, NotImplementedError) as error:
        raise RecipeError(f"TRL's {trainer_name} refuses this recipe: {str(error).splitlines()[0]}") from None


def reference_and_adapters(recipe, model, tokenizer):
    """The reference model and the LoRA config TRL applies: a second copy of the starting model, frozen, and no
    adapters; or under LoRA no copy, the reference being the policy with its adapters disabled (TRL applies them
    from the config, so no reference adapter is copied). Under ZeRO-3 the buckets are filled first
    (`prepare_reference_for_zero3`)."""
    args = recipe.training
    reference, peft_config = None, None
    if recipe.lora.use_lora:
        peft_config = lora_config(model, recipe.lora)
    else:
        reference = load_model(recipe.model, tokenizer, seed=args.seed, strategy=recipe.strategy)
        frozen_reference(reference)
    prepare_reference_for_zero3(args, model)
    return reference, peft_config


def trainer_against_a_reference(trainer_class, trainer_name: str, recipe, model, tokenizer, data, callbacks):
    """A TRL trainer that trains against a frozen reference (the pair methods', KTO's): the reference and adapters as
    `reference_and_adapters` makes them, TRL's refusals in one line, the data TRL tokenizes sent through the recipe's
    length policies (the trainer's `data_args` and `summary`, completing the data summary), and the trainable weights
    held in fp32 under mixed precision whatever dtype the checkpoint was stored in (the adapters TRL added, or every
    weight of a full run; the frozen base and the reference keep the loaded dtype)."""
    from finetune.checkpoints.complete import recipe_values
    from finetune.models.loading import hold_trainable_parameters, trainable_dtype

    args = recipe.training
    reference, peft_config = reference_and_adapters(recipe, model, tokenizer)
    with trl_refusals(trainer_name):
        trainer = trainer_class(model=model, ref_model=reference, args=args, train_dataset=data.train,
                                eval_dataset=data.eval, processing_class=tokenizer, callbacks=callbacks,
                                peft_config=peft_config, recipe_values=recipe_values(recipe),
                                train_data=data.summary["train_fingerprint"], data_args=recipe.data,
                                summary=data.summary)
    hold_trainable_parameters(trainer.model, trainable_dtype(recipe.strategy, args.mixed_precision, args.pure_bf16))
    return trainer


def prepare_reference_for_zero3(args, model) -> None:
    """ZeRO-3 fills its "auto" bucket sizes from the model only when training starts, but TRL builds the reference
    engine when the trainer is constructed, from the config as it is then: fill them now with the values Transformers
    would (hidden², 0.9·hidden², 10·hidden), so the reference is partitioned like the policy."""
    config = getattr(args, "hf_deepspeed_config", None)
    hidden = getattr(model.config, "hidden_size", None)
    if config is None or hidden is None or config.get_value("zero_optimization.stage") != 3:
        return
    config.fill_only("zero_optimization.reduce_bucket_size", hidden * hidden)
    config.fill_only("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
    config.fill_only("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)


def frozen_reference(model) -> None:
    model.requires_grad_(False)
    model.eval()
