"""Benchmarks through lm-evaluation-harness (`finetune eval`, and `eval_harness_tasks:` at the end of training): any
run folder, checkpoint-N or LoRA run, loaded as `finetune chat` loads it, scored by lm-eval's `HFLM` on its tasks.

Three kinds of task, each an lm-eval task in the end:
- `synthetic` (or `synthetic_add`, `synthetic_reverse`, `synthetic_sort`): the embedded tasks' eval split;
- a user's JSONL file (any format training reads: messages, sharegpt, alpaca, prompt/completion): a task named after
  the file, its answer the last assistant turn (the completion);
- any task lm-eval knows (its own, or a user's YAML under `--include-path`): run as lm-eval runs it, with the chat
  template when the run learned one (`apply_chat_template`), and needing the dataset it names (offline: a local copy).

The first two are written as lm-eval task definitions (YAML + JSONL, kept with the results), each prompt rendered as
training rendered it (`finetune.train.trained_model.render_prompt`: the chat template with the generation prompt, system
and earlier turns included, or plain text for a run that learned plain text), generated greedily up to the tokens that
end an answer in training (`finetune.train.evaluation.stop_token_ids`), and scored by lm-eval's `exact_match` with
surrounding whitespace ignored: what the toolkit's own exact match (`finetune.train.evaluation.exact_match`) scores.

What an evaluation writes: one new results file and, beside it, a folder of the same name that it creates (or finds
empty) for the task definitions and answers; never over a file, into a folder holding others' files, or into the run
outside its eval_harness/. A failed evaluation removes what it wrote and nothing else. lm-eval's own task files are
code: their Jinja fields are rendered in Jinja's sandbox here, their `!function`s import Python (`lm_eval_guarded`).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from finetune.errors import RecipeError, did_you_mean

RESULTS_FOLDER = "eval_harness"  # beside the model: one results file an evaluation, never overwritten
SYNTHETIC = "synthetic"
SYNTHETIC_TASKS = ("add", "reverse", "sort")
DEFAULT_MAX_NEW_TOKENS = 256
# lm-eval's exact_match after these are removed from both sides: `answer.strip() == reference.strip()`
STRIP_WHITESPACE = [r"^\s+", r"\s+$"]


@dataclass
class LocalTask:
    """An exact-match task from rows of data: its name, where it came from, and its examples as chat prompts."""

    name: str
    source: str
    examples: list[dict] = field(default_factory=list)  # {"messages": [...prompt turns], "reference": str}
    shows_images: bool = False  # its examples carry `images` too (a vision-language model's task)


@dataclass
class TaskSelection:
    local: list[LocalTask]
    registered: list[str]  # lm-eval's names (its own tasks, or a user's YAML under include_path)
    task_manager: object = None  # lm-eval's index that knows them (a TaskManager), when there are any


def check_installed() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RecipeError("finetune eval runs on lm-evaluation-harness, which is not installed: "
                          "pip install 'finetune-kit[eval]' (or lm-eval).") from None


def select_tasks(names: list[str], include_path: str | None = None) -> TaskSelection:
    """Each name as a task: `synthetic[_<task>]`, a JSONL file, else a name lm-eval knows (checked against its index,
    did-you-mean included), so a typo stops before any model is loaded."""
    if not names:
        raise RecipeError("no task given: name lm-eval tasks, `synthetic`, or a JSONL file of your own.")
    if include_path is not None and not Path(include_path).exists():
        raise RecipeError(f"--include-path {include_path} does not exist: give a folder (or file) of lm-eval task "
                          "YAML.")
    local, registered = [], []
    for name in names:
        if name == SYNTHETIC or name.startswith(f"{SYNTHETIC}_") and name.removeprefix(f"{SYNTHETIC}_") in \
                SYNTHETIC_TASKS:
            local += synthetic_tasks(name.removeprefix(SYNTHETIC).lstrip("_") or None)
        elif name.endswith((".jsonl", ".json")) or Path(name).is_file():
            local.append(jsonl_task(Path(name)))
        else:
            registered.append(name)
    taken = [task.name for task in local]
    clash = next((name for name in taken if taken.count(name) > 1 or name in registered), None)
    if clash is not None:
        raise RecipeError(f"two tasks are named {clash}: rename one of the files.")
    return TaskSelection(local, registered, task_manager(registered, include_path) if registered else None)


def synthetic_tasks(only: str | None) -> list[LocalTask]:
    from finetune.data.formats import to_messages
    from finetune.presets import synthetic_data_dir

    eval_file = synthetic_data_dir() / "eval.jsonl"
    rows = [json.loads(line) for line in eval_file.read_text().splitlines() if line.strip()]
    tasks = []
    for task in SYNTHETIC_TASKS if only is None else (only,):
        examples = [prompt_and_reference(to_messages(row, "alpaca"), f"{eval_file}:{number}")
                    for number, row in enumerate(rows, start=1) if row["task"] == task]
        tasks.append(LocalTask(f"{SYNTHETIC}_{task}", f"{eval_file} ({task})", examples))
    return tasks


def jsonl_task(path: Path) -> LocalTask:
    """A user's file as a task: each row's conversation cut before its last assistant turn (the reference), or its
    prompt and completion."""
    from finetune.data.formats import detect_format, to_messages
    from finetune.data.loading import first_bad_json_line, first_non_utf8_line

    if not path.is_file():
        raise RecipeError(f"task file {path} does not exist.")
    if bad := first_non_utf8_line(str(path)) or first_bad_json_line(str(path)):
        raise RecipeError(f"task file: {bad}; fix or remove that line.")
    text = path.read_text(encoding="utf-8")
    rows = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()
                                                             if line.strip()]
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        raise RecipeError(f"task file {path} holds no rows of data (one JSON object a line).")
    if has_images(rows[0]):  # a vision-language task: scored by the toolkit's own exact match (`score_with_images`)
        return image_task(path, rows)
    dataset_format = detect_format(rows[0].keys())
    examples = []
    for number, row in enumerate(rows, start=1):
        where = f"{path}:{number}"
        if dataset_format == "text":
            raise RecipeError(f"{where}: a `text` row has no answer to score; give prompt/completion or conversations.")
        try:
            if dataset_format == "prompt_completion":
                examples.append({"messages": [{"role": "user", "content": str(row["prompt"])}],
                                 "reference": str(row["completion"])})
            else:
                examples.append(prompt_and_reference(to_messages(row, dataset_format), where))
        except (KeyError, TypeError, AttributeError) as error:  # a row of another shape than the first
            raise RecipeError(f"{where}: not a {dataset_format} row like the first ({type(error).__name__}: "
                              f"{error}); give every row the same columns.") from None
    name = re.sub(r"\W+", "_", path.stem).strip("_") or "task"
    return LocalTask(name, str(path), examples)


def has_images(row: dict) -> bool:
    """Whether a task row shows images: an `images` (or LLaVA's `image`) column, or image parts in its messages."""
    if row.get("images") or row.get("image"):
        return True
    return any(isinstance(message, dict) and isinstance(message.get("content"), list)
               and any(isinstance(part, dict) and part.get("type") in ("image", "image_url")
                       for part in message["content"]) for message in row.get("messages") or [])


def image_task(path: Path, rows: list[dict]) -> LocalTask:
    """A task file whose rows show images (any format training reads for a vision-language model,
    finetune.data.vision.data; image paths relative to the file): each conversation cut before its last assistant turn,
    with the images its prompt shows."""
    from finetune.data.vision.data import vision_row
    from finetune.data.vision.encode import answer_text, image_parts

    examples = []
    for number, row in enumerate(rows, start=1):
        messages, images, _ = vision_row(row, f"{path}:{number}", path.parent)
        answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        if not answers or not answer_text(messages[answers[-1]]).strip():
            raise RecipeError(f"{path}:{number}: the conversation has no assistant answer in text to score against.")
        prompt = messages[: answers[-1]]
        examples.append({"messages": prompt, "images": images[: image_parts(prompt)],
                         "reference": answer_text(messages[answers[-1]])})
    name = re.sub(r"\W+", "_", path.stem).strip("_") or "task"
    return LocalTask(name, str(path), examples, shows_images=True)


def prompt_and_reference(messages: list[dict], where: str) -> dict:
    answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not answers or not isinstance(messages[answers[-1]].get("content"), str):
        raise RecipeError(f"{where}: the conversation has no assistant answer in text to score against.")
    return {"messages": messages[: answers[-1]], "reference": messages[answers[-1]]["content"]}


def task_manager(names: list[str], include_path: str | None):
    """lm-eval's index of tasks that knows every name: the user's folder alone when it holds them all (indexing
    lm-eval's own thousands of tasks takes seconds), else with lm-eval's own; an unknown name is refused."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if set(names) <= set(manager.all_tasks):
            return manager
    manager = TaskManager(include_path=include_path)
    for name in names:
        if name not in manager.all_tasks:
            raise RecipeError(f"lm-eval knows no task `{name}`{did_you_mean(name, manager.all_tasks)}: name one of "
                              "its tasks (lm-eval ls tasks), `synthetic`, a JSONL file, or a YAML task under "
                              "--include-path.")
    return manager


def code_in_task_files(include_path: str | None) -> str | None:
    """A one-line notice when the user's lm-eval task files run Python of their own (`!function`, which lm-eval imports
    from a .py file or module when it builds the task): a task file is code, like a script. Their Jinja fields need no
    notice: they are rendered in Jinja's sandbox (`lm_eval_guarded`)."""
    if include_path is None:
        return None
    root = Path(include_path)
    files = [root] if root.is_file() else sorted(root.glob("**/*.yaml"))  # what lm-eval's index reads
    running = [str(file) for file in files if re.search(r"!function\b", file.read_text(encoding="utf-8",
                                                                                       errors="replace"))]
    if not running:
        return None
    return (f"note: --include-path {include_path}: {', '.join(running[:3])}{' ...' if len(running) > 3 else ''} "
            f"run{'s' if len(running) == 1 else ''} Python (`!function`): a task file is code, like a script; use only "
            "task files you trust.")


class Written:
    """The files and folders an evaluation wrote, so that a failed one removes those and nothing else."""

    def __init__(self):
        self.files: list[Path] = []
        self.folders: list[Path] = []  # created here, outermost first

    def file(self, path: Path) -> Path:
        """`path` to write, in its folder (created when missing); a file already there is refused, not replaced."""
        missing = [folder for folder in (path.parent, *path.parent.parents) if not folder.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        self.folders += reversed(missing)
        path.touch(exist_ok=False)
        self.files.append(path)
        return path

    def remove(self) -> None:
        for path in self.files:
            path.unlink(missing_ok=True)
        for folder in reversed(self.folders):
            with contextlib.suppress(OSError):  # a folder that holds anything else is not emptied
                folder.rmdir()


def write_task_definitions(tasks: list[LocalTask], folder: Path, tokenizer, plain_text: bool, until: list[str],
                           max_new_tokens: int, written: Written) -> None:
    """Each local task as lm-eval reads a task: `<name>.yaml` over `<name>.jsonl`, whose `prompt` is the text the
    model is given, rendered here as training rendered it."""
    import yaml

    from finetune.train.trained_model import render_prompt

    for task in tasks:
        data = written.file(folder / f"{task.name}.jsonl")
        with data.open("w", encoding="utf-8") as file:
            for example in task.examples:
                if plain_text and len(example["messages"]) > 1:
                    raise RecipeError(f"{task.source}: the model learned plain text, without a chat template; a "
                                      "prompt of several turns has no plain-text form. Give one-turn prompts.")
                prompt = (example["messages"][-1]["content"] if plain_text else
                          render_prompt(tokenizer, example["messages"]))
                file.write(json.dumps({"prompt": prompt, "reference": example["reference"]}) + "\n")
        definition = {
            "task": task.name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{reference}}",
            "target_delimiter": "",
            "generation_kwargs": {"until": until, "do_sample": False, "max_gen_toks": max_new_tokens},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "regexes_to_ignore": STRIP_WHITESPACE}],
            "metadata": {"version": 1.0, "source": task.source},
        }
        written.file(folder / f"{task.name}.yaml").write_text(yaml.safe_dump(definition, sort_keys=False))


