"""Launch checks that depend on the machine's GPUs, on simulated GPUs: bf16 on a GPU without it, and several GPUs
seen by one process. Both stop while the recipe is parsed, before `TrainingArguments` exists."""

import json

import pytest
from gpu_simulation import A100, T4, simulate_gpus
from support import PROJECT_ROOT
from transformers import TrainingArguments

from finetune.errors import RecipeError
from finetune.recipe.parse import parse_recipe

ON_GPU = ["--use_cpu", "false"]  # the parser's default on a machine with a GPU


@pytest.fixture
def reaches_training_arguments(monkeypatch):
    """parse_recipe through every check up to `TrainingArguments`, whose own checks and device set-up are skipped
    (they would reach for the simulated CUDA device): returns the training arguments."""
    monkeypatch.chdir(PROJECT_ROOT)
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)

    def parse(*overrides):
        return parse_recipe("recipes/demo.yaml", [*ON_GPU, *overrides]).training

    return parse


def test_bf16_on_a_t4_stops_with_the_fp16_fix(monkeypatch, reaches_training_arguments):
    simulate_gpus(monkeypatch, T4)
    with pytest.raises(RecipeError, match=r"^`bf16: true` but Tesla T4 \(compute capability 7\.5\) has no bf16 .*: "
                                          r"train in fp16 instead \(`--bf16 false --fp16 true`\), "
                                          r"or let `bf16: auto` pick per GPU\.$"):
        reaches_training_arguments("--bf16", "true")
    training = reaches_training_arguments("--fp16", "true")  # the fix, as the message gives it
    assert training.fp16 and not training.bf16


def test_bf16_from_the_accelerate_config_on_a_t4_names_the_launcher_fix(monkeypatch, reaches_training_arguments):
    simulate_gpus(monkeypatch, T4)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # accelerate_configs/single_gpu.yaml
    with pytest.raises(RecipeError, match=r"Accelerate config asks for bf16 .* `accelerate launch --mixed_precision "
                                          r"fp16 \.\.\.`"):
        reaches_training_arguments()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # the fix; the recipe may say fp16 too
    assert reaches_training_arguments("--fp16", "true").fp16


def test_bf16_passes_on_an_a100_and_on_cpu(monkeypatch, reaches_training_arguments):
    simulate_gpus(monkeypatch, A100)
    assert reaches_training_arguments("--bf16", "true").bf16
    simulate_gpus(monkeypatch, T4)
    assert reaches_training_arguments("--bf16", "true", "--use_cpu", "true").bf16  # the CPU trains it, not the T4


def test_two_gpus_without_a_launcher_stop_with_the_launch_command(monkeypatch, reaches_training_arguments):
    simulate_gpus(monkeypatch, A100, count=2)
    with pytest.raises(RecipeError) as error:
        reaches_training_arguments()
    message = str(error.value)
    assert "2 GPUs are visible to one process" in message and "nn.DataParallel" in message
    assert ("`accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 -m finetune train "
            "RECIPE.yaml" in message and "`CUDA_VISIBLE_DEVICES=0 finetune train RECIPE.yaml`" in message)
    simulate_gpus(monkeypatch, A100, count=4)
    with pytest.raises(RecipeError, match="--num_processes 4"):
        reaches_training_arguments()


