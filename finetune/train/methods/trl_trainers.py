"""What the methods built on TRL's trainers share, in one home: TRL's refusals of a setting said in one line
(`trl_refusals`), and the frozen reference model of the methods that train against one (`reference_and_adapters`),
which TRL prepares as the strategy says (trl/models/utils.py `prepare_deepspeed`)."""

from __future__ import annotations

from contextlib import contextmanager

from finetune.errors import RecipeError
from finetune.models.loading import load_model, sharded_from_rank_zero
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
        reference = load_reference(recipe, tokenizer)
    prepare_reference_for_zero3(args, model)
    return reference, peft_config


def load_reference(recipe, tokenizer):
    """The frozen reference, loaded as the policy was: under FSDP2's rank-0 loading only global rank 0 reads the
    checkpoint and the other ranks build its shapes (`reference_filled_from_rank_zero` fills their shards while TRL
    prepares it). `read_bytes` on it: the bytes of weights this rank read from the checkpoint (none where it holds
    only shapes)."""
    reference = load_model(recipe.model, tokenizer, seed=recipe.training.seed, strategy=recipe.strategy,
                           shapes_only=sharded_from_rank_zero())
    frozen_reference(reference)
    reference.read_bytes = sum(parameter.numel() * parameter.element_size() for parameter in reference.parameters()
                               if not parameter.is_meta)
    return reference


@contextmanager
def reference_filled_from_rank_zero(trl_module):  # the TRL trainer module that calls `prepare_fsdp`
    """While a TRL trainer is built: TRL shards the reference under FSDP2 with one `fully_shard` of the whole model
    and no broadcast (trl/models/utils.py `prepare_fsdp`), so a reference built empty on the ranks other than 0
    would stay empty. With FSDP2's rank-0 loading it is prepared as Accelerate prepares the policy instead
    (`fsdp2_prepare_model`: sharded layer by layer, rank 0's weights broadcast into every shard)."""
    from finetune.launch.strategies import fsdp_fills_from_rank_zero

    if not fsdp_fills_from_rank_zero():
        yield
        return
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    def prepare(model, accelerator):
        model = fsdp2_prepare_model(accelerator, model)
        model.eval()
        return model

    original = trl_module.prepare_fsdp  # the name as the trainer's module imported it
    trl_module.prepare_fsdp = prepare
    try:
        yield
    finally:
        trl_module.prepare_fsdp = original


def trainer_against_a_reference(trainer_class, trainer_name: str, recipe, model, tokenizer, data, callbacks):
    """A TRL trainer that trains against a frozen reference (the pair methods', KTO's): the reference and adapters as
    `reference_and_adapters` makes them, TRL's refusals in one line, the data TRL tokenizes sent through the recipe's
    length policies (the trainer's `data_args` and `summary`, completing the data summary), and the trainable weights
    held in fp32 under mixed precision whatever dtype the checkpoint was stored in (the adapters TRL added, or every
    weight of a full run; the frozen base and the reference keep the loaded dtype)."""
    import sys

    from finetune.checkpoints.complete import recipe_values
    from finetune.models.loading import hold_trainable_parameters, trainable_dtype

    args = recipe.training
    reference, peft_config = reference_and_adapters(recipe, model, tokenizer)
    trl_module = sys.modules[next(base.__module__ for base in trainer_class.__mro__
                                  if base.__module__.startswith("trl."))]
    with trl_refusals(trainer_name), reference_filled_from_rank_zero(trl_module):
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
