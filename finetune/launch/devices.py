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
# reports it, dense peaks from the vendors' datasheets (shared/REFERENCE.md; None where none is recorded).
KNOWN_GPUS = {
    "t4": Gpu("Tesla T4", (7, 5), 15.0, 65.0),
    "v100": Gpu("Tesla V100", (7, 0), 32.0),
    "a10g": Gpu("NVIDIA A10G", (8, 6), 22.0),
    "l4": Gpu("NVIDIA L4", (8, 9), 22.0),
    "rtx4090": Gpu("NVIDIA GeForce RTX 4090", (8, 9), 24.0),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80.0, 312.0),
    "a100-40gb": Gpu("NVIDIA A100-SXM4-40GB", (8, 0), 40.0, 312.0),
    "h100-pcie": Gpu("NVIDIA H100 PCIe", (9, 0), 80.0, 756.0),
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80.0, 989.0),
    "h200": Gpu("NVIDIA H200", (9, 0), 141.0, 989.0),
}
# How a device name (`torch.cuda.get_device_name`) is recognised, most specific first.
_NAME_MARKERS = (("H100 PCIe", "h100-pcie"), ("H100", "h100"), ("H200", "h200"), ("A100", "a100"), ("T4", "t4"),
                 ("V100", "v100"), ("A10G", "a10g"), ("L4", "l4"), ("4090", "rtx4090"))


def known_gpu(device_name: str) -> Gpu | None:
    """The table's entry for a device name as CUDA reports it, or None (a CPU, an unknown GPU)."""
    return next((KNOWN_GPUS[key] for marker, key in _NAME_MARKERS if marker in device_name), None)


def visible_gpu() -> Gpu | None:
    """The first GPU this process sees (device 0: what Trainer trains on), or None without CUDA."""
    import torch  # only where a GPU is asked about: planning loads no torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    memory = torch.cuda.get_device_properties(0).total_memory / 1024**3
    return Gpu(torch.cuda.get_device_name(0), (int(major), int(minor)), memory)


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
