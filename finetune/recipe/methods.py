"""The training methods a recipe's `method` names, and the questions each one answers (`Method`).

A method is one home under finetune/train/methods/: its own recipe keys, its data, its trainer and config (TRL's where
TRL has one), what the memory estimate adds (`MethodTerms`) and what its run summary shows. `finetune.train.run.train`
tells one story for all of them. The registry names where each lives and is read when a method is named: a method's
module holds its keys and config only and imports its trainer when the run builds it, so reading a recipe loads no
trainer. Adding a method is its file plus one line in `METHODS`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, ClassVar

from finetune.errors import RecipeError, did_you_mean
from finetune.memory.estimate import MethodTerms

if TYPE_CHECKING:  # the run's types, named in signatures only
    from finetune.recipe.aliases import TrlKey

DEFAULT_METHOD = "sft"
# name → "module:class"; the module is imported when the method is named
METHODS = {
    "sft": "finetune.train.methods.sft:SupervisedFineTuning",
    "dpo": "finetune.train.methods.dpo:DirectPreferenceOptimization",
    "reward": "finetune.train.methods.reward:RewardModelling",
    "kto": "finetune.train.methods.kto:KahnemanTverskyOptimization",
    "cpo": "finetune.train.methods.cpo:ContrastivePreferenceOptimization",
    "orpo": "finetune.train.methods.orpo:OddsRatioPreferenceOptimization",
    "grpo": "finetune.train.methods.grpo:GroupRelativePolicyOptimization",
}


class Method:
    """A training method: the class says what it is, an instance holds the recipe's settings for it (`settings`, an
    instance of `arguments`, or None for a method without keys of its own)."""

    name: ClassVar[str]
    description: ClassVar[str]
    """One sentence for the recipe reference and `--help`."""
    arguments: ClassVar[type | None] = None
    """The method's own recipe keys: a dataclass, documented field by field, checked in its `__post_init__`."""
    trl_keys: ClassVar[tuple[TrlKey, ...]] = ()
    """TRL keys that mean something of this method's (its TRL config's): they win over the general answers in
    finetune.recipe.aliases while this method is the recipe's, and are refused, naming it, under another."""
    memory: ClassVar[MethodTerms] = MethodTerms()
    """What it adds to the memory estimate and ledger (a reference model, sequences per example)."""
    full_logits_on_request: ClassVar[bool] = False
    """Whether `fused_lm_head: false` gives this method's loss from the full logits (its trainer has both paths)."""
    preprocess_refusal: ClassVar[str | None] = None
    """Why `finetune preprocess` cannot cache this method's data, or None when it can."""

    def __init__(self, settings: Any = None):
        self.settings = settings

    def terms(self) -> MethodTerms:
        """What this recipe's settings of the method add to the memory estimate and ledger (the class's `memory`
        unless they change it)."""
        return self.memory

    # --- reading the recipe (no trainer is imported here)
    def training_arguments(self, data_args) -> tuple[type, dict[str, Any]]:
        """The `TrainingArguments` class the trainer reads and the keys this method adds to it."""
        from finetune.recipe.args import FinetuneTrainingArguments

        return FinetuneTrainingArguments, {}

    def check_data_keys(self, data_args) -> None:
        """Refuses data keys that mean nothing for this method, before any launch."""

    def check_training_keys(self, training_inputs: dict[str, Any], sources: dict[str, str]) -> None:
        """Refuses training keys this method cannot train with, the micro-batch as planned for the launch
        (`per_device_train_batch_size`), before any process group starts; `sources` names the keys the user gave."""

    def plan_data(self, sections) -> tuple[tuple[int, ...] | None, dict]:
        """The example lengths `finetune plan --recipe` plans with (None: planned at `max_seq_length`) and the data
        summary it shows."""
        raise NotImplementedError

    # --- the run (finetune.train.run.train calls these in order)
    def prepare_model(self, recipe, model):
        """The model the trainer is given: adapters applied and trainable weights held as the method needs."""
        raise NotImplementedError

    def prepare_data(self, recipe, tokenizer, model):
        """Its data, with a summary holding `train_fingerprint` (what resumes compare)."""
        raise NotImplementedError

    def callbacks(self, recipe, tokenizer, data) -> list:
        """Callbacks of its own (e.g. SFT's generation exact match)."""
        return []

    def build_trainer(self, recipe, model, tokenizer, data, callbacks):
        """The trainer, with the toolkit's checkpoint guarantees (finetune.train.trainer.FinetuneTrainerMixin); the
        data summary is complete once it is built."""
        raise NotImplementedError

    def print_data_summary(self, summary: dict) -> None:
        """What rank 0 says of the data once the trainer is built."""
        raise NotImplementedError


def method_class(name: str) -> type[Method]:
    """The method registered as `name`, imported now."""
    if name not in METHODS:
        raise RecipeError(f"`method: {name}` is not one of {', '.join(METHODS)}{did_you_mean(str(name), METHODS)}.")
    module, _, attribute = METHODS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def all_methods() -> list[type[Method]]:
    return [method_class(name) for name in METHODS]


def requested_method(values: dict[str, Any], tokens: list[str]) -> type[Method]:
    """The recipe's method, read once, before anything else (TRL's keys mean what that method's config says): the last
    `--method` of the command line, else the file's, else sft."""
    name = values.get("method", DEFAULT_METHOD)
    for position, token in enumerate(tokens):
        if token.split("=", 1)[0].replace("-", "_") == "__method":
            inline = token.split("=", 1)[1:]
            following = tokens[position + 1:position + 2]
            name = (inline or [value for value in following if not value.startswith("--")] or [name])[0]
    return method_class(str(name))


def methods_with_key(key: str) -> list[str]:
    """The methods whose own keys include `key` (`beta` is DPO's, KTO's, CPO's, ORPO's and GRPO's), in registry
    order."""
    return [method.name for method in all_methods() if method.arguments is not None
            and key in {field.name for field in dataclasses.fields(method.arguments)}]


def key_of_other_methods(key: str, method: type[Method]) -> RecipeError:
    """The refusal of a key that would do nothing under the recipe's method, naming every method that uses it."""
    users = methods_with_key(key)
    if len(users) == 1:
        return RecipeError(f"`{key}` configures `method: {users[0]}` but `method` is {method.name}: set "
                           f"`method: {users[0]}` (or drop `{key}`).")
    return RecipeError(f"`{key}` configures methods {', '.join(users[:-1])} and {users[-1]}, not `method: "
                       f"{method.name}`, which has no use for it: drop `{key}`, or set `method` to one of those.")
