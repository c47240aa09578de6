"""The engine tensor parallelism runs as (`TensorSplit`): the model Transformers loads sharded, its own TP plan over
`tensor_parallel_size` ranks, FSDP2 over `dp_shard_size` of the rest, replicas over `dp_replicate_size`. How a launch's
strategy names and records it, how it is read back off a loaded model and a checkpoint's marker, what a resume needs
of its checkpoints, and the estimator's terms for one rank (finetune.memory.estimate asks a `Setup`'s axis for them).
A pipeline's stages split their layers by the same rule (`whole_heads`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from finetune.errors import RecipeError
from finetune.memory.estimate import (
    ModelShape,
    Setup,
    _torch_states,
    activation_bytes,
    fsdp_gathered_weights_bytes,
    fsdp_gradient_buffer_bytes,
    sequence_share,
)
from finetune.train.axes.tensor import KEY


@dataclass(frozen=True)
class TensorSplit:
    """Each layer's matrices over `size` ranks, FSDP2 over `dp_shard_size` ranks, `dp_replicate_size` replicas (the
    mesh replicas × shards × TP, TP innermost). A launch's `Strategy` and the estimator's `Setup` carry it as their
    `axis`: it takes the place of DDP, DeepSpeed or FSDP as the engine."""

    size: int
    dp_shard_size: int = 1
    dp_replicate_size: int = 1
    name: ClassVar[str] = "tensor_parallel"
    runs_its_own_loop: ClassVar[bool] = False  # Trainer drives it
    shards_parameters: ClassVar[bool] = True   # each rank holds its slice of every split matrix

    # --- the launch's strategy (finetune.launch.strategies.Strategy)
    def label(self, strategy=None) -> str:
        """`tp2`, `tp2_fsdp2`, `tp2_replicas2`."""
        return "".join([f"tp{self.size}", f"_fsdp{self.dp_shard_size}" if self.dp_shard_size > 1 else "",
                        f"_replicas{self.dp_replicate_size}" if self.dp_replicate_size > 1 else ""])

    def describe(self, strategy=None) -> str:
        """`tensor parallel 2 × FSDP2 2`."""
        return " × ".join([f"tensor parallel {self.size}",
                           *([f"FSDP2 {self.dp_shard_size}"] if self.dp_shard_size > 1 else []),
                           *([f"{self.dp_replicate_size} replicas"] if self.dp_replicate_size > 1 else [])])

    def record(self, strategy=None) -> dict:
        """Its part of the strategy's record (effective_config.json, checkpoint markers)."""
        return {KEY: self.size, "dp_shard_size": self.dp_shard_size, "dp_replicate_size": self.dp_replicate_size}

    @classmethod
    def from_record(cls, record: dict) -> TensorSplit:
        return cls(int(record.get(KEY, 1) or 1), int(record.get("dp_shard_size", 1) or 1),
                   int(record.get("dp_replicate_size", 1) or 1))

    @classmethod
    def of_model(cls, model) -> TensorSplit | None:
        """The split of a model Transformers loaded sharded (`DistributedConfig`), read off the model; None for any
        other model."""
        distributed = getattr(getattr(model, "config", None), "distributed_config", None)
        if (getattr(model, "_tp_size", None) or 1) == 1 or distributed is None:
            return None
        return cls(model._tp_size, distributed.fsdp_size or 1, distributed.dp_replicate_size or 1)

    def distributed_config(self, bf16: bool):
        """Transformers' `DistributedConfig` that loads the model sharded: its own TP plan over `size` ranks, FSDP2
        over `dp_shard_size`, replicas over `dp_replicate_size`. Under bf16 FSDP2 gathers the slices in bf16 and
        reduces their gradients in fp32 (Transformers' `fsdp_mixed_precision` policy), as Accelerate's FSDP2 does:
        without it the fp32 masters would be gathered and reduce-scattered in fp32, twice the bytes. (fp16 runs keep
        fp32 gathers: that policy is bf16 only.)"""
        from transformers.distributed import DistributedConfig

        return DistributedConfig(tp_size=self.size, fsdp_size=self.dp_shard_size,
                                 dp_replicate_size=self.dp_replicate_size,
                                 fsdp_mixed_precision=bf16 and self.dp_shard_size > 1)

    # --- the estimator (finetune.memory.estimate.estimate)
    @property
    def shard_degree(self) -> int:
        """Ranks FSDP2 splits a model state over; the TP split is `tensor_parallel_elements`."""
        return self.dp_shard_size

    def matrix_split(self, shape: ModelShape) -> int:
        return whole_heads(shape, self.size)

    def model_states(self, shape: ModelShape, setup: Setup) -> tuple:
        """Full fine-tuning only (the tensor home refuses LoRA): the rank's slices and FSDP2 shards of every weight."""
        return _torch_states(tensor_parallel_elements(shape, setup), 0, setup, shard_degree=1)

    def activations_bytes(self, shape: ModelShape, setup: Setup) -> float:
        return activation_bytes(shape, sequence_share(setup))

    def loaded_rank_bytes(self, shape: ModelShape, setup: Setup) -> tuple[int, ...]:
        return ()

    def temporary_bytes(self, shape: ModelShape, setup: Setup, trainable: int) -> float:
        """FSDP2's gathered weights and gradient buffers over the shards; none without FSDP2."""
        if self.dp_shard_size == 1:
            return 0
        return fsdp_gathered_weights_bytes(shape, setup) + fsdp_gradient_buffer_bytes(shape, setup, trainable)


def whole_heads(shape: ModelShape, tensor: int) -> int:
    """`tensor` if a decoder layer's matrices split that many ways with whole attention and key/value heads on each
    rank, as the TP plan cuts them (finetune.train.axes.tensor.check_tensor_parallel_model refuses the rest)."""
    if tensor > 1 and (shape.num_attention_heads % tensor or shape.num_key_value_heads % tensor):
        raise RecipeError(f"`{KEY}: {tensor}` does not divide {shape.name}'s {shape.num_attention_heads} attention "
                          f"heads and {shape.num_key_value_heads} key/value heads.")
    return tensor


def tensor_parallel_elements(shape: ModelShape, setup: Setup) -> int:
    """Parameters `setup.rank` holds under tensor parallelism, FSDP2's shards of them included. The model's TP plan
    splits the block's linear layers t ways (q, k, v, gate, up by output rows, o and down by input columns) and the
    vocabulary matrices by rows (the output head `colwise`, the input embedding with it, one matrix when tied);
    FSDP2 then cuts every tensor by rows over the `dp_shard_size` ranks. Uneven rows are cut as `torch.chunk` cuts
    them (⌈rows / n⌉ a rank, the rest on the last): the rank's place in the mesh (replicas × shards × TP, TP
    innermost) decides its share."""
    t, s = setup.axis.size, setup.axis.dp_shard_size
    tp_rank, shard_rank = setup.rank % t, setup.rank // t % s
    matrices = 1 if shape.tied_embeddings else 2
    whole = shape.num_parameters - shape.block_linear_parameters - matrices * shape.vocab_size * shape.hidden_size
    rows = _chunk(_chunk(shape.vocab_size, t, tp_rank), s, shard_rank)
    return whole // s + shape.block_linear_parameters // (t * s) + matrices * rows * shape.hidden_size


def _chunk(size: int, parts: int, index: int) -> int:
    """The length of piece `index` when `torch.chunk` cuts `size` into `parts`."""
    piece = math.ceil(size / parts)
    return max(0, min(piece, size - index * piece))