def stop_strings(model, tokenizer, plain_text: bool) -> list[str]:
    """The texts of the tokens that end an answer in training, for lm-eval's `until` (generation also stops at them
    by id: the model's generation config holds them, finetune.train.evaluation.record_stop_tokens)."""
    from finetune.train.evaluation import stop_token_ids

    ids = stop_token_ids(tokenizer, model.generation_config, chat_template=not plain_text)
    return sorted({text for token in ids if (text := tokenizer.decode([token], skip_special_tokens=False))})


def evaluate_run(source: str | Path, selection: TaskSelection, *, compare_base: str | None = None,
                 max_new_tokens: int | None = None, batch_size: int = 32, limit: int | None = None,
                 merge_lora: bool = False, base_model: str | None = None, seed: int | None = None,
                 output: str | None = None) -> dict:
    """Scores the model in `source` (and, with `compare_base`, the model it was trained from, given the same prompts
    and stops) on `selection`; writes the record, the task definitions and every answer beside the model (or at
    `output`, checked before the model is loaded: `results_file`) and returns the record."""
    from finetune.train.trained_model import load_with_tokenizer, plain_text_format

    source = Path(source)
    path = results_file(source, output)
    tasks_folder = answers_folder(path)  # the local tasks as lm-eval read them, and every answer
    plain_text = plain_text_format(str(source)) is not None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's consolidation prints: stdout is for the results
        model, tokenizer = load_with_tokenizer(source, merge_lora, base_model, seed)
    max_new_tokens = answer_length(model, max_new_tokens, trained_value(source, "generation_max_new_tokens"))
    base_name = None
    if compare_base is not None:
        base_name = trained_value(source, "model_name_or_path") if compare_base == RUN_BASE else compare_base
        if not base_name:
            raise RecipeError(f"{source} does not record the model it was trained from: name it, --compare-base "
                              "MODEL (a directory, hub id, or tiny).")
    record = {"model": str(source), "tasks": [task.name for task in selection.local] + selection.registered,
              "max_new_tokens": max_new_tokens, "limit": limit}
    from finetune.models.vision import processor_of

    if processor_of(tokenizer) is not None or any(task.shows_images for task in selection.local):
        return evaluate_with_images(source, selection, model, tokenizer, record, path, tasks_folder, base_name, seed,
                                    batch_size, limit)
    written = Written()
    try:
        if selection.local:
            write_task_definitions(selection.local, tasks_folder, tokenizer, plain_text,
                                   stop_strings(model, tokenizer, plain_text), max_new_tokens, written)
        scoring = dict(selection=selection, tasks_folder=tasks_folder, tokenizer=tokenizer, plain_text=plain_text,
                       max_new_tokens=max_new_tokens, batch_size=batch_size, limit=limit)
        record["scores"], samples = score(model, **scoring)
        del model
        if base_name is not None:
            record["base_model"] = base_name
            record["before"], _ = score(load_base(base_name, source, seed), **scoring)
        write_answers(tasks_folder, samples, written)
        written.file(path).write_text(json.dumps(record, indent=2) + "\n")
    except BaseException:  # an error or Ctrl-C: no half-written evaluation left, and nothing else touched
        written.remove()
        raise
    record["results_file"] = str(path)
    return record


