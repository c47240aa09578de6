"""A NaN or infinite loss stops the run with the step and what to change, instead of training on silently."""

from types import SimpleNamespace

import pytest

from finetune.cli import main
from finetune.errors import TrainingDiverged
from finetune.train.divergence import FP16_PATIENCE, FP16_SKIPPED_STEPS, NonFiniteLossCallback

ARGS = SimpleNamespace(output_dir="outputs/x", save_strategy="steps")


def log(callback, step, **logs):
    callback.on_log(ARGS, SimpleNamespace(global_step=step), None, logs={"learning_rate": 1e-3, **logs})


def test_bf16_or_fp32_stops_at_the_first_non_finite_value():
    callback = NonFiniteLossCallback(fp16=False)
    log(callback, 1, loss=2.0, grad_norm=1.0)
    log(callback, 2, eval_loss=float("nan"))  # an eval log has neither key: not judged here
    with pytest.raises(TrainingDiverged, match=r"step 3: grad_norm nan .*learning_rate.*resume_from_checkpoint"):
        log(callback, 3, loss=2.0, grad_norm=float("nan"))


def test_fp16_tolerates_skipped_overflow_steps_but_not_a_run_of_them():
    callback = NonFiniteLossCallback(fp16=True)
    for step in range(1, FP16_PATIENCE):
        log(callback, step, loss=float("inf"), grad_norm=float("inf"))
    log(callback, FP16_PATIENCE, loss=3.0, grad_norm=2.0)  # the loss scaler recovered: the count starts again
    for step in range(FP16_PATIENCE + 1, 2 * FP16_PATIENCE):
        log(callback, step, loss=float("inf"))
    with pytest.raises(TrainingDiverged, match=f"step {2 * FP16_PATIENCE}: loss inf"):
        log(callback, 2 * FP16_PATIENCE, loss=float("inf"))


def test_fp16_start_up_overflows_with_a_finite_loss_do_not_stop_a_run_logging_every_step():
    """GradScaler starts at 2**16 and halves on each overflowing step: with `logging_steps: 1` a T4 run logs a dozen
    infinite grad norms in a row while its loss stays finite. Those steps were skipped, not applied."""
    callback = NonFiniteLossCallback(fp16=True)
    for step in range(1, 17):
        log(callback, step, loss=5.0, grad_norm=float("inf"))
    log(callback, 17, loss=4.9, grad_norm=3.0)
    for step in range(18, 18 + FP16_SKIPPED_STEPS - 1):  # the gradients overflow at every scale: a real problem
        log(callback, step, loss=4.9, grad_norm=float("inf"))
    with pytest.raises(TrainingDiverged, match=f"skipped {FP16_SKIPPED_STEPS} logged steps in a row"):
        log(callback, 18 + FP16_SKIPPED_STEPS - 1, loss=4.9, grad_norm=float("inf"))


def test_a_diverging_run_stops_with_the_step_and_exit_status_2(tmp_path, capsys):
    status = main(["train", "recipes/demo.yaml", "--learning_rate", "1e30", "--max_steps", "30", "--logging_steps", "1",
                   "--eval_on_start", "false", "--generation_eval_samples", "0", "--save_strategy", "no",
                   "--output_dir", str(tmp_path), "--disable_tqdm", "true"])
    error = capsys.readouterr().err
    assert status == 2
    assert "training diverged at step" in error and "nan" in error and "Lower `learning_rate`" in error
    assert not (tmp_path / "eval_results.json").exists()  # it stopped instead of finishing
