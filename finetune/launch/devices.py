"""The GPU a run is for: its name, compute capability and memory, and the one answer to "does it do bf16?".

Everything that picks a precision (plan, train preflight, QLoRA's compute dtype, the notebooks) asks `Gpu.supports_bf16`
here, on the visible GPU (`visible_gpu`) or a named one (`KNOWN_GPUS`, for `finetune plan --gpu t4`).
"""

from __future__ import annotations

from dataclasses import dataclass

# bf16 arithmetic arrived with Ampere (compute capability 8.0): the test `torch.cuda.is_bf16_supported(
# including_emulation=False)` makes (`get_device_properties(device).major >= 8`, torch/cuda/__init__.py). Older GPUs
# (Turing T4 7.5, Volta V100 7.0) have fp16 tensor cores only; Transformers' and Accelerate's own checks count
# emulation as support, so on a T4 they let bf16 through to run emulated.
BF16_COMPUTE_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_capability: tuple[int, int]
    memory_gib: float | None = None
    peak_tflops: float | None = None  # dense bf16 (fp16 on a T4) peak, for MFU; None where not recorded

    @property
    def supports_bf16(self) -> bool:
        return tuple(self.compute_capability) >= BF16_COMPUTE_CAPABILITY

    @property
    def half_precision(self) -> str:
        """The mixed precision to train in: bf16 where the GPU has it (fp16 needs loss scaling), else fp16."""
        return "bf16" if self.supports_bf16 else "fp16"

    def describe(self) -> str:
        major, minor = self.compute_capability
        return f"{self.name} (compute capability {major}.{minor})"


# For `finetune plan --gpu NAME` and MFU: compute capabilities from NVIDIA's CUDA GPUs table, memory as the GPU
# reports it, dense (no sparsity) bf16 peaks from NVIDIA's datasheets, fp16 where the GPU has no bf16 (T4, V100), with
# fp32 accumulation on a GeForce card (shared/REFERENCE.md). None where NVIDIA publishes no figure (the A10G, AWS's
# variant of the A10): MFU then needs `peak_tflops`, and the run says so.
KNOWN_GPUS = {
    "t4": Gpu("Tesla T4", (7, 5), 15.0, 65.0),
    "v100": Gpu("Tesla V100-SXM2-32GB", (7, 0), 32.0, 125.0),
    "a10": Gpu("NVIDIA A10", (8, 6), 22.5, 125.0),
    "a10g": Gpu("NVIDIA A10G", (8, 6), 22.0),
    "l4": Gpu("NVIDIA L4", (8, 9), 22.0, 121.0),
    "l40": Gpu("NVIDIA L40", (8, 9), 45.0, 181.0),
    "l40s": Gpu("NVIDIA L40S", (8, 9), 45.0, 362.0),
    "rtx4090": Gpu("NVIDIA GeForce RTX 4090", (8, 9), 24.0, 165.0),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80.0, 312.0),
    "a100-40gb": Gpu("NVIDIA A100-SXM4-40GB", (8, 0), 40.0, 312.0),
    "h100-pcie": Gpu("NVIDIA H100 PCIe", (9, 0), 80.0, 756.0),
    "h100-nvl": Gpu("NVIDIA H100 NVL", (9, 0), 93.6, 835.0),
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80.0, 989.0),
    "h200": Gpu("NVIDIA H200", (9, 0), 141.0, 989.0),
}
# The other names CUDA gives the same parts (`torch.cuda.get_device_name`), each with its own datasheet peak.
_OTHER_NAMES = {
    "Tesla V100-SXM2-16GB": KNOWN_GPUS["v100"],
    "Tesla V100-PCIE-16GB": Gpu("Tesla V100-PCIE-16GB", (7, 0), 16.0, 112.0),
    "Tesla V100-PCIE-32GB": Gpu("Tesla V100-PCIE-32GB", (7, 0), 32.0, 112.0),
    "Tesla V100S-PCIE-32GB": Gpu("Tesla V100S-PCIE-32GB", (7, 0), 32.0, 130.0),
    "NVIDIA A100-PCIE-40GB": KNOWN_GPUS["a100-40gb"],
    "NVIDIA A100 80GB PCIe": KNOWN_GPUS["a100"],
}
# Exact names only: a part whose name merely contains a known one ("NVIDIA L40S" holds "L4", "NVIDIA H100 NVL" holds
# "H100") is another part with another peak.
_BY_DEVICE_NAME = {gpu.name: gpu for gpu in KNOWN_GPUS.values()} | _OTHER_NAMES


