"""`python -m finetune` with Accelerate allowed to prepare FSDP on CPU processes over gloo: the CPU twin of an FSDP run,
for the tests and `finetune bench --cpu`, never on a GPU path:
    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml -m finetune.testing.fsdp_on_cpu train
    recipes/demo.yaml

Accelerate turns FSDP on only for GPU-like distributed types (accelerate/state.py: `AcceleratorState.__init__`
switches MULTI_GPU, MULTI_XPU, ... to FSDP, never MULTI_CPU), though PyTorch's FSDP2 (`fully_shard`) shards and trains
on CPU over gloo. This shim makes that one switch for MULTI_CPU too, as Accelerate makes it (with the mixed precision
policy FSDP2 casts by: Accelerate wraps no autocast around an FSDP2 model); everything after it is the user's path.
"""

import runpy

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    # Accelerator builds the plugin from the launcher's variables and hands it here (the state is shared: an earlier
    # call, from TrainingArguments, had none).
    if fsdp_plugin is not None and self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.FSDP):
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type  # as Accelerate does for GPUs


AcceleratorState.__init__ = _init_with_fsdp_on_cpu

if __name__ == "__main__":  # then exactly `python -m finetune ...`
    runpy.run_module("finetune", run_name="__main__", alter_sys=True)
