"""The strategy model: one reader of DeepSpeed JSON and Accelerate YAML (files and inline keys, and what a launcher
hands a process), and one table of shipped strategies that the shipped files, the estimator, the plan and the bench
agree with."""

import json
from pathlib import Path

import pytest
import yaml
from support import PROJECT_ROOT

from finetune.bench.harness import variants
from finetune.configs.accelerate import deepspeed_section_as_json
from finetune.errors import RecipeError
from finetune.generated_files import SHIPPED as SHIPPED_FILES
from finetune.launch.strategies import (
    DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE,
    SHIPPED,
    SHIPPED_BY_NAME,
    Strategy,
    launched_strategy,
    read_accelerate,
    read_config_file,
    shipped,
)
from finetune.memory.estimate import Setup, temporary_bytes
from finetune.memory.shapes import model_shape
from finetune.plan.decision_tree import CANDIDATES, PlanRequest, make_plan
from finetune.train.axes.pipeline.layout import PipelineLayout

ROWS = {row.name: row for row in SHIPPED}


@pytest.mark.parametrize("name", [row.name for row in SHIPPED])
def test_each_shipped_file_reads_back_as_its_table_row(name, monkeypatch):
    """The files on disk (generated from the table) read back, through the one reader, as the row's strategy."""
    monkeypatch.chdir(PROJECT_ROOT)
    row = ROWS[name]
    files = [path for path in (row.deepspeed_file, row.accelerate_file, row.multinode_file) if path]
    assert files, f"{name} ships no file"
    for path in files:
        strategy, _ = read_config_file(path)
        assert strategy.kind == row.kind
        assert (strategy.zero_stage, strategy.offload_optimizer, strategy.offload_param, strategy.fsdp_sharding) == (
            row.strategy.zero_stage, row.strategy.offload_optimizer, row.strategy.offload_param,
            row.strategy.fsdp_sharding), path
        assert strategy.reduce_bucket_size == row.strategy.reduce_bucket_size
    if row.multinode_file:
        assert read_config_file(row.multinode_file)[0].nodes == 2


def test_every_shipped_launch_file_belongs_to_a_table_row():
    paths = {config.path for config in SHIPPED_FILES}
    named = {path for row in SHIPPED for path in (row.deepspeed_file, row.accelerate_file, row.multinode_file) if path}
    assert named <= paths
    cpu_files = {row.launch(cpu=True).config_file for row in SHIPPED if row.cpu}
    assert cpu_files == {"accelerate_configs/cpu_ddp.yaml", "accelerate_configs/cpu_deepspeed_zero2.yaml",
                         "accelerate_configs/cpu_fsdp.yaml", "accelerate_configs/cpu_fsdp_shard_grad_op.yaml",
                         "accelerate_configs/cpu_tensor_parallel.yaml",
                         "accelerate_configs/cpu_tensor_parallel_fsdp.yaml",
                         "accelerate_configs/sequence_parallel.yaml"}  # DeepSpeed runs it on CPU as on GPUs
    # the CPU twins, launched through `ShippedStrategy.launch(cpu=True)`
    assert paths - named == cpu_files - {"accelerate_configs/sequence_parallel.yaml"}
    for row in SHIPPED:
        if row.cpu:  # each CPU twin runs the row's own strategy
            assert read_config_file(row.launch(cpu=True).config_file)[0].kind == row.kind


