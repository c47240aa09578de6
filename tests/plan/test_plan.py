"""`finetune plan` for a named or visible GPU: the precision it has (fp16 on a T4), a QLoRA launch that loads 4-bit."""

import json

import pytest
from gpu_simulation import T4, simulate_gpus

from finetune.cli import main
from finetune.launch.devices import KNOWN_GPUS
from finetune.memory import model_shape
from finetune.memory.estimate import GiB
from finetune.plan.decision_tree import PlanRequest, decision_path, make_plan

QLORA = ["--model", "qwen2.5-0.5b", "--gpus", "1", "--qlora", "--lora-rank", "16", "--seq-len", "512", "--json"]


def planned(capsys, *arguments) -> dict:
    assert main(["plan", *arguments]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("gpu, precision, other", [("t4", "fp16", "bf16"), ("a100", "bf16", "fp16")])
def test_qlora_plan_launches_4bit_in_the_precision_the_gpu_has(capsys, gpu, precision, other):
    plan = planned(capsys, *QLORA, "--gpu", gpu)
    command = plan["launch_command"]
    assert "--use_qlora true --lora_r 16" in command and "--use_lora" not in command
    assert f"--{precision} true" in command and f"--{other} " not in command
    assert plan["precision"] == precision and plan["gpu_memory_gib"] == KNOWN_GPUS[gpu].memory_gib


def test_plan_reads_the_visible_gpu_or_a_compute_capability(capsys, monkeypatch):
    assert planned(capsys, *QLORA, "--compute-capability", "7.5", "--gpu-memory", "15")["precision"] == "fp16"
    assert planned(capsys, *QLORA, "--compute-capability", "8.0", "--gpu-memory", "40")["precision"] == "bf16"
    simulate_gpus(monkeypatch, T4, memory_gib=14.7)
    plan = planned(capsys, *QLORA)
    assert plan["gpu"] == "Tesla T4 (compute capability 7.5)" and plan["gpu_memory_gib"] == pytest.approx(14.7)
    assert "--fp16 true" in plan["launch_command"]
    assert "--fp32" not in planned(capsys, *QLORA, "--precision", "fp32")["launch_command"]  # asked by name: kept


def test_plan_without_a_gpu_keeps_bf16_and_lora_without_qlora_loads_16_bit():
    plan = make_plan(PlanRequest("qwen2.5-0.5b", gpus=2, gpu_memory_gib=24, lora_rank=8))
    assert plan["precision"] == "bf16" and "--bf16 true --use_lora true --lora_r 8" in plan["launch_command"]
    assert "--use_qlora" not in plan["launch_command"]


def test_plan_refuses_bf16_for_a_t4_and_unknown_gpus(capsys):
    assert main(["plan", *QLORA, "--gpu", "t4", "--precision", "bf16"]) == 2
    assert "`--precision bf16` for Tesla T4 (compute capability 7.5): it has no bf16" in capsys.readouterr().err
    assert main(["plan", *QLORA, "--gpu", "a1000"]) == 2
    assert "`--gpu a1000` is not a known GPU (did you mean `a100`?)" in capsys.readouterr().err
    assert main(["plan", *QLORA]) == 2  # no GPU here, none named, no memory given
    assert "`--gpu-memory` (GiB per GPU) is needed" in capsys.readouterr().err


def test_plan_help_names_the_gpu_options(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "--gpu " in out and "--compute-capability" in out and "auto" in out


# --- the batch: adapted to the GPU count, planned by finetune.recipe.batch_plan, passed on as a global batch
# -------------------

def test_a_default_global_batch_is_adapted_to_the_gpu_count_and_launched_as_a_global_batch(capsys):
    assert main(["plan", "--model", "qwen2.5-0.5b", "--gpus", "64", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "Recommended:" in out and "cannot be split" not in out
    assert "global batch 64: the default 32 rounded up to a multiple of 64 GPUs" in out
    plan = planned(capsys, "--model", "qwen2.5-0.5b", "--gpus", "64", "--gpu-memory", "80", "--json")
    batch, command = plan["batch_plan"], plan["launch_command"]
    assert plan["global_batch_size"] == batch["global_batch_size"] == 64
    assert f"--global_batch_size 64 --max_micro_batch_size {batch['max_micro_batch_size']}" in command
    for pinned in ("--per_device_train_batch_size", "--gradient_accumulation_steps"):
        assert pinned not in command


def test_a_global_batch_the_user_gave_must_split_over_the_gpus(capsys):
    assert main(["plan", "--model", "qwen2.5-0.5b", "--gpus", "64", "--gpu-memory", "80",
                 "--global-batch-size", "100"]) == 2
    err = capsys.readouterr().err
    assert "`global_batch_size: 100` cannot be split evenly over 64 processes; nearest reachable: 64 or 128." in err
    assert "Give a multiple of 64 (`--global-batch-size`)" in err
    plan = planned(capsys, "--model", "qwen2.5-0.5b", "--gpus", "8", "--gpu-memory", "80", "--global-batch-size", "24",
                   "--json")
    assert plan["global_batch_size"] == 24 and plan["global_batch_note"] is None


def test_the_launch_command_replans_like_finetune_train_for_another_world_size(capsys):
    """The keys the plan launches with, read by the recipe parser and planned by `finetune.recipe.batch_plan` for 4
    processes
    (what `finetune train` does under any launch), keep the global batch and the LR rule and cap the micro-batch."""
    from finetune.recipe.batch_plan import plan_from_recipe
    from finetune.recipe.parse import read_recipe

    plan = planned(capsys, "--model", "qwen2.5-0.5b", "--gpus", "8", "--gpu-memory", "80", "--global-batch-size",
                   "64", "--learning-rate", "1e-4", "--base-batch-size", "16", "--lr-scaling", "sqrt", "--json")
    command = plan["launch_command"].split()
    keys = command[command.index("RECIPE.yaml") + 1:]
    assert "--lr_scaling" in keys and "--base_batch_size" in keys and "--learning_rate" in keys
    keys = [key for key in keys if key not in ("--model_name_or_path", "Qwen/Qwen2.5-0.5B")]  # no hub here
    sections = read_recipe("recipes/demo.yaml", keys)
    four = plan_from_recipe(sections.training_inputs, 2048, 4)
    assert four.global_batch_size == 64 and four.micro_batch_size <= plan["batch_plan"]["max_micro_batch_size"]
    assert four.learning_rate == pytest.approx(plan["batch_plan"]["learning_rate"]) == pytest.approx(2e-4)


def test_the_plan_and_finetune_train_share_the_lr_scaling_default(capsys):
    from finetune.recipe.args import FinetuneTrainingArguments
    from finetune.recipe.batch_plan import DEFAULT_LR_SCALING

    plan = planned(capsys, "--model", "qwen2.5-0.5b", "--gpus", "2", "--gpu-memory", "80", "--json")
    assert plan["batch_plan"]["lr_scaling"] == DEFAULT_LR_SCALING == FinetuneTrainingArguments.lr_scaling
    assert "--lr_scaling" not in plan["launch_command"]


# --- accumulation and host RAM at load, charged by the estimator (finetune.memory.estimate) -------------------------

def test_zero1_under_accumulation_is_charged_its_full_gradients(capsys):
    plan = planned(capsys, "--model", "llama-3-8b", "--gpus", "32", "--gpu-memory", "40", "--global-batch-size", "256",
                   "--json")
    rows = {row["name"]: row for row in plan["strategies"]}
    zero1 = rows["ZeRO-1"]
    assert zero1["setup"]["gradient_accumulation_steps"] == 8  # 256 / 32 GPUs at micro-batch 1
    assert zero1["per_gpu"]["grads_peak_bytes"] >= 2 * plan["num_parameters"]  # full bf16 gradients between steps
    assert zero1["fits"] is False and zero1["per_gpu"]["total_bytes"] > 0.9 * 40 * GiB
    assert plan["recommended"] != "ZeRO-1" and rows[plan["recommended"]]["fits"]
    recommended = plan["recommended_estimate"]
    assert recommended["per_gpu"]["total_bytes"] <= 0.9 * 40 * GiB
    assert recommended["setup"]["gradient_accumulation_steps"] == plan["batch_plan"]["gradient_accumulation_steps"]


def test_host_ram_at_load_rejects_a_strategy_and_shows_in_the_plan(capsys):
    roomy = planned(capsys, "--model", "llama-3-8b", "--gpus", "2", "--gpu-memory", "80", "--host-memory", "512",
                    "--json")
    assert roomy["recommended"] is not None
    loads = {row["name"]: row["host_load_bytes_per_node"] for row in roomy["strategies"]}
    assert loads["DDP"] >= 2 * 2 * roomy["num_parameters"]  # each of the 2 ranks loads the whole bf16 model
    short = planned(capsys, "--model", "llama-3-8b", "--gpus", "2", "--gpu-memory", "80", "--host-memory", "16",
                    "--json")
    for row in short["strategies"]:
        if row["host_load_bytes_per_node"] > 0.9 * 16 * GiB:
            assert row["fits"] is False and row["shortfall"] in ("gpu", "host offload", "host load")
    assert any(row["shortfall"] == "host load" for row in short["strategies"])
    assert short["recommended"] != roomy["recommended"]
    assert main(["plan", "--model", "llama-3-70b", "--gpus", "2", "--gpu-memory", "80", "--host-memory",
                 "128"]) == 0  # a 70B on a 2-GPU node with 128 GiB: each rank would load 140 GB
    out = capsys.readouterr().out
    assert "host RAM at load" in out and "Recommended:" not in out
    assert "not in host RAM while the model loads" in out


# --- new options: help and errors ------------------------------------------------------------------------------------

def test_plan_help_names_the_recipe_config_and_calibration_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for option in ("--recipe RECIPE.yaml", "--config ACCELERATE.yaml", "--calibrate OUTPUT_DIR", "--save-calibration",
                   "--global-batch-size", "rounded up to a multiple of --gpus"):
        assert option in out


@pytest.mark.parametrize("arguments, message", [
    (["--recipe", "recipes/demo.yaml", "--model", "tiny", "--gpus", "2", "--gpu-memory", "24"],
     "`--model` with `--recipe recipes/demo.yaml`: the recipe gives these (`model_name_or_path`)"),
    (["--recipe", "no/such.yaml", "--gpus", "2", "--gpu-memory", "24"], "recipe file `no/such.yaml` does not exist."),
    (["--recipe", "recipes/demo.yaml", "--gpu-memory", "24"], "`--gpus N` (GPUs in all) is needed to plan."),
    (["--gpus", "2", "--gpu-memory", "24"], "`finetune plan` needs `--model M` or `--recipe RECIPE.yaml`"),
    (["--model", "tiny", "--gpus", "2", "--gpu-memory", "24", "--config", "no/such.yaml"],
     "Accelerate config `no/such.yaml` does not exist."),
    (["--calibrate", "no/such/run"], "no memory_report.json in no/such/run"),
    (["--model", "tiny", "--gpus", "2", "--gpu-memory", "24", "--save-calibration"],
     "`--save-calibration` stores what `--calibrate OUTPUT_DIR` measured: give that too."),
])
def test_plan_option_errors_are_one_line(capsys, arguments, message):
    assert main(["plan", *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_prints_the_parallelism_axes_and_picks_sequence_parallelism_for_a_long_sequence(capsys):
    """Llama-3-8B at 32k tokens on 8 H100s: no data-parallel strategy fits (activations), SP 8 × ZeRO-3 does; TP and
    PP are printed with their terms and costs."""
    long = ["--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "32768", "--global-batch-size", "8"]
    plan = planned(capsys, *long, "--json")
    axes = {row["name"]: row for row in plan["axes"]}
    assert list(axes) == ["SP 8 × ZeRO-3", "TP 8", "PP 8 (1F1B)"]
    assert not any(row["fits"] for row in plan["strategies"])
    sequence = axes["SP 8 × ZeRO-3"]
    assert sequence["fits"] and plan["recommended"] == "SP 8 × ZeRO-3"
    zero3 = next(row for row in plan["strategies"] if row["key"] == "zero3")
    split, whole = sequence["per_gpu"], zero3["per_gpu"]
    assert split["activations_bytes"] == pytest.approx(whole["activations_bytes"] / 8, rel=0.02)
    assert split["params_bytes"] == whole["params_bytes"]  # ZeRO-3 still shards over all 8
    assert "idle 47%" in axes["PP 8 (1F1B)"]["cost"]  # (8 − 1) / (8 + 8 − 1)
    assert plan["axis_choice"]["launch_command"].endswith("-m finetune train RECIPE.yaml --sequence_parallel_size 8")
    assert "activations" in plan["axis_choice"]["because"]
    assert main(["plan", *long]) == 0
    out = capsys.readouterr().out
    assert "Parallelism axes on 8 GPUs" in out and "Recommended: SP 8 × ZeRO-3 — chosen because no data-parallel" in out


def test_a_pipeline_plans_each_rank_reading_only_its_stage_at_load(capsys):
    """Llama-3-70B, PP 8 on one node of H100s: each rank builds the model on the meta device and reads its stage in
    fp32 (finetune.train.axes.pipeline.loop), so the node's host RAM at load is the model once in fp32 (plus one
    tensor being cast on each rank), not 8 × the model loaded and upcast (6 bytes a parameter on every rank: 3.4 TB)."""
    plan = planned(capsys, "--model", "llama-3-70b", "--gpus", "8", "--gpu", "h100", "--seq-len", "4096", "--json")
    pipeline = next(row for row in plan["axes"] if row["name"] == "PP 8 (1F1B)")
    shape = model_shape("llama-3-70b")
    at_load = pipeline["host_load_bytes_per_node"]
    cast = 8 * 2 * 2 * shape.largest_layer_parameters  # one tensor as stored, mapped and read, on each rank
    assert at_load == pytest.approx(4 * shape.num_parameters + cast, rel=1e-6)
    assert at_load < 0.1 * 8 * 6 * shape.num_parameters
    assert f"loads {at_load / 1024**3:,.1f} GiB/node (a stage a rank)" in pipeline["cost"]


def test_a_short_sequence_keeps_the_data_parallel_recommendation_beside_the_axes(capsys):
    plan = planned(capsys, "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "2048", "--json")
    assert plan["recommended"] in [row["name"] for row in plan["strategies"]] and plan["axis_choice"] is None
    assert [row["name"] for row in plan["axes"]] == ["SP 8 × ZeRO-3", "TP 8", "PP 8 (1F1B)"]


def test_the_recommended_row_is_estimated_at_the_batch_plans_micro_batch(capsys):
    """The table's other rows say whether a strategy fits at all (the smallest micro-batch); the recommended one is
    what the run will hold, at the micro-batch the batch plan picks, and the `micro` column says which is which."""
    plan = planned(capsys, "--model", "qwen2.5-0.5b", "--gpus", "2", "--gpu", "a100", "--seq-len", "512", "--json")
    rows = {row["name"]: row for row in plan["strategies"]}
    recommended, micro = rows[plan["recommended"]], plan["batch_plan"]["micro_batch_size"]
    assert micro > 1 and recommended["micro_batch_size"] == micro
    assert recommended["per_gpu"] == plan["recommended_estimate"]["per_gpu"]
    assert all(row["micro_batch_size"] == 1 for name, row in rows.items() if name != plan["recommended"])
    assert main(["plan", "--model", "qwen2.5-0.5b", "--gpus", "2", "--gpu", "a100", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "micro" in out and "the recommended one at the batch plan's" in " ".join(out.split())


def test_on_several_nodes_the_pipeline_row_runs_a_pipeline_a_node_data_parallel(capsys):
    """Llama-3-70B on 2 nodes of 8 H100s: PP 8 × DP 2, each rank holding its stage as in one pipeline of 8, the step's
    micro-batches split over the 2 replicas, and each stage's gradients all-reduced across them (a ring: 2 (r − 1)/r
    of the stage's gradients a GPU); launched as 16 plain processes with the recipe's pipeline keys."""
    common = ["--model", "llama-3-70b", "--gpu", "h100", "--seq-len", "4096", "--global-batch-size", "32", "--json"]
    two = next(row for row in planned(capsys, "--gpus", "16", "--nodes", "2", *common)["axes"]
               if row["key"] == "pipeline")
    one = next(row for row in planned(capsys, "--gpus", "8", *common)["axes"] if row["key"] == "pipeline")
    assert (two["name"], one["name"], two["replicas"]) == ("PP 8 × DP 2 (1F1B)", "PP 8 (1F1B)", 2)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert two["per_gpu"][key] == one["per_gpu"][key], key
    assert two["overrides"] == ["--pipeline_parallel_size 8", "--gradient_accumulation_steps 16"]  # 32 = 16 × 2
    assert one["overrides"] == ["--pipeline_parallel_size 8", "--gradient_accumulation_steps 32"]
    all_reduced = two["per_gpu"]["grads_bytes"] / 1024**3  # 2 (2 − 1)/2 = once the stage's gradients
    assert f"gradients all-reduced over 2 replicas: {all_reduced:,.1f} GiB a GPU a step" in two["cost"]


# --- PP × TP × DP (3D): sized from the pipeline loop's stages with TP inside, chosen when nothing simpler fits
# -------------------

SEVENTY_ON_EIGHT_NODES = ["--model", "llama-3-70b", "--gpus", "64", "--nodes", "8", "--gpu", "h100"]


def three_d_row(plan: dict) -> dict:
    (row,) = [row for row in plan["axes"] if "sizes" in row]
    return row


def test_the_3d_row_for_llama_70b_on_8_nodes_gives_its_sizes_and_terms(capsys):
    """TP 8 (a node's GPUs, dividing 64 heads and 8 key/value heads), then the fewest stages that fit, here none at
    4,096 tokens, so the most (8, the least memory): PP 8 × TP 8 × DP 1, the global batch of 64 in 64 micro-batches. The
    row is the fullest stage (the first: 8 micro-batches in flight under 1F1B) as the estimator counts it; its
    replicated activations (norms, autocast's copies of the fp32 hidden states) do not shrink with t or p, so it does
    not fit an H100 and SP 8 × ZeRO-3 stays recommended."""
    plan = planned(capsys, *SEVENTY_ON_EIGHT_NODES, "--seq-len", "4096", "--json")
    row = three_d_row(plan)
    sizes = row["sizes"]
    assert row["name"] == "PP 8 × TP 8 (1F1B)" and plan["parallel_3d"]["name"] == row["name"]
    assert (sizes["pipeline_parallel"], sizes["tensor_parallel"], sizes["data_parallel"]) == (8, 8, 1)
    assert sizes["pipeline_parallel"] * sizes["tensor_parallel"] * sizes["data_parallel"] == 64
    assert sizes["micro_batches"] == 64 and sizes["bubble_fraction"] == pytest.approx((8 - 1) / (64 + 8 - 1))
    shape = model_shape("llama-3-70b")
    linear = shape.block_linear_parameters // shape.num_layers
    first_stage = 10 * (shape.layer_parameters - linear + linear // 8) + shape.vocab_size * shape.hidden_size
    assert row["per_gpu"]["params_bytes"] == 4 * first_stage  # fp32 masters: 10 layers' matrices ÷ 8, embedding
    assert row["per_gpu"]["optimizer_bytes"] == 8 * first_stage
    states = 4096 * shape.hidden_size  # one micro-batch's hidden states
    cost = row["cost"]
    assert "idle 10% of each step (bubble, 64 micro-batches)" in cost
    assert f"P2P {4 * states / 1024**2:,.1f} MiB of hidden states a micro-batch" in cost  # fp32 residual
    assert "receive buffers 8.0 GiB on the fullest stage" in cost  # 64 micro-batches' gradients from stage 2
    tp_step = 4 * 10 * 64 * 2 * 7 / 8 * 2 * states  # 4 a layer × 10 layers × 64 micro-batches, a ring, bf16
    assert f"TP all-reduces 4 × {2 * states / 1024**2:,.1f} MiB a layer and micro-batch (NVLink): " \
           f"{tp_step / 1024**3:,.1f} GiB a GPU a step" in cost
    assert f"loads {row['host_load_bytes_per_node'] / 1024**3:,.1f} GiB/node (a rank its TP slice of a stage)" in cost
    assert "all-reduced over" not in cost  # one replica: no data-parallel gradient all-reduce
    assert row["launch_command"] == ("accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 64 "
                                     "-m finetune train RECIPE.yaml --pipeline_parallel_size 8 "
                                     "--tensor_parallel_size 8 --gradient_accumulation_steps 64")
    usable = 0.9 * 80 * 1024**3 - 1024**3
    assert not row["fits"] and row["per_gpu"]["total_bytes"] > usable and plan["recommended"] == "SP 8 × ZeRO-3"
    assert main(["plan", *SEVENTY_ON_EIGHT_NODES, "--seq-len", "4096"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "PP 8 × TP 8 (1F1B): PP 8 × TP 8 × DP 1 = 64 GPUs, 64 micro-batches a replica, bubble 9.9%" in out
    assert "On paper" not in out  # one 3D answer: the row


def test_the_3d_row_takes_the_fewest_stages_that_fit_and_its_replicas_all_reduce_gradients(capsys):
    """At 512 tokens PP 4 fits beside TP 8: 2 pipelines data parallel, the global batch of 64 in 32 micro-batches
    each, every stage's gradients all-reduced across the 2 replicas (a ring: 2 (r − 1)/r of them)."""
    plan = planned(capsys, *SEVENTY_ON_EIGHT_NODES, "--seq-len", "512", "--json")
    row = three_d_row(plan)
    assert row["name"] == "PP 4 × TP 8 × DP 2 (1F1B)" and row["fits"]
    assert row["sizes"]["micro_batches"] == 32 and row["sizes"]["bubble_fraction"] == pytest.approx(3 / 35)
    gradients = row["per_gpu"]["grads_bytes"] / 1024**3
    assert f"the stage's gradients all-reduced over 2 replicas: {gradients:,.1f} GiB a GPU a step" in row["cost"]
    assert row["overrides"] == ["--pipeline_parallel_size 4", "--tensor_parallel_size 8",
                                "--gradient_accumulation_steps 32"]


def test_the_3d_row_is_recommended_when_nothing_simpler_fits(capsys):
    """Nodes of 128 GiB of host RAM: ZeRO-3 (and SP over it) reads the 70B checkpoint on one rank (131 GiB), TP ×
    FSDP2 and the data-parallel strategies on every rank, PP 8 × DP 8 does not fit the GPUs; PP 8 × TP 8 fits both
    (each rank reads its TP slice of its stage)."""
    arguments = [*SEVENTY_ON_EIGHT_NODES, "--seq-len", "1024", "--host-memory", "128"]
    plan = planned(capsys, *arguments, "--json")
    row = three_d_row(plan)
    assert row["fits"] and not any(other["fits"] for other in plan["strategies"] + plan["axes"] if other is not row)
    assert plan["recommended"] == row["name"] == "PP 8 × TP 8 (1F1B)"
    assert row["per_gpu"]["total_bytes"] <= 0.9 * 80 * 1024**3 - 1024**3
    assert row["host_load_bytes_per_node"] <= 0.9 * 128 * 1024**3
    choice = plan["axis_choice"]
    assert choice["launch_command"] == row["launch_command"] == plan["launch_command"]
    assert "nor does a 2D axis (SP 8 × ZeRO-3: 131.4 GiB of host RAM a node at load" in choice["because"]
    path = decision_path(make_plan(PlanRequest("llama-3-70b", gpus=64, nodes=8, gpu_memory_gib=80,
                                               sequence_length=1024, host_memory_gib=128)))
    assert path[-1].startswith("PP 8 × TP 8 (1F1B): 54.4 GiB ≤ ") and path[-1].endswith("→ recommended")
    assert [line.split(":")[0] for line in path[-4:-1]] == ["SP 8 × ZeRO-3", "TP 8 × FSDP2 8", "PP 8 × DP 8 (1F1B)"]
    assert main(["plan", *arguments]) == 0
    assert "Recommended: PP 8 × TP 8 (1F1B) — chosen because no data-parallel strategy fits" in capsys.readouterr().out


@pytest.mark.parametrize("arguments", [["--gpus", "1"], ["--gpus", "8"],
                                       ["--gpus", "16", "--nodes", "2", "--lora-rank", "16"]],
                         ids=["one GPU", "one node: no stage beside TP 8", "LoRA: the pipeline refuses adapters"])
def test_no_3d_row_where_it_cannot_run(capsys, arguments):
    plan = planned(capsys, "--model", "llama-3-8b", "--gpu", "h100", *arguments, "--json")
    assert not any("sizes" in row for row in plan["axes"]) and plan["parallel_3d"] is None
