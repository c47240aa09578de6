"""Accelerate launch configs (the YAML `accelerate launch --config_file` reads) as dicts.

One function covers every strategy; the shipped files differ only in its arguments (see files.py).
Multi-node files carry placeholders that `accelerate launch --machine_rank R --main_process_ip IP`
overrides on each node.
"""

from __future__ import annotations

from typing import Any

STRATEGIES = ("single", "ddp", "deepspeed", "fsdp", "tensor_parallel")
FSDP_SHARDING = ("full_shard", "shard_grad_op", "hybrid_shard")
MAIN_PROCESS_IP_PLACEHOLDER = "MAIN_NODE_IP"


def accelerate_config(
    strategy: str = "ddp",
    num_processes: int = 2,
    num_machines: int = 1,
    use_cpu: bool = False,
    mixed_precision: str = "bf16",
    deepspeed_config_file: str | None = None,
    fsdp_sharding: str = "full_shard",
    fsdp_offload_params: bool = False,
    main_process_port: int = 29500,
    zero3_init: bool = False,
    parallelism: dict[str, int] | None = None,
) -> dict[str, Any]:
    """`num_processes` counts every process on every machine, as Accelerate does.

    `deepspeed_config_file` is relative to the directory `accelerate launch` runs in. With DeepSpeed the
    JSON decides precision, so `mixed_precision` is left out (Accelerate refuses both). `zero3_init`: the JSON is
    ZeRO-3, so the model loads partitioned under `zero.Init`, global rank 0 alone reading the checkpoint (what
    `finetune train` does anyway: TrainingArguments registers the DeepSpeed config before the model loads; the flag
    says so, and does the same for a script that creates its Accelerator first). `parallelism`: the mesh's sizes by
    Accelerate's names (`tp_size`, ...), written as its config's `parallelism_config` section, which
    `accelerate launch` exports to every process; `tensor_parallel` launches plain processes that Transformers
    shards itself while loading the model.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    # Not MULTI_CPU for plain processes: without mpirun, `accelerate launch` starts ONE process for it. MULTI_GPU
    # with use_cpu gives N gloo ranks (Trainer must also get use_cpu, which the recipe parser sets). A mesh axis in
    # the engine's place launches plain processes too.
    distributed_type = {"single": "NO", "deepspeed": "DEEPSPEED", "fsdp": "FSDP"}.get(strategy, "MULTI_GPU")
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "num_machines": num_machines,
        "num_processes": num_processes,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": use_cpu,
    }
    if strategy == "single":
        # One GPU, pinned: `accelerate launch` then sets CUDA_VISIBLE_DEVICES, so on a box with several GPUs Trainer
        # does not wrap the model in nn.DataParallel (finetune.recipe.preflight stops a process that sees several).
        config["gpu_ids"] = "0"
    if num_machines > 1:
        config.update(main_process_ip=MAIN_PROCESS_IP_PLACEHOLDER, main_process_port=main_process_port)
    if strategy == "deepspeed":
        config["deepspeed_config"] = {"deepspeed_config_file": deepspeed_config_file, "zero3_init_flag": zero3_init}
        # One launcher per node (like torchrun; what SLURM's srun and scripts/launch_multinode.sh start). Without
        # it Accelerate hands a multi-node DeepSpeed run to pdsh from node 0 (scripts/launch_deepspeed.sh does that).
        config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    else:
        config["mixed_precision"] = "no" if use_cpu else mixed_precision
    if strategy == "fsdp":
        config["fsdp_config"] = _fsdp_section(fsdp_sharding, fsdp_offload_params)
        if fsdp_sharding == "hybrid_shard":
            # FSDP2 hybrid sharding: shard inside a node, replicate across nodes (fast intra-node links only).
            config["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": num_machines,
                "parallelism_config_dp_shard_size": num_processes // num_machines,
                "parallelism_config_tp_size": 1,
                "parallelism_config_cp_size": 1,
            }
    if parallelism:
        config["parallelism_config"] = parallelism_section(**parallelism)
    return config


# The sizes of Accelerate's `ParallelismConfig`, as its config's `parallelism_config` section names them
# (`parallelism_config_<size>`).
PARALLELISM_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def parallelism_section(**sizes: int) -> dict[str, Any]:
    """Accelerate's `parallelism_config` keys for the sizes given by Accelerate's names (`tp_size=2`; 1 for the
    others); sequence parallelism through DeepSpeed Ulysses (`sp_backend: deepspeed`, the one Accelerate has)."""
    unknown = set(sizes) - set(PARALLELISM_SIZES)
    if unknown:
        raise ValueError(f"parallelism sizes must be among {PARALLELISM_SIZES}, got {sorted(unknown)}")
    section: dict[str, Any] = {f"parallelism_config_{name}": int(sizes.get(name, 1)) for name in PARALLELISM_SIZES}
    if section["parallelism_config_sp_size"] > 1:
        section["parallelism_config_sp_backend"] = "deepspeed"
    return section


def _fsdp_section(sharding: str, offload_params: bool) -> dict[str, Any]:
    if sharding not in FSDP_SHARDING:
        raise ValueError(f"fsdp_sharding must be one of {FSDP_SHARDING}, got {sharding!r}")
    return {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # wraps the model's `_no_split_modules` layers
        # FSDP2 expresses ZeRO-2-like sharding (gradients + optimizer only) as not resharding after forward.
        "fsdp_reshard_after_forward": sharding != "shard_grad_op",
        "fsdp_offload_params": offload_params,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
    }


def deepspeed_section_as_json(section: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config Accelerate builds from DeepSpeed keys written inline in its YAML (`zero_stage`,
    `offload_optimizer_device`, ...: the form `accelerate config` writes), as `DeepSpeedPlugin.__post_init__` does
    (accelerate/utils/dataclasses.py); Accelerate adds the precision section at launch from `mixed_precision`."""
    accumulation = str(section.get("gradient_accumulation_steps", "auto"))
    clipping = section.get("gradient_clipping", "auto")
    clipping = clipping if str(clipping) == "auto" else float(clipping)
    optimizer_device = str(section.get("offload_optimizer_device", "none")).lower()
    param_device = str(section.get("offload_param_device", "none")).lower()
    config: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": int(accumulation) if accumulation.isdigit() else accumulation,
        "zero_optimization": {
            "stage": int(section.get("zero_stage", 2)),
            "offload_optimizer": {
                "device": optimizer_device,
                "nvme_path": section.get("offload_optimizer_nvme_path", "none") if optimizer_device == "nvme" else None,
            },
            "offload_param": {
                "device": param_device,
                "nvme_path": section.get("offload_param_nvme_path", "none") if param_device == "nvme" else None,
            },
            "stage3_gather_16bit_weights_on_model_save":
                str(section.get("zero3_save_16bit_model", "false")).lower() == "true",
        },
    }
    if clipping:
        config["gradient_clipping"] = clipping
    return config
