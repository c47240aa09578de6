"""Stops a run whose loss or gradient norm became NaN or infinite, naming the step and what to change, instead of
training on (Trainer keeps going and, with `logging_nan_inf_filter`, hides non-finite losses from its logs)."""

from __future__ import annotations

import math

from transformers import TrainerCallback

from finetune.errors import TrainingDiverged

# Under fp16 a loss scaler skips steps whose gradients overflow and lowers the scale: a few non-finite values are
# normal there, so only this many logging windows in a row count as divergence. Under bf16/fp32 nothing skips the
# step: the first non-finite gradient has already been applied to the weights.
FP16_PATIENCE = 3


class NonFiniteLossCallback(TrainerCallback):
    """Raises `TrainingDiverged` on every rank when the logged loss or grad_norm is not finite (the logged values are
    already reduced over ranks, so all ranks stop at the same step)."""

    def __init__(self, fp16: bool = False):
        self.patience = FP16_PATIENCE if fp16 else 1
        self.strikes = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        values = {key: logs[key] for key in ("loss", "grad_norm") if isinstance((logs or {}).get(key), (int, float))}
        bad = {key: value for key, value in values.items() if not math.isfinite(value)}
        if not values:
            return
        self.strikes = self.strikes + 1 if bad else 0
        if self.strikes < self.patience:
            return
        seen = ", ".join(f"{key} {value}" for key, value in bad.items())
        resume = (" A checkpoint saved before it resumes with `resume_from_checkpoint: auto`."
                  if args.save_strategy != "no" else "")
        raise TrainingDiverged(
            f"training diverged at step {state.global_step}: {seen} (learning rate {logs.get('learning_rate')}). "
            f"Lower `learning_rate` or lengthen `warmup_steps`, keep `max_grad_norm` (gradient clipping) on, prefer "
            f"`bf16: true` to `fp16: true`, and check the data ({args.output_dir}/data_summary.json).{resume}"
        )
