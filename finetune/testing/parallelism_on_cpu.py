"""`python -m finetune` with Accelerate allowed to build a `ParallelismConfig` mesh on CPU processes over gloo: the CPU
twin of a tensor-parallel run (alone or with FSDP2), for the tests and `finetune bench --cpu`, never on a GPU path:
    accelerate launch --config_file accelerate_configs/cpu_tensor_parallel.yaml -m finetune.testing.parallelism_on_cpu
    train recipes/demo.yaml

Accelerate checks a parallelism config against the launch (accelerate/parallelism_config.py, `_validate_accelerator`)
and accepts only GPU-like distributed types (`Accelerator.multi_device` lists MULTI_GPU, MULTI_XPU, ..., never
MULTI_CPU), though the DTensor mesh, Transformers' TP plan and FSDP2 all run on CPU over gloo. This shim counts
MULTI_CPU among them, that one property; everything after it is the user's path.
"""

import os
import runpy

from accelerate import Accelerator
from accelerate.utils import DistributedType

from finetune.train.axes.tensor import CPU_MESH_ALLOWED

_multi_device = Accelerator.multi_device


def _multi_device_or_cpu(self) -> bool:
    return _multi_device.fget(self) or (self.use_distributed and self.distributed_type == DistributedType.MULTI_CPU)


if __name__ == "__main__":  # then exactly `python -m finetune ...`; importing this module changes nothing
    Accelerator.multi_device = property(_multi_device_or_cpu)
    os.environ[CPU_MESH_ALLOWED] = "1"  # the recipe check's sign that this shim runs (finetune.train.axes.tensor)
    runpy.run_module("finetune", run_name="__main__", alter_sys=True)