def evaluate_with_images(source: Path, selection: TaskSelection, model, tokenizer, record: dict, path: Path,
                         tasks_folder: Path, base_name: str | None, seed: int | None, batch_size: int,
                         limit: int | None) -> dict:
    """A vision-language model, or tasks that show images: lm-eval's text harness cannot give a model images, so
    each local task is scored by the toolkit's own exact match (finetune.train.evaluation: the processor renders the
    prompt and its images, generation stops where training taught it, surrounding whitespace ignored, as lm-eval's
    `exact_match` here); the same record and answers are written."""
    from finetune.models.vision import processor_of

    if processor_of(tokenizer) is None:
        shown = next(task for task in selection.local if task.shows_images)
        raise RecipeError(f"task {shown.name} ({shown.source}) shows images; {source} is a text model (no processor "
                          "was saved with it): it cannot read them.")
    if selection.registered:
        raise RecipeError(f"{source} is a vision-language model: lm-eval's tasks ({', '.join(selection.registered)}) "
                          "are run through its text harness here, which cannot give it images; score it on your own "
                          "JSONL tasks (rows with images, exact match).")
    record["scorer"] = "exact match with images"
    written = Written()
    try:
        record["scores"], samples = score_with_images(model, tokenizer, selection.local, record["max_new_tokens"],
                                                      batch_size, limit)
        del model
        if base_name is not None:
            record["base_model"] = base_name
            from finetune.checkpoints.export import _base_model

            base = _base_model(base_name, seed, source)
            record["before"], _ = score_with_images(base, tokenizer, selection.local, record["max_new_tokens"],
                                                    batch_size, limit)
        write_answers(tasks_folder, samples, written)
        written.file(path).write_text(json.dumps(record, indent=2) + "\n")
    except BaseException:
        written.remove()
        raise
    record["results_file"] = str(path)
    return record


