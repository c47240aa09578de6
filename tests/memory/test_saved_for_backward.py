"""The activation model against what autograd really saves, at the widths of the 7-8B models people fine-tune.

`finetune.memory.saved.measure` runs the real Transformers and peft modules on fake tensors (real kernel dispatch, no
memory) and sums every distinct storage `saved_tensors_hooks` sees; the estimator must match it per layer and
outside the layers.
"""

from dataclasses import replace

import pytest

from finetune.memory.estimate import (
    MethodTerms,
    Setup,
    activation_bytes,
    saved_outside_layers_bytes,
    saved_per_layer_bytes,
)
from finetune.memory.saved import measure
from finetune.memory.shapes import model_shape

# Each model at one of the lengths people train at: hidden 4096 (MHA and GQA) and 3584 (Qwen's biased q, k, v).
MODELS = {"llama-2-7b": 512, "llama-3-8b": 2048, "qwen2.5-7b": 1024}
DEEPSPEED = dict(strategy="deepspeed", num_gpus=2, zero_stage=2)
DDP = dict(strategy="ddp", num_gpus=2)
CASES = {
    "full, bf16 weights (DeepSpeed)": DEEPSPEED,
    "full, fp32 masters under autocast (DDP)": DDP,
    "full, fp32": dict(DDP, precision="fp32"),
    "full, eager attention": dict(DEEPSPEED, attention="eager"),
    "full, packed rows": dict(DEEPSPEED, packed=True),
    "full, gradient checkpointing": dict(DEEPSPEED, gradient_checkpointing=True),
    "LoRA, fp32 adapters, no dropout": dict(DDP, lora_rank=16),
    "LoRA, fp32 adapters, dropout": dict(DDP, lora_rank=16, lora_dropout=0.05),
    "LoRA, bf16 adapters (DeepSpeed), no dropout": dict(DEEPSPEED, lora_rank=16),
    "LoRA, bf16 adapters (DeepSpeed), dropout": dict(DEEPSPEED, lora_rank=16, lora_dropout=0.05),
    "LoRA on attention only, dropout": dict(DDP, lora_rank=8, lora_dropout=0.1,
                                            lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
    "LoRA, dropout, gradient checkpointing": dict(DDP, lora_rank=16, lora_dropout=0.05, gradient_checkpointing=True),
}
# Every case on Llama-3-8B; on the other two the cases whose terms depend on the shape (GQA or not, biases, widths).
SHAPE_CASES = ("full, bf16 weights (DeepSpeed)", "full, fp32 masters under autocast (DDP)", "full, packed rows",
               "LoRA, fp32 adapters, dropout", "LoRA, bf16 adapters (DeepSpeed), no dropout")
MiB = 2**20


@pytest.mark.parametrize("model, case", [("llama-3-8b", case) for case in CASES]
                         + [(model, case) for model in ("llama-2-7b", "qwen2.5-7b") for case in SHAPE_CASES])
def test_the_estimator_matches_the_bytes_autograd_saves(model, case):
    setup = Setup(**CASES[case], sequence_length=MODELS[model])
    measured = measure(model, setup, packed_examples=4 if setup.packed else 0)
    shape = model_shape(model)
    per_layer, outside = saved_per_layer_bytes(shape, setup), saved_outside_layers_bytes(shape, setup)
    # the acceptance bar is 5% per layer; every case lands within 1%
    assert per_layer == pytest.approx(measured.per_layer, rel=0.01), (per_layer / MiB, measured.per_layer / MiB)
    assert outside == pytest.approx(measured.outside_layers, rel=0.01), (outside / MiB, measured.outside_layers / MiB)


def test_each_term_is_the_tensor_it_names():
    """What the terms add, measured as differences between runs, in MiB of Llama-3-8B at 2048 tokens."""
    shape, base = model_shape("llama-3-8b"), Setup(**DEEPSPEED, sequence_length=2048)
    tokens, h, i = 2048, shape.hidden_size, shape.intermediate_size
    full, lora = measure("llama-3-8b", base), measure("llama-3-8b", replace(base, lora_rank=16))
    dropout = measure("llama-3-8b", replace(base, lora_rank=16, lora_dropout=0.05))
    # Dropout on seven adapters a layer: each keeps a bool mask of its input, and its own dropped copy where
    # without dropout the adapters reading one normed input (q, k, v; gate, up) share it.
    masks = tokens * (6 * h + i)
    copies = 2 * tokens * 4 * h  # q, k, v: 3 copies for 1 shared; gate, up: 2 for 1; o_proj: 1 for the attention's
    assert dropout.per_layer - lora.per_layer == masks + copies
    # Full fine-tuning keeps each norm's normalised input for its weight's gradient; LoRA's frozen norms do not.
    assert full.per_layer - lora.per_layer == pytest.approx(2 * 2 * tokens * h - 2 * tokens * 16 * 7, abs=MiB)
    # The loss keeps fp32 log-probabilities over the vocabulary: 1002 MiB here, more than two layers.
    no_loss = measure("llama-3-8b", base, loss=False)
    assert full.outside_layers - no_loss.outside_layers == pytest.approx(4 * tokens * shape.vocab_size, rel=1e-4)
    assert saved_outside_layers_bytes(shape, base) - saved_outside_layers_bytes(
        shape, replace(base, method=MethodTerms(logits_held=False))) == 4 * tokens * shape.vocab_size
    # The peak adds the loss's backward (two more fp32 vocabulary-wide gradients) to what is saved.
    saved = shape.num_layers * full.per_layer + full.outside_layers
    assert activation_bytes(shape, base) == pytest.approx(saved + 8 * tokens * shape.vocab_size, rel=0.01)


@pytest.mark.parametrize("case", ["full, fp32 masters under autocast (DDP)", "full, bf16 weights (DeepSpeed)",
                                  "LoRA, fp32 adapters, dropout"])
def test_grpo_scores_through_trls_fused_head_keeping_no_logits_and_no_head_cast(case):
    """GRPO's forward goes through TRL's fused LM head (`add_fused_lm_head`, as GRPOTrainer patches the policy): it
    keeps the hidden states and two fp32 vectors, neither the (tokens × vocab) logits nor the bf16 cast of the fp32
    head. Qwen2.5-7B (vocab 152,064) at 4 × 2,048 tokens under DDP: 13.9 GiB of logits and their gradients (and the
    head's 1 GiB cast) no longer planned."""
    from finetune.train.methods.grpo import GroupRelativePolicyOptimization

    terms = GroupRelativePolicyOptimization.memory
    assert terms.fused_head and not terms.logits_held
    setup = Setup(**CASES[case], sequence_length=1024, method=terms)
    measured = measure("qwen2.5-7b", setup)
    shape = model_shape("qwen2.5-7b")
    assert saved_per_layer_bytes(shape, setup) == pytest.approx(measured.per_layer, rel=0.01)
    assert saved_outside_layers_bytes(shape, setup) == pytest.approx(measured.outside_layers, abs=0.5 * MiB)
    planned = activation_bytes(shape, replace(Setup(**DDP, sequence_length=2048, micro_batch_size=4), method=terms))
    before = activation_bytes(shape, replace(Setup(**DDP, sequence_length=2048, micro_batch_size=4),
                                             method=replace(terms, fused_head=False, logits_held=True)))
    assert (before - planned) / 1024**3 > 14.5  # 13.9 + 1.0, less one tile of logits (0.25) and the hidden states


@pytest.mark.parametrize("model, t", [("llama-3-8b", 2), ("llama-3-8b", 4), ("qwen2.5-7b", 2)])
def test_a_tensor_parallel_rank_saves_its_share_of_the_casts_and_of_the_mlp_input(model, t, tmp_path):
    """What one TP rank's layer computes is the layer with 1/t of the heads and of the MLP's width (q, k, v, gate and
    up split by rows, o and down by columns; the norms and the residual whole): measured so on fake tensors, fp32
    masters under bf16 autocast, it keeps 1/t of the weights' bf16 casts and of the down projection's input, as the
    TP row now counts (Llama-3-8B, TP 2: 548 MiB a layer at 2,048 tokens, where 784 were planned)."""
    import json

    from finetune.memory.shapes import resolve_config

    config = resolve_config(model).to_dict()
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    config.update(num_attention_heads=heads // t, num_key_value_heads=kv // t,
                  intermediate_size=config["intermediate_size"] // t, head_dim=config["hidden_size"] // heads)
    (tmp_path / "config.json").write_text(json.dumps(config))
    local = measure(str(tmp_path), Setup(**DDP, sequence_length=1024), loss=False).per_layer
    from finetune.train.axes.tensor.layout import TensorSplit

    tensor_parallel = Setup(strategy="tensor_parallel", num_gpus=t, axis=TensorSplit(t), sequence_length=1024)
    assert saved_per_layer_bytes(model_shape(model), tensor_parallel) == pytest.approx(local, rel=0.01)


@pytest.mark.parametrize("tokens", [2048, 8192])
def test_sft_through_the_fused_head_keeps_no_logits_and_drops_what_the_plan_drops(tokens):
    """SFT's loss comes from TRL's fused LM head (finetune.train.trainer.FinetuneTrainer): at Llama-3-8B width
    (vocabulary 128,256) what the forward saves outside the layers is less than one bf16 (tokens × vocab) tensor, and
    the bytes it no longer saves, measured against the full-logits loss, are those the plan no longer counts."""
    from finetune.train.methods.sft import SupervisedFineTuning

    terms = SupervisedFineTuning.memory
    assert terms.fused_head and not terms.logits_held
    shape = model_shape("llama-3-8b")
    fused = Setup(**DDP, sequence_length=tokens, method=terms)
    full = replace(fused, method=MethodTerms())
    measured_fused, measured_full = measure("llama-3-8b", fused), measure("llama-3-8b", full)
    assert measured_fused.outside_layers < 2 * tokens * shape.vocab_size
    assert measured_fused.per_layer == measured_full.per_layer
    dropped = measured_full.outside_layers - measured_fused.outside_layers
    planned = saved_outside_layers_bytes(shape, full) - saved_outside_layers_bytes(shape, fused)
    assert planned == pytest.approx(dropped, rel=0.05), (planned / MiB, dropped / MiB)


def test_orpo_through_the_fused_head_keeps_no_logits_and_drops_what_the_plan_drops():
    """The reference-free pair methods (CPO, ORPO) score chosen and rejected through the same fused head
    (finetune.train.methods.reference_free_trainer): at Llama-3-8B width, 2 sequences of 2,048 tokens a pair, nothing
    outside the layers is a (tokens × vocab) tensor, and the drop against TRL's full logits is the plan's."""
    from finetune.train.methods.orpo import OddsRatioPreferenceOptimization

    terms = OddsRatioPreferenceOptimization.memory
    assert terms.fused_head and not terms.logits_held and terms.sequences_per_example == 2
    shape, tokens = model_shape("llama-3-8b"), 2048
    fused = Setup(**DDP, sequence_length=tokens, method=terms)
    full = replace(fused, method=replace(terms, fused_head=False, logits_held=True))
    measured_fused, measured_full = measure("llama-3-8b", fused), measure("llama-3-8b", full)
    assert measured_fused.outside_layers < 2 * tokens * shape.vocab_size  # two sequences: still under one (T, V)
    dropped = measured_full.outside_layers - measured_fused.outside_layers
    planned = saved_outside_layers_bytes(shape, full) - saved_outside_layers_bytes(shape, fused)
    assert planned == pytest.approx(dropped, rel=0.05), (planned / MiB, dropped / MiB)
