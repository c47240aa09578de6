"""Memory planning and measurement: the estimator (`estimate`), model shapes (`model_shape`), the per-rank
ledger and `MemoryReportCallback`, and the report files.

The callback is imported when first used: it needs torch and Transformers, which planning never loads."""

from finetune.memory.estimate import MemoryEstimate, Setup, estimate
from finetune.memory.shapes import model_shape

__all__ = ["MemoryEstimate", "MemoryReportCallback", "Setup", "estimate", "model_shape"]


def __getattr__(name: str):
    if name == "MemoryReportCallback":
        from finetune.memory.callback import MemoryReportCallback

        return MemoryReportCallback
    raise AttributeError(f"module 'finetune.memory' has no attribute {name!r}")
