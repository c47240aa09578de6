"""Liger Kernel's fused kernels in the plan: what each one changes in the activations, counted from what its autograd
function saves for backward (Liger 0.8.5, ops/*.py), at Llama-3-8B width; the planner learning them from a recipe and
from a patched model; the effective config's record of them.

Liger's kernels are Triton and do not run here. Its saved sets are transcribed below (`twins`) into CPU autograd
functions that save exactly what Liger's save, patched into Transformers' Llama the way Liger patches it, and
`finetune.memory.saved.measure` sums what they keep on fake tensors: that checks how the counts compose with the rest of
the block (which storages are shared), not Liger's kernels themselves, which are to be measured on a GPU.
"""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from finetune.errors import RecipeError
from finetune.memory.estimate import (
    FusedKernels,
    MethodTerms,
    Setup,
    activation_bytes,
    held_precisions,
    liger_chunk_tokens,
    loss_transient_bytes,
    saved_outside_layers_bytes,
    saved_per_layer_bytes,
)
from finetune.memory.shapes import model_shape
from finetune.train.axes.pipeline.layout import PipelineLayout

MiB, GiB = 2**20, 2**30
TOKENS = 2048
DEEPSPEED = dict(strategy="deepspeed", num_gpus=2, zero_stage=2)
DDP = dict(strategy="ddp", num_gpus=2)
# The loss over the full logits (the model's forward given labels), which Liger's two losses replace.
FULL_LOGITS = MethodTerms()
CASES = {
    "full, fp32 masters under autocast (DDP)": DDP,
    "full, bf16 weights (DeepSpeed)": DEEPSPEED,
    "LoRA, dropout (DDP)": dict(DDP, lora_rank=16, lora_dropout=0.05),
}
LIGER = FusedKernels.from_trainer_arguments(True)


def only(**kernels) -> FusedKernels:
    return FusedKernels(**kernels)


def test_the_kernels_trainer_applies_for_use_liger_kernel_and_its_config():
    assert FusedKernels.from_trainer_arguments(False, {"rope": True}) == FusedKernels()
    assert LIGER.names == ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")  # Liger's Llama defaults
    asked = FusedKernels.from_trainer_arguments("true", {"fused_linear_cross_entropy": False, "cross_entropy": True,
                                                         "geglu": True})  # a key Llama's patch does not take
    assert asked.names == ("rope", "rms_norm", "swiglu", "cross_entropy")
    assert FusedKernels.from_trainer_arguments(True, json.dumps({"rope": False})).names == \
        ("rms_norm", "swiglu", "fused_linear_cross_entropy")
    with pytest.raises(RecipeError, match="cannot both be on"):
        Setup(kernels=only(cross_entropy=True, fused_linear_cross_entropy=True)).check()


