"""Canary for upgrades: every Trainer, TRL and TrainingArguments method the toolkit overrides (private ones above all,
which their libraries may rename or drop in any release) still exists on the library class with the parameters the
override was written for. A removed or changed one fails here by name, not as a silent loss of a guarantee."""

import inspect
from functools import cached_property

import pytest
from transformers import Trainer, TrainingArguments
from trl import DPOTrainer, KTOTrainer

from finetune.recipe.args import FinetuneTrainingArguments
from finetune.train.methods.cpo.trainer import CPOTrainer
from finetune.train.methods.dpo.trainer import FinetuneDPOTrainer
from finetune.train.methods.kto.trainer import FinetuneKTOTrainer
from finetune.train.methods.orpo.trainer import ORPOTrainer
from finetune.train.methods.reference_free_trainer import ReferenceFreePairTrainer
from finetune.train.trainer import FinetuneTrainer, FinetuneTrainerMixin

# Each toolkit class, the library class it extends, and the library methods it overrides. The private ones carry the
# guarantees: complete checkpoints (_save_checkpoint), resume (_load_optimizer_and_scheduler), the data policies on
# TRL's tokenized pairs (_prepare_dataset), no telemetry (_send_telemetry), ddp_timeout on gloo (_setup_devices), the
# token count summed when read rather than at every micro-step (_track_num_input_tokens, log), packed rows' lengths
# kept for the collator (_set_signature_columns_if_needed), a tensor-parallel model's slices saved and resumed
# (_save_optimizer_and_scheduler, _load_from_checkpoint).
OVERRIDES = [
    (FinetuneTrainerMixin, Trainer, ("create_accelerator_and_postprocess", "_save_checkpoint", "save_model", "_save",
                                     "_load_optimizer_and_scheduler", "train", "_track_num_input_tokens", "log",
                                     "_save_optimizer_and_scheduler", "_load_from_checkpoint")),
    (FinetuneTrainer, Trainer, ("compute_loss", "_set_signature_columns_if_needed")),
    (FinetuneTrainerMixin, DPOTrainer, ("create_accelerator_and_postprocess", "_save_checkpoint", "save_model",
                                        "_save", "_load_optimizer_and_scheduler", "train", "_track_num_input_tokens",
                                        "log", "_save_optimizer_and_scheduler", "_load_from_checkpoint")),
    (FinetuneDPOTrainer, DPOTrainer, ("_prepare_dataset", "_send_telemetry", "create_model_card")),
    (FinetuneKTOTrainer, KTOTrainer, ("_prepare_dataset", "_send_telemetry", "create_model_card")),
    # TRL's experimental CPO and ORPO trainers: their pairs tokenized whole (tokenize_row) and cut by the length
    # policies, their tokens counted from the pairs' own columns, scored through TRL's fused LM head
    # (concatenated_forward)
    *[(ReferenceFreePairTrainer, trainer, ("tokenize_row", "_track_num_input_tokens", "_send_telemetry",
                                           "create_model_card", "concatenated_forward"))
      for trainer in (CPOTrainer, ORPOTrainer)],
    (FinetuneTrainingArguments, TrainingArguments, ("_setup_devices",)),
]


def _function(value):
    """The function behind a method, a property or a cached property."""
    if isinstance(value, (property, cached_property)):
        return getattr(value, "fget", None) or getattr(value, "func", None)
    return value


def _parameters(function) -> list[str]:
    return [name for name, parameter in inspect.signature(function).parameters.items()
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]


def _takes_anything(function) -> bool:
    kinds = {parameter.kind for parameter in inspect.signature(function).parameters.values()}
    return {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds


def override_problems(ours: type, library: type, names) -> list[str]:
    """What no longer holds for each override: the library method is gone, or our override no longer takes (or no
    longer names) a parameter the library's version has."""
    problems = []
    for name in names:
        theirs = inspect.getattr_static(library, name, None)
        if theirs is None:
            problems.append(f"{library.__module__}.{library.__name__}.{name} is gone; {ours.__name__} overrides it: "
                            "find what replaced it in the library's release notes and move the override there")
            continue
        mine = _function(ours.__dict__[name])
        theirs = _function(theirs)
        if _takes_anything(mine):
            continue
        missing = [parameter for parameter in _parameters(theirs) if parameter not in _parameters(mine)]
        if missing:
            problems.append(f"{library.__name__}.{name}{inspect.signature(theirs)} changed: {ours.__name__}.{name}"
                            f"{inspect.signature(mine)} lacks {', '.join(missing)}")
    return problems


@pytest.mark.parametrize(("ours", "library", "names"), OVERRIDES,
                         ids=[f"{ours.__name__}-{library.__name__}" for ours, library, _ in OVERRIDES])
def test_every_overridden_library_method_exists_with_the_parameters_the_override_takes(ours, library, names):
    assert override_problems(ours, library, names) == []


def test_the_list_names_every_library_method_the_toolkit_classes_override():
    """A new override is added to OVERRIDES, so that the canary watches it too."""
    listed = {(ours, name) for ours, _, names in OVERRIDES for name in names}
    for ours, library, _ in OVERRIDES:
        for name, value in vars(ours).items():
            if callable(_function(value)) and not name.startswith("__") and hasattr(library, name):
                assert (ours, name) in listed, f"{ours.__name__}.{name} overrides {library.__name__}.{name}: list it"


def test_a_library_method_patched_away_fails_the_canary_by_name(monkeypatch):
    monkeypatch.delattr(Trainer, "_save_checkpoint")
    problems = override_problems(FinetuneTrainerMixin, Trainer, ("_save_checkpoint", "save_model"))
    assert problems == ["transformers.trainer.Trainer._save_checkpoint is gone; FinetuneTrainerMixin overrides it: "
                        "find what replaced it in the library's release notes and move the override there"]


def test_a_changed_signature_fails_the_canary_naming_the_parameter(monkeypatch):
    def _load_optimizer_and_scheduler(self, checkpoint, map_location):
        """A release that added a parameter the override does not take."""

    monkeypatch.setattr(Trainer, "_load_optimizer_and_scheduler", _load_optimizer_and_scheduler)
    problems = override_problems(FinetuneTrainerMixin, Trainer, ("_load_optimizer_and_scheduler",))
    assert len(problems) == 1 and "lacks map_location" in problems[0]