def score_with_images(model, tokenizer, tasks: list[LocalTask], max_new_tokens: int, batch_size: int,
                      limit: int | None) -> tuple[dict, dict]:
    """`({task: {"exact_match": value}}, {task: [answers]})` of a vision-language model on local tasks."""
    from finetune.train.evaluation import generate_answers

    model = placed_for_evaluation(model).eval()
    scores, samples = {}, {}
    for task in tasks:
        examples = task.examples[:limit] if limit else task.examples
        answers = generate_answers(model, tokenizer, [example["messages"] for example in examples], max_new_tokens,
                                   batch_size=batch_size, images=[example.get("images") for example in examples])
        hits = [answer.strip() == example["reference"].strip() for answer, example in zip(answers, examples)]
        scores[task.name] = {"exact_match": sum(hits) / len(hits) if hits else 0.0}
        samples[task.name] = [{"doc": {"prompt": example["messages"][-1], "images": len(example.get("images") or [])},
                               "target": example["reference"], "answer": answer, "exact_match": float(hit)}
                              for example, answer, hit in zip(examples, answers, hits)]
    return scores, samples


def answer_length(model, asked: int | None, trained: int | None) -> int:
    """Tokens an answer may take: asked, else the run's, else 256; the prompt must keep room in the model's context
    (lm-eval's check), so a default is halved to fit and a value asked for that does not fit is refused."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if asked is not None and context is not None and asked >= context:
        raise RecipeError(f"--max-new-tokens {asked} leaves no room for the prompt in the model's {context} "
                          "positions: give fewer.")
    length = asked or trained or DEFAULT_MAX_NEW_TOKENS
    return min(length, context // 2) if context is not None else length


RUN_BASE = "run"  # --compare-base without a value: the model the run started from


def score(model, *, selection: TaskSelection, tasks_folder: Path, tokenizer, plain_text: bool, max_new_tokens: int,
          batch_size: int, limit: int | None) -> tuple[dict, dict]:
    """`({task: {metric: value}}, {task: [answers]})` of `model` through lm-eval's `HFLM`: the local tasks as
    written (a rendered template writes BOS itself; plain text gets what the tokenizer adds, as in training), lm-eval's
    own with the chat template when the run learned one."""
    from datasets.exceptions import DatasetNotFoundError
    from jinja2.exceptions import SecurityError
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = placed_for_evaluation(model).eval()
    harness = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_gen_toks=max_new_tokens)
    runs = []
    if selection.local:
        runs.append(([task.name for task in selection.local],
                     TaskManager(include_path=str(tasks_folder), include_defaults=False), False,
                     None if plain_text else False))
    if selection.registered:
        runs.append((selection.registered, selection.task_manager, not plain_text, None))
    scores, samples = {}, {}
    for names, manager, chat_template, add_bos in runs:
        harness.add_bos_token = add_bos
        try:
            with lm_eval_guarded():
                result = simple_evaluate(model=harness, tasks=names, task_manager=manager,
                                         apply_chat_template=chat_template, limit=limit, log_samples=True,
                                         random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        except SecurityError as error:
            refused = str(error).rstrip(".")
            raise RecipeError(f"a template of {', '.join(names)} reaches outside its data ({refused}): lm-eval task "
                              "templates are rendered in Jinja's sandbox here; give code as a `!function` in a .py "
                              "file beside the task.") from None
        except (ConnectionError, OSError, DatasetNotFoundError) as error:  # the task's data cannot be read
            raise RecipeError(f"lm-eval cannot read the data of {', '.join(names)}: {error}. Its datasets come from "
                              "the Hugging Face hub: evaluate where it can be reached, or point a YAML task under "
                              "--include-path at a local copy.") from None
        for task, metrics in result["results"].items():
            scores[task] = {name.split(",")[0]: value for name, value in metrics.items()
                            if "," in name and "_stderr" not in name and isinstance(value, (int, float))}
        for task, rows in result.get("samples", {}).items():
            samples[task] = [{"doc": row.get("doc"), "target": row.get("target"),
                              "answer": row["filtered_resps"][0] if row.get("filtered_resps") else None,
                              **{name: row[name] for name in scores.get(task, {}) if name in row}} for row in rows]
    return scores, samples


# The share of a GPU's free memory the weights may take where an evaluation places them: the rest is for a batch's
# activations and KV cache (32 prompts of a few hundred tokens: a few GiB at 70B).
EVALUATION_WEIGHT_SHARE = 0.8


def placed_for_evaluation(model):
    """`model` where it is scored: the CPU without CUDA; the first GPU when its weights fit there; else spread over
    the visible GPUs layer by layer by Accelerate's big-model dispatch (`infer_auto_device_map` + `dispatch_model`,
    what `device_map="auto"` does; lm-eval's HFLM feeds the first device and the hooks move activations on). A 70B
    in bf16 (141 GB) fits neither an 80 GB H100 nor a 141 GB H200 whole; over 8 H100s it takes 18 GB each. A model
    the GPUs cannot hold between them is refused by its size before anything is moved."""
    import torch

    if not torch.cuda.is_available():
        return model.to("cpu")
    need = sum(tensor.numel() * tensor.element_size() for tensor in (*model.parameters(), *model.buffers()))
    free = [torch.cuda.mem_get_info(device)[0] for device in range(torch.cuda.device_count())]
    room = [int(EVALUATION_WEIGHT_SHARE * bytes_free) for bytes_free in free]
    if need <= room[0]:
        return model.to("cuda:0")
    if need > sum(room):
        raise RecipeError(f"the model's weights take {need / 1024**3:.1f} GiB, more than the {len(free)} GPU(s) here "
                          f"leave for them ({EVALUATION_WEIGHT_SHARE:.0%} of {sum(free) / 1024**3:.1f} GiB free): "
                          "evaluate where the GPUs hold it, or free them.")
    from accelerate import dispatch_model, infer_auto_device_map

    device_map = infer_auto_device_map(model, max_memory=dict(enumerate(room)),
                                       no_split_module_classes=getattr(model, "_no_split_modules", None) or [])
    if any(not isinstance(device, int) for device in device_map.values()):  # whole layers left over: no offload
        raise RecipeError(f"the model's weights ({need / 1024**3:.1f} GiB) do not split over the {len(free)} GPU(s) "
                          f"here in whole layers ({EVALUATION_WEIGHT_SHARE:.0%} of {sum(free) / 1024**3:.1f} GiB "
                          "free): evaluate where the GPUs hold it, or free them.")
    print(f"evaluation: the model ({need / 1024**3:.1f} GiB) is spread over "
          f"{len(set(device_map.values()))} GPUs", file=sys.stderr, flush=True)
    return dispatch_model(model, device_map)


@contextlib.contextmanager
def lm_eval_guarded():
    """lm-eval as `finetune eval` runs it. Task templates are rendered in Jinja's sandbox: lm-eval renders every
    template field (`doc_to_text`, ...) with one module-level `Environment` (lm_eval/utils.py `env`, read by
    `apply_template` at each call), where `{{ cycler.__init__.__globals__.os.system(...) }}` runs a shell command; the
    sandbox keeps its settings and filters and refuses such access. And the git commit lm-eval records is asked of git
    with its stderr discarded: from outside a repository, lm_eval/loggers/utils.py `get_git_commit_hash` leaves git's
    `fatal: not a git repository` on the console (the hash is not kept here). lm-eval's environment report
    (lm_eval/loggers/utils.py `add_env_info`: torch's `collect_env`, which runs pip, conda, nvidia-smi, lscpu and
    more, about 2 s an evaluation) is not kept here either, so it is not gathered."""
    import os
    import subprocess

    import lm_eval.evaluator
    import lm_eval.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from lm_eval.loggers.utils import get_commit_from_path

    def git_commit_hash():
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    original = lm_eval.utils.env, lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info
    sandbox = ImmutableSandboxedEnvironment(loader=original[0].loader, undefined=original[0].undefined,
                                            keep_trailing_newline=original[0].keep_trailing_newline)
    sandbox.filters.update(original[0].filters)
    lm_eval.utils.env, lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info = (
        sandbox, git_commit_hash, lambda results: None)
    try:
        yield
    finally:
        lm_eval.utils.env, lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info = original


def load_base(name: str, source: Path, seed: int | None):
    """The model a run started from: `tiny` rebuilt from the run's seed, a directory or a hub id."""
    from finetune import presets
    from finetune.checkpoints.export import run_seed
    from finetune.models.loading import DTYPES

    if name == presets.TINY_MODEL:
        return presets.build_model(presets.build_tokenizer(), seed=run_seed(source) if seed is None else seed)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES["auto"])
    except OSError as error:
        raise RecipeError(f"--compare-base {name}: cannot load it ({error}).") from None


