"""The recipe keys people arrive with, and our answer to each: renamed to our key, accepted when they ask for what
finetune does anyway, ignored with a note, or refused naming the key and the fix. People bring `trl sft --config
recipe.yaml` recipes (alignment-handbook, axolotl exports), written against TRL's configs and often against
Transformers 4's `TrainingArguments`; the one table here says what becomes of each of their keys.

Names are those of trl 1.16: `SFTConfig` (trl/trainer/sft_config.py), `ModelConfig` (trl/trainer/model_config.py),
`ScriptArguments`, `DatasetMixtureConfig` and `TrlParser` (trl/scripts/utils.py). `SFTConfig` subclasses
`TrainingArguments`, so Trainer's keys (`learning_rate`, `bf16`, `use_liger_kernel`, `push_to_hub`, ...) keep Trainer's
meaning and need no entry; TRL's older `max_seq_length` and `torch_dtype` are our own names. Transformers 5 removed a
few Trainer keys that recipes still carry (`warmup_ratio`: a `warmup_steps` below 1 is now the fraction;
`evaluation_strategy`, `overwrite_output_dir`, `logging_dir`); they are answered here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from finetune.errors import RecipeError

if TYPE_CHECKING:  # a method is passed in by the parser
    from finetune.recipe.methods import Method

SFT_CONFIG = "SFTConfig"
MODEL_CONFIG = "ModelConfig"
SCRIPT_ARGUMENTS = "ScriptArguments"
DATASET_MIXTURE = "DatasetMixtureConfig"
TRL_PARSER = "TrlParser"
TRANSFORMERS_4 = "Transformers 4"  # TrainingArguments keys removed in Transformers 5
AXOLOTL = "axolotl"
LLAMA_FACTORY = "LLaMA-Factory"
NAMED_OWNERS = (TRANSFORMERS_4, AXOLOTL, LLAMA_FACTORY)  # every other origin is one of TRL's configs
GIVEN_AS = "given as "  # in the source of a key given under another name: `recipe R.yaml (given as TRL's max_length)`
READ_FROM = "read from "  # in the source of a key read from another's value: `(read from axolotl's adapter)`
TOOLS_DEFAULT = "'s default (its config leaves "  # the source of a tool's default: `LLaMA-Factory's default (...)`
FOREIGN = (GIVEN_AS, READ_FROM, TOOLS_DEFAULT)  # sources of keys effective_config.json lists whatever they are


@dataclass(frozen=True)
class TrlKey:
    """One key of TRL's configs and what a finetune recipe does with it."""

    name: str
    """The key as TRL spells it."""
    origin: str
    """The TRL class that declares it."""
    ours: str | None = None
    """Our key that takes its value as it is; None when there is none."""
    kept: tuple = ()
    """Values that ask for what finetune does anyway: accepted with a note. Any other value is refused."""
    ignored: bool = False
    """Every value is accepted with a note: the key changes nothing that matters here."""
    why: str = ""
    """What finetune does instead: said in the note, or in the refusal with the fix."""
    convert: Callable[[Any], Any] | None = None
    """Turns the value into ours (raising `ValueError` with the reason when it cannot); None: taken as it is."""
    expand: Callable[[Any, dict], dict] | None = None
    """Reads the value (and the recipe's other values) into our keys, `{key: value}`, raising `ValueError` with the
    reason when it cannot; an empty answer for a value that asks for something is noted with `why`."""

    @property
    def owner(self) -> str:
        return self.origin if self.origin in NAMED_OWNERS else "TRL"

    @property
    def given_as(self) -> str:
        """How the source of a renamed key names it: `given as TRL's max_length`."""
        return f"{GIVEN_AS}{self.owner}'s {self.name}"


def warmup_fraction(value: Any) -> float:
    """Transformers 4's `warmup_ratio` as Transformers 5's `warmup_steps`, which reads a value below 1 as a fraction of
    the training steps (training_args.py, `get_warmup_steps`); 1 or more would be read as a count of steps."""
    fraction = float(value)
    if not 0 <= fraction < 1:
        raise ValueError(f"a fraction of the training steps must be in [0, 1), got {value}: give a count of steps as "
                         "`warmup_steps` instead")
    return fraction


