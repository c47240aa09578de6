"""GRPO's rewards, as a recipe names them (`reward_funcs`), each resolved when the recipe is read so that a name that
cannot be used stops the run before any launch:

- a built-in verifiable reward (`BUILT_IN`): `exact_match` (1 when the completion is the row's `answer`) and
  `format` (1 when it has the answer's shape: one line, as many characters, of the same kinds);
- a Python function by import path (`package.module:function`, or TRL's dotted `package.module.function`; TRL's own
  `accuracy_reward`, `think_format_reward`, ... by name), called as TRL calls one (`prompts`, `completions`,
  `completion_ids` and every other column of the rows as keywords), whose answer is checked: one number (or None)
  per completion (`CheckedReward`);
- a trained reward model: a directory holding a one-score `...ForSequenceClassification` (what `method: reward`
  saves), which scores prompt and completion as TRL renders them.
"""

from __future__ import annotations

import importlib
import json
import numbers
import sys
from pathlib import Path
from typing import Any, Callable

from finetune.errors import RecipeError

EXACT_MATCH, FORMAT = "exact_match", "format"


def completion_text(completion) -> str:
    """A completion as text: TRL gives plain text for text prompts, a list with one assistant message for chat
    prompts."""
    if isinstance(completion, list):
        return "".join(str(message.get("content") or "") for message in completion)
    return str(completion)


def exact_match(completions, answer, **_) -> list[float | None]:
    """1.0 where the completion, stripped, is the row's answer; None (not scored) for a row without one."""
    return [None if expected is None else float(completion_text(completion).strip() == expected.strip())
            for completion, expected in zip(completions, answer)]


def _kind(character: str) -> str:
    return "digit" if character.isdigit() else "letter" if character.isalpha() else "space" \
        if character.isspace() else "other"


def answer_format(completions, answer, **_) -> list[float | None]:
    """1.0 where the completion has the answer's shape: one line, as many characters, of the same kinds (digits,
    letters, others) in the same places; None for a row without an answer."""
    scores = []
    for completion, expected in zip(completions, answer):
        if expected is None:
            scores.append(None)
            continue
        text, expected = completion_text(completion).strip(), expected.strip()
        scores.append(float("\n" not in text and len(text) == len(expected)
                            and [_kind(c) for c in text] == [_kind(c) for c in expected]))
    return scores


exact_match.__name__, answer_format.__name__ = EXACT_MATCH, FORMAT
BUILT_IN: dict[str, Callable] = {EXACT_MATCH: exact_match, FORMAT: answer_format}
NEEDS_ANSWER = set(BUILT_IN)  # built-ins that read the rows' `answer`
# TRL's own reward functions, by the names its GRPO script takes (trl.rewards; `accuracy_reward` reads a `solution`
# column and needs the math-verify package)
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")


class CheckedReward:
    """A user's reward function whose answer is checked at every call: one real number (or None, not scored) per
    completion; anything else stops the run naming the function, not deep in TRL."""

    def __init__(self, name: str, function: Callable):
        self.name, self.function, self.__name__ = name, function, name.replace(":", ".").rsplit(".", 1)[-1]

    def __call__(self, prompts, completions, **kwargs) -> list[float | None]:
        try:
            scores = self.function(prompts=prompts, completions=completions, **kwargs)
        except TypeError as error:
            raise RecipeError(f"reward function `{self.name}` cannot be called as TRL calls one (prompts=, "
                              f"completions=, completion_ids= and the rows' columns as keywords; accept **kwargs): "
                              f"{error}") from None
        if isinstance(scores, (str, bytes)) or not hasattr(scores, "__len__"):
            raise RecipeError(f"reward function `{self.name}` returned {type(scores).__name__}, not a list of "
                              f"{len(completions)} numbers (one per completion).")
        scores = list(scores.tolist() if hasattr(scores, "tolist") else scores)
        if len(scores) != len(completions):
            raise RecipeError(f"reward function `{self.name}` returned {len(scores)} scores for {len(completions)} "
                              "completions: return one per completion (None where it does not apply).")
        wrong = next((score for score in scores
                      if score is not None and (isinstance(score, bool) or not isinstance(score, numbers.Real))),
                     None)
        if wrong is not None:
            raise RecipeError(f"reward function `{self.name}` returned {wrong!r} ({type(wrong).__name__}) among its "
                              "scores: each must be a real number, or None where it does not apply.")
        return [None if score is None else float(score) for score in scores]


def is_reward_model(name: str) -> bool:
    return (Path(name) / "config.json").is_file()


def check_reward_model(path: str) -> None:
    config = json.loads((Path(path) / "config.json").read_text())
    architectures = config.get("architectures") or ["?"]
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if not architectures[0].endswith("ForSequenceClassification") or labels != 1:
        raise RecipeError(f"`reward_funcs: {path}` is a {architectures[0]} with {labels} output(s); a reward model is "
                          "a one-score ...ForSequenceClassification (what `method: reward` trains).")
    if not any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise RecipeError(f"`reward_funcs: {path}` has no tokenizer, which scores the completions as the reward model "
                          "was trained to read them: save it beside the model (`method: reward` does).")


def import_reward(name: str) -> Callable:
    """A function named by import path, `package.module:function` or `package.module.function`; the working
    directory is searched first, as TRL's scripts do."""
    module_name, _, attribute = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name and name in TRL_REWARDS:
        module_name, attribute = "trl.rewards", name
    if not module_name or not attribute:
        raise RecipeError(f"`reward_funcs: {name}` is not one of {', '.join(BUILT_IN)}, a reward model's directory, or "
                          "an import path (`package.module:function`).")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - a user's module can fail to import in any way; say how, in one line
        raise RecipeError(f"reward function `{name}`: module `{module_name}` cannot be imported "
                          f"({type(error).__name__}: {error}).") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RecipeError(f"reward function `{name}`: module `{module_name}` has no function `{attribute}`"
                          f"{'' if function is None else f' (it is a {type(function).__name__})'}.")
    return function


def check_reward_names(names: list[str]) -> None:
    """Every name resolves: a built-in, a reward model's directory, or an importable function (imported now)."""
    if not names:
        raise RecipeError(f"`method: grpo` needs at least one reward in `reward_funcs` ({', '.join(BUILT_IN)}, a "
                          "reward model's directory, or `package.module:function`).")
    for name in names:
        if name in BUILT_IN:
            continue
        if is_reward_model(name):
            check_reward_model(name)
        else:
            import_reward(name)


def resolve_rewards(names: list[str]) -> list[Any]:
    """The reward functions TRL's GRPOTrainer takes: built-ins, checked user functions, and reward model paths
    (loaded by `load_reward_models`)."""
    return [BUILT_IN[name] if name in BUILT_IN else name if is_reward_model(name)
            else CheckedReward(name, import_reward(name)) for name in names]