def test_one_gpu_a_launcher_or_use_cpu_pass_the_one_process_check(monkeypatch, reaches_training_arguments):
    simulate_gpus(monkeypatch, A100, count=1)
    assert reaches_training_arguments().use_cpu is False
    simulate_gpus(monkeypatch, A100, count=2)
    assert reaches_training_arguments("--use_cpu", "true").use_cpu is True
    for variable, value in (("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):  # what torchrun / accelerate launch set
        simulate_gpus(monkeypatch, A100, count=2)
        monkeypatch.setenv(variable, value)
        assert reaches_training_arguments().use_cpu is False


def test_the_single_gpu_config_pins_one_gpu_through_accelerates_own_launcher():
    """The plan's one-GPU launch must pass the one-process check on a box with several GPUs: Accelerate's simple
    launcher turns the config's `gpu_ids` into CUDA_VISIBLE_DEVICES."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(
        ["--config_file", "accelerate_configs/single_gpu.yaml", "-m", "finetune", "train", "recipes/demo.yaml"])
    _validate_launch_command(args)
    _, environment = prepare_simple_launcher_cmd_env(args)
    assert environment["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize("gpu, bf16, fp16", [(T4, False, True), (A100, True, False)])
def test_bf16_auto_picks_fp16_on_a_t4_and_bf16_where_the_gpu_has_it_and_records_why(
        monkeypatch, reaches_training_arguments, gpu, bf16, fp16):
    simulate_gpus(monkeypatch, gpu)
    training = reaches_training_arguments("--bf16", "auto")
    assert (training.bf16, training.fp16) == (bf16, fp16)
    recipe = parse_recipe("recipes/demo.yaml", [*ON_GPU, "--bf16", "auto"])
    assert recipe.sources["bf16"] == f"command line: auto → {'bf16' if bf16 else 'fp16'} ({gpu[0]} (compute " \
                                     f"capability {gpu[1][0]}.{gpu[1][1]}))"


def test_bf16_auto_in_a_recipe_file_trains_without_mixed_precision_on_cpu(tmp_path):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text((PROJECT_ROOT / "recipes/demo.yaml").read_text() + "bf16: auto\n")
    recipe = parse_recipe(recipe_file, [])
    assert not recipe.training.bf16 and not recipe.training.fp16
    assert recipe.sources["bf16"] == recipe.sources["fp16"] == f"recipe {recipe_file}: auto → fp32 (no GPU visible)"


# --- sizes written for one cluster shape, checked against the launch's ------------------------------------------

HYBRID_2_BY_2 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
                 "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "1",
                 "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_SP_SIZE": "1"}


def test_parallelism_sizes_written_for_2_by_2_are_refused_on_2_nodes_of_8_naming_both():
    from finetune.recipe.preflight import check_per_node_sizes

    launch = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    with pytest.raises(RecipeError, match=r"parallelism sizes multiply to 4 \(dp_replicate 2 × dp_shard 2\) but this "
                                          r"launch runs 16 processes \(2 node\(s\) × 8\).*--parallelism_config_dp_"):
        check_per_node_sizes(None, {**HYBRID_2_BY_2, **launch})
    # the sizes scripts/launch_multinode.sh passes for 2 nodes × 8 GPUs
    check_per_node_sizes(None, {**HYBRID_2_BY_2, **launch, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8"})
    check_per_node_sizes(None, launch)  # no parallelism config: nothing to check
    all_one = {name: "1" if name.endswith("_SIZE") else value for name, value in HYBRID_2_BY_2.items()}
    check_per_node_sizes(None, {**all_one, **launch})  # as Accelerate takes it: data parallelism over all 16


def test_a_recipe_launched_with_mismatched_sizes_stops_before_the_process_group(monkeypatch,
                                                                                reaches_training_arguments):
    for name, value in {**HYBRID_2_BY_2, "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RecipeError, match="multiply to 4 .* runs 16 processes"):
        reaches_training_arguments("--use_cpu", "true")


def test_zeropp_hpz_must_be_the_gpus_of_one_node():
    from finetune.configs.deepspeed import deepspeed_config, fill_hpz_partition_size
    from finetune.recipe.preflight import check_per_node_sizes

    launch = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    written_for_2 = deepspeed_config(stage=3, zeropp_hpz_partition_size=2)
    with pytest.raises(RecipeError, match=r"`zero_hpz_partition_size: 2` .* but this node runs 8 process\(es\).*set "
                                          r"it to 8, or \"auto\""):
        check_per_node_sizes(written_for_2, launch)
    check_per_node_sizes(deepspeed_config(stage=3, zeropp_hpz_partition_size=8), launch)
    shipped = json.loads((PROJECT_ROOT / "deepspeed_configs/zero3_zeropp.json").read_text())
    assert shipped["zero_optimization"]["zero_hpz_partition_size"] == "auto"
    check_per_node_sizes(shipped, launch)
    fill_hpz_partition_size(shipped, 8)  # what `finetune train` does before DeepSpeed starts
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig(**shipped["zero_optimization"]).zero_hpz_partition_size == 8


@pytest.mark.parametrize("rows", ["packing", "padding_free"])
def test_packed_rows_under_context_parallelism_stop_naming_the_mask_it_drops(monkeypatch, reaches_training_arguments,
                                                                              rows):
    simulate_gpus(monkeypatch, A100, count=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=rf"^`{rows}: true` with `context_parallel_size: 2`: context parallelism "
                                          r"drops the attention mask .* attend across their boundaries; set "):
        reaches_training_arguments("--context_parallel_size", "2", f"--{rows}", "true")


def test_liger_kernels_stop_in_one_line_without_cuda_or_without_the_package(monkeypatch, reaches_training_arguments,
                                                                             capsys):
    """Liger's kernels are Triton: on the CPU the recipe stops before anything loads, with the fix; on a GPU without
    the `liger-kernel` package (this machine has none), with the install line. With both it reaches Trainer."""
    import importlib.util

    from finetune.cli import main

    assert main(["train", "recipes/demo.yaml", "--use_liger_kernel", "true", "--output_dir", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["finetune: error: `use_liger_kernel: true` runs Liger's Triton kernels, which need a CUDA GPU, and "
                   "this process trains on the CPU: drop `use_liger_kernel` to train with PyTorch's own kernels."]
    simulate_gpus(monkeypatch, A100)
    with pytest.raises(RecipeError, match=r"on NVIDIA A100.* needs the `liger-kernel` package .* `pip install "
                                          r"liger-kernel`, or drop `use_liger_kernel`\.$"):
        reaches_training_arguments("--use_liger_kernel", "true")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object() if name in ("liger_kernel", "triton")
                        else find_spec(name, *args))
    assert reaches_training_arguments("--use_liger_kernel", "true").use_liger_kernel
