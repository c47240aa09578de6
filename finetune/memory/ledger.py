"""What one rank really holds: bytes of parameters, gradients and optimizer states, found by walking the objects.

Bytes are counted per storage, not per tensor, so a flat buffer that many parameters view (DeepSpeed's
flattened groups, alignment padding included) counts once, and a tensor two owners share counts once.
Gradients are read when the optimizer steps, the only moment they all exist: a pre-hook on the innermost
torch optimizer sees each gradient partition DeepSpeed hands it (DeepSpeed steps one parameter group at
a time and frees each fp32 partition right after), plus the gradients still held in the model dtype.
"""

from __future__ import annotations

import torch

# Where DeepSpeed's ZeRO optimizers keep gradient partitions in the model dtype between backward and step
# (stage_1_and_2.py: averaged_gradients; stage3.py: grad_partitions_flat_buffer).
DEEPSPEED_GRADIENT_ATTRIBUTES = ("averaged_gradients", "grad_partitions_flat_buffer")


def _local(tensor):
    """An FSDP2 DTensor's shard on this rank; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _tensors(value):
    if torch.is_tensor(value):
        yield _local(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _storage_key(tensor) -> tuple[str, int]:
    tensor = _local(tensor)
    return tensor.device.type, tensor.untyped_storage().data_ptr()


class StorageCount:
    """Bytes per device type of distinct storages; a storage already counted (here or in `seen`) is skipped."""

    def __init__(self, seen: set | None = None):
        self.seen = set() if seen is None else seen
        self.by_device: dict[str, int] = {}

    def add(self, tensors) -> StorageCount:
        for tensor in _tensors(tensors):
            if tensor.device.type == "meta" or tensor.untyped_storage().nbytes() == 0:
                continue
            key = _storage_key(tensor)
            if key not in self.seen:
                self.seen.add(key)
                self.by_device[key[0]] = self.by_device.get(key[0], 0) + tensor.untyped_storage().nbytes()
        return self

    @property
    def total(self) -> int:
        return sum(self.by_device.values())


def optimizer_chain(optimizer) -> list:
    """The optimizer and every wrapper's inner optimizer (Accelerate → DeepSpeed ZeRO → torch), outermost first."""
    chain = []
    while optimizer is not None and optimizer not in chain:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def local_parameters(model) -> list:
    """The parameter data this rank holds: ZeRO-3's partition (`ds_tensor`), FSDP's local shard, or the tensor."""
    held = []
    for parameter in model.parameters():
        local = getattr(parameter, "ds_tensor", None)
        if local is None and hasattr(parameter, "to_local"):
            local = parameter.to_local()
        held.append(parameter if local is None else local)
    return held


def optimizer_tensors(optimizer, model_storage: set) -> list:
    """Optimizer states, plus the tensors the torch optimizer steps on when they are not the model's own
    (the fp32 master copies of DeepSpeed and of mixed-precision wrappers)."""
    base = optimizer_chain(optimizer)[-1]
    held = [value for state in base.state.values() for value in state.values()
            if torch.is_tensor(value) and value.dim() > 0]
    # The stepped tensors: state is keyed by them, and ZeRO-3 empties param_groups between steps.
    stepped = [p for p in base.state if torch.is_tensor(p)]
    stepped += [p for group in base.param_groups for p in group["params"]]
    return held + [p for p in stepped if _storage_key(p) not in model_storage]


class GradientProbe:
    """Counts gradient bytes at the next optimizer step through a step pre-hook on the torch optimizer."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.held: StorageCount | None = None  # gradients in the model dtype, read at the step's first call
        self.stepped: dict[str, int] = {}       # gradients each stepped group was handed, summed over the step
        self.handle = optimizer_chain(optimizer)[-1].register_step_pre_hook(self._before_step)

    def _before_step(self, base, args, kwargs) -> None:
        if self.held is None:
            self.held = StorageCount().add([p.grad for p in self.model.parameters() if p.grad is not None])
            for wrapper in optimizer_chain(self.optimizer):
                for name in DEEPSPEED_GRADIENT_ATTRIBUTES:
                    self.held.add(getattr(wrapper, name, None))
        # DeepSpeed narrows param_groups to the group it steps now and frees that group's fp32 gradients
        # after; counting each call on its own keeps a reused address from hiding the next group's bytes.
        group = StorageCount(seen=set(self.held.seen))
        group.add([p.grad for g in base.param_groups for p in g["params"] if p.grad is not None])
        for device, nbytes in group.by_device.items():
            self.stepped[device] = self.stepped.get(device, 0) + nbytes

    @property
    def done(self) -> bool:
        return self.held is not None

    def by_device(self) -> dict[str, int]:
        devices = set(self.stepped) | set(self.held.by_device)
        return {d: self.held.by_device.get(d, 0) + self.stepped.get(d, 0) for d in sorted(devices)}

    def remove(self) -> None:
        self.handle.remove()


def measure_states(model, optimizer, gradients: dict[str, int]) -> dict:
    """The ledger of one rank after an optimizer step: bytes per category, and per device type."""
    params = StorageCount().add(local_parameters(model))
    optimizer_count = StorageCount(seen=set(params.seen)).add(optimizer_tensors(optimizer, params.seen))
    by_device = {"params_bytes": params.by_device, "grads_bytes": gradients,
                 "optimizer_bytes": optimizer_count.by_device}
    return {**{key: sum(devices.values()) for key, devices in by_device.items()}, "by_device": by_device}


def peak_memory() -> dict:
    """Peak device memory on an accelerator (allocated and reserved), else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"peak_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "peak_kind": "cuda_max_allocated"}
    import resource

    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_kind": "cpu_max_rss"}
