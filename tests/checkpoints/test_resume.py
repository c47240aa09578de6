"""Resumes keep what the user changed, or refuse it by name: a changed learning rate and warmup run from the resume
step (as the logged rates show), changed training data is refused unless `ignore_data_skip`, and "after training"
is always the evaluation of the final weights."""

import json
import shutil

import pytest
from support import CHECKPOINTED_RUN, CPU_LAUNCHES, assert_succeeded, finetune_command, launch_demo, run
from transformers.optimization import _get_linear_schedule_with_warmup_lr_lambda

from finetune.checkpoints.complete import read_marker

STEPS, WARMUP, SAVE = 12, 4, 6


def logged_rates(output_dir) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["learning_rate"] for entry in state["log_history"] if "learning_rate" in entry}


def linear_schedule(learning_rate: float, step: int, warmup: int = WARMUP, total: int = STEPS) -> float:
    """The rate Trainer logs for `step` under `lr_scheduler_type: linear` (the rate that step ran at)."""
    return learning_rate * _get_linear_schedule_with_warmup_lr_lambda(step - 1, num_warmup_steps=warmup,
                                                                      num_training_steps=total)


def train_file(path, words):
    path.write_text("".join(json.dumps({"instruction": "reverse", "input": word, "output": word[::-1]}) + "\n"
                            for word in words))
    return path


def short_run(output_dir, *extra):
    return run(finetune_command(
        "train", "recipes/demo.yaml", "--output_dir", str(output_dir), "--max_steps", str(STEPS),
        "--warmup_steps", str(WARMUP), "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", str(SAVE),
        "--per_device_train_batch_size", "4", "--generation_eval_samples", "4", "--max_eval_samples", "8", *extra,
    ), timeout=300)


def test_a_resume_applies_a_changed_learning_rate_and_warmup_from_the_resume_step(tmp_path):
    output_dir = tmp_path / "out"
    first = short_run(output_dir, "--learning_rate", "0.002", "--eval_on_start", "false")
    assert_succeeded(first)
    rates = logged_rates(output_dir)
    assert all(rates[step] == pytest.approx(linear_schedule(0.002, step)) for step in range(1, STEPS + 1))
    (output_dir / f"checkpoint-{STEPS}").rename(output_dir / "set-aside")  # resume from checkpoint-6

    resumed = short_run(output_dir, "--learning_rate", "0.001", "--warmup_steps", "8", "--eval_on_start", "false",
                        "--resume_from_checkpoint", "auto")
    assert_succeeded(resumed)
    rates = logged_rates(output_dir)
    assert all(rates[step] == pytest.approx(linear_schedule(0.002, step)) for step in range(1, SAVE + 1))
    # From the resume step on: this run's rate and warmup, not the checkpoint's (0.002 with 4 warmup steps).
    assert all(rates[step] == pytest.approx(linear_schedule(0.001, step, warmup=8)) for step in range(SAVE + 1,
                                                                                                       STEPS + 1))
    assert f"learning rate from step {SAVE + 1}: 0.00075 by this run's schedule (learning_rate 0.001)" in resumed.output
    effective = json.loads((output_dir / "effective_config.json").read_text())
    assert effective["values"]["learning_rate"]["value"] == 0.001
    assert effective["resumed"]["step"] == SAVE and "0.00075" in effective["resumed"]["schedule"]


