"""Exact-match accuracy by greedy generation, per task, as a `TrainerCallback` that runs at every evaluation.

Every rank generates for its share of the examples and the results are gathered, so the work is split
and ZeRO-3 (where all ranks must take part in each forward) works with `synced_gpus`.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int = 64) -> list[str]:
    """Greedy answers for chat prompts, decoded without special tokens."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    was_training = model.training
    model.eval()
    answers = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(model.device)
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=is_deepspeed_zero3_enabled() and PartialState().num_processes > 1,
            )
            answers += tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return answers


def exact_match(model, tokenizer, examples: list[dict], max_new_tokens: int) -> dict:
    """`{"per_task": {task: accuracy}, "samples": [...]}` over `examples`, computed across all ranks."""
    state = PartialState()
    with state.split_between_processes(list(enumerate(examples)), apply_padding=True) as shard:
        answers = generate_answers(model, tokenizer, [example["prompt"] for _, example in shard], max_new_tokens)
        scored = [(index, answer.strip()) for (index, _), answer in zip(shard, answers)]
    results = dict(gather_object(scored))  # padding repeats the last index; dict() removes it
    hits = defaultdict(list)
    samples = []
    for index, example in enumerate(examples):
        answer = results[index]
        hits[example["task"]].append(answer == example["reference"].strip())
        samples.append({"task": example["task"], "prompt": example["prompt"][-1]["content"],
                        "reference": example["reference"], "answer": answer})
    per_task = {task: sum(flags) / len(flags) for task, flags in sorted(hits.items())}
    return {"per_task": per_task, "samples": samples}


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
        logged = {f"eval_exact_match/{task}": value for task, value in result["per_task"].items()}
        state.log_history.append({**logged, "step": state.global_step})
