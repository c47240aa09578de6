"""The estimator against published parameter counts and DeepSpeed's own estimator functions; the planner's
decision tree; the report files. The measured-vs-predicted ledger is in test_memory_distributed.py."""

import json

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from finetune import presets
from finetune.cli import main
from finetune.errors import RecipeError
from finetune.memory import Setup, estimate, model_shape
from finetune.memory.estimate import (
    NF4_BYTES_PER_PARAMETER,
    GiB,
    host_load_bytes_of_rank,
)
from finetune.memory.report import write_memory_report
from finetune.plan.decision_tree import PlanRequest, make_plan
from finetune.train.axes.pipeline.layout import pipeline_bubble_fraction

# Parameter counts published on the models' cards.
PUBLISHED = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "qwen2.5-0.5b": 0.494e9,
             "qwen2.5-7b": 7.62e9, "mistral-7b": 7.24e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_known_shapes_have_their_published_parameter_count(name):
    assert model_shape(name).num_parameters == pytest.approx(PUBLISHED[name], rel=0.005)


def test_shape_from_a_local_directory_and_its_config_json_equals_the_preset(tmp_path):
    config = presets.build_model_config(presets.build_tokenizer())
    config.save_pretrained(tmp_path)
    tiny = model_shape("tiny")
    assert tiny.num_parameters == 525_824  # tied head counted once
    assert model_shape(str(tmp_path)).num_parameters == tiny.num_parameters
    assert model_shape(str(tmp_path / "config.json")).layer_parameters == tiny.layer_parameters


def test_unknown_model_is_a_user_error_with_a_suggestion(tmp_path):
    with pytest.raises(RecipeError, match=r"did you mean `llama-3-8b`"):
        model_shape("llama-3-8")
    with pytest.raises(RecipeError, match="has no config.json"):
        model_shape(str(tmp_path))


def test_lora_adapters_count_rank_times_in_plus_out_on_every_block_linear():
    shape = model_shape("llama-3-8b")
    # per layer: q 4096→4096, k,v 4096→1024, o 4096→4096, gate/up 4096→14336, down 14336→4096
    per_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    assert shape.lora_parameters(16) == 32 * per_layer
    assert shape.lora_parameters(16, ["q_proj", "v_proj"]) == 32 * 16 * ((4096 + 4096) + (4096 + 1024))
    with pytest.raises(RecipeError, match="match no linear layer"):
        shape.lora_parameters(16, ["query_key_value"])


def model_states(result):
    return result.params_bytes + result.grads_bytes + result.optimizer_bytes


@pytest.mark.parametrize("name", ["mistral-7b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_zero2_model_states_equal_deepspeeds_estimator(name, gpus):
    shape = model_shape(name)
    psi = shape.num_parameters
    ours = estimate(shape, Setup("deepspeed", gpus, zero_stage=2))
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=gpus, cpu_offload=False)
    assert model_states(ours) == pytest.approx(gpu, abs=2)  # 2Ψ + 18Ψ/N, int rounding only

    offload = estimate(shape, Setup("deepspeed", gpus, zero_stage=2, offload_optimizer="cpu"))
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=gpus, cpu_offload=True)
    assert model_states(offload) == gpu  # 2Ψ of bf16 weights stay on the GPU
    if 4 * gpus <= 16:  # DeepSpeed's max(4N, 16): loading the fp32 model on every process can dominate
        # Host: fp32 gradients + master + Adam (16Ψ per node); DeepSpeed adds a 1.5 pinned-buffer factor.
        assert offload.host_bytes_per_node * 1.5 == pytest.approx(cpu, abs=gpus * 4)


