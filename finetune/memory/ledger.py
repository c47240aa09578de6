"""What one rank really holds: bytes of parameters, gradients and optimizer states, found by walking the objects.

Bytes are counted per storage, not per tensor, so a flat buffer that many parameters view (DeepSpeed's
flattened groups, alignment padding included) counts once, and a tensor two owners share counts once.
Gradients are read where they peak. At the optimizer step a pre-hook on the innermost torch optimizer sees each
gradient partition DeepSpeed hands it, plus the gradients still held in the model dtype; DeepSpeed steps one
parameter group (ZeRO-3: one sub-group) at a time and frees each fp32 partition right after, so the step holds the
largest of those at once. Under gradient accumulation the gradients held between micro-steps are read too (ZeRO-1
keeps them at full size until the boundary): the callback calls `GradientProbe.between_micro_steps`.
"""

from __future__ import annotations

import torch

# Where DeepSpeed's ZeRO optimizers keep gradient partitions in the model dtype between backward and step
# (stage_1_and_2.py: averaged_gradients at the boundary, all_grad_tensors between micro-steps,
# independent_gradient_partition_epilogue; stage3.py: grad_partitions_flat_buffer).
DEEPSPEED_GRADIENT_ATTRIBUTES = ("averaged_gradients", "all_grad_tensors", "grads_in_partition",
                                 "grad_partitions_flat_buffer")


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


def held_gradients(model, optimizer) -> StorageCount:
    """Gradients held now: `p.grad`, DeepSpeed's fp32 accumulation attribute `p.grad_accum` (stage_1_and_2.py
    `_fill_param_grad_accum_attribute`) and its partition buffers."""
    parameters = list(model.parameters())
    held = StorageCount().add([p.grad for p in parameters if p.grad is not None])
    held.add([p.grad_accum for p in parameters if getattr(p, "grad_accum", None) is not None])
    for wrapper in optimizer_chain(optimizer):
        for name in DEEPSPEED_GRADIENT_ATTRIBUTES:
            held.add(getattr(wrapper, name, None))
    return held


class GradientProbe:
    """Counts gradient bytes at the next optimizer step (a step pre-hook on the torch optimizer) and, each time
    `between_micro_steps` is called, the gradients held between two micro-steps; keeps the largest of those."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.held: StorageCount | None = None  # gradients in the model dtype, read at the step's first call
        self.stepped: dict[str, int] = {}       # the largest set of gradients one stepped group was handed
        self.between: dict[str, int] = {}       # the most held between micro-steps so far
        self.handle = optimizer_chain(optimizer)[-1].register_step_pre_hook(self._before_step)

    def _before_step(self, base, args, kwargs) -> None:
        if self.held is None:
            self.held = held_gradients(self.model, self.optimizer)
        # DeepSpeed narrows param_groups to the (sub-)group it steps now and frees that group's fp32 gradients after
        # (stage_1_and_2.py::step "Step 4: get rid of the fp32 gradients"; stage3.py::_release_sub_group): one
        # group's copy is held at a time. Each call is counted on its own so a reused address hides nothing.
        group = StorageCount(seen=set(self.held.seen))
        group.add([p.grad for g in base.param_groups for p in g["params"] if p.grad is not None])
        if group.total > sum(self.stepped.values()):
            self.stepped = dict(group.by_device)

    def between_micro_steps(self) -> None:
        """Reads the gradients held after a micro-step that is not an accumulation boundary."""
        held = held_gradients(self.model, self.optimizer)
        if held.total > sum(self.between.values()):
            self.between = dict(held.by_device)

    @property
    def done(self) -> bool:
        return self.held is not None

    def by_device(self) -> dict[str, int]:
        devices = set(self.stepped) | set(self.held.by_device)
        return {d: self.held.by_device.get(d, 0) + self.stepped.get(d, 0) for d in sorted(devices)}

    def remove(self) -> None:
        """Stops counting optimizer steps (the first one is measured); `between_micro_steps` still works."""
        self.handle.remove()


def measure_states(model, optimizer, gradients: dict[str, int]) -> dict:
    """The ledger of one rank after an optimizer step: bytes per category, and per device type."""
    params = StorageCount().add(local_parameters(model))
    optimizer_count = StorageCount(seen=set(params.seen)).add(optimizer_tensors(optimizer, params.seen))
    by_device = {"params_bytes": params.by_device, "grads_bytes": gradients,
                 "optimizer_bytes": optimizer_count.by_device}
    return {**{key: sum(devices.values()) for key, devices in by_device.items()}, "by_device": by_device}


def gradient_peaks(ledger: dict, between: dict[str, int]) -> dict:
    """The ledger's gradient figures besides the step: between micro-steps (0 without accumulation) and the peak."""
    between_bytes = sum(between.values())
    ledger["by_device"]["grads_between_micro_steps_bytes"] = dict(between)
    return {**ledger, "grads_between_micro_steps_bytes": between_bytes,
            "grads_peak_bytes": max(ledger["grads_bytes"], between_bytes)}


class PhasePeaks:
    """`torch.cuda.max_memory_allocated` per training phase ("micro_step": a forward and backward that ends between
    micro-steps; "step": the boundary micro-step with the optimizer step), read and reset at each phase's end; does
    nothing without CUDA."""

    def __init__(self):
        self.by_phase: dict[str, int] = {}

    def record(self, phase: str) -> None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        self.by_phase[phase] = max(self.by_phase.get(phase, 0), torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()


# The process's peak resident set before a span reset the kernel's high-water mark (`HostLoadProbe`), which
# `peak_resident_bytes` still counts: the reset lowers getrusage's maxrss too.
_PEAK_BEFORE_RESET = 0


def peak_resident_bytes() -> int:
    """The process's peak resident set so far (Linux reports KiB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(peak if sys.platform == "darwin" else peak * 1024, _PEAK_BEFORE_RESET)


def _reset_resident_high_water_mark() -> bool:
    """Starts the kernel's high-water mark of this process's resident set afresh (Linux: "5" into
    /proc/self/clear_refs, proc(5)), the peak so far kept for `peak_resident_bytes`; False where it cannot."""
    global _PEAK_BEFORE_RESET

    earlier = peak_resident_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    _PEAK_BEFORE_RESET = earlier
    return True


def _resident_high_water_mark() -> int:
    """VmHWM of /proc/self/status: the peak resident set since the last reset, in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


class HostLoadProbe:
    """Host RAM a span takes (`finetune train`: loading the model and preparing it for the method): the process's
    peak resident set during the span less its resident set at its start. On Linux the peak is the span's own (the
    kernel's high-water mark, reset at the start); elsewhere the process's lifetime peak, which overstates the span
    where the process was larger before it (imports freed, pages reclaimed under memory pressure)."""

    def __init__(self):
        import psutil

        self.before = psutil.Process().memory_info().rss
        self.own_peak = _reset_resident_high_water_mark()
        self.bytes: int | None = None

    def stop(self) -> int:
        peak = _resident_high_water_mark() if self.own_peak else peak_resident_bytes()
        self.bytes = max(0, peak - self.before)
        return self.bytes


def peak_memory(phases: dict[str, int] | None = None) -> dict:
    """Peak device memory on an accelerator (allocated, over the whole run when `phases` holds the peaks read before
    a reset, and reserved since the last reset), else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"peak_bytes": max(torch.cuda.max_memory_allocated(), *(phases or {}).values()),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "peak_kind": "cuda_max_allocated"}
    return {"peak_bytes": peak_resident_bytes(), "peak_kind": "cpu_max_rss"}
