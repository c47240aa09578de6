"""What generating holds, measured: the KV cache a model's `generate` fills, read from the cache each forward returns
(`CacheMeter`), for an online RL method's ledger to set beside the prediction (finetune.memory.estimate
`generation_bytes`)."""

from __future__ import annotations

from contextlib import contextmanager


def cache_tensors(cache) -> list:
    """Every key and value tensor a Transformers cache holds (its `layers`, each with `keys` and `values`)."""
    tensors = []
    for layer in getattr(cache, "layers", ()):
        tensors += [tensor for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if tensor is not None and hasattr(tensor, "nbytes")]
    return tensors


class CacheMeter:
    """The largest KV cache seen: its bytes, the sequences it holds and the tokens of each (`largest`)."""

    def __init__(self):
        self.largest: dict | None = None

    @contextmanager
    def watching(self, model):
        handle = model.register_forward_hook(self._read)
        try:
            yield self
        finally:
            handle.remove()

    def _read(self, module, args, output) -> None:
        tensors = cache_tensors(getattr(output, "past_key_values", None))
        if not tensors:
            return
        held = sum(tensor.nbytes for tensor in tensors)
        if self.largest is None or held > self.largest["bytes"]:
            self.largest = {"bytes": held, "sequences": int(tensors[0].shape[0]), "tokens": int(tensors[0].shape[-2])}
