"""The estimator's terms for a pipeline stage with tensor parallelism inside it (PP × TP), against numbers counted by
hand for Llama-3-8B: the layers' matrices, their casts and the split activations ÷ t; norms, the embedding, the head
and the receive buffers whole on every rank of the stage."""

import pytest

from finetune.errors import RecipeError
from finetune.memory import model_shape
from finetune.memory.estimate import Setup, estimate
from finetune.train.axes.pipeline.layout import (
    PipelineLayout,
    pipeline_layer_bytes,
    pipeline_recv_buffer_bytes,
    pipeline_stage_elements,
)

SHAPE = model_shape("llama-3-8b")  # 32 layers, hidden 4096, MLP 14336, 32 heads, 8 key/value heads, vocab 128256
H, MLP, KV, HEADS, VOCAB = 4096, 14336, 1024, 32, 128256
LINEAR = 2 * H * H + 2 * H * KV + 3 * H * MLP  # q, o; k, v; gate, up, down: one layer's matrices
TOKENS = 1024  # one micro-batch: 1 row of 1,024 tokens


def stage(rank: int, tensor: int = 4, **fields) -> Setup:
    return Setup(strategy="pipeline", num_gpus=8, gpus_per_node=4, axis=PipelineLayout(2, tensor=tensor), rank=rank,
                 sequence_length=TOKENS, gradient_accumulation_steps=4,
                 **fields)


def test_the_stage_holds_its_layers_matrices_split_and_its_norms_and_ends_whole():
    assert SHAPE.block_linear_parameters == 32 * LINEAR
    first = 16 * (2 * H + LINEAR // 4) + VOCAB * H  # 16 layers: 2 norms whole, matrices ÷ 4; the embedding whole
    last = 16 * (2 * H + LINEAR // 4) + H + VOCAB * H  # the final norm and the (untied) head whole
    assert pipeline_stage_elements(SHAPE, stage(0)) == first
    assert pipeline_stage_elements(SHAPE, stage(1)) == last
    result = estimate(SHAPE, stage(0))
    # fp32 masters, fp32 gradients, fp32 Adam moments (the loop's torch AdamW): 4 + 4 + 8 bytes a parameter
    assert (result.params_bytes, result.grads_bytes, result.optimizer_bytes) == (4 * first, 4 * first, 8 * first)


def test_the_stage_activations_split_the_heads_and_mlp_and_keep_the_norms_inputs_and_buffers_whole():
    """Stage 0 of 2 under 1F1B with 4 micro-batches holds 2 in flight; bf16 autocast over fp32 weights and hidden
    states (finetune.memory.estimate.saved_per_layer_bytes, term by term)."""
    norms = 2 * (4 * H + 4 + 4 * H) * TOKENS  # each RMSNorm: fp32 input, fp32 1/rms, the normalised fp32 output
    attention = 2 * TOKENS * (2 * H + 2 * KV) + 4 * HEADS * TOKENS  # q, k, v, output in bf16; fp32 log-sum-exp
    mlp = 3 * 2 * TOKENS * MLP  # gate, activation, up
    inputs = 5 * 2 * TOKENS * H  # autocast's bf16 copy of the fp32 norm output for q, k, v, gate, up
    down_input = 2 * TOKENS * MLP  # the MLP's activation, split with its width
    casts = 2 * LINEAR / 4  # bf16 casts of the rank's fp32 weight slices, once for all micro-batches
    per_micro_batch = norms + inputs + (attention + mlp + down_input) / 4
    receive = 4 * TOKENS * H * 4  # gradients from stage 1, one fp32 buffer a micro-batch (all 4), whole
    expected = 16 * (2 * per_micro_batch + casts) + receive
    assert estimate(SHAPE, stage(0)).activations_bytes == int(expected)
    # without TP the split parts are whole: TP 4 saves exactly 3/4 of them
    whole = estimate(SHAPE, stage(0, tensor=1)).activations_bytes
    assert whole == int(16 * (2 * (norms + inputs + attention + mlp + down_input) + 2 * LINEAR) + receive)


def test_the_last_stage_keeps_the_whole_head_and_loss_on_every_tp_rank():
    """The head is replicated over the TP group, so its logits and loss terms do not shrink with t."""
    def past_the_layers(setup: Setup) -> float:  # stage 1 holds 1 micro-batch in flight under 1F1B
        return (estimate(SHAPE, setup).activations_bytes - 16 * pipeline_layer_bytes(SHAPE, setup, 1)
                - pipeline_recv_buffer_bytes(SHAPE, setup))

    assert past_the_layers(stage(1)) == pytest.approx(past_the_layers(stage(1, tensor=1)), abs=1)
    assert past_the_layers(stage(1)) > 4 * TOKENS * VOCAB  # at least the fp32 log-probabilities of the vocabulary


def test_host_ram_at_load_counts_each_rank_of_a_stage_on_its_node():
    """4 GPUs a node, TP 4: node 0 holds stage 0's four ranks, node 1 stage 1's; each rank reads its slice in fp32
    and the largest tensor as stored twice (bf16: 2 × 2 bytes an element)."""
    result = estimate(SHAPE, stage(0))
    transient = 2 * 2 * SHAPE.largest_layer_parameters
    first, last = (4 * pipeline_stage_elements(SHAPE, stage(rank)) + transient for rank in (0, 1))
    assert result.loaded_rank_bytes == (first,) * 4 + (last,) * 4  # by global rank, TP innermost
    assert result.host_load_bytes_per_node == 4 * last
    assert [result.host_load_bytes_of_rank(rank) for rank in (0, 3, 4, 7, 8, 12)] == [first, first, last, last,
                                                                                        first, last]


def test_a_tp_size_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(RecipeError, match="does not divide llama-3-8b's 32 attention heads and 8 key/value heads"):
        estimate(SHAPE, stage(0, tensor=3))
