"""Parsing a recipe: a YAML file plus `--key value` overrides onto the sections of `finetune.recipe.args`.

Scalars from YAML go through argparse exactly as they would on the command line, so `learning_rate: abc` fails the
same way `--learning_rate abc` does. Unknown keys (with a did-you-mean), bad values and a launch that cannot work
(`finetune.recipe.preflight`) stop with a `RecipeError` before any process group is started.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import HfArgumentParser

from finetune.axes import Axis, active_axes, axis_sections, on_the_mesh, runner_of
from finetune.errors import RecipeError, did_you_mean, launched_rank
from finetune.launch.parallelism import DATA_SIZES, Parallelism
from finetune.launch.strategies import Strategy
from finetune.recipe.aliases import READ_FROM, TOOLS_DEFAULT, Translation, translate_command_line, translate_values
from finetune.recipe.args import (
    RECIPE_SECTIONS,
    DataArguments,
    FinetuneTrainingArguments,
    LoraArguments,
    MethodArguments,
    ModelArguments,
)
from finetune.recipe.batch_plan import BatchPlan, plan_from_recipe
from finetune.recipe.methods import Method, all_methods, key_of_other_methods, requested_method
from finetune.recipe.preflight import (
    check_launcher_precision,
    check_lora_adapters,
    check_loss_head,
    check_named_strategy,
    check_parallelism,
    check_pure_bf16,
    check_qlora,
    preflight_launch,
    warmup_warning,
)

COMMAND_LINE = "command line"
BATCH_PLAN = "batch plan (global_batch_size, lr_scaling, warmup_tokens)"


@dataclass
class Recipe:
    """A parsed recipe: its sections, where each value the user gave came from, and what the launch derived."""

    model: ModelArguments
    data: DataArguments
    lora: LoraArguments
    training: FinetuneTrainingArguments
    method: Method  # the training method, holding its own keys (finetune.recipe.methods)
    # Where each key given by the user came from: "recipe <path>", COMMAND_LINE or BATCH_PLAN.
    sources: dict[str, str] = field(default_factory=dict)
    batch_plan: BatchPlan | None = None
    strategy: Strategy = field(default_factory=Strategy)  # what the launcher and the recipe ask for
    parallelism: Parallelism = field(default_factory=Parallelism)  # tensor, sequence, context axes (all 1: none)
    deepspeed_config: dict | None = None  # the DeepSpeed config as written (file or inline keys), "auto" values kept
    foreign_keys: dict | None = None  # what became of TRL's or another tool's keys (effective_config.json)
    axes: tuple[Axis, ...] = ()  # the parallelism axes that are on, holding their own keys (finetune.axes)

    @property
    def runner(self) -> Axis | None:
        """The axis that takes the training steps (its own loop), or None: Trainer takes them."""
        return runner_of(self.axes)

    @property
    def sections(self) -> tuple:
        method = MethodArguments(method=self.method.name)
        return (self.model, self.data, self.lora, method, *filter(None, [self.method.settings]),
                *(axis.settings for axis in self.axes), self.training)

    @property
    def planned_keys(self) -> set[str]:
        """Keys the batch plan set for this launch (micro-batch, accumulation, learning rate, warmup)."""
        return {key for key, source in self.sources.items() if source == BATCH_PLAN}


class RecipeParser(HfArgumentParser):
    """`HfArgumentParser` that raises `RecipeError` instead of printing usage and exiting."""

    def __init__(self):
        # A key several methods declare (`beta`, as TRL's configs do) is one option; each method's own default
        # applies where the recipe leaves it out (`shared_method_keys`)
        super().__init__(method_sections() + axis_sections() + RECIPE_SECTIONS, prog="finetune train",
                         allow_abbrev=False, conflict_handler="resolve")
        self.set_defaults(**dict.fromkeys(shared_method_keys(), None))

        # Without an accelerator, Trainer must be told `use_cpu`: otherwise a launcher's DeepSpeed or
        # multi-process config silently trains as ONE process per rank (world size 1).
        self.set_defaults(use_cpu=not torch.accelerator.is_available())

    def error(self, message):
        raise RecipeError(message)

    def known_keys(self) -> set[str]:
        return {action.dest for action in self._actions if action.dest != "help"}


def load_recipe_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file `{path}` does not exist.")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise RecipeError(f"recipe `{path}` is not UTF-8 text (byte 0x{data[error.start]:02x} on line {line}): save it "
                          "as UTF-8.") from None
    try:
        values = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise RecipeError(f"recipe `{path}` is not valid YAML: {error}") from None
    if values is None:
        raise RecipeError(f"recipe `{path}` is empty: it would train on every default. Give at least "
                          "`model_name_or_path` and `dataset` (see recipes/demo.yaml).")
    if not isinstance(values, dict):
        raise RecipeError(f"recipe `{path}` must be a mapping of keys to values, got {type(values).__name__}.")
    return values


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice: PyYAML silently keeps the last value."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key `{key}` is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})"
                    "; keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def method_sections() -> tuple[type, ...]:
    """Every registered method's own keys: all are known keys, so that one given under another method is named."""
    return tuple(method.arguments for method in all_methods() if method.arguments is not None)