def held_out_size(value: Any) -> float:
    """A held-out size as `train_test_split` reads it: below 1 a fraction, from 1 a count of rows."""
    size = float(value)
    if size < 0 or (size >= 1 and size != int(size)):
        raise ValueError(f"a held-out size is a fraction below 1 or a whole count of rows, got {value}")
    return size if size < 1 else int(size)


TRL_KEYS = (
    # SFTConfig
    TrlKey("max_length", SFT_CONFIG, ours="max_seq_length"),
    TrlKey("dataset_text_field", SFT_CONFIG, kept=("text",),
           why="finetune reads plain-text examples from a column named `text` (`dataset_format: auto` or `text`); "
               "rename your column to `text` in the data"),
    TrlKey("completion_only_loss", SFT_CONFIG, kept=(True, None),
           why="finetune learns only the completion of prompt/completion examples (and every token of `text` "
               "examples); to learn the prompt too, write the examples as one `text` column"),
    TrlKey("assistant_only_loss", SFT_CONFIG, kept=(True,),
           why="finetune learns only the assistant turns of a conversation (see them with `finetune labels`); to "
               "learn every token, write the examples as one `text` column"),
    TrlKey("truncation_mode", SFT_CONFIG, kept=("keep_start",),
           why="an overlong example keeps its start (`overlong_policy: truncate`), or is dropped or refused with "
               "`overlong_policy: drop` or `error`"),
    TrlKey("eval_packing", SFT_CONFIG, kept=(None,),
           why="eval data is packed exactly when training data is (`packing`); drop the key"),
    TrlKey("loss_type", SFT_CONFIG, kept=("nll",),
           why="the loss is the answer tokens' cross-entropy (finetune/train/trainer.py, compute_loss); drop the key "
               "(a preference method's loss types: under that `method`, docs/preference.md)"),
    TrlKey("activation_offloading", SFT_CONFIG, kept=(False,),
           why="activations are not offloaded; save activation memory with `gradient_checkpointing: true`"),
    TrlKey("model_init_kwargs", SFT_CONFIG, kept=(None,),
           why="give the loading keys by name: `torch_dtype`, `attn_implementation`, `trust_remote_code`"),
    TrlKey("chat_template_path", SFT_CONFIG, ours="chat_template"),
    TrlKey("eos_token", SFT_CONFIG, kept=(None,),
           why="each answer ends with the tokenizer's EOS or the chat template's end of turn; drop the key"),
    TrlKey("pad_token", SFT_CONFIG, kept=(None,),
           why="the tokenizer's pad token is used (its EOS when it has none); drop the key"),
    TrlKey("dataset_kwargs", SFT_CONFIG, kept=(None,),
           why="the dataset is always prepared (formats, chat template, labels); drop the key"),
    TrlKey("shuffle_dataset", SFT_CONFIG, ignored=True,
           why="Trainer's sampler shuffles the training data every epoch, seeded by `seed`"),
    TrlKey("pad_to_multiple_of", SFT_CONFIG, ignored=True, why="each micro-batch is padded to its longest row"),
    # ModelConfig
    TrlKey("dtype", MODEL_CONFIG, ours="torch_dtype"),
    TrlKey("use_peft", MODEL_CONFIG, ours="use_lora"),
    TrlKey("load_in_4bit", MODEL_CONFIG, ours="use_qlora"),
    TrlKey("lora_modules_to_save", MODEL_CONFIG, ours="modules_to_save"),
    TrlKey("model_revision", MODEL_CONFIG, kept=("main",),
           why="the default revision is loaded; download the revision you want (`huggingface-cli download ID "
               "--revision R --local-dir DIR`) and give DIR as `model_name_or_path`"),
    TrlKey("lora_task_type", MODEL_CONFIG, kept=("CAUSAL_LM",),
           why="causal language models are trained (peft's CAUSAL_LM); drop the key"),
    TrlKey("lora_target_parameters", MODEL_CONFIG, kept=(None,),
           why="adapters go on modules (`lora_target_modules`), not on bare parameters"),
    TrlKey("load_in_8bit", MODEL_CONFIG, kept=(False,),
           why="an 8-bit base is not supported; `load_in_4bit: true` (our `use_qlora`) trains on a 4-bit NF4 base"),
    TrlKey("bnb_4bit_quant_type", MODEL_CONFIG, kept=("nf4",), why="the 4-bit base is always NF4; drop the key"),
    TrlKey("use_bnb_nested_quant", MODEL_CONFIG, ignored=True,
           why="the 4-bit base always uses nested (double) quantization (finetune/models/loading.py)"),
    TrlKey("bnb_4bit_quant_storage", MODEL_CONFIG, ignored=True,
           why="the 4-bit storage dtype follows the strategy: the compute dtype under FSDP or ZeRO-3, so they shard"),
    # ScriptArguments
    TrlKey("dataset_name", SCRIPT_ARGUMENTS, ours="dataset"),
    TrlKey("dataset_train_split", SCRIPT_ARGUMENTS, ours="dataset_split"),
    TrlKey("dataset_test_split", SCRIPT_ARGUMENTS, ours="eval_split"),
    TrlKey("dataset_streaming", SCRIPT_ARGUMENTS, ours="streaming"),
    TrlKey("ignore_bias_buffers", SCRIPT_ARGUMENTS, ignored=True,
           why="a DDP debugging switch of TRL's scripts; finetune's DDP needs none"),
    # DatasetMixtureConfig
    TrlKey("datasets", DATASET_MIXTURE, expand=lambda value, values: {"dataset_mixture": {"datasets": value}},
           why="read into our `dataset_mixture` (each dataset's path, name, split, columns, fraction)"),
    TrlKey("test_split_size", DATASET_MIXTURE, ours="eval_split_ratio", convert=held_out_size),
    # TrlParser
    TrlKey("env", TRL_PARSER, kept=(None,),
           why="set environment variables in the shell or the launcher, before any library reads them"),
    # TrainingArguments of Transformers 4, removed in 5
    TrlKey("warmup_ratio", TRANSFORMERS_4, ours="warmup_steps", convert=warmup_fraction),
    TrlKey("evaluation_strategy", TRANSFORMERS_4, ours="eval_strategy"),
    TrlKey("overwrite_output_dir", TRANSFORMERS_4, ignored=True,
           why="finetune never deletes an output_dir: a run continues from its newest complete checkpoint with "
               "`resume_from_checkpoint: auto`, and starts fresh without it"),
    TrlKey("logging_dir", TRANSFORMERS_4, ignored=True,
           why="TensorBoard writes its event files under <output_dir>/runs"),
)
TRL_KEYS_BY_NAME = {key.name: key for key in TRL_KEYS}