@pytest.mark.parametrize("gpus", [2, 8])
def test_zero3_model_states_differ_from_deepspeeds_estimator_exactly_as_documented(gpus):
    shape = model_shape("mistral-7b")
    psi, largest = shape.num_parameters, shape.largest_layer_parameters
    # No offload: DeepSpeed's 4·largest_layer is a gathered layer (our `temporary_bytes`), its 18Ψ/N leaves
    # out the 2Ψ/N bf16 parameter partition each rank holds, and counts the whole partition's fp32 gradients where
    # the step holds one sub-group of them (1e9 elements by default, + one tensor's shard): less on 2 GPUs.
    ours = estimate(shape, Setup("deepspeed", gpus, zero_stage=3))
    _, gpu, largest_memory = estimate_zero3_model_states_mem_needs(psi, largest, gpus, cpu_offload=False)
    assert largest_memory == 4 * largest
    fp32_not_held = 4 * max(0, psi / gpus - (1e9 + largest / gpus))
    assert (fp32_not_held > 0) == (gpus == 2)
    assert model_states(ours) == pytest.approx(gpu - largest_memory + 2 * psi / gpus - fp32_not_held, abs=4)
    # Optimizer offload: only the bf16 parameter partition stays, exactly as DeepSpeed counts it.
    optimizer_offload = estimate(shape, Setup("deepspeed", gpus, zero_stage=3, offload_optimizer="cpu"))
    _, gpu, _ = estimate_zero3_model_states_mem_needs(psi, largest, gpus, cpu_offload=True, cpu_offload_params=False)
    assert model_states(optimizer_offload) == pytest.approx(gpu - largest_memory, abs=4)
    # Full offload: nothing but gathered layers on the GPU; the host holds 20Ψ (DeepSpeed: 18Ψ × 1.5).
    full = estimate(shape, Setup("deepspeed", gpus, zero_stage=3, offload_optimizer="cpu", offload_param="cpu"))
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(psi, largest, gpus, cpu_offload=True, cpu_offload_params=True)
    assert model_states(full) == 0 and gpu == largest_memory
    assert full.host_bytes_per_node == pytest.approx(cpu / 1.5 + 2 * psi, rel=1e-6)


def test_strategies_order_as_the_zero_paper_says():
    shape = model_shape("llama-3-8b")
    states = [model_states(estimate(shape, Setup("deepspeed", 8, zero_stage=stage))) for stage in (0, 1, 2, 3)]
    psi = shape.num_parameters
    assert states[0] == 20 * psi  # bf16 weights + bf16 and fp32 gradients + fp32 master + Adam
    assert states[1] == states[2] == 2 * psi + 18 * psi // 8  # DeepSpeed's ZeRO-1 partitions gradients too
    assert states[3] == pytest.approx(20 * psi / 8, abs=8)
    ddp = estimate(shape, Setup("ddp", 8))
    assert model_states(ddp) == 16 * psi and ddp.temporary_bytes == 4 * psi  # fp32 + Adam; reducer buckets


def test_activations_scale_with_micro_batch_and_shrink_with_checkpointing():
    shape = model_shape("llama-3-8b")

    def activations(strategy="deepspeed", **options):
        setup = Setup(strategy, 2 if strategy == "deepspeed" else 1, zero_stage=2 if strategy == "deepspeed" else 0,
                      sequence_length=1024, **options)
        return estimate(shape, setup).activations_bytes

    one = activations(micro_batch_size=1)
    assert activations(micro_batch_size=2) == 2 * one
    assert activations(gradient_checkpointing=True) < one / 3  # the fp32 log-probabilities stay
    assert activations(attention="eager") > one  # the s² attention scores
    # fp32 master weights under autocast: the half cast of every weight is held for the backward, once per forward
    single_one, single_two = activations("single", micro_batch_size=1), activations("single", micro_batch_size=2)
    casts = 2 * sum(linear.in_features * linear.out_features for linear in shape.linears)
    assert 2 * single_one - single_two == casts


def test_lora_and_qlora_shrink_model_states():
    shape = model_shape("llama-3-8b")
    full = estimate(shape, Setup("single"))
    lora = estimate(shape, Setup("single", lora_rank=16))
    qlora = estimate(shape, Setup("single", lora_rank=16, qlora=True))
    adapters = shape.lora_parameters(16)
    assert lora.trainable_parameters == adapters
    assert lora.grads_bytes == 4 * adapters and lora.optimizer_bytes == 8 * adapters
    assert lora.params_bytes == 2 * shape.num_parameters + 4 * adapters  # bf16 base + fp32 adapters
    # NF4 blocks; what is not quantized (embeddings, norms, head) upcast to fp32 by peft's k-bit preparation
    block = shape.block_linear_parameters
    assert qlora.params_bytes == int(4 * (shape.num_parameters - block) + NF4_BYTES_PER_PARAMETER * block
                                     + 4 * adapters)
    assert qlora.params_bytes < lora.params_bytes * 0.5 < full.params_bytes


def test_setup_errors_name_the_problem():
    shape = model_shape("tiny")
    with pytest.raises(RecipeError, match="offload_param needs ZeRO stage 3"):
        estimate(shape, Setup("deepspeed", 2, zero_stage=2, offload_param="cpu"))
    with pytest.raises(RecipeError, match="`optimizer: adam` is not one of"):
        estimate(shape, Setup("ddp", 2, optimizer="adam"))
    with pytest.raises(RecipeError, match="QLoRA"):
        estimate(shape, Setup("single", qlora=True))


def test_pipeline_bubble_fraction():
    assert pipeline_bubble_fraction(1, 8) == 0
    assert pipeline_bubble_fraction(4, 4) == pytest.approx(3 / 7)


def test_plan_for_a_7b_model_on_two_24_gib_gpus_recommends_a_strategy_that_fits():
    plan = make_plan(PlanRequest("mistral-7b", gpus=2, gpu_memory_gib=24))
    rows = {row["name"]: row for row in plan["strategies"]}
    assert not rows["DDP"]["fits"] and not rows["ZeRO-1"]["fits"]
    recommended = rows[plan["recommended"]]
    assert recommended["fits"] and recommended["estimate"].total_bytes <= 0.9 * 24 * GiB
    # The first that fits in decision-tree order: nothing before it fits.
    names = [row["name"] for row in plan["strategies"]]
    assert not any(rows[name]["fits"] for name in names[: names.index(plan["recommended"])])
    assert plan["recommended"] == "ZeRO-3 + CPU offload"
    batch = plan["batch_plan"]
    assert batch["micro_batch_size"] * 2 * batch["gradient_accumulation_steps"] == 32
    assert plan["launch_command"].startswith(
        "accelerate launch --config_file accelerate_configs/deepspeed_zero3_offload.yaml -m finetune train")


def test_plan_picks_ddp_when_it_fits_and_grows_the_micro_batch():
    plan = make_plan(PlanRequest("qwen2.5-0.5b", gpus=2, gpu_memory_gib=80, sequence_length=512))
    assert plan["recommended"] == "DDP"
    assert plan["batch_plan"]["micro_batch_size"] > 1


def test_plan_json_from_the_command_line(capsys):
    assert main(["plan", "--model", "mistral-7b", "--gpus", "2", "--gpu-memory", "24", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    fits = {row["name"]: row["fits"] for row in plan["strategies"]}
    assert fits["DDP"] is False and fits["ZeRO-1"] is False and fits[plan["recommended"]] is True
    assert plan["strategies"][0]["per_gpu"]["total_bytes"] > 100 * GiB


def test_plan_table_names_the_recommendation(capsys):
    assert main(["plan", "--model", "mistral-7b", "--gpus", "2", "--gpu-memory", "24"]) == 0
    out = capsys.readouterr().out
    assert "Recommended: ZeRO-3 + CPU offload" in out and "DDP, ZeRO-1, ZeRO-2" in out
    assert "accelerate launch --config_file accelerate_configs/deepspeed_zero3_offload.yaml" in out


def test_plan_help_and_unknown_model_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0 and "--gpu-memory" in capsys.readouterr().out
    assert main(["plan", "--model", "no-such-model", "--gpus", "2", "--gpu-memory", "24"]) == 2
    assert "cannot read a config for model 'no-such-model'" in capsys.readouterr().err


def fake_records():
    ledger = {"params_bytes": 2 << 20, "grads_bytes": 1 << 20, "optimizer_bytes": 3 << 20}
    return [{"rank": rank, "world_size": 2, "strategy": "deepspeed_zero2",
             "measured": {**ledger, "peak_bytes": 500 << 20, "peak_kind": "cpu_max_rss"},
             "predicted": {**ledger, "peak_bytes": 10 << 20}} for rank in (0, 1)]


def test_report_files_and_rerender(tmp_path, capsys):
    paths = write_memory_report(fake_records(), tmp_path)
    assert [p.name for p in paths] == ["memory_report.json", "memory_report.md", "memory_report.png"]
    assert (tmp_path / "memory_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "memory_report.md").read_text()
    assert "| 1 | gradients | 1.00 | 1.00 | 1.000 |" in markdown
    assert "| 0 | peak (cpu_max_rss) | 10.00 | 500.00 | – |" in markdown  # RSS is not comparable to a GPU peak
    (tmp_path / "memory_report.md").unlink()
    assert main(["report", str(tmp_path)]) == 0
    assert "| 0 | parameters | 2.00 | 2.00 | 1.000 |" in capsys.readouterr().out
    assert (tmp_path / "memory_report.md").is_file()


def test_report_without_a_run_is_a_user_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no memory_report.json in" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--help"])
    assert exit_info.value.code == 0 and "OUTPUT_DIR" in capsys.readouterr().out.upper()


def train_tiny_with_callback(output_dir, steps=2):
    import torch
    from transformers import Trainer, TrainingArguments

    from finetune.memory import MemoryReportCallback

    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer, seed=0)
    ids = torch.randint(0, 250, (8, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(str(output_dir), per_device_train_batch_size=4, max_steps=steps, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": i, "labels": i} for i in ids],
                      callbacks=[MemoryReportCallback(sequence_length=16)])
    trainer.train()
    return trainer, json.loads((output_dir / "memory_report.json").read_text())["ranks"]


def test_callback_in_a_plain_single_process_trainer(tmp_path):
    trainer, ranks = train_tiny_with_callback(tmp_path)
    (record,) = ranks
    psi = model_shape("tiny").num_parameters
    assert record["strategy"] == "single" and record["world_size"] == 1
    assert record["measured"]["params_bytes"] == record["predicted"]["params_bytes"] == 4 * psi
    assert record["measured"]["grads_bytes"] == record["predicted"]["grads_bytes"] == 4 * psi
    assert record["measured"]["optimizer_bytes"] == record["predicted"]["optimizer_bytes"] == 8 * psi
    assert trainer.state.log_history[0]["memory/optimizer_bytes"] == 8 * psi
    assert "memory/optimizer_bytes" not in trainer.state.log_history[1]  # logged once
    assert (tmp_path / "memory_report.png").is_file()


def test_a_model_the_estimator_cannot_read_still_trains_and_reports_what_was_held(tmp_path, monkeypatch):
    import finetune.memory.callback as callback

    def unreadable(model):
        raise RecipeError("cannot find the repeated decoder blocks of Exotic.")

    monkeypatch.setattr(callback, "shape_of", unreadable)
    trainer, (record,) = train_tiny_with_callback(tmp_path)
    assert trainer.state.global_step == 2
    assert record["predicted"] is None and record["measured"]["params_bytes"] == 4 * model_shape("tiny").num_parameters
    assert "| 0 | parameters | – | 2.01 | – |" in (tmp_path / "memory_report.md").read_text()


def test_plan_across_nodes_says_when_zeropp_and_hybrid_sharding_pay_off(capsys):
    slow = make_plan(PlanRequest("llama-3-8b", gpus=16, gpu_memory_gib=80, nodes=2, inter_node_gbps=100))
    traffic = {row["name"]: row for row in slow["inter_node"]["strategies"]}
    psi = slow["trainable_parameters"]
    assert traffic["ZeRO-3"]["bytes_per_node"] == pytest.approx(3 * psi * 2 / 2)  # 3Ψ bf16 values, half cross
    assert traffic["ZeRO-3 + ZeRO++"]["bytes_per_node"] == pytest.approx(traffic["ZeRO-3"]["bytes_per_node"] / 4)
    assert traffic["FSDP hybrid-shard"]["bytes_per_node"] == traffic["ZeRO-2"]["bytes_per_node"]
    assert not traffic["ZeRO-3"]["hidden"] and traffic["ZeRO-3"]["seconds"] > slow["inter_node"]["compute_seconds"]
    fast = make_plan(PlanRequest("llama-3-8b", gpus=16, gpu_memory_gib=80, nodes=2, inter_node_gbps=3200))
    assert all(row["hidden"] for row in fast["inter_node"]["strategies"])
    assert make_plan(PlanRequest("llama-3-8b", gpus=2, gpu_memory_gib=80))["inter_node"] is None

    assert main(["plan", "--model", "llama-3-8b", "--gpus", "16", "--nodes", "2", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "Across 2 nodes × 8 GPUs at 100 Gb/s per node" in out and "ZeRO++" in out and "pay off" in out
    assert main(["plan", "--model", "tiny", "--gpus", "3", "--nodes", "2", "--gpu-memory", "80"]) == 2
    assert "must be a multiple of `--nodes 2`" in capsys.readouterr().err


def test_plan_across_nodes_under_lora_still_gathers_the_frozen_base_under_zero3():
    lora = make_plan(PlanRequest("llama-3-8b", gpus=16, gpu_memory_gib=80, nodes=2, lora_rank=16))
    traffic = {row["name"]: row for row in lora["inter_node"]["strategies"]}
    base, trained = lora["num_parameters"], lora["trainable_parameters"]
    assert traffic["ZeRO-2"]["bytes_per_node"] == pytest.approx(2 * trained * 2 / 2)
    assert traffic["ZeRO-3"]["bytes_per_node"] == pytest.approx((2 * base + trained) * 2 / 2)


def test_zero1_under_accumulation_holds_full_gradients_between_micro_steps():
    shape = model_shape("llama-3-8b")
    psi = shape.num_parameters
    once = {stage: estimate(shape, Setup("deepspeed", 8, zero_stage=stage)) for stage in (1, 2, 3)}
    accumulate = {stage: estimate(shape, Setup("deepspeed", 8, zero_stage=stage, gradient_accumulation_steps=4))
                  for stage in (1, 2, 3)}
    assert all(result.grads_between_micro_steps_bytes == 0 for result in once.values())
    # ZeRO-1 reduces only at the boundary: 2Ψ of bf16 gradients, more than the step's (2 + 4)Ψ/8.
    assert accumulate[1].grads_between_micro_steps_bytes == 2 * psi
    assert accumulate[1].grads_peak_bytes == 2 * psi > accumulate[1].grads_bytes == once[1].grads_bytes
    assert accumulate[1].total_bytes - once[1].total_bytes == 2 * psi - once[1].grads_bytes
    # ZeRO-2/3 keep their bf16 partition: below the step's figure, so the peak is the step's.
    for stage in (2, 3):
        assert accumulate[stage].grads_between_micro_steps_bytes == 2 * psi // 8
        assert accumulate[stage].total_bytes == once[stage].total_bytes
    assert estimate(shape, Setup("deepspeed", 8, zero_stage=1, gradient_accumulation_steps=4,
                                 offload_optimizer="cpu")).grads_between_micro_steps_bytes == 2 * psi
    per_gpu = accumulate[1].to_dict()["per_gpu"]
    assert per_gpu["grads_between_micro_steps_bytes"] == per_gpu["grads_peak_bytes"] == 2 * psi
    with pytest.raises(RecipeError, match="gradient_accumulation_steps must be positive"):
        estimate(shape, Setup("deepspeed", 8, zero_stage=1, gradient_accumulation_steps=0))


def test_zero3_fp32_gradients_are_bounded_by_the_sub_group_for_a_7b_on_2_gpus():
    shape = model_shape("mistral-7b")
    psi, shard = shape.num_parameters, shape.largest_layer_parameters / 2
    default = estimate(shape, Setup("deepspeed", 2, zero_stage=3))
    # bf16 partition + one sub-group of fp32 gradients (DeepSpeed's default 1e9 elements, overshooting by at most
    # one tensor's shard), not the whole 3.6e9-element partition in fp32.
    assert default.grads_bytes == pytest.approx(2 * psi / 2 + 4 * (1e9 + shard), abs=8)
    assert default.grads_bytes < (2 + 4) * psi / 2 - 9 * GiB
    small = estimate(shape, Setup("deepspeed", 2, zero_stage=3, sub_group_size=100_000_000))
    assert small.grads_bytes == pytest.approx(2 * psi / 2 + 4 * (1e8 + shard), abs=8)
    # A sub-group larger than the partition: the whole partition, as DeepSpeed's own estimator counts it.
    assert estimate(shape, Setup("deepspeed", 8, zero_stage=3, sub_group_size=10**10)).grads_bytes == \
        pytest.approx(6 * psi / 8, abs=8)
    with pytest.raises(RecipeError, match="sub_group_size: 0"):
        estimate(shape, Setup("deepspeed", 2, zero_stage=3, sub_group_size=0))


def test_host_ram_at_load_is_one_model_per_local_rank_unless_global_rank_0_alone_reads_it():
    shape = model_shape("llama-3-70b")
    psi = shape.num_parameters
    # DDP, ZeRO-1/2: every local rank holds the whole model (DeepSpeed in bf16, DDP its fp32 masters).
    per_node = estimate(shape, Setup("deepspeed", 2, gpus_per_node=2, zero_stage=2)).host_load_bytes_per_node
    assert per_node == 2 * 2 * psi and per_node == pytest.approx(2 * 141e9, rel=0.01)
    # DDP holds fp32 masters: the bf16 weights as loaded and their fp32 cast, 6 bytes a parameter at the peak.
    assert estimate(model_shape("tiny"), Setup("ddp", 2)).host_load_bytes_per_node == 2 * 6 * 525_824
    assert estimate(model_shape("tiny"), Setup("ddp", 2, precision="fp32")).host_load_bytes_per_node == \
        2 * 4 * 525_824
    # ZeRO-3 and FSDP2 (as shipped): global rank 0 reads the checkpoint, partitions land on the GPUs, so 16 GPUs on
    # 2 nodes need one model on the first node; parameter offload adds each rank's partition there.
    assert estimate(shape, Setup("deepspeed", 16, gpus_per_node=8, zero_stage=3)).to_dict()[
        "host_load_bytes_per_node"] == 2 * psi
    offload = estimate(shape, Setup("deepspeed", 2, zero_stage=3, offload_param="cpu", offload_optimizer="cpu"))
    assert offload.host_load_bytes_per_node == 2 * psi + 2 * psi
    assert estimate(shape, Setup("fsdp", 8)).host_load_bytes_per_node == 6 * psi  # rank 0 casts to fp32 masters
    # FSDP without `fsdp_cpu_ram_efficient_loading`: every rank loads (and casts to fp32) the whole model.
    assert estimate(shape, Setup("fsdp", 8, sharded_loading=False)).host_load_bytes_per_node == 8 * 6 * psi
    # Per rank, as the memory report predicts a CPU-only run (partitions are then host memory).
    zero3 = Setup("deepspeed", 2, zero_stage=3)
    assert [host_load_bytes_of_rank(2 * psi, zero3, rank, device_is_host=True) for rank in (0, 1)] == \
        [2 * psi + psi, psi]
    assert [host_load_bytes_of_rank(6 * psi, Setup("fsdp", 2), rank, device_is_host=True) for rank in (0, 1)] == \
        [6 * psi, 0]


def test_zeropp_counts_its_secondary_weight_copy_over_the_gpus_of_a_node():
    """ZeRO++'s hpZ: beside its ZeRO-3 partition each GPU holds a bf16 slice of the weights over its hpZ group. On
    2 nodes × 8 GPUs a file written for hpZ 2 would hold 2Ψ/2 (70 GB for a 70B) where the node's 8 hold 2Ψ/8."""
    from finetune.launch.strategies import SHIPPED_BY_NAME

    shape = model_shape("llama-3-8b")
    psi = shape.num_parameters
    zero3 = estimate(shape, Setup("deepspeed", 16, gpus_per_node=8, zero_stage=3))
    shipped = SHIPPED_BY_NAME["zero3_zeropp"].strategy.estimator_options()  # read back from the shipped JSON
    assert shipped["hpz_partition_size"] == "auto"
    per_node = estimate(shape, Setup(**shipped, num_gpus=16, gpus_per_node=8))
    assert per_node.params_bytes - zero3.params_bytes == pytest.approx(2 * psi / 8, abs=1)
    written_for_2 = estimate(shape, Setup(**{**shipped, "hpz_partition_size": 2}, num_gpus=16, gpus_per_node=8))
    assert written_for_2.params_bytes - zero3.params_bytes == pytest.approx(2 * psi / 2, abs=1)
    assert per_node.grads_bytes == zero3.grads_bytes and per_node.optimizer_bytes == zero3.optimizer_bytes
