"""Memory planning and measurement: the estimator (`estimate`), model shapes (`model_shape`), the per-rank
ledger and `MemoryReportCallback`, and the report files."""

from finetune.memory.callback import MemoryReportCallback
from finetune.memory.estimate import MemoryEstimate, Setup, estimate
from finetune.memory.shapes import model_shape

__all__ = ["MemoryEstimate", "MemoryReportCallback", "Setup", "estimate", "model_shape"]
