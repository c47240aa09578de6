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

A function's module is code, like a script: reading a recipe (`finetune plan --recipe`, `finetune train --dry-run`)
only locates it and reads its source (`check_reward_function`), running none of it, not even its packages'
`__init__.py`; the run imports it when it builds the trainer, and says so in one line (`code_notice`). Each call is
bounded by `reward_timeout` and its scores checked: real, finite numbers, or None (not scored).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import math
import numbers
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from finetune.errors import RecipeError, did_you_mean

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


TIMEOUT_KEY = "reward_timeout"


class _TimedOut(BaseException):
    """Raised into a reward function past its time; a BaseException, so that the function's own `except Exception`
    does not swallow it."""


class CheckedReward:
    """A user's reward function, called as TRL calls one and held to what TRL needs: each call bounded by
    `reward_timeout` seconds, and its answer one real, finite number (or None, not scored) per completion. A call it
    cannot take, an exception it raises, a hang or a bad score stops the run in one line naming the function."""

    def __init__(self, name: str, function: Callable, timeout: float | None = None):
        self.name, self.function, self.timeout = name, function, timeout
        self.__name__ = name.replace(":", ".").rsplit(".", 1)[-1]

    def __call__(self, prompts, completions, **kwargs) -> list[float | None]:
        self._check_signature(prompts=prompts, completions=completions, **kwargs)
        return self._checked(self._call_in_time(prompts=prompts, completions=completions, **kwargs), completions)

    def _checked(self, scores, completions) -> list[float | None]:
        """The scores as TRL takes them, or the run stopped naming what is wrong with them."""
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
        # TRL reads NaN as "not scored" (its stand-in for None) and an infinity turns every advantage of the group
        # into NaN or 0: either trains on no signal without a word
        infinite = next((score for score in scores if score is not None and not math.isfinite(score)), None)
        if infinite is not None:
            raise RecipeError(f"reward function `{self.name}` returned {float(infinite)} among its scores: each must "
                              "be a finite number (return None for a completion it does not score).")
        return [None if score is None else float(score) for score in scores]

    def _check_signature(self, **arguments) -> None:
        try:
            inspect.signature(self.function).bind(**arguments)
        except TypeError as error:
            raise RecipeError(f"reward function `{self.name}` cannot be called as TRL calls one (prompts=, "
                              f"completions=, completion_ids= and the rows' columns as keywords; accept **kwargs): "
                              f"{error}") from None
        except ValueError:  # no signature to read (a builtin): the call itself tells
            pass

    def _timed_out(self) -> RecipeError:
        return RecipeError(f"reward function `{self.name}` did not return within {self.timeout:g} s "
                           f"(`{TIMEOUT_KEY}: {self.timeout:g}`): make it faster, or raise `{TIMEOUT_KEY}` for a slow "
                           "scorer.")

    def _raised(self, error: Exception) -> RecipeError:
        return RecipeError(f"reward function `{self.name}` raised {type(error).__name__}: {error}{_where(error)}.")

    def _call_in_time(self, **arguments):
        """The function's answer, the call interrupted past `timeout` seconds (by SIGALRM, in the thread TRL calls
        it from, so that it runs as TRL would run it: its CUDA device, grad mode and thread-locals); off the main
        thread, where no signal can reach, it runs unbounded."""
        bounded = (self.timeout is not None and hasattr(signal, "setitimer")
                   and threading.current_thread() is threading.main_thread())
        if bounded:
            def interrupt(*_):
                raise _TimedOut

            previous = signal.signal(signal.SIGALRM, interrupt)
            signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            return self.function(**arguments)
        except _TimedOut:
            raise self._timed_out() from None
        except Exception as error:  # noqa: BLE001 - the user's code can fail in any way: named in one line
            raise self._raised(error) from error
        finally:
            if bounded:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)


class CheckedAsyncReward(CheckedReward):
    """An `async def` reward function, awaited as TRL awaits one (on its event loop, beside the other async rewards),
    bounded by `reward_timeout` through `asyncio.wait_for`, its scores checked as a function's are."""

    async def __call__(self, prompts, completions, **kwargs) -> list[float | None]:
        self._check_signature(prompts=prompts, completions=completions, **kwargs)
        try:
            scores = await asyncio.wait_for(self.function(prompts=prompts, completions=completions, **kwargs),
                                            self.timeout)
        except asyncio.TimeoutError:
            raise self._timed_out() from None
        except Exception as error:  # noqa: BLE001 - the user's code can fail in any way: named in one line
            raise self._raised(error) from error
        return self._checked(scores, completions)


