"""What autograd saves for backward, measured: the estimator's activation model (`finetune.memory.estimate`) is
checked against these numbers, at the widths of the models people train, on a machine without a GPU.

The model is built from its config (no weights, no download) with one and then two decoder layers, its parameters as
fake tensors on the CPU (`torch._subclasses.fake_tensor`: shapes, dtypes and real kernel dispatch, no memory, no
arithmetic), and one forward runs under `torch.autograd.graph.saved_tensors_hooks`, which sees every tensor an
operation keeps for its backward. Distinct storages are summed once each (q, k and v save the same normed input),
parameters left out (they are model states). Two layers minus one is one layer's bytes; the rest is what lies outside
the layers (the loss's log-probabilities, the final norm).

The weights and adapters are held as `finetune train` holds them for the strategy (`held_precisions`), under autocast
where Trainer uses it. Two kernels differ between CPU and GPU, and the GPU's is used: dropout is `native_dropout` (what
`dropout` dispatches to on CUDA: a bool mask, aten/src/ATen/native/Dropout.cpp `is_fused_kernel_acceptable`; the CPU's
keeps a mask in the input's dtype), and SDPA is the CPU's flash kernel, which saves what the GPU's flash and
memory-efficient kernels save (q, k, v, the output and the fp32 log-sum-exp). Gradient checkpointing is measured
re-entrant, whose saved inputs the hooks see; Transformers' default (non-re-entrant) holds the same inputs through
its recomputation closure instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from finetune.memory.estimate import Setup, held_precisions


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward in one micro-batch's forward."""

    per_layer: int        # one decoder layer: two layers minus one
    outside_layers: int   # one layer's model minus that layer: the final norm, the head's input, the loss's
                          # log-probabilities (under LoRA also the first layer's shortfall: nothing before it needs a
                          # gradient, so its first norm keeps nothing)

    def total(self, num_layers: int) -> int:
        return self.outside_layers + num_layers * self.per_layer


def measure(model: str, setup: Setup, loss: bool = True, packed_examples: int = 0,
            micro_batches: int = 1) -> SavedBytes:
    """Saved-for-backward bytes of `model` (a name `finetune.memory.shapes.resolve_config` reads) trained as `setup`
    says (precision, strategy, LoRA rank/targets/dropout, micro-batch, sequence length, gradient checkpointing,
    attention); `packed_examples` > 0 packs that many examples in each row (position ids restart, as TRL's and this
    toolkit's packing give them); `loss=False` leaves the loss out. `micro_batches` > 1 runs that many forwards in
    one autocast context, their graphs all held, as the pipeline loop holds the micro-batches in flight."""
    if setup.qlora:
        raise ValueError("QLoRA's 4-bit layers (bitsandbytes) do not run on fake tensors: measure LoRA instead.")
    one = _saved_bytes(model, setup, 1, loss, packed_examples, micro_batches)
    two = _saved_bytes(model, setup, 2, loss, packed_examples, micro_batches)
    return SavedBytes(per_layer=two - one, outside_layers=2 * one - two)


def _saved_bytes(name: str, setup: Setup, layers: int, loss: bool, packed_examples: int,
                 micro_batches: int = 1) -> int:
    import torch

    model, mode = _fake_model(name, setup, layers)
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters:
            seen[storage._cdata] = storage.nbytes()
        return tensor

    b, s = setup.micro_batch_size * setup.method.sequences_per_example, setup.sequence_length
    precision = held_precisions(setup)
    autocast = torch.autocast("cpu", dtype=_dtype(precision.compute)) if precision.autocast \
        else contextlib.nullcontext()
    with mode, _gpu_dropout(), _positions_read(packed=bool(packed_examples)):
        ids = torch.zeros(b, s, dtype=torch.long)
        inputs = {"input_ids": ids, "labels": ids if loss else None}
        if setup.method.fused_head and loss:
            inputs["fused_lm_head"] = True
        if packed_examples:
            if s % packed_examples:
                raise ValueError(f"{packed_examples} examples do not pack evenly into rows of {s} tokens.")
            inputs["position_ids"] = torch.arange(s // packed_examples).repeat(packed_examples)[None].expand(b, -1)
        held = []  # every forward's graph stays alive, so no saved storage is freed and its address reused
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            for _ in range(micro_batches):
                held.append(model(**inputs))
    return sum(seen.values())


def _dtype(nbytes: int):
    import torch

    return torch.float32 if nbytes == 4 else torch.bfloat16


def _fake_model(name: str, setup: Setup, layers: int):
    """The model with `layers` decoder layers, built on the meta device, LoRA applied as `finetune train` applies it,
    every parameter then replaced by a fake CPU tensor of its dtype (tied weights stay one tensor)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from finetune.memory.shapes import resolve_config

    precision = held_precisions(setup)
    config = resolve_config(name)
    config.get_text_config().num_hidden_layers = layers
    config.use_cache = False  # as in training: no KV cache
    attention = "eager" if setup.attention == "eager" else "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                 dtype=_dtype(precision.residual if not setup.lora_rank
                                                              else precision.compute))
    if setup.method.fused_head:  # as TRL's GRPOTrainer patches the policy, before peft wraps it
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if setup.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = list(setup.lora_target_modules) if setup.lora_target_modules else "all-linear"
        model = get_peft_model(model, LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank,
                                                 lora_dropout=setup.lora_dropout, target_modules=targets))
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.to(_dtype(precision.adapters))
    elif precision.residual == 4:  # fp32 master weights: every trainable weight (finetune.models.loading)
        model = model.float()
    if setup.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        if setup.lora_rank:  # as peft and Trainer do, so the re-entrant checkpoints see an input needing a gradient
            model.enable_input_require_grads()
    model.train()

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = torch.device("cpu")
    fakes: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for key, parameter in list(module._parameters.items()):
            if parameter is not None:
                if id(parameter) not in fakes:
                    fake = mode.fake_tensor_converter.from_meta_and_device(mode, parameter.data, cpu)
                    fakes[id(parameter)] = torch.nn.Parameter(fake, requires_grad=parameter.requires_grad)
                module._parameters[key] = fakes[id(parameter)]
        for key, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[key] = mode.fake_tensor_converter.from_meta_and_device(mode, buffer, cpu)
    return model, mode


@contextlib.contextmanager
def _positions_read(packed: bool):
    """Transformers reads packing off the position ids (`masking_utils.find_packed_sequence_indices`); a fake tensor
    has no values to read, so it would always build the packed mask. Unpacked rows get what a real run reads: no
    restart, so no mask (SDPA's causal kernel, GQA without repeating k and v)."""
    if packed:
        yield
        return
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _gpu_dropout():
    """`torch.nn.functional.dropout` as CUDA runs it: `native_dropout`, which keeps a bool mask."""
    import torch
    import torch.nn.functional as functional

    original = functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        return torch.native_dropout(input, p, True)[0]

    functional.dropout = dropout
    try:
        yield
    finally:
        functional.dropout = original