@pytest.mark.parametrize("case", CASES)
def test_each_liger_kernel_changes_the_plan_by_what_its_autograd_function_keeps(case):
    """Llama-3-8B at 2,048 tokens, byte for byte. RMSNorm: Transformers' keeps the fp32 upcast of its input and, when
    its weight trains, the normalised input (4Th + rTh), Liger's its input as it comes (rTh); both the fp32 1/rms.
    SwiGLU: Liger's recomputes the activation (c·T·i fewer). RoPE: neither keeps anything but the one cos/sin pair all
    blocks share. The fused linear cross-entropy keeps grad_input (rTh) and, where the head trains, grad_weight (vocab
    × hidden, the head's dtype) instead of the head's input and cast and the fp32 log-probabilities; its transient is a
    chunk of 64 tokens' logits (and the half cast of an fp32 head) instead of two fp32 (tokens × vocab) gradients."""
    shape = model_shape("llama-3-8b")
    base = Setup(**CASES[case], sequence_length=TOKENS, method=FULL_LOGITS)
    precision = held_precisions(base)
    c, r, w = precision.compute, precision.residual, precision.weights
    T, h, i, V = TOKENS, shape.hidden_size, shape.intermediate_size, shape.vocab_size
    lora = bool(base.lora_rank)

    def change(function, **kernels):
        return function(shape, base) - function(shape, replace(base, kernels=only(**kernels)))

    norm_weight = 0 if lora else r
    assert change(saved_per_layer_bytes, rms_norm=True) == 2 * (4 + norm_weight - r) * T * h
    # the final norm, less (under LoRA) the first block's first norm, which keeps nothing either way
    assert change(saved_outside_layers_bytes, rms_norm=True) == (0 if lora else (4 + norm_weight - r) * T * h)
    assert change(saved_per_layer_bytes, swiglu=True) == c * T * i
    assert change(saved_outside_layers_bytes, swiglu=True) == 0
    assert change(activation_bytes, rope=True) == 0

    fused = dict(fused_linear_cross_entropy=True)
    assert change(saved_per_layer_bytes, **fused) == 0
    head = 0 if lora else c * T * h + (c * V * h if w != c else 0)  # the head's input (and cast), as without Liger
    kept = r * T * h + (0 if lora else w * V * h)  # grad_input, grad_weight
    assert change(saved_outside_layers_bytes, **fused) == head + 4 * T * V - kept
    assert liger_chunk_tokens(T, shape) == 64  # 128,256 ids / 4,096 wide → 32 chunks' budget: 2,048 / 32
    head_cast = c * V * h if (r if lora else w) == 4 else 0
    assert loss_transient_bytes(shape, replace(base, kernels=only(**fused))) == c * 64 * V + head_cast
    assert change(loss_transient_bytes, **fused) == 8 * T * V - c * 64 * V - head_cast

    # Liger's cross-entropy keeps as much (the fp32 logits, overwritten by their gradient) and drops the transient to
    # the logits in the compute dtype beside them
    assert change(saved_outside_layers_bytes, cross_entropy=True) == 0
    assert change(loss_transient_bytes, cross_entropy=True) == 8 * T * V - c * T * V


def test_liger_defaults_at_llama_3_8b_in_gib():
    """What the plan drops with Liger's defaults at Llama-3-8B, 2,048 tokens, a loss over the full logits: 3.75 GiB
    of blocks (120 MiB a block, full fine-tuning) and, outside them, 0.98 GiB under DDP or 1.97 GiB under DeepSpeed.
    Under DDP's fp32 masters Liger keeps an fp32 grad_weight (2 GiB) where the head's bf16 cast and the fp32
    log-probabilities were (1 GiB each), so the drop is the loss's transient: 2 GiB of fp32 gradients become the
    head's cast and one chunk of logits."""
    shape = model_shape("llama-3-8b")
    dropped = {}
    for name, strategy in (("ddp", DDP), ("deepspeed", DEEPSPEED)):
        base = Setup(**strategy, sequence_length=TOKENS, method=FULL_LOGITS)
        dropped[name] = (activation_bytes(shape, base) - activation_bytes(shape, replace(base, kernels=LIGER))) / GiB
    assert dropped == pytest.approx({"ddp": 4.729, "deepspeed": 5.723}, abs=0.001)


def test_a_fused_loss_replaces_only_a_loss_over_the_full_logits_and_a_pipeline_runs_none():
    """TRL's trainers turn Liger's fused loss off for their fused heads and log-probabilities (SFT's fused head here,
    GRPO's, DPO's own): the plan keeps theirs. The pipeline loop never calls `Trainer.train`, where Liger is applied."""
    from finetune.train.methods.grpo import GroupRelativePolicyOptimization
    from finetune.train.methods.sft import SupervisedFineTuning

    shape = model_shape("llama-3-8b")
    for terms in (SupervisedFineTuning.memory, GroupRelativePolicyOptimization.memory):
        setup = Setup(**DDP, sequence_length=TOKENS, method=terms)
        liger = replace(setup, kernels=LIGER)
        assert liger.liger_loss is None
        assert saved_outside_layers_bytes(shape, liger) == saved_outside_layers_bytes(shape, setup) - 4 * TOKENS * \
            shape.hidden_size  # the final norm's only
        assert loss_transient_bytes(shape, liger) == loss_transient_bytes(shape, setup)
    pipeline = Setup(strategy="pipeline", axis=PipelineLayout(2), rank=1, sequence_length=TOKENS)
    assert replace(pipeline, kernels=LIGER).applied_kernels == FusedKernels()
    assert saved_per_layer_bytes(shape, replace(pipeline, kernels=LIGER)) == saved_per_layer_bytes(shape, pipeline)