def shared_method_keys() -> set[str]:
    """Keys declared by more than one method, under TRL's one name (`beta`): given, they configure the recipe's
    method; left out, each method's own default applies."""
    seen, shared = set(), set()
    for section in method_sections():
        names = {field.name for field in dataclasses.fields(section) if field.init}
        shared |= seen & names
        seen |= names
    return shared


@dataclass
class RecipeSections:
    """A recipe as parsed, before any launch check: the model, data and LoRA sections and the training keys (not yet
    `TrainingArguments`, whose construction starts the process group)."""

    model: ModelArguments
    data: DataArguments
    lora: LoraArguments
    method: Method
    training_inputs: dict[str, Any]
    sources: dict[str, str]
    values: dict[str, Any]  # the YAML's own values
    overrides: list[str]
    foreign_keys: dict | None = None  # what became of TRL's or another tool's keys (aliases.Translation.record)
    axes: tuple[Axis, ...] = ()  # the parallelism axes that are on (finetune.axes)
    axis_inputs: dict[str, Any] = field(default_factory=dict)  # every axis's keys the recipe gives, by key


def parse_recipe(recipe_path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """YAML values become the parser's defaults, then `overrides` (`--key value` strings) win over them.

    The model, data and LoRA sections are built first; then the launch is checked (`preflight_launch`) and the batch
    planned for its world size, and only then is `TrainingArguments` built, whose construction starts the process
    group.
    """
    sections = read_recipe(recipe_path, overrides)
    model, data, lora, training_inputs, sources = (sections.model, sections.data, sections.lora,
                                                   sections.training_inputs, sections.sources)
    strategy, deepspeed_config = preflight_launch(training_inputs)
    inside = any(axis.splits_tensor_parallelism for axis in sections.axes)  # a pipeline's stages split their layers
    parallelism = check_parallelism({**training_inputs, **sections.axis_inputs}, model, inside_stages=inside)
    if parallelism.named:  # the resolved sizes, whoever named them, are what TrainingArguments carries
        if sections.method.name != "sft":
            raise RecipeError(f"`method: {sections.method.name}` with {parallelism.describe()}: only supervised "
                              "fine-tuning runs on these axes so far; train it under DDP, ZeRO or FSDP.")
        training_inputs.update({key: parallelism.size(key) for key in DATA_SIZES})
    axes = on_the_mesh(sections.axes, parallelism)  # the mesh's axes at their resolved sizes, whoever named them
    for axis in axes:  # each axis refuses what it cannot run beside the rest
        strategy = axis.check(sections, parallelism, strategy)
    check_named_strategy(training_inputs.get("strategy"), strategy, int(os.environ.get("WORLD_SIZE", "1")),
                         sources.get("strategy") == COMMAND_LINE)
    if lora.use_qlora:
        check_qlora(model.torch_dtype, training_inputs, strategy)
    check_pure_bf16(training_inputs, strategy)
    check_launcher_precision(training_inputs, sources)
    shared = parallelism.ranks_sharing_a_batch * math.prod(  # ranks of one batch
        axis.ranks_sharing_a_batch() for axis in axes)
    data_parallel = int(os.environ.get("WORLD_SIZE", "1")) // shared
    batch_plan = plan_from_recipe(training_inputs, data.max_seq_length, data_parallel)
    _check_steps_and_accumulation(training_inputs, sources, batch_plan)
    _apply_batch_plan(batch_plan, training_inputs, sources)
    _steps_of_the_data(data, batch_plan, training_inputs, sources)
    sections.method.check_training_keys(training_inputs, sources)
    check_loss_head(sections.method, training_inputs)
    max_steps = int(training_inputs.get("max_steps") or -1)  # -1 (epochs): said once Trainer knows the steps
    warning = warmup_warning(float(training_inputs.get("warmup_steps") or 0), float(training_inputs["learning_rate"]),
                             max_steps)
    if warning and launched_rank() == 0:
        print(f"warning: {warning}")
    training_type, method_inputs = sections.method.training_arguments(data)  # TRL's config, where the method has one
    training = _build(training_type, {**training_inputs, **method_inputs}, sections.values, sections.overrides)
    training.ranks_sharing_a_batch = parallelism.ranks_sharing_a_batch  # what Trainer's data-parallel size divides out
    if inside:  # the stages split their layers themselves (the pipeline's strategy): nothing loads sharded
        parallelism = Parallelism()
    parallelism = parallelism.replaced(bf16=bool(training.bf16))  # the precision FSDP2 gathers TP slices in
    return Recipe(model=model, data=data, lora=lora, training=training, method=sections.method,
                  sources=sources, batch_plan=batch_plan, strategy=strategy, parallelism=parallelism,
                  deepspeed_config=deepspeed_config,
                  foreign_keys=sections.foreign_keys, axes=axes)


def read_recipe(recipe_path: str | Path | None = None, overrides: list[str] | None = None,
                auto_precision: str | None = None) -> RecipeSections:
    """The recipe's sections and training keys, checked key by key but not as a launch (`finetune plan --recipe`
    reads a recipe this way for a machine it does not run on). `bf16: auto` becomes `auto_precision` (bf16, fp16
    or fp32; default: what the visible GPU does)."""
    parser = RecipeParser()
    source = f"recipe `{recipe_path}`" if recipe_path is not None else "the recipe"
    file_values = load_recipe_file(recipe_path) if recipe_path is not None else {}
    method = requested_method(file_values, list(overrides or []))  # TRL's keys mean what that method's config says
    recipe_dir = Path(recipe_path).parent if recipe_path is not None else None
    known = parser.known_keys()
    values, from_file = translate_values(file_values, source, method, recipe_dir, known)
    if values.get("method") not in (None, method.name):  # another tool's config named it (LLaMA-Factory's `stage`)
        method = requested_method(values, list(overrides or []))
        values, from_file = translate_values(file_values, source, method, recipe_dir, known)
    overrides, from_command_line = translate_command_line(list(overrides or []), method, from_file.tool, known)
    for key in values:
        if key not in known:
            raise RecipeError(f"unknown key `{key}` in {source}{did_you_mean(key, known)}.")
    for key in _unset(parser, values):  # YAML's null (`key:` with no value): unset, as TRL and the other tools read it
        from_file.notes.append(f"`{key}: null` (unset: the default, {parser.get_default(key)})")
        del values[key]
    _check_value_shapes(parser, values, source)
    resolved_auto = _resolve_auto_precision(values, overrides, auto_precision)
    parser.set_defaults(**{key: _as_argparse_default(value) for key, value in values.items()})
    namespace, remaining = parser.parse_known_args(args=overrides)
    if remaining:
        name = remaining[0].lstrip("-").replace("-", "_")
        raise RecipeError(f"unknown option `{remaining[0]}`{did_you_mean(name, known)}.")
    sources = {key: f"recipe {recipe_path}" for key in values}
    sources.update({_option_name(token): COMMAND_LINE for token in overrides if token.startswith("--")})
    _name_the_aliases(sources, from_file, from_command_line)
    for theirs, produced in from_file.read_into.items():
        for key in produced:
            sources.setdefault(key, f"recipe {recipe_path}")
            sources[key] = f"{sources[key]} ({READ_FROM}{from_file.tool or 'TRL'}'s {theirs})"
    for key in from_file.defaults:
        sources[key] = f"{from_file.tool}{TOOLS_DEFAULT}`{key}` out)"
    if resolved_auto:
        sources["bf16"] = sources["fp16"] = f"{sources.get('bf16', 'the recipe')}: {resolved_auto}"
    shared = shared_method_keys()
    inputs = {section: {f.name: getattr(namespace, f.name) for f in dataclasses.fields(section)
                        if f.init and hasattr(namespace, f.name)
                        and not (f.name in shared and getattr(namespace, f.name) is None)}
              for section in RECIPE_SECTIONS + method_sections() + axis_sections()}
    model = _build(ModelArguments, inputs[ModelArguments], values, overrides)
    data = _build(DataArguments, inputs[DataArguments], values, overrides)
    lora = _build(LoraArguments, inputs[LoraArguments], values, overrides)
    check_lora_adapters(model, lora)  # names against the model's own, built empty: a dry run and a launch stop here
    _refuse_other_methods_keys(method, inputs)
    settings = None if method.arguments is None else _build(method.arguments, inputs[method.arguments], values,
                                                            overrides)
    chosen = method(settings)
    chosen.check_data_keys(data)
    axes = active_axes(inputs, lambda section, given: _build(section, given, values, overrides))
    return RecipeSections(model, data, lora, chosen, inputs[FinetuneTrainingArguments], sources, values, overrides,
                          foreign_keys=from_file.record() if from_file.tool or from_file.renamed or from_file.notes
                          or from_file.read_into else None, axes=axes,
                          axis_inputs={key: value for section in axis_sections()
                                       for key, value in inputs[section].items() if value is not None})


def _refuse_other_methods_keys(method: type[Method], inputs: dict[type, dict[str, Any]]) -> None:
    """A key of another method's, given another value than its default, would do nothing: refused, naming it."""
    own = set() if method.arguments is None else {field.name for field in dataclasses.fields(method.arguments)}
    for other in all_methods():
        if other is method or other.arguments is None:
            continue
        defaults = {field.name: field.default if field.default_factory is dataclasses.MISSING
                    else field.default_factory() for field in dataclasses.fields(other.arguments)}
        for key, value in inputs[other.arguments].items():
            if key not in own and value != defaults[key]:
                raise key_of_other_methods(key, method)


def _name_the_aliases(sources: dict[str, str], from_file: Translation, from_command_line: Translation) -> None:
    """Marks the keys given under another name (`recipe R.yaml (given as TRL's max_length)`), and notes, once, the
    keys accepted without effect (finetune.recipe.aliases)."""
    for key, source in sources.items():
        alias = (from_command_line if source == COMMAND_LINE else from_file).renamed.get(key)
        if alias is not None:
            sources[key] = f"{source} ({alias.given_as})"
    if launched_rank() != 0:
        return
    if from_file.reading:  # whose config the file is read as, and each stray key of another tool's
        print(f"note: {'; '.join([from_file.reading, *from_file.strays])}.")
    if from_command_line.strays:
        print(f"note: on the command line, {'; '.join(from_command_line.strays)}.")
    notes = from_file.notes + from_command_line.notes
    if notes:
        print(f"note: keys that change nothing here, accepted and ignored: {'; '.join(notes)}.")


def _check_value_shapes(parser: RecipeParser, values: dict[str, Any], source: str) -> None:
    """A YAML list or mapping where a number or a boolean belongs (argparse would pass it through untyped, and
    Trainer fail later with a TypeError), named by its key. Keys that take text may take structures too (`report_to`
    a list, `deepspeed` a mapping), as Trainer allows."""
    actions = {action.dest: action for action in parser._actions}
    for key, value in values.items():
        action = actions[key]
        scalar = action.nargs in (None, "?") and (action.type in (int, float)
                                                  or getattr(action.type, "__name__", "") == "string_to_bool")
        if scalar and isinstance(value, (list, dict)):
            kind = "a list" if isinstance(value, list) else "a mapping"
            raise RecipeError(f"`{key}` in {source} is {kind} ({value!r}); it takes one "
                              f"{'true/false' if action.type not in (int, float) else action.type.__name__}.")


def _unset(parser: RecipeParser, values: dict[str, Any]) -> list[str]:
    """Keys given as null that cannot hold null: they keep their default."""
    sections = RECIPE_SECTIONS + method_sections() + axis_sections()
    fields = {field.name: field for section in sections for field in dataclasses.fields(section)}
    return [key for key, value in values.items() if value is None and key in fields and not _takes_null(fields[key])]


def _takes_null(field: dataclasses.Field) -> bool:
    """Whether a recipe key may be null: its annotation admits None (`str | None`, `Optional[...]`, `Any`)."""
    annotation = str(field.type)
    return "None" in annotation or "Optional" in annotation or "Any" in annotation


def _build(section_type, inputs: dict[str, Any], values: dict[str, Any], overrides: list[str]):
    try:
        return section_type(**inputs)
    except RecipeError:
        raise
    except (ValueError, TypeError) as error:  # Transformers' own checks
        raise RecipeError(_name_the_culprit(str(error), values, overrides)) from None


def _resolve_auto_precision(values: dict[str, Any], overrides: list[str], precision: str | None = None) -> str | None:
    """`bf16: auto` (axolotl's habit): bf16 mixed precision where the visible GPU has it, fp16 where it does not (a
    T4, a V100), none on CPU; written into `values`/`overrides` as plain booleans before parsing. Returns how it was
    resolved, which the effective config records as the source of `bf16` and `fp16`."""
    from finetune.launch.devices import training_precision_here, visible_gpu

    flags = [index for index, token in enumerate(overrides[:-1]) if token == "--bf16"]
    given = overrides[flags[-1] + 1] if flags else values.get("bf16")
    if str(given).lower() != "auto":
        return None
    planned = precision is not None
    precision = precision or training_precision_here()
    chosen = {"bf16": "true", "fp16": "false"} if precision == "bf16" else \
        {"bf16": "false", "fp16": "true" if precision == "fp16" else "false"}
    if flags:
        overrides[flags[-1] + 1] = chosen["bf16"]
        overrides += ["--fp16", chosen["fp16"]]
    else:
        values.update(chosen)
    if planned:
        return f"auto → {precision} (the GPU planned for)"
    gpu = visible_gpu()
    return f"auto → {precision} ({gpu.describe() if gpu is not None else 'no GPU visible'})"


def _check_steps_and_accumulation(training_inputs: dict[str, Any], sources: dict[str, str], plan: BatchPlan) -> None:
    """Values Trainer would take without a word but that cannot be what the user meant."""
    if str(training_inputs.get("max_steps")) == "0":
        raise RecipeError("`max_steps: 0` trains nothing (Trainer would still run one step and report before = "
                          "after): give a positive number of steps, or -1 to train `num_train_epochs` epochs.")
    if training_inputs.get("global_batch_size") is None and plan.world_size > 1 and launched_rank() == 0:
        per_process = plan.micro_batch_size * plan.gradient_accumulation_steps
        print(f"warning: the global batch is {plan.global_batch_size} sequences ({plan.micro_batch_size} per device × "
              f"{plan.world_size} processes × {plan.gradient_accumulation_steps} accumulation) and follows the process "
              f"count ({per_process} on 1 process, {per_process * (plan.world_size + 1)} on {plan.world_size + 1}); "
              f"set `global_batch_size: {plan.global_batch_size}` to hold it, and the learning rate, whatever the "
              "launch.")
    given = training_inputs.get("gradient_accumulation_steps")
    if training_inputs.get("global_batch_size") is None or given == plan.gradient_accumulation_steps:
        return
    source = sources.get("gradient_accumulation_steps", "default")
    contradiction = (f"`gradient_accumulation_steps: {given}` ({source}) "
                     f"contradicts `global_batch_size: {training_inputs['global_batch_size']}`, planned as "
                     f"{plan.micro_batch_size} × {plan.world_size} process(es) × {plan.gradient_accumulation_steps}")
    if sources.get("gradient_accumulation_steps") == COMMAND_LINE:
        raise RecipeError(f"{contradiction}: drop one (cap the micro-batch with `max_micro_batch_size` to get more "
                          "accumulation under `global_batch_size`).")
    if launched_rank() == 0 and "gradient_accumulation_steps" in sources:
        print(f"warning: {contradiction}; the global batch wins.")


def _steps_of_the_data(data: DataArguments, plan: BatchPlan, training_inputs: dict[str, Any],
                       sources: dict[str, str]) -> None:
    """`max_tokens` as Trainer's `max_steps`; a stream, which has no length, needs one of them."""
    given_steps = int(training_inputs.get("max_steps") or -1)
    if data.max_tokens is not None:
        from_file = sources.get("max_steps", COMMAND_LINE) != COMMAND_LINE
        overridden = sources.get("max_tokens") == COMMAND_LINE and from_file
        if given_steps > 0 and not overridden:  # the command line's budget wins over the file's steps, as any key does
            raise RecipeError(f"give `max_tokens: {data.max_tokens}` or `max_steps: {given_steps}`, not both.")
        tokens_per_step = plan.global_batch_size * data.max_seq_length
        training_inputs["max_steps"] = -(-data.max_tokens // tokens_per_step)
        sources["max_steps"] = (f"max_tokens {data.max_tokens:,} ÷ {tokens_per_step:,} tokens a step "
                                f"({plan.global_batch_size} rows of max_seq_length {data.max_seq_length})")
    elif data.streaming and given_steps <= 0:
        raise RecipeError("`streaming: true` reads a stream of unknown length: give `max_steps` or a token budget "
                          "`max_tokens` to end the run.")


def _apply_batch_plan(plan: BatchPlan, training_inputs: dict[str, Any], sources: dict[str, str]) -> None:
    """Writes the planned values into the training section, noting where each changed value came from."""
    planned = {
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "learning_rate": plan.learning_rate,
    }
    if plan.warmup_steps is not None:
        planned["warmup_steps"] = plan.warmup_steps
    for key, value in planned.items():
        if training_inputs.get(key) != value:
            training_inputs[key] = value
            sources[key] = BATCH_PLAN


def _option_name(token: str) -> str:
    return token[2:].split("=", 1)[0].replace("-", "_")


def _name_the_culprit(message: str, values: dict[str, Any], overrides: list[str]) -> str:
    """Prefixes `key: value` to a Trainer error that quotes the value but not the key."""
    given = dict(values)
    given.update({key.lstrip("-"): value for key, value in zip(overrides, overrides[1:]) if key.startswith("--")})
    culprits = [f"`{key}: {value}`" for key, value in given.items() if str(value) and str(value) in message]
    return f"{', '.join(culprits)}: {message}" if len(culprits) == 1 else message


def _as_argparse_default(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return str(value)
    return value
