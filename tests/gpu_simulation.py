"""A machine's GPUs, simulated for tests on CPU: what `finetune.launch.devices` and the preflight checks read from
torch."""

from types import SimpleNamespace

import torch

T4 = ("Tesla T4", (7, 5))
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))


def simulate_gpus(monkeypatch, gpu=T4, count: int = 1, memory_gib: float = 15.0):
    """`count` visible GPUs of model `gpu` (name, compute capability), as torch.cuda reports them, and no launcher.
    The recipe parser's `use_cpu` default still follows the real `torch.accelerator` (True here, so that
    `TrainingArguments` builds on CPU): give `--use_cpu false` to check a launch as a GPU machine parses it."""
    name, capability = gpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(name=name, major=capability[0], minor=capability[1],
                                                            total_memory=int(memory_gib * 1024**3)))
    for variable in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_MIXED_PRECISION",
                     "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch
