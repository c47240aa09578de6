"""FinetuneTrainer, in one process: the loss normalisation in compute_loss, rotation taken over from Trainer, the DDP
comm hook. The 2-process equivalence of the normalisation is tests/recipe/test_scaling.py's."""

import json

import pytest
import torch

from finetune import presets
from finetune.recipe.args import FinetuneTrainingArguments
from finetune.train.trainer import FinetuneTrainer


def make_trainer(tmp_path, **options):
    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer, seed=0)
    args = FinetuneTrainingArguments(str(tmp_path), use_cpu=True, report_to=[], eval_on_start=False, **options)
    return FinetuneTrainer(model=model, args=args)


def batch_with_few_answer_tokens():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 250, (2, 16), generator=generator)
    labels = input_ids.clone()
    labels[:, :12] = -100  # a prompt: only the last 4 tokens of each row are answer tokens
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def token_losses(model, inputs) -> torch.Tensor:
    logits = model(input_ids=inputs["input_ids"]).logits[:, :-1].float()
    labels = inputs["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")[
        labels != -100]


@torch.no_grad()
def test_tokens_divides_by_the_answer_tokens_of_the_whole_step(tmp_path):
    trainer = make_trainer(tmp_path)
    inputs = batch_with_few_answer_tokens()
    losses = token_losses(trainer.model, inputs)
    step_tokens = 3 * losses.numel()  # as if two more micro-batches of the step held twice as many answer tokens
    loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=torch.tensor(step_tokens))
    assert loss.item() == pytest.approx(losses.sum().item() / step_tokens, rel=1e-5)
    assert trainer.loss_is_scaled_for_ga is None  # Trainer's rule: scaled by num_items_in_batch already


@torch.no_grad()
def test_micro_batch_mean_is_this_micro_batchs_own_mean(tmp_path):
    trainer = make_trainer(tmp_path, loss_normalization="micro_batch_mean", gradient_accumulation_steps=4)
    inputs = batch_with_few_answer_tokens()
    losses = token_losses(trainer.model, inputs)
    loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=torch.tensor(3 * losses.numel()))
    assert loss.item() == pytest.approx(losses.mean().item(), rel=1e-5)
    assert trainer.loss_is_scaled_for_ga is False  # training_step divides it by the accumulation steps


def test_rotation_and_comm_hook_are_the_trainers(tmp_path):
    from accelerate.utils import DDPCommunicationHookType

    trainer = make_trainer(tmp_path, save_total_limit=2, ddp_comm_hook="fp16")
    assert (trainer.save_total_limit, trainer.args.save_total_limit) == (2, None)  # Trainer's own rotation is off
    assert trainer.accelerator.ddp_handler.comm_hook == DDPCommunicationHookType.FP16


def test_the_token_count_is_summed_once_a_log_not_at_every_micro_step(tmp_path, monkeypatch):
    """Trainer gathers and reads back the token count at every micro-step; here the ranks' counts are summed when a
    log or a checkpoint reads them."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling

    tokenizer = presets.build_tokenizer()
    lengths = (5, 9, 7, 11) * 6
    rows = Dataset.from_list([{"input_ids": list(range(3, 3 + n)), "attention_mask": [1] * n} for n in lengths])
    args = FinetuneTrainingArguments(str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                                     gradient_accumulation_steps=2, max_steps=6, logging_steps=3,
                                     save_strategy="steps", save_steps=4, include_num_input_tokens_seen="non_padding")
    trainer = FinetuneTrainer(model=presets.build_model(tokenizer, seed=0), args=args, train_dataset=rows,
                              data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                              processing_class=tokenizer)
    calls = {"gather": 0, "reduce": 0}
    for name in calls:
        def counted(*arguments, name=name, original=getattr(trainer.accelerator, name), **kwargs):
            calls[name] += 1
            return original(*arguments, **kwargs)
        monkeypatch.setattr(trainer.accelerator, name, counted)
    trainer.train()

    # 5 sums for 12 micro-steps: the logs at steps 3 and 6, the saves at 4 and 6 (the last step), the closing metrics
    assert calls == {"gather": 0, "reduce": 5} and (tmp_path / "checkpoint-6").is_dir()
    # the 24 rows are read once (6 steps × 2 micro-batches × 2 rows), padding not counted
    assert trainer.state.num_input_tokens_seen == sum(lengths)
    logged = {entry["step"]: entry["num_input_tokens_seen"] for entry in trainer.state.log_history if "loss" in entry}
    assert logged[6] == trainer.state.num_input_tokens_seen
    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["num_input_tokens_seen"]
    assert 0 < logged[3] < saved < logged[6]  # the checkpoint holds the count at its own step, not the last log's