def test_the_bucket_the_estimator_counts_is_the_one_the_generated_config_sets(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    shape = model_shape("llama-3-8b")
    for row in SHIPPED:
        if row.kind != "deepspeed" or row.strategy.zero_stage == 0:
            continue
        zero = json.loads(Path(row.deepspeed_file).read_text())["zero_optimization"]
        written = zero.get("reduce_bucket_size", DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE)
        bucket = shape.hidden_size**2 if written == "auto" else int(written)  # Trainer fills "auto" with hidden²
        setup = Setup(**row.strategy.estimator_options(), num_gpus=2)
        buffers = temporary_bytes(shape, setup, shape.num_parameters)
        if row.strategy.zero_stage in (1, 2):
            assert buffers == bucket * 2 * (2 if zero["overlap_comm"] else 1), row.name
        else:
            assert buffers - bucket * 2 == 2 * shape.largest_layer_parameters * 2 + shape.layer_parameters * 2


def test_deepspeed_default_bucket_is_deepspeeds_own():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig().reduce_bucket_size == DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE


def test_plan_and_bench_read_the_table():
    tree = [row for row in SHIPPED if row.decision_tree]
    assert [(c.name, c.config, c.options) for c in CANDIDATES] == [
        (row.label, row.accelerate_file, row.strategy.estimator_options()) for row in tree]
    plan = make_plan(PlanRequest(model="mistral-7b", gpus=2, gpu_memory_gib=24))
    assert [row["name"] for row in plan["strategies"]] == [row.label for row in tree]
    nodes = make_plan(PlanRequest(model="llama-3-8b", gpus=4, gpu_memory_gib=80, nodes=2))["inter_node"]
    assert [(r["name"], r["config"]) for r in nodes["strategies"]] == [
        (row.label, row.multinode_file) for row in SHIPPED if row.cross_node]
    assert [v.launch for v in variants(2) if v.launch] == [row.name for row in SHIPPED if row.cpu]


ACCELERATE_INLINE = {
    "distributed_type": "DEEPSPEED", "num_machines": 1, "num_processes": 2, "mixed_precision": "no",
    "deepspeed_config": {"gradient_accumulation_steps": 1, "offload_optimizer_device": "cpu",
                         "offload_param_device": "none", "zero3_init_flag": True, "zero3_save_16bit_model": True,
                         "zero_stage": 3},
}


def test_inline_deepspeed_keys_read_as_accelerate_builds_them(monkeypatch):
    """The DeepSpeed config built from inline keys is the one Accelerate's own DeepSpeedPlugin builds from them."""
    from accelerate.utils import DeepSpeedPlugin

    strategy, deepspeed = read_accelerate(ACCELERATE_INLINE)
    assert (strategy.kind, strategy.zero_stage, strategy.offload_optimizer, strategy.offload_param) == (
        "deepspeed", 3, "cpu", None)
    assert strategy.source == "Accelerate config (inline deepspeed_config)"
    section = ACCELERATE_INLINE["deepspeed_config"]
    for variable, key in (("ZERO_STAGE", "zero_stage"), ("OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer_device"),
                          ("OFFLOAD_PARAM_DEVICE", "offload_param_device"),
                          ("ZERO3_SAVE_16BIT_MODEL", "zero3_save_16bit_model")):
        monkeypatch.setenv(f"ACCELERATE_DEEPSPEED_{variable}", str(section[key]).lower())
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    built = dict(DeepSpeedPlugin().deepspeed_config)
    built.pop("steps_per_print")
    assert deepspeed == built == deepspeed_section_as_json(section)


def test_what_a_launcher_hands_a_process(tmp_path, monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    accelerate = {"ACCELERATE_MIXED_PRECISION": "no", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    file, _ = launched_strategy(environ={**accelerate, "ACCELERATE_USE_DEEPSPEED": "true",
                                         "ACCELERATE_DEEPSPEED_CONFIG_FILE": "deepspeed_configs/zero3_offload.json"})
    assert (file.label, file.nodes) == ("deepspeed_zero3+offload_optimizer=cpu+offload_param=cpu", 2)
    assert file.source == "DeepSpeed JSON deepspeed_configs/zero3_offload.json"
    inline, config = launched_strategy(environ={**accelerate, "ACCELERATE_USE_DEEPSPEED": "true",
                                                "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"})
    assert (inline.label, inline.source) == ("deepspeed_zero1", "Accelerate config (inline deepspeed_config)")
    assert config["zero_optimization"]["stage"] == 1
    fsdp, _ = launched_strategy(environ={**accelerate, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                                         "FSDP_RESHARD_AFTER_FORWARD": "false"})
    assert (fsdp.kind, fsdp.fsdp_sharding, fsdp.fsdp_version) == ("fsdp", "shard_grad_op", 2)
    hybrid, _ = launched_strategy(environ={**accelerate, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                                           "FSDP_RESHARD_AFTER_FORWARD": "true",
                                           "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"})
    assert hybrid.fsdp_sharding == "hybrid_shard"
    assert launched_strategy(environ={"WORLD_SIZE": "2"})[0] == Strategy("ddp")  # torchrun
    assert launched_strategy(environ={})[0] == Strategy("single")
    recipe_dict, _ = launched_strategy({"zero_optimization": {"stage": 2}}, environ=accelerate)
    assert recipe_dict.zero_stage == 2  # the recipe's `deepspeed` wins over the launcher


def test_ddp_on_one_process_is_one_process():
    assert Strategy("ddp").for_world_size(1) == Strategy("single")
    assert Strategy("ddp").for_world_size(2) == Strategy("ddp")
    assert Strategy("deepspeed", zero_stage=2).for_world_size(1).kind == "deepspeed"


@pytest.mark.parametrize("section, sharding", [
    ({"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD"}, "full_shard"),
    ({"fsdp_version": 1, "fsdp_sharding_strategy": 2}, "shard_grad_op"),
    ({"fsdp_version": 1, "fsdp_reshard_after_forward": "NO_SHARD"}, "no_shard"),
    ({"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2"}, "hybrid_shard"),
    ({"fsdp_version": 2, "fsdp_reshard_after_forward": False}, "shard_grad_op"),
])
def test_fsdp_sharding_in_every_form_accelerate_writes(section, sharding):
    strategy = Strategy.from_accelerate({"distributed_type": "FSDP", "fsdp_config": section})
    assert (strategy.kind, strategy.fsdp_sharding) == ("fsdp", sharding)


def test_unreadable_or_unsupported_configs_are_user_errors(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        read_config_file(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(RecipeError, match="is not valid JSON"):
        read_config_file(tmp_path / "broken.json")
    (tmp_path / "tpu.yaml").write_text(yaml.safe_dump({"distributed_type": "XLA"}))
    with pytest.raises(RecipeError, match="distributed_type XLA is not one this toolkit runs"):
        read_config_file(tmp_path / "tpu.yaml")
    with pytest.raises(RecipeError, match="did you mean `zero2`"):
        shipped("zero_2")
    assert shipped("zero3") is SHIPPED_BY_NAME["zero3"]


def test_a_pipeline_with_tensor_parallelism_inside_its_stages_is_named_and_recorded_with_both_sizes():
    alone = Strategy("pipeline", axis=PipelineLayout(2))
    split = Strategy("pipeline", axis=PipelineLayout(2, tensor=4))
    assert (alone.label, alone.describe(), alone.to_dict()) == (
        "pp2", "pipeline parallel 2", {"strategy": "pipeline", "pipeline_parallel_size": 2})
    assert (split.label, split.describe()) == ("pp2_tp4", "pipeline parallel 2 × tensor parallel 4 inside each stage")
    assert split.to_dict() == {"strategy": "pipeline", "pipeline_parallel_size": 2, "tensor_parallel_size": 4}
    assert split.estimator_options() == {"strategy": "pipeline", "axis": PipelineLayout(2, tensor=4)}
    # as a checkpoint's marker records it, without its layout: named by its kind, never as DDP
    assert Strategy("pipeline").describe() == "pipeline"