def _where(error: BaseException) -> str:
    """` (file, line N)`: the innermost frame of the traceback, where the user's code failed."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def is_reward_model(name: str) -> bool:
    return (Path(name) / "config.json").is_file()


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")  # what from_pretrained loads


def check_reward_model(path: str) -> None:
    """A reward model's folder read as untrusted input before anything loads it (finetune.checkpoints.untrusted_files:
    JSON that parses, whole safetensors, no pickle that could run code), then its config and files: a one-score
    `...ForSequenceClassification` with weights and a tokenizer."""
    from finetune.checkpoints.untrusted_files import check_checkpoint_files

    folder = Path(path)
    try:
        check_checkpoint_files(folder, skip_checkpoints=True)
    except RecipeError as error:
        raise type(error)(f"`reward_funcs: {path}`: {error}") from None
    config = json.loads((folder / "config.json").read_text())
    architectures = (config.get("architectures") or ["?"]) if isinstance(config, dict) else ["?"]
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2) if isinstance(config, dict) else 0
    if not str(architectures[0]).endswith("ForSequenceClassification") or labels != 1:
        raise RecipeError(f"`reward_funcs: {path}` is a {architectures[0]} with {labels} output(s); a reward model is "
                          "a one-score ...ForSequenceClassification (what `method: reward` trains).")
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise RecipeError(f"`reward_funcs: {path}` has a config but no weights ({' or '.join(WEIGHT_PATTERNS)}): "
                          "name the folder `method: reward` saved, or the checkpoint inside it.")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise RecipeError(f"`reward_funcs: {path}` has no tokenizer, which scores the completions as the reward model "
                          "was trained to read them: save it beside the model (`method: reward` does).")


def _saved_inside(folder: str) -> str:
    """`; checkpoint-N holds one` for a reward run stopped before its final save: the newest checkpoint to name."""
    from finetune.checkpoints.complete import checkpoints_newest_first

    saved = [path for path in checkpoints_newest_first(folder) if is_reward_model(str(path))]
    return f"; {saved[0]} holds one" if saved else ""


def split_reward_name(name: str) -> tuple[str, str]:
    """(module, function) of an import path, `package.module:function` or `package.module.function`; TRL's own
    rewards by name."""
    module_name, _, attribute = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name and name in TRL_REWARDS:
        module_name, attribute = "trl.rewards", name
    if not module_name or not attribute:
        raise RecipeError(f"`reward_funcs: {name}` is not one of {', '.join(BUILT_IN)}, a reward model's directory, or "
                          "an import path (`package.module:function`).")
    return module_name, attribute


def _search_the_working_directory() -> None:
    """The working directory is searched first, as TRL's scripts do."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def find_module(module_name: str):
    """The module's spec, found as `import` finds it but running no code. `importlib.util.find_spec` imports the
    parent packages of a dotted name (running their `__init__.py`), so each package on the way is asked of the
    import system's finders with its parent's search locations instead; one already imported is taken as it is.
    None when it is not found."""
    spec, locations = None, None
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__spec__", None) is not None:
            spec, locations = module.__spec__, getattr(module, "__path__", None)
            continue
        if depth > 1 and locations is None:  # the parent is a module, not a package
            return None
        spec = _ask_the_finders(name, locations)
        if spec is None:
            return None
        locations = spec.submodule_search_locations
    return spec


def _ask_the_finders(name: str, locations):
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = None if find_spec is None else find_spec(name, locations)
        if spec is not None:
            return spec
    return None


def top_level_names(tree: ast.Module) -> dict[str, ast.stmt] | None:
    """The names a module's code binds at its top level (in its `if`, `try`, `with` and `for` blocks too), each to
    the statement binding it; None when that cannot be told from the source (a star import, a module `__getattr__`)."""
    names: dict[str, ast.stmt] = {}

    def bind(target: ast.AST, statement: ast.stmt) -> None:
        for node in ast.walk(target):  # a, (a, b), [a, *b]
            if isinstance(node, ast.Name):
                names[node.id] = statement

    def visit(statements) -> bool:
        for statement in statements:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[statement.name] = statement
                continue
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                if any(alias.name == "*" for alias in statement.names):
                    return False
                names.update({alias.asname or alias.name.split(".")[0]: statement for alias in statement.names})
            for target in (getattr(statement, "targets", None) or [getattr(statement, "target", None)]):
                if target is not None:
                    bind(target, statement)
            for item in getattr(statement, "items", []):  # with ... as name
                if getattr(item, "optional_vars", None) is not None:
                    bind(item.optional_vars, statement)
            blocks = [getattr(statement, field, []) for field in ("body", "orelse", "finalbody")]
            blocks += [part.body for part in [*getattr(statement, "handlers", []), *getattr(statement, "cases", [])]]
            if not all(visit(block) for block in blocks):
                return False
        return True

    return names if visit(tree.body) and "__getattr__" not in names else None


