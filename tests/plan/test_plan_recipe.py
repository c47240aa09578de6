"""`finetune plan --recipe` (the user's own recipe and data) and `--calibrate` (a finished run's measured memory),
checked against a real 2-process ZeRO-2 run of the demo recipe (the shared `deepspeed_runs` fixture) and a synthetic
GPU report."""

import json

import pytest
from support import slack  # the ledger's documented slack: alignment, ZeRO-1/2 gradient buffers

from finetune import outputs
from finetune.cli import main
from finetune.launch.devices import KNOWN_GPUS
from finetune.memory.estimate import GiB
from finetune.memory.report import write_memory_report
from finetune.plan.decision_tree import CUDA_CONTEXT_BYTES

# The `deepspeed_runs` fixture launches the demo recipe under this Accelerate config on 2 CPU processes (fp32).
ZERO2_LAUNCH = ["--recipe", "recipes/demo.yaml", "--gpus", "2", "--gpu-memory", "24",
                "--config", "accelerate_configs/cpu_deepspeed_zero2.yaml"]
STATES = ("params_bytes", "grads_bytes", "optimizer_bytes")


def planned(capsys, *arguments) -> dict:
    assert main(["plan", *arguments, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Calibrations go to a temporary cache, never the user's."""
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))


@pytest.mark.distributed
def test_recipe_plan_uses_the_datas_lengths_and_predicts_the_zero2_ledger(deepspeed_runs, capsys):
    run = deepspeed_runs["zero2"]
    plan = planned(capsys, *ZERO2_LAUNCH)
    summary = outputs.read_record(run["output_dir"], outputs.DATA_SUMMARY)
    train = summary["sources"][0]["train"]
    # The same data pipeline as the run: the same rows and lengths.
    assert plan["data"]["sources"][0]["train"]["length_percentiles"] == train["length_percentiles"]
    assert plan["data"]["sources"][0]["train"]["rows_kept"] == train["rows_kept"]
    # Micro-batches of 16 of these rows reach the longest row, far below max_seq_length 64 (no packing).
    assert plan["batch_plan"]["micro_batch_size"] == 16
    assert plan["sequence_length"] == train["length_percentiles"]["max"] < 64
    assert plan["recommended_estimate"]["setup"]["sequence_length"] == plan["sequence_length"]
    assert plan["precision"] == "fp32"  # the demo recipe sets no bf16, as the run
    report = json.loads((run["output_dir"] / "memory_report.json").read_text())["ranks"]
    zero2 = next(row for row in plan["strategies"] if row["name"] == "ZeRO-2")
    yours = plan["your_strategy"]
    assert yours["name"] == "yours: deepspeed_zero2" and yours["fits"]
    assert len(report) == 2
    for record in report:
        for key in STATES:
            # What the run itself predicted, to the byte, and what it really held, within the ledger's slack.
            assert zero2["per_gpu"][key] == yours["per_gpu"][key] == record["predicted"][key], (record["rank"], key)
            assert abs(zero2["per_gpu"][key] - record["measured"][key]) <= slack(key, "zero2"), (record["rank"], key)


@pytest.mark.distributed
def test_calibrate_compares_a_cpu_run_part_by_part_and_stores_nothing(deepspeed_runs, capsys):
    output_dir = str(deepspeed_runs["zero2"]["output_dir"])
    comparison = planned(capsys, "--recipe", "recipes/demo.yaml", "--calibrate", output_dir)
    assert [rank["rank"] for rank in comparison["ranks"]] == [0, 1]
    for rank in comparison["ranks"]:
        parts = {part["part"]: part for part in rank["parts"]}
        assert set(parts) == {"parameters", "gradients", "optimizer states", "peak"}
        for name, key in zip(("parameters", "gradients", "optimizer states"), STATES):
            part = parts[name]
            assert abs(part["measured"] - part["predicted"]) <= slack(key, "zero2"), (rank["rank"], name)
            assert part["ratio"] == pytest.approx(part["measured"] / part["predicted"])
        assert rank["peak_kind"] == "cpu_max_rss" and parts["peak"]["ratio"] is None
    assert comparison["overhead_bytes"] is None
    assert main(["plan", "--calibrate", output_dir]) == 0
    assert "Measured on CPU" in capsys.readouterr().out
    assert main(["plan", "--calibrate", output_dir, "--gpu", "a100", "--save-calibration"]) == 2
    assert "was measured without a GPU (peak cpu_max_rss); calibrate from a GPU run." in capsys.readouterr().err


def gpu_report(directory, predicted_peak: int, measured_peak: int):
    ledger = {"params_bytes": 4 << 30, "grads_bytes": 2 << 30, "optimizer_bytes": 3 << 30}
    records = [{"rank": rank, "world_size": 2, "strategy": "ddp",
                "measured": {**ledger, "peak_bytes": measured_peak + rank, "peak_kind": "cuda_max_allocated"},
                "predicted": {**ledger, "offloaded_bytes": 0, "peak_bytes": predicted_peak}} for rank in (0, 1)]
    write_memory_report(records, directory)
    return directory


def test_a_gpu_calibration_is_folded_into_later_plans_for_that_gpu(tmp_path, capsys):
    arguments = ["--model", "qwen2.5-0.5b", "--gpus", "2", "--seq-len", "512"]
    before = planned(capsys, *arguments, "--gpu", "a100")
    ddp_total = before["strategies"][0]["per_gpu"]["total_bytes"]
    memory = f"{(ddp_total + CUDA_CONTEXT_BYTES + GiB) / 0.9 / GiB:.3f}"  # DDP fits with 1 GiB to spare
    assert planned(capsys, *arguments, "--gpu", "a100", "--gpu-memory", memory)["recommended"] == "DDP"

    run = gpu_report(tmp_path / "run", predicted_peak=10 * GiB, measured_peak=12 * GiB)
    assert main(["plan", "--calibrate", str(run)]) == 0
    out = capsys.readouterr().out
    assert "Overhead beyond the prediction: 2,048.0 MiB" in out and "--save-calibration" in out
    assert main(["plan", "--calibrate", str(run), "--gpu", "a100", "--save-calibration"]) == 0
    assert "later plans for it add 2,048.0 MiB" in " ".join(capsys.readouterr().out.split())  # rich wraps long paths
    stored = json.loads((tmp_path / "cache" / "plan_calibration.json").read_text())
    assert stored[KNOWN_GPUS["a100"].name]["overhead_bytes"] == 2 * GiB + 1  # the larger of the two ranks

    after = planned(capsys, *arguments, "--gpu", "a100", "--gpu-memory", memory)
    assert after["gpu_overhead_bytes"] == 2 * GiB + 1
    assert after["strategies"][0]["fits"] is False and after["recommended"] != "DDP"  # 2 GiB more than the spare
    assert planned(capsys, *arguments, "--gpu", "h100", "--gpu-memory", memory)["gpu_overhead_bytes"] == 0
    # A run that used less than predicted never loosens later plans.
    cheap = gpu_report(tmp_path / "cheap", predicted_peak=10 * GiB, measured_peak=9 * GiB)
    assert main(["plan", "--calibrate", str(cheap), "--gpu", "a100", "--save-calibration"]) == 0
    capsys.readouterr()
    stored = json.loads((tmp_path / "cache" / "plan_calibration.json").read_text())
    assert stored[KNOWN_GPUS["a100"].name]["overhead_bytes"] == 0
    assert stored[KNOWN_GPUS["a100"].name]["measured_overhead_bytes"] == -GiB + 1


def test_recipe_plan_reads_the_recipes_keys_and_packs_its_data(tmp_path, capsys):
    recipe = tmp_path / "packed.yaml"
    recipe.write_text("model_name_or_path: tiny\nmax_seq_length: 64\npacking: true\nbf16: auto\nuse_lora: true\n"
                      "lora_r: 4\nglobal_batch_size: 12\nper_device_train_batch_size: 2\nlearning_rate: 1.0e-3\n"
                      "lr_scaling: sqrt\nbase_batch_size: 6\ndeepspeed: deepspeed_configs/zero3.json\n")
    plan = planned(capsys, "--recipe", str(recipe), "--gpus", "3", "--gpu", "t4")
    assert plan["precision"] == "fp16"  # bf16: auto, for the GPU planned for (a T4), not this machine
    assert plan["strategies"][0]["setup"]["lora_rank"] == 4
    packing = plan["data"]["packing"]["train"]
    assert packing["row_length"] == 64 and 0.9 < packing["fill"] <= 1
    assert plan["sequence_length"] == 64  # packed rows are (nearly) full: the longest of a micro-batch is 64
    assert plan["your_strategy"]["name"] == "yours: deepspeed_zero3"
    batch = plan["batch_plan"]
    assert (batch["global_batch_size"], batch["micro_batch_size"], batch["gradient_accumulation_steps"]) == (12, 2, 2)
    assert batch["learning_rate"] == pytest.approx(1e-3 * 2 ** 0.5) and batch["lr_scaling"] == "sqrt"
    assert plan["recommended"] == "DDP"
    assert plan["launch_command"].endswith(f"train {recipe} --global_batch_size 12 --max_micro_batch_size 2")
    assert "the recipe's `deepspeed` key would run DeepSpeed" in plan["launch_note"]
    # Batch options on the command line win over the recipe's and travel in the launch.
    plan = planned(capsys, "--recipe", str(recipe), "--gpus", "3", "--gpu", "t4", "--global-batch-size", "6",
                   "--lr-scaling", "none")
    assert plan["batch_plan"]["global_batch_size"] == 6 and plan["batch_plan"]["learning_rate"] == pytest.approx(1e-3)
    assert "--global_batch_size 6" in plan["launch_command"] and "--lr_scaling none" in plan["launch_command"]
    assert main(["plan", "--recipe", str(recipe), "--gpus", "5", "--gpu", "t4"]) == 2
    assert "`global_batch_size: 12` cannot be split evenly over 5 processes" in capsys.readouterr().err
