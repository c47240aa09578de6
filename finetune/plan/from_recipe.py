"""`finetune plan --recipe`: a plan request read from the user's own recipe and data.

The recipe is parsed by `finetune.recipe.parse.read_recipe` (the same keys, defaults and errors as `finetune train`,
but no launch check and no process group: the plan is for another machine), and its training rows are read by the
recipe's method as `finetune train` reads them (`Method.plan_data`: for SFT tokenized, truncated and packed by
finetune.data.pipeline; no model is loaded), so activations are predicted from the lengths the micro-batches will
really have, not from `max_seq_length`.
"""

from __future__ import annotations

from finetune.errors import RecipeError
from finetune.launch.devices import Gpu, default_precision
from finetune.memory.estimate import FusedKernels, precision_of
from finetune.plan.decision_tree import PlanRequest
from finetune.recipe.batch_plan import BatchPlan
from finetune.recipe.preflight import training_precision


def your_strategy(training: dict, config: str | None):
    """The strategy the recipe launches: its `deepspeed` key (which wins over an Accelerate config, as in
    Trainer), else `--config` (an Accelerate YAML or DeepSpeed JSON), else its `strategy` key when it names a
    shipped strategy; None when none says."""
    from finetune.launch.strategies import launched_strategy, read_config_file, shipped

    if training.get("deepspeed"):
        strategy, _ = launched_strategy(training["deepspeed"], environ={})
        return strategy, str(training["deepspeed"])
    if config is not None:
        return read_config_file(config)[0], config
    if training.get("strategy") not in (None, "auto"):
        row = shipped(training["strategy"])
        return row.strategy, f"strategy: {row.name}"
    return None, None


def load_balancing_in_plan(model_args) -> float | None:
    """The load-balancing weight a model with experts will train with (the recipe's `router_aux_loss_coef`, else its
    config's), from its config alone; None without experts, or when the config cannot be read here."""
    from finetune.memory.shapes import resolve_config
    from finetune.models.experts import has_router_loss

    try:
        config = resolve_config(model_args.model_name_or_path).get_text_config()
    except (OSError, ValueError):
        return None
    if not has_router_loss(config):
        return None
    given = model_args.router_aux_loss_coef
    return float(getattr(config, "router_aux_loss_coef", 0.0) if given is None else given)


def request_from_recipe(recipe: str, gpus: int, gpu_memory_gib: float, gpu: Gpu | None = None,
                        config: str | None = None, batch_options: dict | None = None,
                        overrides: list[str] | None = None, sections=None, **hardware) -> tuple[PlanRequest, dict]:
    """The plan request for `recipe` (with its `--key value` `overrides`) on `gpus` GPUs, and its data summary.
    `batch_options` (global_batch_size, max_micro_batch_size, learning_rate, base_batch_size, lr_scaling) given on
    the command line win over the recipe's and are passed on in the launch command; `sections`: the recipe as
    `read_recipe` already read it (else read here, `bf16: auto` as the planned GPU's half precision); `hardware`: the
    other `PlanRequest` fields (host memory...)."""
    from finetune.memory.callback import optimizer_kind
    from finetune.recipe.parse import read_recipe

    if sections is None:
        sections = read_recipe(recipe, overrides, auto_precision=default_precision(gpu))
    training, data, lora = sections.training_inputs, sections.data, sections.lora
    # the lengths the method's data will have (None: planned at `max_seq_length`, as for pairs TRL tokenizes later)
    lengths, summary = sections.method.plan_data(sections)
    summary["method"] = sections.method.name
    weight = load_balancing_in_plan(sections.model)
    if weight is not None:  # a model with experts trains its load-balancing loss (finetune.models.experts)
        summary["router_aux_loss_coef"] = weight
    strategy, strategy_source = your_strategy(training, config)
    given = {key: value for key, value in (batch_options or {}).items() if value is not None}
    micro, accumulation = training["per_device_train_batch_size"], training["gradient_accumulation_steps"]
    global_batch = given.get("global_batch_size") or training.get("global_batch_size") or BatchPlan(
        world_size=gpus, micro_batch_size=micro, gradient_accumulation_steps=accumulation,
        learning_rate=training["learning_rate"]).global_batch_size
    launch_keys = [f"--{key} {given[key]}" for key in ("lr_scaling", "base_batch_size") if key in given]
    if "learning_rate" in given:  # the recipe's reference point: base_learning_rate wins over learning_rate
        launch_keys.append(f"--base_learning_rate {given['learning_rate']:g}")
    use_lora = lora.use_lora or lora.use_qlora
    request = PlanRequest(
        model=sections.model.model_name_or_path, gpus=gpus, gpu_memory_gib=gpu_memory_gib, gpu=gpu,
        precision=precision_of(training_precision(training, launcher=False)),
        optimizer=optimizer_kind(training.get("optim", "adamw")) or "adamw",
        lora_rank=lora.lora_r if use_lora else 0, qlora=lora.use_qlora, lora_dropout=lora.lora_dropout,
        lora_target_modules=tuple(lora.lora_target_modules) if use_lora and lora.lora_target_modules else None,
        dora=use_lora and lora.use_dora,
        lora_modules_to_save=tuple(lora.modules_to_save) if use_lora and lora.modules_to_save else None,
        sequence_length=data.max_seq_length, gradient_checkpointing=bool(training.get("gradient_checkpointing")),
        attention="eager" if sections.model.attn_implementation == "eager" else "sdpa",
        global_batch_size=global_batch,
        max_micro_batch_size=given.get("max_micro_batch_size") or training.get("max_micro_batch_size") or micro,
        learning_rate=given.get("learning_rate") or training.get("base_learning_rate") or training["learning_rate"],
        base_batch_size=given.get("base_batch_size") or training.get("base_batch_size"),
        lr_scaling=given.get("lr_scaling") or training.get("lr_scaling"),
        recipe=recipe, from_recipe=True, launch_keys=tuple(launch_keys), token_lengths=lengths,
        padding_free=data.padding_free, packing=data.packing, your_strategy=strategy, your_config=strategy_source,
        recipe_sets_deepspeed=bool(training.get("deepspeed")), method=sections.method.name,
        method_terms=sections.method.terms(),
        kernels=FusedKernels.from_trainer_arguments(training.get("use_liger_kernel"),
                                                    training.get("liger_kernel_config")),
        num_generations=getattr(sections.method.settings, "num_generations", None),
        image_tokens_per_row=max((source["train"].get("image_tokens", {}).get("max_per_row", 0)
                                  for source in summary.get("sources", [])), default=0),
        vision_tower_frozen=sections.model.freeze_vision_tower, projector_frozen=sections.model.freeze_projector,
        **hardware,
    )
    if lengths is not None and not lengths:
        raise RecipeError(f"recipe `{recipe}`: no training row is left after the data policies.")
    return request, summary