def check_reward_function(name: str) -> None:
    """A function named by import path is where the name says, found without importing it (`find_module`) and read
    from its source (`top_level_names`): reading a recipe runs none of the user's code. A module already imported,
    or one with no Python source to read (compiled), is told by the run's import."""
    module_name, attribute = split_reward_name(name)
    _search_the_working_directory()
    spec = find_module(module_name)
    if spec is None:
        raise RecipeError(f"reward function `{name}`: module `{module_name}` cannot be found (searched from the "
                          "working directory and the installed packages): check the name, or run from the folder "
                          "that holds it.")
    module = sys.modules.get(module_name)
    if module is not None:
        _check_attribute(name, module_name, attribute, getattr(module, attribute, None))
        return
    if not str(spec.origin or "").endswith(".py"):
        return
    try:
        tree = ast.parse(Path(spec.origin).read_bytes(), filename=spec.origin)
    except SyntaxError as error:
        raise RecipeError(f"reward function `{name}`: {spec.origin}, line {error.lineno}: {error.msg} (it does not "
                          "parse as Python).") from None
    names = top_level_names(tree)
    if names is None:
        return
    bound = names.get(attribute)
    if bound is None:
        raise RecipeError(f"reward function `{name}`: module `{module_name}` ({spec.origin}) has no function "
                          f"`{attribute}`{did_you_mean(attribute, [n for n in names if not n.startswith('_')])}.")
    if isinstance(bound, (ast.Assign, ast.AnnAssign)) and isinstance(bound.value, ast.Constant):
        _check_attribute(name, module_name, attribute, bound.value.value)


def _check_attribute(name: str, module_name: str, attribute: str, function) -> None:
    if not callable(function):
        raise RecipeError(f"reward function `{name}`: module `{module_name}` has no function `{attribute}`"
                          f"{'' if function is None else f' (it is a {type(function).__name__})'}.")


def import_reward(name: str) -> Callable:
    """A function named by import path, imported now (the run, as it builds the trainer: its module's code runs)."""
    module_name, attribute = split_reward_name(name)
    _search_the_working_directory()
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - a user's module can fail to import in any way; say how, in one line
        raise RecipeError(f"reward function `{name}`: module `{module_name}` cannot be imported "
                          f"({type(error).__name__}: {error}{_where(error)}).") from None
    function = getattr(module, attribute, None)
    _check_attribute(name, module_name, attribute, function)
    return function


def check_reward_names(names: list[str]) -> None:
    """Every name resolves, nothing imported: a built-in, a reward model's directory (its files read as untrusted),
    or a function its module's source defines."""
    if not names:
        raise RecipeError(f"`method: grpo` needs at least one reward in `reward_funcs` ({', '.join(BUILT_IN)}, a "
                          "reward model's directory, or `package.module:function`).")
    for name in names:
        if name in BUILT_IN:
            continue
        if is_reward_model(name):
            check_reward_model(name)
        elif Path(name).is_dir():
            raise RecipeError(f"`reward_funcs: {name}` is a folder without a model (no config.json)"
                              f"{_saved_inside(name)}: name the folder `method: reward` saved, or a checkpoint "
                              "inside it.")
        else:
            check_reward_function(name)


def runs_code(name: str) -> bool:
    """A reward named by import path outside TRL's own: a module of the user's, whose code the run imports."""
    return name not in BUILT_IN and not is_reward_model(name) and not split_reward_name(name)[0].startswith("trl.")


def code_notice(names: list[str]) -> str | None:
    """The one line a run prints before it imports the user's reward functions: their modules are code, like a
    script, and run with the user's permissions on every rank."""
    running = [name for name in names if runs_code(name)]
    if not running:
        return None
    return (f"note: reward_funcs: {', '.join(f'`{name}`' for name in running)} import{'s' if len(running) == 1 else ''}"
            " Python of your own: its module runs as code, like a script, on every rank; use only modules you trust.")


def resolve_rewards(names: list[str], timeout: float | None = None) -> list[Any]:
    """The reward functions TRL's GRPOTrainer takes: built-ins, checked user functions (each call bounded by
    `timeout` seconds), and reward model paths (TRL loads them)."""
    return [BUILT_IN[name] if name in BUILT_IN else name if is_reward_model(name) else checked_reward(name, timeout)
            for name in names]


def checked_reward(name: str, timeout: float | None = None) -> CheckedReward:
    """The function named by import path, imported and wrapped as TRL will call it: awaited if it is `async def`."""
    function = import_reward(name)
    checked = CheckedAsyncReward if inspect.iscoroutinefunction(function) else CheckedReward
    return checked(name, function, timeout)