def write_answers(folder: Path, samples: dict, written: Written) -> None:
    for task, rows in samples.items():
        with written.file(folder / f"{task}.answers.jsonl").open("w", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps(row, default=str) + "\n")


def trained_value(source: str | Path, key: str):
    """A value the run recorded in its effective_config.json (`generation_max_new_tokens`, so `synthetic` scores as
    training did; `model_name_or_path`, the model it started from); None when not recorded."""
    from finetune import outputs
    from finetune.train.trained_model import run_folders

    return outputs.recorded_value(run_folders(str(source)), key)


def results_file(source: Path, output: str | None) -> Path:
    """Where an evaluation's results go, checked before any model is loaded: `output`, else a new file under
    `<source>/eval_harness/`. The file must be new and its answers folder (`answers_folder`) new or empty, so the
    evaluation replaces nothing and a failed one removes only what it wrote; inside the run, only under
    eval_harness/ (`--output RUN.json` would make the run its answers folder, `RUN/eval_results.json` is training's)."""
    if output is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        folder = source / RESULTS_FOLDER
        path, number = folder / f"results_{stamp}.json", 1
        while path.exists() or answers_folder(path).exists():
            number += 1
            path = folder / f"results_{stamp}_{number}.json"
        return path
    from finetune.train.trained_model import run_folders

    path = Path(output)
    if path.is_dir():
        raise RecipeError(f"--output {output} is a folder: name the results file, e.g. {path / 'results.json'}.")
    if path.suffix != ".json":
        raise RecipeError(f"--output {output}: name a .json file (its answers go in the folder of the same name "
                          "without .json).")
    if path.exists():
        raise RecipeError(f"--output {output} already exists: an evaluation replaces no file; name a new one, or leave "
                          f"--output out for a new file under {source / RESULTS_FOLDER}.")
    answers = answers_folder(path)
    if answers.exists() and (not answers.is_dir() or any(answers.iterdir())):
        raise RecipeError(f"--output {output}: its answers would go in {answers}, which already holds other files; "
                          "name a file whose folder of the same name is new.")
    for folder in run_folders(str(source)):
        if inside(path, folder) and not inside(path, folder / RESULTS_FOLDER):
            raise RecipeError(f"--output {output} is inside the run {folder}: an evaluation writes there only under "
                              f"{RESULTS_FOLDER}/ (leave --output out), or name a file outside the run.")
    return path


def answers_folder(results: Path) -> Path:
    """The folder beside a results file with the task definitions and every answer: its path without `.json`."""
    return results.with_suffix("")


def inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def print_scores(record: dict, console=None) -> None:
    """One row a task and metric: the score, and with a base, before → after and the change."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    before = record.get("before")
    against = f" against {record['base_model']}" if before else ""
    table = Table(title=f"{record.get('scorer', 'lm-eval')}: {record['model']}{against}")
    table.add_column("task")
    table.add_column("metric")
    if before is not None:
        table.add_column("before", justify="right")
    table.add_column("score" if before is None else "after", justify="right")
    if before is not None:
        table.add_column("change", justify="right")
    for task, metrics in record["scores"].items():
        for metric, value in metrics.items():
            old = (before or {}).get(task, {}).get(metric)
            row = [task, metric, *([f"{old:.4f}" if old is not None else "-"] if before is not None else []),
                   f"{value:.4f}"]
            if before is not None:
                row.append(f"{value - old:+.4f}" if old is not None else "-")
            table.add_row(*row)
    console.print(table)
    console.print(f"results: {record['results_file']}")
