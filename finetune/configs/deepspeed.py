"""DeepSpeed JSON configs as dicts.

Values Trainer knows are left as "auto" so the recipe stays the one source of truth: micro batch,
accumulation, train batch, gradient clipping, precision, and ZeRO-3's size-dependent buckets
(transformers/integrations/deepspeed.py: `trainer_config_process`, `trainer_config_finalize`).
ZeRO-1/2 buckets are fixed (2e8, as in Hugging Face's ZeRO-2 example): Trainer's "auto" is hidden², which splits
a small model's gradients into thousands of collectives per step, and DeepSpeed's own default (5e8) allocates
2.5 times the memory for them.
"""

from __future__ import annotations

from typing import Any

OFFLOAD_DEVICES = ("cpu", "nvme")
NVME_PATH_PLACEHOLDER = "/local_nvme"
BUCKET_SIZE = 200_000_000  # ZeRO-1/2 reduce and all-gather buckets, elements


# ZeRO-3's NVMe parameter swapper moves one parameter partition through one buffer of `buffer_size` elements
# (deepspeed/runtime/swap_tensor/partitioned_param_swapper.py `get_buffer`: "More elements ... than buffer size"), so a
# buffer must hold the largest partition: ceil(numel / world size) of the largest weight. DeepSpeed's default (1e8)
# is too small for Llama-3-8B's embedding on 2 GPUs (262.7M). "auto" is filled by `finetune train` from the model it
# loaded and the world size it runs (`fill_nvme_param_buffer`); `finetune plan` prints the number for other launchers.
DEEPSPEED_DEFAULT_PARAM_BUFFER = 100_000_000


def _offload(device: str, nvme_path: str | None, parameters: bool = False) -> dict[str, Any]:
    if device not in OFFLOAD_DEVICES:
        raise ValueError(f"offload device must be one of {OFFLOAD_DEVICES}, got {device!r}")
    section: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        section["nvme_path"] = nvme_path
        if parameters:
            section["buffer_size"] = "auto"
    return section


def partition_elements(numel: int, world_size: int) -> int:
    """Elements of one rank's ZeRO-3 partition of a weight: ceil(numel / world size) (partition_parameters.py pads
    each weight to a multiple of the world size)."""
    return -(-numel // world_size)


def nvme_param_buffer(config: dict[str, Any]) -> Any:
    """`zero_optimization.offload_param.buffer_size` of a config offloading parameters to NVMe (a number, "auto"
    or DeepSpeed's default when unset); None when parameters are not offloaded to NVMe."""
    offload = (config.get("zero_optimization") or {}).get("offload_param") or {}
    if offload.get("device") != "nvme":
        return None
    return offload.get("buffer_size", DEEPSPEED_DEFAULT_PARAM_BUFFER)


def nvme_buffer_problem(config: dict[str, Any], largest_partition: int, source: str = "DeepSpeed config") -> str | None:
    """Why the NVMe parameter buffer cannot hold a partition of `largest_partition` elements, or None."""
    size = nvme_param_buffer(config)
    if size is None or size == "auto" or int(size) >= largest_partition:
        return None
    return (f"{source}: `zero_optimization.offload_param.buffer_size` {int(size):,} is smaller than the largest "
            f"parameter partition, {largest_partition:,} elements (DeepSpeed would stop with \"More elements ... than "
            f"buffer size\"): set it to {largest_partition} or \"auto\" (finetune train sizes it from the model).")


def fill_nvme_param_buffer(config: dict[str, Any], largest_partition: int) -> None:
    """Replaces an "auto" NVMe parameter buffer with the largest partition, in place."""
    if nvme_param_buffer(config) == "auto":
        config["zero_optimization"]["offload_param"]["buffer_size"] = largest_partition


def fill_hpz_partition_size(config: dict[str, Any], processes_per_node: int) -> None:
    """Replaces an "auto" ZeRO++ hpZ group with the processes of one node (the launch's LOCAL_WORLD_SIZE), in place."""
    zero = config.get("zero_optimization") or {}
    if zero.get("zero_hpz_partition_size") == "auto":
        zero["zero_hpz_partition_size"] = processes_per_node


def deepspeed_config(
    stage: int = 2,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    nvme_path: str | None = None,
    overlap_comm: bool = True,
    zeropp_hpz_partition_size: int | str | None = None,
) -> dict[str, Any]:
    """A ZeRO config for `stage` 0-3, optional offload to `cpu`/`nvme`, optional ZeRO++ (stage 3).

    `zeropp_hpz_partition_size` turns on ZeRO++: quantized weight all-gather (qwZ), quantized gradient
    reduce-scatter (qgZ) and a secondary weight partition of that many ranks, the GPUs of one node (hpZ), so the
    backward all-gather stays inside the node (arXiv 2306.10209); "auto" is filled from the launch by `finetune train`
    (`fill_hpz_partition_size`), so one file serves nodes of any size.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update(overlap_comm=overlap_comm, contiguous_gradients=True)
    if stage in (1, 2):
        # No round_robin_gradients: it reorders the flat partitions, and DeepSpeed's ds_to_universal then puts
        # the wrong values in most parameters (measured), so the checkpoint could not change world size.
        zero.update(reduce_bucket_size=BUCKET_SIZE, allgather_bucket_size=BUCKET_SIZE, allgather_partitions=True,
                    reduce_scatter=True)
    if stage == 3:
        zero.update(
            reduce_bucket_size="auto",
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
            stage3_max_live_parameters=1e9,
            stage3_max_reuse_distance=1e9,
            # Saves consolidated 16-bit weights, so a saved model loads with from_pretrained directly.
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if zeropp_hpz_partition_size:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True,
                    zero_hpz_partition_size=zeropp_hpz_partition_size)
    if offload_optimizer:
        zero["offload_optimizer"] = _offload(offload_optimizer, nvme_path)
    if offload_param:
        zero["offload_param"] = _offload(offload_param, nvme_path, parameters=True)
    return {
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }
