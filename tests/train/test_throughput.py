"""Throughput: the FLOP formula against a hand calculation, the accelerator table, and what a 2-process run
writes (throughput.json and throughput/* in the logs)."""

import json

import pytest

from finetune import presets
from finetune.train.throughput import FlopsModel, peak_tflops_of


def test_flops_per_token_of_the_tiny_model_match_a_hand_calculation():
    model = presets.build_model(presets.build_tokenizer())
    # hidden 128, MLP 256, 3 layers, 4 heads of 32, vocab 261, tied embedding (so it is a matmul: the head)
    embedding = 261 * 128
    per_layer = 4 * 128 * 128 + 3 * 128 * 256 + 2 * 128
    parameters = embedding + 3 * per_layer + 128
    assert parameters == 525_824
    flops = FlopsModel.of(model)
    assert flops.per_token(64) == 6 * parameters + 12 * 3 * 4 * 32 * 64 == 3_449_856
    for parameter in model.model.parameters():  # a frozen base: no weight gradients, 4 FLOPs a parameter
        parameter.requires_grad_(False)
    assert FlopsModel.of(model).per_token(0) == 4 * parameters


def test_an_untied_embedding_is_a_lookup_not_a_matmul():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    total = sum(parameter.numel() for parameter in model.parameters())
    assert FlopsModel.of(model).per_token(0) == 6 * (total - 100 * 16)


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                            ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                            ("Tesla T4", 65.0), ("cpu", None), ("NVIDIA GeForce RTX 3090", None)])
def test_peaks_come_from_the_accelerator_table(name, peak):
    assert peak_tflops_of(name) == peak


@pytest.mark.distributed
def test_a_two_process_run_writes_throughput_json_and_logs_it(ddp_run):
    record = json.loads((ddp_run / "throughput.json").read_text())
    history = json.loads((ddp_run / "trainer_state.json").read_text())["log_history"]
    seen = {entry["step"]: entry["num_input_tokens_seen"] for entry in history if "loss" in entry}
    assert record["world_size"] == 2 and record["device"] == "cpu" and record["mfu"] is None
    assert record["steps"] == 2  # steps 2-3: the first is warm-up
    assert record["tokens"] == seen[3] - seen[1] > 0  # non-pad tokens of both ranks, as Trainer counted them
    assert record["tokens_per_second"] == pytest.approx(record["tokens"] / record["seconds"], rel=1e-3)
    mean_row = record["tokens"] / (2 * 2 * 16)  # 2 steps × 2 ranks × 16 sequences
    assert record["flops_per_token"] == 6 * 525_824 + 12 * 3 * 4 * 32 * mean_row
    logged = [entry for entry in history if "throughput/tokens_per_second" in entry]
    assert [entry["step"] for entry in logged] == [2, 3]
