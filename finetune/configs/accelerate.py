"""Accelerate launch configs (the YAML `accelerate launch --config_file` reads) as dicts."""

from __future__ import annotations

from typing import Any


def accelerate_config(
    strategy: str = "ddp",
    num_processes: int = 2,
    num_machines: int = 1,
    use_cpu: bool = False,
    mixed_precision: str = "no",
    deepspeed_config_file: str | None = None,
) -> dict[str, Any]:
    """`strategy` is one of single, ddp, deepspeed; `deepspeed_config_file` is relative to the launch directory."""
    distributed_type = {"single": "NO", "ddp": "MULTI_CPU" if use_cpu else "MULTI_GPU", "deepspeed": "DEEPSPEED"}
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type[strategy],
        "num_machines": num_machines,
        "num_processes": num_processes,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": use_cpu,
    }
    if strategy != "deepspeed":
        config["mixed_precision"] = mixed_precision  # with DeepSpeed the JSON decides precision
    else:
        config["deepspeed_config"] = {"deepspeed_config_file": deepspeed_config_file, "zero3_init_flag": False}
    return config