def note_for(key: TrlKey, value: Any) -> str:
    return f"`{key.name}: {shown(value)}` ({key.why})"


@dataclass
class Translation:
    """What became of TRL's (or another tool's) keys in one place (the recipe file or the command line)."""

    renamed: dict[str, TrlKey] = field(default_factory=dict)
    """Our key → the key it was given as."""
    notes: list[str] = field(default_factory=list)
    """One `key: value (why)` per key accepted without effect."""
    tool: str | None = None
    """The tool whose config the file is (finetune.recipe.peers), None for a finetune or TRL recipe."""
    read_into: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Their key → the keys of ours its value was read into (`adapter: qlora` → `{use_qlora: true}`)."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """The tool's own defaults applied for keys its config left out (our key → value)."""
    reading: str | None = None
    """What the console says the file is read as (peers.read_as), when it has any other tool's key."""
    strays: list[str] = field(default_factory=list)
    """How each of another tool's keys in a finetune recipe (or on its command line) was read."""

    def record(self) -> dict[str, Any]:
        """What `effective_config.json` lists under `foreign_keys`."""
        return {"read_as": f"{self.tool} config" if self.tool else "finetune / TRL recipe",
                "renamed": {key.name: ours for ours, key in self.renamed.items()},
                "read_into": self.read_into, "tool_defaults": self.defaults, "noted": self.notes}


# Values that ask for nothing: a key read into ours that gives none of them is not noted.
NOTHING = (None, "", False, [], {})


def translate_values(values: dict[str, Any], where: str, method: type[Method] | None = None,
                     recipe_dir: Path | None = None,
                     native: set[str] = frozenset()) -> tuple[dict[str, Any], Translation]:
    """A recipe file's values with TRL's keys answered (as the config of `method` declares them), or, for another
    tool's config, that tool's keys (finetune.recipe.peers): renamed to ours, read into ours, dropped with a note, or
    refused. `native` holds the keys the recipe parser knows: with TRL's, they tell a finetune recipe from another
    tool's config (peers.read_as)."""
    from finetune.recipe.peers import RECIPE_DIR, TOOL_KEYS, read_as, tool_defaults

    native = set(native) | trl_key_names()
    reading = read_as(values, where, native)
    translation = Translation(tool=reading.tool, reading=reading.line)
    tool_keys = TOOL_KEYS.get(reading.tool) or {name: TOOL_KEYS[reading.stray_tool][name] for name in reading.strays}
    context, translated = {**values, RECIPE_DIR: recipe_dir}, {}
    for name, value in values.items():
        if reading.tool is not None and value is None and name not in native:  # YAML's null: unset, as the tool reads
            translation.notes.append(f"`{name}: null` (unset)")
            continue
        key = tool_keys.get(name) or method_trl_key(name, method)
        if key is not None and key.expand is not None:
            translated.update(_read_into(key, value, context, where, translation, values))
            continue
        target = _answer(name, value, where, translation, method, key)
        if target is not None:
            translated[target] = _converted(key, value, where)
    _refuse_both(translation, set(values), where)
    translation.strays = [_stray_line(tool_keys[name], values[name], translation) for name in reading.strays]
    for ours, value in tool_defaults(translation.tool, values).items():
        if ours not in translated:
            translated[ours] = translation.defaults[ours] = value
    lora_targets = translated.get("lora_target_modules")
    if isinstance(lora_targets, str):  # TRL writes one name or `all-linear` as a string; our key is a list
        translated["lora_target_modules"] = [lora_targets]
    return translated, translation


def _stray_line(key: TrlKey, value: Any, translation: Translation) -> str:
    """How a finetune recipe read one key of another tool's (`lora_rank` is LLaMA-Factory's name for `lora_r`)."""
    if key.ours is not None:
        return f"`{key.name}` is {key.owner}'s name for `{key.ours}`: read as {key.ours}"
    produced = translation.read_into.get(key.name)
    if produced:
        read = ", ".join(f"{ours}: {shown(value)}" for ours, value in produced.items())
        return f"`{key.name}` is {key.owner}'s key: read as {read}"
    return f"`{key.name}: {shown(value)}` is {key.owner}'s key: {key.why}"


def trl_key_names() -> set[str]:
    """Every key TRL's configs name (this table's and each method's own)."""
    from finetune.recipe.methods import all_methods

    return set(TRL_KEYS_BY_NAME) | {key.name for method in all_methods() for key in method.trl_keys}


def translate_command_line(tokens: list[str], method: type[Method] | None = None, tool: str | None = None,
                           native: set[str] = frozenset()) -> tuple[list[str], Translation]:
    """`--key value ...` tokens with TRL's keys answered the same way, and the renamed keys of `tool` (the file's
    tool; of any tool, said so, for a finetune recipe) as in the file; `--use_peft` alone means true, as in
    `HfArgumentParser`."""
    from finetune.recipe.peers import TOOL_KEYS

    translation, translated, given = Translation(tool=tool), [], set()
    for option, values in _options(tokens):
        if option is None:
            translated += values
            continue
        name = option[2:].split("=", 1)[0].replace("-", "_")
        given.add(name)
        inline = option.split("=", 1)[1:]
        value = (inline or values or ["true"])[0] if len(values) <= 1 else values
        key = _tool_key(name, tool, native, TOOL_KEYS) or method_trl_key(name, method)
        target = _answer(name, value, "the command line", translation, method, key)
        if target == name:
            translated += [option, *values]
        elif target is not None:
            converted = [str(_converted(key, given, "the command line")) for given in (inline or values)]
            translated += [f"--{target}", *converted]
            if tool is None and key.owner in TOOL_KEYS:
                translation.strays.append(_stray_line(key, value, translation))
    _refuse_both(translation, given, "the command line")
    return translated, translation


def _tool_key(name: str, tool: str | None, native: set[str], tables: dict[str, dict[str, TrlKey]]) -> TrlKey | None:
    """The key of the file's tool (of any tool for a finetune recipe) that a command-line option names, when it is
    renamed to ours or noted (a key whose value needs reading is given in the file)."""
    if name in native or (tool is None and name in trl_key_names()):  # a finetune recipe's TRL keys are TRL's
        return None
    for owner, table in tables.items():
        key = table.get(name)
        if key is not None and key.expand is None and (tool is None or owner == tool):
            return key
    return None