def test_changed_training_data_is_refused_or_restarted_explicitly_and_after_is_of_the_final_weights(tmp_path):
    output_dir = tmp_path / "out"
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    first_data, other_data = train_file(tmp_path / "a.jsonl", words), train_file(tmp_path / "b.jsonl", words[::-1][:8])
    first = short_run(output_dir, "--train_file", str(first_data), "--eval_split_ratio", "0.2",
                      "--max_steps", str(SAVE))
    assert_succeeded(first)
    recorded = read_marker(output_dir / f"checkpoint-{SAVE}")["train_data"]
    assert recorded.startswith("8 rows, sha256 ")

    # The same data under another name resumes; other data is refused, naming both, before any step.
    renamed = (tmp_path / "copy.jsonl")
    renamed.write_text(first_data.read_text())
    same = short_run(output_dir, "--train_file", str(renamed), "--eval_split_ratio", "0.2", "--max_steps", "7",
                     "--resume_from_checkpoint", "auto", "--save_strategy", "no")
    assert_succeeded(same)
    assert "the training data changed" not in same.output

    refused = short_run(output_dir, "--train_file", str(other_data), "--max_steps", "9", "--eval_split_ratio", "0",
                        "--resume_from_checkpoint", "auto")
    assert refused.returncode != 0 and "Traceback" not in refused.output
    assert f"the training data differs from the data {output_dir}/checkpoint-{SAVE} was trained on ({recorded} → " \
           in refused.output and "ignore_data_skip: true" in refused.output

    # Explicitly restarted on the new data without an eval split: no old evaluation is reported as "after".
    restarted = short_run(output_dir, "--train_file", str(other_data), "--max_steps", "9", "--eval_split_ratio", "0",
                          "--resume_from_checkpoint", "auto", "--ignore_data_skip", "true")
    assert_succeeded(restarted)
    assert "continuing with the new data from its first row (ignore_data_skip)" in restarted.output
    summary = json.loads((output_dir / "eval_results.json").read_text())
    assert "before" not in summary and "after" not in summary
    assert json.loads((output_dir / "trainer_state.json").read_text())["global_step"] == 9


@pytest.mark.distributed
def test_a_changed_learning_rate_reaches_deepspeeds_optimizer_on_resume(checkpointed_runs, tmp_path):
    """Under ZeRO-2 the optimizer and scheduler come back through DeepSpeed's engine: the new rate must reach them."""
    # The shared ZeRO-2 run (6 steps at the recipe's 0.002, 2 warmup steps, checkpoints at 3 and 6), copied.
    output_dir = shutil.copytree(checkpointed_runs["zero2"], tmp_path / "out")
    (output_dir / "checkpoint-6").rename(output_dir / "set-aside")
    resumed = launch_demo(CPU_LAUNCHES["zero2"], output_dir, *CHECKPOINTED_RUN, "--learning_rate", "0.001",
                          "--resume_from_checkpoint", "auto")
    assert_succeeded(resumed)
    assert f"resuming from {output_dir / 'checkpoint-3'}" in resumed.output
    rates = logged_rates(output_dir)
    # Steps 2 and 3 (past step 1's zero rate) tell the two rates apart, as do steps 4 to 6.
    assert [rates[step] for step in (1, 2, 3)] == pytest.approx([linear_schedule(0.002, step, 2, 6)
                                                                 for step in (1, 2, 3)])
    assert [rates[step] for step in (4, 5, 6)] == pytest.approx([linear_schedule(0.001, step, 2, 6)
                                                                 for step in (4, 5, 6)])


def test_a_resume_after_a_chat_template_change_names_the_template_not_the_data(tmp_path):
    from finetune import presets
    from finetune.checkpoints.complete import check_same_data, mark_complete
    from finetune.errors import RecipeError
    from finetune.models.loading import NAMED_TEMPLATES

    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    tokenizer = presets.build_tokenizer()
    tokenizer.save_pretrained(checkpoint)  # as Trainer saves its processing class in every checkpoint
    mark_complete(checkpoint, 2, {}, {}, train_data="rows-before")
    with pytest.raises(RecipeError, match=r"^the chat template differs from the one .*checkpoint-2 was trained with, "
                                          r"so the tokenized training rows changed \(rows-before → rows-after\).* "
                                          r"Resume with the template it was saved with \(`chat_template`: "
                                          r".*checkpoint-2/chat_template.jinja\)"):
        check_same_data(checkpoint, "rows-after", False, NAMED_TEMPLATES["chatml"])
    with pytest.raises(RecipeError, match=r"^the training data differs from the data .*checkpoint-2 was trained on"):
        check_same_data(checkpoint, "rows-after", False, tokenizer.chat_template)  # same template: the data changed
    assert "chat template changed" in check_same_data(checkpoint, "rows-after", True, NAMED_TEMPLATES["chatml"])