def test_gradient_checkpointing_keeps_the_block_input_and_recomputes_with_liger():
    shape = model_shape("llama-3-8b")
    # SFT's fused head: the block recomputed in the backward is the largest transient, not the loss
    setup = Setup(**DEEPSPEED, sequence_length=TOKENS, gradient_checkpointing=True,
                  method=MethodTerms(logits_held=False))
    liger = replace(setup, kernels=only(rms_norm=True, swiglu=True))
    assert saved_per_layer_bytes(shape, liger) == saved_per_layer_bytes(shape, setup) == 2 * TOKENS * shape.hidden_size
    # the recomputed block keeps Liger's less: (4 + 2 − 2)Th a norm, twice, and c·T·i; the final norm once
    per_block = 2 * 4 * TOKENS * shape.hidden_size + 2 * TOKENS * shape.intermediate_size
    final_norm = 4 * TOKENS * shape.hidden_size
    assert activation_bytes(shape, setup) - activation_bytes(shape, liger) == per_block + final_norm


# --- Liger's saved sets transcribed (ops/rms_norm.py, swiglu.py, rope.py, cross_entropy.py,
# fused_linear_cross_entropy.py), computed with torch ops where Liger runs Triton.

class RMSNormTwin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # casting mode "llama": only 1/rms in fp32
        rows = x.view(-1, x.shape[-1])
        rstd = torch.rsqrt(rows.float().pow(2).mean(-1) + eps)
        y = (rows.float() * rstd[:, None]).to(x.dtype) * weight.to(x.dtype)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view_as(x)


class SiLUMulTwin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b


class RopeTwin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):  # rotates q and k in place, unseen by autograd as Triton's writes are
        for x in (q.detach(), k.detach()):
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            x.copy_(x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1))
        ctx.save_for_backward(cos, sin)
        return q, k


class CrossEntropyTwin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):  # the gradient written into the logits, which are kept
        ctx.save_for_backward(logits)
        return logits.new_zeros((), dtype=torch.float32)


class FusedLinearCrossEntropyTwin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target):  # both gradients computed here, kept for the backward
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        ctx.save_for_backward(grad_input, grad_weight)
        return hidden.new_zeros((), dtype=torch.float32)