def method_trl_key(name: str, method: type[Method] | None) -> TrlKey | None:
    """TRL's key `name` as the recipe's method answers it (its TRL config's meaning), else as any recipe does; a key
    only another method's config has is answered as that method answers it when the value asks for nothing (the
    default), and refused, naming the method, otherwise (`_answer`)."""
    own = {key.name: key for key in (method.trl_keys if method is not None else ())}
    return own.get(name) or TRL_KEYS_BY_NAME.get(name)


def _other_method_wanting(name: str, method: type[Method] | None) -> tuple[type[Method], TrlKey] | None:
    from finetune.recipe.methods import all_methods

    for other in all_methods():
        if other is not method:
            for key in other.trl_keys:
                if key.name == name:
                    return other, key
    return None


def _read_into(key: TrlKey, value: Any, context: dict, where: str, translation: Translation,
               given: dict) -> dict[str, Any]:
    """Our keys the value of `key` is read into; a value that asks for something and is read into nothing is noted."""
    try:
        produced = key.expand(value, context)
    except (TypeError, ValueError) as error:
        raise RecipeError(f"{key.owner}'s `{key.name}` in {where}: {error}.") from None
    for ours, value_of_ours in produced.items():
        if ours in given and given[ours] != value_of_ours:
            raise RecipeError(f"{where} gives `{ours}: {shown(given[ours])}` and {key.owner}'s `{key.name}`, which "
                              f"means `{ours}: {shown(value_of_ours)}`; keep one.")
    if produced:
        translation.read_into[key.name] = produced
    elif value not in NOTHING:
        translation.notes.append(note_for(key, value))
    return produced


def _answer(name: str, value: Any, where: str, translation: Translation, method: type[Method] | None,
            key: TrlKey | None = None) -> str | None:
    """The key `name` goes to (itself when it is not TRL's), or None when it is accepted without effect."""
    if key is None and method is not None and method.arguments is not None and name in {
            field.name for field in dataclasses.fields(method.arguments)}:
        return name  # the recipe's method declares it as its own (GRPO's `max_completion_length`)
    key = key or method_trl_key(name, method)
    if key is None:
        wanting = _other_method_wanting(name, method)
        if wanting is None:
            return name
        other, key = wanting
        if value is None or key.ignored or _normalised(value) in [_normalised(kept) for kept in key.kept]:
            translation.notes.append(note_for(key, value))
            return None
        ours = f", where it is our `{key.ours}`" if key.ours else ""
        raise RecipeError(f"TRL's `{name}: {shown(value)}` in {where} is {key.origin}'s: it needs `method: "
                          f"{other.name}`{ours}.")
    ours = key.ours
    if ours is not None:
        if value is None:  # YAML's null: unset, as TRL and the other tools read it
            translation.notes.append(f"`{name}: null` (unset: finetune's `{ours}` keeps its default)")
            return None
        translation.renamed[ours] = key
        return ours
    if key.ignored or _normalised(value) in [_normalised(kept) for kept in key.kept]:
        translation.notes.append(note_for(key, value))
        return None
    raise RecipeError(f"{key.owner}'s `{name}: {shown(value)}` in {where} is not supported: {key.why}.")


def _converted(key: TrlKey | None, value: Any, where: str) -> Any:
    if key is None or key.convert is None:
        return value
    try:
        return key.convert(value)
    except (TypeError, ValueError) as error:
        raise RecipeError(f"`{key.name}: {shown(value)}` in {where}: {error}.") from None


def _refuse_both(translation: Translation, given: set[str], where: str) -> None:
    for ours, theirs in translation.renamed.items():
        if ours in given:
            owner = theirs.given_as.removeprefix(GIVEN_AS)  # "TRL's max_length"
            raise RecipeError(f"{where} gives both `{ours}` and `{theirs.name}` ({owner}, our `{ours}`); keep one.")


def _options(tokens: list[str]):
    """`(option, [values])` groups of `--key value ...` tokens; tokens before any option come as `(None, [...])`."""
    option, values = None, []
    for token in tokens:
        if token.startswith("--"):
            if option is not None or values:
                yield option, values
            option, values = token, []
        else:
            values.append(token)
    if option is not None or values:
        yield option, values


def _normalised(value: Any) -> Any:
    """A command-line string as YAML would read it (true/false/null, case-insensitive), for comparing values."""
    if isinstance(value, str):
        text = value.strip().lower()
        return {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False, "null": None,
                "none": None, "~": None}.get(text, text)
    return value


def shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)