def known_gpu(device_name: str) -> Gpu | None:
    """The table's entry for a device name exactly as CUDA reports it, or None (a CPU, a GPU not in the table)."""
    return _BY_DEVICE_NAME.get(device_name.strip())


def visible_gpu() -> Gpu | None:
    """The first GPU this process sees (device 0: what Trainer trains on), or None without CUDA."""
    gpus = visible_gpus()
    return gpus[0] if gpus else None


def visible_gpus() -> list[Gpu]:
    """Every GPU this process sees, as CUDA (or ROCm) reports it; none without one."""
    import torch  # only where a GPU is asked about: planning loads no torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for device in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(device)
        memory = torch.cuda.get_device_properties(device).total_memory / 1024**3
        gpus.append(Gpu(torch.cuda.get_device_name(device), (int(major), int(minor)), memory))
    return gpus


def gpu_named(name: str | None = None, compute_capability: str | None = None) -> Gpu | None:
    """A GPU from `--gpu NAME` or `--compute-capability MAJOR.MINOR`, else the visible one (None: no GPU known)."""
    from finetune.errors import RecipeError, did_you_mean

    if name is not None:
        key = name.lower()
        if key not in KNOWN_GPUS:
            raise RecipeError(f"`--gpu {name}` is not a known GPU{did_you_mean(key, KNOWN_GPUS)} (known: "
                              f"{', '.join(KNOWN_GPUS)}); or give `--compute-capability MAJOR.MINOR`.")
        return KNOWN_GPUS[key]
    if compute_capability is not None:
        try:
            major, minor = (int(part) for part in compute_capability.split("."))
        except ValueError:
            raise RecipeError(f"`--compute-capability {compute_capability}` must read MAJOR.MINOR, e.g. 7.5 "
                              "(T4) or 8.0 (A100).") from None
        return Gpu(f"a GPU of compute capability {major}.{minor}", (major, minor))
    return visible_gpu()


def default_precision(gpu: Gpu | None) -> str:
    """`auto` precision: the GPU's half precision; fp32 on CPU is for `use_cpu` runs, so with no GPU known the
    planner assumes a bf16 GPU (its default before GPUs were told apart)."""
    return gpu.half_precision if gpu is not None else "bf16"


def training_precision_here() -> str:
    """What a run on this machine should train in: bf16 or fp16 by the visible GPU, fp32 without one (notebooks)."""
    gpu = visible_gpu()
    return gpu.half_precision if gpu is not None else "fp32"


def without_deepspeeds_cpu_inference_collective(uses_deepspeed: bool) -> bool:
    """On a machine without GPUs, keeps a DeepSpeed run from compiling `deepspeed_shm_comm` (a shared-memory
    all-reduce, about a CPU-minute of C++ in each new environment) when its communication backend starts
    (deepspeed/comm/torch.py, `build_shm_op`). Only DeepSpeed's inference all-reduce reads it (`init_inference`,
    AutoTP layers), which without it is the process group's own all-reduce; training calls neither. Returns whether it
    was kept out."""
    import importlib.util

    if not uses_deepspeed or importlib.util.find_spec("deepspeed") is None:
        return False
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    # `import deepspeed.comm.torch as x` would bind torch itself: deepspeed.comm's attribute `torch` is the module
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None
    return True
