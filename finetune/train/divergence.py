"""Stops a run whose loss or gradient norm became NaN or infinite, naming the step and what to change, instead of
training on (Trainer keeps going and, with `logging_nan_inf_filter`, hides non-finite losses from its logs)."""

from __future__ import annotations

import math

from transformers import TrainerCallback

from finetune.errors import TrainingDiverged

# Under bf16/fp32 nothing skips a step: the first non-finite value has already been applied to the weights. Under fp16
# the loss scaler skips every step whose scaled gradients overflow and halves its scale, so an infinite grad_norm with
# a finite loss is a skipped step, not divergence: GradScaler starts at 2**16 and a run can overflow for a dozen steps
# or more in a row before the scale settles (with `logging_steps: 1` each one is logged). Under fp16 the guard is
# therefore keyed on the loss, a few logging windows in a row; only a run of skipped steps longer than any start-up
# (the scale fallen by 2**32) means the gradients themselves overflow.
FP16_PATIENCE = 3
FP16_SKIPPED_STEPS = 32


class NonFiniteLossCallback(TrainerCallback):
    """Raises `TrainingDiverged` on every rank when the logged loss (and, outside fp16, grad_norm) is not finite (the
    logged values are already reduced over ranks, so all ranks stop at the same step)."""

    def __init__(self, fp16: bool = False):
        self.fp16 = fp16
        self.loss_strikes = self.skipped_in_a_row = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        values = {key: logs[key] for key in ("loss", "grad_norm") if isinstance((logs or {}).get(key), (int, float))}
        if not values:
            return
        bad = {key: value for key, value in values.items() if not math.isfinite(value)}
        if not self.fp16:
            if bad:
                self.diverged(args, state, logs, bad)
            return
        self.loss_strikes = self.loss_strikes + 1 if "loss" in bad else 0
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if "grad_norm" in bad else 0
        if self.loss_strikes >= FP16_PATIENCE:
            self.diverged(args, state, logs, bad)
        if self.skipped_in_a_row >= FP16_SKIPPED_STEPS:
            self.diverged(args, state, logs, bad, f" The fp16 loss scaler skipped {self.skipped_in_a_row} logged "
                                                  "steps in a row: the gradients overflow at any scale.")

    def diverged(self, args, state, logs, bad: dict, why: str = "") -> None:
        seen = ", ".join(f"{key} {value}" for key, value in bad.items())
        resume = (" A checkpoint saved before it resumes with `resume_from_checkpoint: auto`."
                  if args.save_strategy != "no" else "")
        raise TrainingDiverged(
            f"training diverged at step {state.global_step}: {seen} (learning rate {logs.get('learning_rate')}).{why} "
            f"Lower `learning_rate` or lengthen `warmup_steps`, keep `max_grad_norm` (gradient clipping) on, prefer "
            f"`bf16: true` to `fp16: true`, and check the data ({args.output_dir}/data_summary.json).{resume}"
        )
