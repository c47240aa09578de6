"""Evaluation: exact-match accuracy by greedy generation, per task, as a `TrainerCallback` that runs at every
evaluation, and the before/after summary of a run (eval loss, exact match per task, sample answers).

Every rank generates for its share of the examples and the results are gathered, so the work is split
and ZeRO-3 (where all ranks must take part in each forward) works with `synced_gpus`. Generation (here and in
`finetune chat`) stops at every token that ends an answer in training (`stop_token_ids`), not only at EOS.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from rich.console import Console
from rich.table import Table
from transformers import TrainerCallback
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from finetune.data.tokenize import turn_end_ids
from finetune.data.vision.encode import answer_text
from finetune.launch.strategies import loaded_sharded


def stop_token_ids(tokenizer, generation_config, chat_template: bool = True) -> list[int]:
    """Every token that ends an answer: the generation config's EOS (one or several), the tokenizer's, and, for
    prompts rendered with the chat template, each token that closes an assistant turn in it, which training taught
    the model to write (`finetune.data.tokenize.turn_end_ids`). A base model's EOS is often not its template's end of
    turn (Qwen2.5 base: `<|endoftext|>`, ChatML turns end with `<|im_end|>`): stopping at EOS alone lets the model
    write the user's next turn itself. Plain-text runs (prompt/completion, text) learned EOS alone."""
    configured = generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    if chat_template:
        ids.update(turn_end_ids(tokenizer))
    ids.discard(None)
    return sorted(ids)


def record_stop_tokens(model, tokenizer, plain_text: bool) -> None:
    """Puts every token that ends an answer (`stop_token_ids`) into the model's generation config, which every saved
    checkpoint and the final model carry: `generate` elsewhere (a pipeline, `transformers serve`, an exported model)
    then stops where training taught the model to, not only at a base model's EOS."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        return
    ids = stop_token_ids(tokenizer, generation_config, chat_template=not plain_text)
    generation_config.eos_token_id = ids[0] if len(ids) == 1 else ids


def until_stop(ids: list[int], stop_ids: list[int]) -> list[int]:
    """Generated ids before the first stop token (a batch's finished rows are padded after it)."""
    return next((ids[:index] for index, token in enumerate(ids) if token in stop_ids), ids)


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int,
                     batch_size: int = 64, synced: bool = False, images: list[list] | None = None) -> list[str]:
    """Greedy answers for chat prompts, each up to the token that ends it, decoded without special tokens. `synced`:
    every rank runs each forward together until all are done (a model whose weights are split over the ranks).
    `images`: each prompt's images (PIL), for a vision-language model, whose tokenizer carries its processor
    (finetune.models.vision.processor_of)."""
    from finetune.models.vision import processor_of

    processor = processor_of(tokenizer)
    render = processor if processor is not None else tokenizer
    texts = [render.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    stop_ids = stop_token_ids(tokenizer, model.generation_config)
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    was_training = model.training
    model.eval()
    answers = []
    try:
        for start in range(0, len(texts), batch_size):
            if processor is not None:
                shown = [image for row in (images or [])[start : start + batch_size] for image in row or []]
                batch = processor(text=texts[start : start + batch_size], images=shown or None, return_tensors="pt",
                                  padding=True, add_special_tokens=False).to(model.device)
            else:
                batch = tokenizer(
                    texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(model.device)
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop_ids,
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=synced or (is_deepspeed_zero3_enabled() and PartialState().num_processes > 1),
            )
            answers += [tokenizer.decode(until_stop(ids, stop_ids), skip_special_tokens=True)
                        for ids in output[:, batch["input_ids"].shape[1] :].tolist()]
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return answers


def exact_match(model, tokenizer, examples: list[dict], max_new_tokens: int) -> dict:
    """`{"per_task": {task: accuracy}, "samples": [...]}` over `examples`, computed across all ranks (split between
    them; a model Transformers loaded sharded, whose every forward needs every rank, answers all of them on each)."""
    if loaded_sharded(model) is not None:
        answers = generate_answers(model, tokenizer, [example["prompt"] for example in examples], max_new_tokens,
                                   synced=True, images=[example.get("images") for example in examples])
        results = {index: answer.strip() for index, answer in enumerate(answers)}
    else:
        state = PartialState()
        with state.split_between_processes(list(enumerate(examples)), apply_padding=True) as shard:
            answers = generate_answers(model, tokenizer, [example["prompt"] for _, example in shard],
                                       max_new_tokens, images=[example.get("images") for _, example in shard])
            scored = [(index, answer.strip()) for (index, _), answer in zip(shard, answers)]
        results = dict(gather_object(scored))  # padding repeats the last index; dict() removes it
    hits = defaultdict(list)
    samples = []
    for index, example in enumerate(examples):
        answer = results[index]
        hits[example["task"]].append(answer == example["reference"].strip())
        samples.append({"task": example["task"], "prompt": answer_text(example["prompt"][-1]),
                        "reference": example["reference"], "answer": answer})
    per_task = {task: sum(flags) / len(flags) for task, flags in sorted(hits.items())}
    return {"per_task": per_task, "samples": samples}


EXACT_MATCH_PREFIX = "eval_exact_match/"  # the log's key for a task's exact match


class ExactMatchCallback(TrainerCallback):
    """Scores exact match whenever the Trainer evaluates; results are kept in `history` and in the log."""

    def __init__(self, tokenizer, examples: list[dict], max_new_tokens: int):
        self.tokenizer = tokenizer
        self.examples = examples
        self.max_new_tokens = max_new_tokens
        self.history: list[dict] = []

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        if not self.examples:
            return
        result = exact_match(model, self.tokenizer, self.examples, self.max_new_tokens)
        result["step"] = state.global_step
        result["eval_loss"] = (metrics or {}).get("eval_loss")
        self.history.append(result)
        logged = {f"{EXACT_MATCH_PREFIX}{task}": value for task, value in result["per_task"].items()}
        state.log_history.append({**logged, "step": state.global_step})


SAMPLES_PER_TASK = 2


def summarize_evaluations(log_history: list[dict], exact_match_history: list[dict], final_evaluation: dict | None,
                          since_step: int = 0) -> dict:
    """'after' is the evaluation of the final weights (`final_evaluation`, what `Trainer.evaluate` returned at the end;
    none without it, so a resumed run never reports an old evaluation as after training); 'before' the first
    evaluation logged from `since_step` on (a resumed run's log holds its earlier evaluations). Each with eval loss,
    exact match per task (from the log) and sample answers (where this process scored them)."""
    evaluations = [entry for entry in log_history if "eval_loss" in entry and entry["step"] >= since_step]
    if final_evaluation is None or not evaluations:
        return {}
    summary: dict = {}
    # 'before' only when something was evaluated before the final weights (eval_on_start, or an earlier eval step)
    labels = (("before", 0), ("after", -1)) if evaluations[0]["step"] < evaluations[-1]["step"] else (("after", -1),)
    for label, position in labels:
        step = evaluations[position]["step"]
        evaluation = {"step": step, "eval_loss": evaluations[position]["eval_loss"]}
        evaluation.update(preference_metrics(evaluations[position]))
        scores = [entry for entry in log_history if entry.get("step") == step
                  and any(key.startswith(EXACT_MATCH_PREFIX) for key in entry)]
        if scores:
            evaluation["exact_match"] = {key.removeprefix(EXACT_MATCH_PREFIX): value
                                         for key, value in scores[position].items()
                                         if key.startswith(EXACT_MATCH_PREFIX)}
        scored = [result for result in exact_match_history if result["step"] == step]
        if scored:
            evaluation["samples"] = _pick_samples(scored[position]["samples"])
        summary[label] = evaluation
    summary["after"]["eval_loss"] = final_evaluation["eval_loss"]
    summary["after"].update(preference_metrics(final_evaluation))
    return summary


# A preference method's evaluation (TRL's): how often the policy prefers the chosen answer more than the reference
# does, and by how much (β times the log-ratio difference). Both are 0 before training, when the policy is the
# reference.
# KTO's (TRL's KTOTrainer), on unpaired examples, has the margin only: the mean reward of the desirable completions
# minus that of the undesirable ones, also 0 before training. The reference-free methods' (CPO, SimPO, ORPO) reward is
# β times the policy's own log-probability of an answer: not 0 before training.
# A reward model's (TRL's RewardTrainer): how often the chosen answer scores above the rejected one, and the mean
# score margin.
# GRPO's (TRL's GRPOTrainer): the mean reward of completions sampled for the eval prompts.
PREFERENCE_METRICS = {"eval_rewards/accuracies": "reward_accuracy", "eval_rewards/margins": "reward_margin",
                      "eval_accuracy": "pair_accuracy", "eval_margin": "score_margin",
                      "eval_reward": "mean_reward"}


REWARD_PREFIX, REWARD_SUFFIX = "eval_rewards/", "/mean"  # TRL's GRPO: each reward function's mean, sampled


def preference_metrics(evaluation: dict) -> dict:
    """A preference or RL method's held-out measures; an RL method's mean of each reward over the completions sampled
    for the eval prompts under `rewards` (`{"exact_match": 0.1}`)."""
    metrics = {name: evaluation[key] for key, name in PREFERENCE_METRICS.items() if key in evaluation}
    rewards = {key.removeprefix(REWARD_PREFIX).removesuffix(REWARD_SUFFIX): value for key, value in evaluation.items()
               if key.startswith(REWARD_PREFIX) and key.endswith(REWARD_SUFFIX)}
    return metrics | ({"rewards": rewards} if rewards else {})


def _pick_samples(samples: list[dict]) -> list[dict]:
    picked, per_task = [], {}
    for sample in samples:
        if per_task.get(sample["task"], 0) < SAMPLES_PER_TASK:
            per_task[sample["task"]] = per_task.get(sample["task"], 0) + 1
            picked.append(sample)
    return picked


def _shown(value, spec: str) -> str:
    """A measure as the table shows it; `–` where there is none (before the first evaluation, or a mean over no
    scored completion, which TRL logs as None when every reward returned None)."""
    return "–" if value is None else format(value, spec)


def print_before_after(summary: dict, console: Console | None = None) -> None:
    console = console or Console()
    before, after = summary.get("before"), summary.get("after")
    if not after:
        console.print(f"train loss {_shown(summary.get('train_loss'), '.4f')} (no eval split: no before/after)")
        return
    if not before:
        table = Table(title="After training", caption="eval_on_start: true adds a 'before' column")
        table.add_column("metric")
        table.add_column(f"after (step {after['step']})", justify="right")
        table.add_row("eval loss", _shown(after["eval_loss"], ".4f"))
        for name in PREFERENCE_METRICS.values():
            if name in after:
                table.add_row(name.replace("_", " "), _shown(after[name], ".3f"))
        for task, accuracy in after.get("exact_match", {}).items():
            table.add_row(f"exact match: {task}", _shown(accuracy, ".1%"))
        console.print(table)
        return
    table = Table(title="Before vs after training")
    table.add_column("metric")
    table.add_column(f"before (step {before['step']})", justify="right")
    table.add_column(f"after (step {after['step']})", justify="right")
    table.add_row("eval loss", _shown(before["eval_loss"], ".4f"), _shown(after["eval_loss"], ".4f"))
    for name in PREFERENCE_METRICS.values():
        if name in after:
            then = before.get(name)
            table.add_row(name.replace("_", " "), _shown(then, ".3f"), _shown(after[name], ".3f"))
    for name, value in after.get("rewards", {}).items():
        then = before.get("rewards", {}).get(name)
        table.add_row(f"reward {name} (sampled)", _shown(then, ".3f"), _shown(value, ".3f"))
    for task, accuracy in after.get("exact_match", {}).items():
        then = before.get("exact_match", {}).get(task)
        table.add_row(f"exact match: {task}", _shown(then, ".1%"), _shown(accuracy, ".1%"))
    console.print(table)
    if after.get("samples") and before.get("samples"):
        samples = Table(title="Sample generations (held-out)")
        for column in ("task", "prompt", "expected", "before", "after"):
            samples.add_column(column)
        for old, new in zip(before["samples"], after["samples"]):
            samples.add_row(new["task"], new["prompt"].replace("\n", " "), new["reference"], old["answer"],
                            new["answer"])
        console.print(samples)