def twins(monkeypatch, kernels: FusedKernels) -> None:
    """Patches Transformers' Llama as `apply_liger_kernel_to_llama` does, with the twins."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.models.llama import modeling_llama

    if kernels.rms_norm:
        monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward",
                            lambda self, x: RMSNormTwin.apply(x, self.weight, self.variance_epsilon))
    if kernels.swiglu:
        monkeypatch.setattr(modeling_llama.LlamaMLP, "forward",
                            lambda self, x: self.down_proj(SiLUMulTwin.apply(self.gate_proj(x), self.up_proj(x))))
    if kernels.rope:
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                            lambda q, k, cos, sin, unsqueeze_dim=1: RopeTwin.apply(q, k, cos, sin))
    if kernels.cross_entropy:
        monkeypatch.setattr(torch.nn.functional, "cross_entropy",
                            lambda logits, target, **kwargs: CrossEntropyTwin.apply(logits, target))
    if kernels.fused_linear_cross_entropy:
        def forward(self, input_ids=None, labels=None, **kwargs):  # liger_kernel/transformers/model/llama.py
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            target = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
            loss = FusedLinearCrossEntropyTwin.apply(hidden.view(-1, hidden.shape[-1]), self.lm_head.weight,
                                                     target.view(-1))
            return CausalLMOutputWithPast(loss=loss)

        monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", forward)


@pytest.mark.parametrize("case, kernels", [
    ("full, fp32 masters under autocast (DDP)", LIGER),
    ("full, bf16 weights (DeepSpeed)", LIGER),
    ("LoRA, dropout (DDP)", LIGER),
    ("full, fp32 masters under autocast (DDP)", replace(LIGER, fused_linear_cross_entropy=False, cross_entropy=True)),
])
def test_liger_saved_sets_composed_in_a_real_block_match_the_plan(monkeypatch, case, kernels):
    from finetune.memory.saved import measure

    setup = Setup(**CASES[case], sequence_length=512, method=FULL_LOGITS, kernels=kernels)
    twins(monkeypatch, kernels)
    measured = measure("llama-3-8b", setup)
    shape = model_shape("llama-3-8b")
    assert saved_per_layer_bytes(shape, setup) == measured.per_layer
    assert saved_outside_layers_bytes(shape, setup) == pytest.approx(measured.outside_layers, abs=0.5 * MiB)


def test_the_eager_rmsnorm_term_is_byte_exact():
    """Liger's RMSNorm change is counted against Transformers' norm, whose count is exact: the fp32 input, the
    normalised input, and the fp32 1/rms per token."""
    from finetune.memory.saved import measure

    setup = Setup(**DEEPSPEED, sequence_length=512)
    assert saved_per_layer_bytes(model_shape("llama-3-8b"), setup) == measure("llama-3-8b", setup).per_layer


def test_the_kernels_are_read_off_a_model_liger_patched(monkeypatch):
    """`liger_kernels_applied` reads what Liger's patch leaves on a model (its names and its functions), without
    Liger; the memory report's prediction and the effective config use it."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from finetune import presets
    from finetune.memory.callback import liger_kernels_applied

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(presets.build_model_config(presets.build_tokenizer()))
    assert liger_kernels_applied(model) == FusedKernels()

    def from_liger(function, module="liger_kernel.transformers.rope"):
        function.__module__ = module
        return function

    for layer in model.model.layers:  # `_bind_method_to_module(module, "_get_name", ...)`
        layer.input_layernorm._get_name = lambda: "LigerRMSNorm"
        layer.mlp._get_name = lambda: "LigerSwiGLUMLP"
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", from_liger(lambda q, k, cos, sin: (q, k)))
    assert liger_kernels_applied(model) == only(rope=True, rms_norm=True, swiglu=True)
    model.forward = from_liger(lambda *args, **kwargs: None, "liger_kernel.transformers.model.llama").__get__(model)
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", from_liger(lambda *args, **kwargs: None,
                                                                         "liger_kernel.transformers.functional"))
    assert liger_kernels_applied(model) == FusedKernels(rope=True, rms_norm=True, swiglu=True, cross_entropy=True,
                                                        fused_linear_cross_entropy=True)


def test_the_effective_config_names_the_kernels_and_why():
    from finetune.train.effective import fused_kernels_asked, record_applied_kernels

    args = SimpleNamespace(use_liger_kernel=False, liger_kernel_config=None)
    assert fused_kernels_asked(args, {}, cuda=False) == ("PyTorch's own", "no CUDA GPU: Liger's kernels are Triton")
    value, source = fused_kernels_asked(args, {}, cuda=True)
    assert value == "PyTorch's own" and "measured on a GPU" in source
    assert fused_kernels_asked(args, {"use_liger_kernel": "recipe"}, cuda=True)[1] == \
        "`use_liger_kernel: false` (recipe)"
    # as TRL's trainers leave the arguments: their fused heads keep Liger's fused loss off
    args = SimpleNamespace(use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False})
    value, source = fused_kernels_asked(args, {"use_liger_kernel": "recipe"}, cuda=True)
    assert value == "Liger: rope, rms_norm, swiglu"
    assert source == "recipe with `liger_kernel_config` over Liger's defaults"
    effective = {"values": {"fused_kernels": {"value": value, "source": source}}}
    model = torch.nn.Module()  # a model Liger left as it was (a type it has no kernels for)
    record_applied_kernels(effective, model)
    assert effective["values"]["fused_kernels"]["applied"] == []


def test_a_recipe_asking_for_liger_is_planned_with_its_kernels(tmp_path, capsys):
    """`finetune plan --recipe` reads `use_liger_kernel` and `liger_kernel_config` into every strategy's setup."""
    from support import PROJECT_ROOT

    from finetune.cli import main

    recipe = tmp_path / "liger.yaml"
    recipe.write_text((PROJECT_ROOT / "recipes" / "demo.yaml").read_text()
                      + "use_liger_kernel: true\nliger_kernel_config:\n  rope: false\n")
    assert main(["plan", "--recipe", str(recipe), "--gpus", "2", "--gpu-memory", "16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["strategies"][0]["setup"]["kernels"] == {
        "rope": False, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": True}
