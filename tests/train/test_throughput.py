"""Throughput: the FLOP formula against a hand calculation, the accelerator table, and what a 2-process run
writes (throughput.json and throughput/* in the logs)."""

import json
from types import SimpleNamespace

import pytest
import torch

from finetune import presets
from finetune.train.throughput import FlopsModel, ThroughputCallback, peak_tflops_of


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


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0),
    ("NVIDIA GeForce RTX 4090", 165.0), ("Tesla V100-SXM2-16GB", 125.0), ("Tesla V100-PCIE-32GB", 112.0),
    ("Tesla V100S-PCIE-32GB", 130.0), ("Tesla T4", 65.0),
    # no published figure, not in the table, or a name that only contains a known one: no peak rather than a wrong one
    ("NVIDIA A10G", None), ("cpu", None), ("NVIDIA GeForce RTX 3090", None), ("NVIDIA H200 NVL", None),
    ("NVIDIA L40S-PCIE", None)])
def test_peaks_come_from_the_accelerator_table_by_exact_name(name, peak):
    assert peak_tflops_of(name) == peak


def test_a_4bit_weight_counts_the_elements_it_stands_for_not_its_packed_storage():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    full = FlopsModel.of(model).per_token(0)
    for module in model.modules():  # bitsandbytes' Params4bit: two 4-bit values a byte, the shape in its quant_state
        if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
            packed = torch.nn.Parameter(torch.zeros(module.weight.numel() // 2, 1, dtype=torch.uint8),
                                        requires_grad=False)
            packed.quant_state = SimpleNamespace(shape=module.weight.shape)
            module.weight = packed
    frozen = sum(module.weight.quant_state.shape.numel() for module in model.modules()
                 if isinstance(module, torch.nn.Linear) and module is not model.lm_head)
    # the same weights, now frozen: 4 FLOPs an element instead of 6, none of them halved by the packing
    assert FlopsModel.of(model).per_token(0) == full - 2 * frozen


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
    # attention spans the training examples' token-weighted mean length ΣL²/ΣL (the demo's examples are 18-23 tokens
    # long: near their mean), never the 64-token cap
    assert record["attention_span"] == pytest.approx(mean_row, rel=0.1) and record["attention_span"] < 64
    assert record["flops_per_token"] == 6 * 525_824 + 12 * 3 * 4 * 32 * record["attention_span"]
    logged = [entry for entry in history if "throughput/tokens_per_second" in entry]
    assert [entry["step"] for entry in logged] == [2, 3]


@pytest.mark.parametrize(("device", "peak_tflops", "warned"), [
    ("NVIDIA A10G", None, True), ("NVIDIA A10G", 70.0, False), ("NVIDIA L40S", None, False), ("cpu", None, False)])
def test_a_gpu_without_a_known_peak_says_mfu_is_left_out(monkeypatch, capsys, device, peak_tflops, warned):
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.train import throughput

    monkeypatch.setattr(throughput, "device_name", lambda: device)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    args = SimpleNamespace(per_device_train_batch_size=2, world_size=1, gradient_accumulation_steps=1,
                           learning_rate=1e-3)
    state = SimpleNamespace(global_step=0, num_input_tokens_seen=0, is_world_process_zero=True)
    callback = throughput.ThroughputCallback(peak_tflops=peak_tflops)
    callback.on_train_begin(args, state, None, model=model)
    out = capsys.readouterr().out
    assert ("MFU is left out; set `peak_tflops`" in out) is warned
    assert callback.peak == (peak_tflops or throughput.peak_tflops_of(device))


def test_attention_counts_each_packed_example_not_the_row_it_shares():
    from datasets import Dataset

    from finetune.data.collate import pack_examples
    from finetune.train.throughput import Window, attention_span

    lengths = [30, 10, 20, 40, 5, 15]
    examples = Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "labels": [[1] * n for n in lengths]})
    packed = pack_examples(examples, max_length=64)
    span = sum(n * n for n in lengths) / sum(lengths)  # ΣL²/ΣL = 22.5
    assert attention_span(examples) == attention_span(packed) == pytest.approx(span)
    assert len(packed) < len(lengths)  # several examples a row: the mean row would be longer

    callback = ThroughputCallback(peak_tflops=100.0)
    callback.flops, callback.attention_span, callback.peak = FlopsModel(1000, 0, 2, 4, 8), attention_span(packed), 100.0
    window = Window(steps=1, seconds=1.0, tokens=sum(lengths), sequences=len(packed))
    args = SimpleNamespace(include_num_input_tokens_seen="non_padding", world_size=1)
    result = callback.summary(window, args)
    assert result["flops_per_token"] == 6 * 1000 + 12 * 2 * 4 * 8 * span
    assert result["mfu"] == pytest.approx(result["flops_per_token"] * sum(lengths) / 1e12 / 100.0)


def test_a_window_gets_its_steps_tokens_when_the_count_is_summed_only_at_logs():
    """The token count moves at logs only (summed over ranks then); the warm-up step's share of the first window's
    count is left out with its time."""
    callback = ThroughputCallback(warmup_steps=1)
    args = SimpleNamespace(per_device_train_batch_size=2, world_size=1, gradient_accumulation_steps=1,
                           learning_rate=1e-3, include_num_input_tokens_seen="non_padding")
    state = SimpleNamespace(global_step=0, num_input_tokens_seen=0, is_world_process_zero=False, log_history=[])
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    callback.on_train_begin(args, state, None, model=model)
    windows = []
    for step in range(1, 7):  # 100 tokens a step, logs every 2 steps
        state.global_step = step
        callback.on_step_end(args, state, None)
        if step % 2 == 0:
            state.num_input_tokens_seen = 100 * step
            windows.append(callback.window.steps)
            callback.on_log(args, state, None, logs={"loss": 1.0})
            assert callback.window.steps == 0 and callback.total.tokens == 100 * sum(windows)
    callback.on_log(args, state, None, logs={"train_runtime": 1.0})  # no training loss: no window
    callback.on_train_end(args, state, None)
    assert windows == [1, 2, 2]  # steps a window timed: the first step is the warm-up
    assert (callback.total.steps, callback.total.tokens) == (5, 500)
