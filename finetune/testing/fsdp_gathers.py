"""`python -m finetune` measuring what FSDP2 gathers, for the tests of the plan's gathered-weights term: over the
second training micro-step, the weights FSDP2 holds gathered at once (every group's unsharded parameters and the
all-gather buffers they are copied out of, each storage counted once) are summed at each moment FSDP2 allocates one
(after an all-gather, after a copy-out), and the peak is written, with the parameter count of each FSDP2 group, to
`$FINETUNE_RECORD_GATHERS/rank<RANK>.json`:
    accelerate launch --config_file ... -m finetune.testing.fsdp_gathers train ...
A launch whose own program is a CPU shim (`-m finetune.testing.parallelism_on_cpu`) names it in
`$FINETUNE_RECORD_GATHERS_UNDER`: that module then runs in place of `finetune`.

It reads FSDP2's own state (torch.distributed.fsdp._fully_shard, torch 2.13): the all-gather result a group holds
until its copy-out, the one the forward defers to the next copy-out, and the unsharded parameters' storages, which
FSDP2 resizes to 0 when it reshards. Only the measured micro-step is observed; everything else is the user's path.
"""

import json
import os
import runpy
from pathlib import Path

import torch
import transformers

RECORD_DIR = "FINETUNE_RECORD_GATHERS"
UNDER = "FINETUNE_RECORD_GATHERS_UNDER"
MEASURED_STEP = 1  # the second optimizer step: the first runs FSDP2's lazy initialization


def param_groups(model: torch.nn.Module) -> list[tuple[str, object]]:
    """Each FSDP2 parameter group and the names of the modules it wraps (one `fully_shard` may take several)."""
    from torch.distributed.fsdp import FSDPModule

    groups = {}
    for name, module in model.named_modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is not None:
            groups.setdefault(id(group), (name, group))
    return list(groups.values())


def gathered_bytes(groups) -> int:
    """The weights every group holds gathered now: unsharded parameters and all-gather buffers, by storage."""
    storages = {}

    def add(tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()

    for _, group in groups:
        for result in (group._all_gather_result, getattr(group.comm_ctx.all_gather_state, "all_gather_result", None)):
            if result is not None:
                add(result.all_gather_output)
        for fsdp_param in group.fsdp_params:
            for tensor in fsdp_param.all_gather_outputs:
                add(tensor)
    return sum(storages.values())


class GatherMeter:
    """The peak of `gathered_bytes` while installed: sampled after each all-gather and each copy-out."""

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        self.groups = param_groups(model)
        self.peak = 0
        self._module = _fsdp_param_group
        self._copy_out = _fsdp_param_group.foreach_all_gather_copy_out

        def copy_out_and_sample(*args, **kwargs):
            self._copy_out(*args, **kwargs)
            self.sample()

        _fsdp_param_group.foreach_all_gather_copy_out = copy_out_and_sample
        for _, group in self.groups:
            group.unshard = self._sampled(group.unshard)
            group.wait_for_unshard = self._sampled(group.wait_for_unshard)

    def _sampled(self, method):
        def call_and_sample(*args, **kwargs):
            result = method(*args, **kwargs)
            self.sample()
            return result

        return call_and_sample

    def sample(self) -> None:
        self.peak = max(self.peak, gathered_bytes(self.groups))

    def remove(self) -> None:
        self._module.foreach_all_gather_copy_out = self._copy_out
        for _, group in self.groups:
            del group.unshard, group.wait_for_unshard

    def record(self) -> dict:
        return {"gathered_weights_peak_bytes": self.peak,
                "groups": [{"module": name, "parameters": sum(p._orig_size.numel() for p in group.fsdp_params),
                            "dtype": str(group.fsdp_params[0].param_dtype or group.fsdp_params[0].orig_dtype)}
                           for name, group in self.groups]}


def measuring_training_step(training_step):
    def step_and_measure(self, model, inputs, *args, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        if self.state.global_step != MEASURED_STEP or getattr(self, "_gathers_measured", False) \
                or not any(isinstance(module, FSDPModule) for module in model.modules()):
            return training_step(self, model, inputs, *args, **kwargs)
        self._gathers_measured = True
        meter = GatherMeter(model)
        try:
            loss = training_step(self, model, inputs, *args, **kwargs)
        finally:
            meter.remove()
        path = Path(os.environ[RECORD_DIR], f"rank{os.environ.get('RANK', '0')}.json")
        path.write_text(json.dumps(meter.record()))
        return loss

    return step_and_measure


if __name__ == "__main__":  # Trainer's training step wrapped in this process only, then exactly `python -m finetune`
    transformers.Trainer.training_step = measuring_training_step(transformers.Trainer.training_step)
    runpy.run_module(os.environ.get(UNDER, "finetune"), run_name="__main__", alter_sys=True)
