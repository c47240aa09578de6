"""`finetune plan --recipe` (the user's own recipe and data) and `--calibrate` (a finished run's measured memory),
checked against a real 2-process ZeRO-2 run of the demo recipe (the shared `deepspeed_runs` fixture) and a synthetic
GPU report."""

import json

import pytest
from support import PROJECT_ROOT, slack  # the ledger's documented slack: alignment, ZeRO-1/2 gradient buffers

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


def gpu_report(directory, predicted_peak: int, measured_peak: int, strategy: str = "ddp",
               num_parameters: int = 494_032_768, method: str | None = None):
    """The memory report a 2-rank GPU run writes (CUDA's peak allocated), for a run that is not there: by default of
    Qwen2.5-0.5B's size, supervised (no eval_results.json); `method` writes the run's eval_results.json."""
    ledger = {"params_bytes": 4 << 30, "grads_bytes": 2 << 30, "optimizer_bytes": 3 << 30}
    records = [{"rank": rank, "world_size": 2, "strategy": strategy,
                "measured": {**ledger, "peak_bytes": measured_peak + rank, "peak_kind": "cuda_max_allocated"},
                "predicted": {**ledger, "offloaded_bytes": 0, "peak_bytes": predicted_peak,
                              "estimate": {"num_parameters": num_parameters}}} for rank in (0, 1)]
    write_memory_report(records, directory)
    if method is not None:
        (directory / "eval_results.json").write_text(json.dumps({"method": method}))
    return directory


def a100_store(tmp_path) -> dict:
    return json.loads((tmp_path / "cache" / "plan_calibration.json").read_text())[KNOWN_GPUS["a100"].name][
        "calibrations"]


def test_a_gpu_calibration_is_a_share_of_the_peak_folded_into_later_plans_of_its_class(tmp_path, capsys):
    """A run 20% over its predicted peak adds 20% of the predicted peak to later plans of the same strategy, method
    and model size on that GPU, and lends it (named) to the other strategies of that method and size; a run of
    another method or size lends nothing; the share is the largest its class's runs measured, with their count."""
    arguments = ["--model", "qwen2.5-0.5b", "--gpus", "2", "--seq-len", "512", "--max-micro-batch-size", "1"]
    before = planned(capsys, *arguments, "--gpu", "a100")
    ddp_total = before["strategies"][0]["per_gpu"]["total_bytes"]
    memory = f"{(ddp_total + CUDA_CONTEXT_BYTES + GiB) / 0.9 / GiB:.3f}"  # DDP fits with 1 GiB to spare
    assert planned(capsys, *arguments, "--gpu", "a100", "--gpu-memory", memory)["recommended"] == "DDP"

    run = gpu_report(tmp_path / "run", predicted_peak=10 * GiB, measured_peak=12 * GiB)
    assert main(["plan", "--calibrate", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Overhead beyond the prediction: 2,048.0 MiB" in out and "+20.0% of the predicted peak" in out
    assert "--save-calibration" in out and "ddp · sft · under 1B" in out
    assert main(["plan", "--calibrate", str(run), "--gpu", "a100", "--save-calibration"]) == 0
    assert "add 20.0% of their predicted peak" in " ".join(capsys.readouterr().out.split())  # rich wraps long paths
    stored = a100_store(tmp_path)["ddp · sft · under 1B"]
    assert stored["overhead_share"] == pytest.approx(0.2, abs=1e-9) and stored["runs"] == 1
    assert stored["latest"]["from"] == str(run)

    after = planned(capsys, *arguments, "--gpu", "a100", "--gpu-memory", memory)
    rows = {row["name"]: row for row in after["strategies"]}
    assert rows["DDP"]["overhead_bytes"] == pytest.approx(0.2 * rows["DDP"]["per_gpu"]["total_bytes"], rel=1e-6)
    assert rows["DDP"]["calibrated_by"] == "ddp · sft · under 1B"
    # A strategy never measured on this GPU takes the largest share of its method and size, and says whose it is.
    assert rows["ZeRO-3"]["overhead_bytes"] == pytest.approx(0.2 * rows["ZeRO-3"]["per_gpu"]["total_bytes"], rel=1e-6)
    assert rows["ZeRO-3"]["calibrated_by"] == "ddp · sft · under 1B"
    assert rows["DDP"]["fits"] is False and after["recommended"] != "DDP"
    assert main(["plan", *arguments, "--gpu", "a100", "--gpu-memory", memory]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Calibrated on NVIDIA A100-SXM4-80GB (compute capability 8.0) by 1 run(s) in 1 class(es)" in text
    assert "20.0% of its peak (1 run(s) of it; latest" in text
    assert "none of it: the largest of sft at under 1B, 1 ddp run(s)" in text
    assert all(row["overhead_bytes"] == 0 for row in
               planned(capsys, *arguments, "--gpu", "h100", "--gpu-memory", memory)["strategies"])
    # Another method, another size: nothing lent (a DPO plan, a 7B plan).
    for other in (["--method", "dpo"], ["--model", "qwen2.5-7b"]):
        rows = planned(capsys, *arguments, *other, "--gpu", "a100")["strategies"]
        assert all(row["overhead_bytes"] == 0 and row["calibrated_by"] is None for row in rows), other
    # A second DDP run 10% over: the class keeps the largest share and counts both runs; a ZeRO-3 run under its
    # prediction stores 0 for ZeRO-3 only: never loosening, never lent over the DDP runs' 20%.
    second = gpu_report(tmp_path / "second", predicted_peak=10 * GiB, measured_peak=11 * GiB)
    cheap = gpu_report(tmp_path / "cheap", predicted_peak=10 * GiB, measured_peak=9 * GiB, strategy="deepspeed_zero3")
    for folder in (second, cheap):
        assert main(["plan", "--calibrate", str(folder), "--gpu", "a100", "--save-calibration"]) == 0
    capsys.readouterr()
    stored = a100_store(tmp_path)
    assert stored["ddp · sft · under 1B"]["runs"] == 2
    assert stored["ddp · sft · under 1B"]["overhead_share"] == pytest.approx(0.2, abs=1e-9)
    assert stored["deepspeed_zero3 · sft · under 1B"]["overhead_share"] == 0
    assert stored["deepspeed_zero3 · sft · under 1B"]["latest"]["overhead_bytes"] == -GiB + 1
    rows = {row["name"]: row for row in planned(capsys, *arguments, "--gpu", "a100", "--gpu-memory",
                                                memory)["strategies"]}
    assert rows["ZeRO-3"]["overhead_bytes"] == 0
    assert rows["ZeRO-3"]["calibrated_by"] == "deepspeed_zero3 · sft · under 1B"
    assert rows["ZeRO-2"]["overhead_bytes"] == pytest.approx(0.2 * rows["ZeRO-2"]["per_gpu"]["total_bytes"], rel=1e-6)


def test_a_store_of_absolute_bytes_from_before_classes_is_not_read(tmp_path, capsys):
    """A byte count measured on one model says nothing of another: the old store's entries add nothing."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "plan_calibration.json").write_text(json.dumps({KNOWN_GPUS["a100"].name: {
        "strategies": {"deepspeed_zero2": {"overhead_bytes": GiB, "from": "old"}}}}))
    rows = planned(capsys, "--model", "qwen2.5-0.5b", "--gpus", "2", "--gpu", "a100")["strategies"]
    assert all(row["overhead_bytes"] == 0 for row in rows)
    (tmp_path / "cache" / "plan_calibration.json").write_text("[1, 2]")
    assert main(["plan", "--model", "qwen2.5-0.5b", "--gpus", "2", "--gpu", "a100"]) == 2
    assert "is not a calibration store" in capsys.readouterr().err


def test_a_finished_gpu_run_stores_its_calibration_and_a_cpu_run_or_a_small_model_nothing(tmp_path, monkeypatch,
                                                                                           capsys):
    """What `finetune train` does with its memory report at the end (finetune.train.run.learn_from_memory): on a
    (simulated) GPU it stores the run's overhead for that GPU and its class, read by the next plan there; on CPU
    processes, and for a model under 1B parameters (a check or a toy run), it stores nothing; it holds the measured
    memory against the run's prediction either way."""
    from types import SimpleNamespace

    from gpu_simulation import A100, simulate_gpus

    from finetune.memory.report import load_memory_report
    from finetune.train.run import learn_from_memory

    args = SimpleNamespace(output_dir=str(tmp_path / "cpu_run"), save_calibration=True)
    cpu = tmp_path / "cpu_run"
    records = [{"rank": 0, "world_size": 1, "strategy": "ddp", "predicted": {**dict.fromkeys(STATES, 100),
                                                                             "peak_bytes": 300},
                "measured": {**dict.fromkeys(STATES, 100), "peak_bytes": 5 << 30, "peak_kind": "cpu_max_rss"}}]
    write_memory_report(records, cpu)
    learned = learn_from_memory(records, args)
    assert "calibration_saved" not in learned and not (tmp_path / "cache" / "plan_calibration.json").exists()
    check = learned["memory_against_plan"]
    assert check["what"] == "model states" and check["ranks"][0]["ratio"] == 1.0 and check["over"] == []

    simulate_gpus(monkeypatch, A100, count=2, memory_gib=80)
    small = gpu_report(tmp_path / "small_run", predicted_peak=10 * GiB, measured_peak=13 * GiB,
                       strategy="deepspeed_zero2")
    learned = learn_from_memory(load_memory_report(small), SimpleNamespace(output_dir=str(small),
                                                                           save_calibration=True), "sft")
    assert "calibration_saved" not in learned and not (tmp_path / "cache" / "plan_calibration.json").exists()
    run = gpu_report(tmp_path / "gpu_run", predicted_peak=10 * GiB, measured_peak=13 * GiB,
                     strategy="deepspeed_zero2", num_parameters=7_615_616_512)
    learned = learn_from_memory(load_memory_report(run), SimpleNamespace(output_dir=str(run), save_calibration=True),
                                "dpo")
    assert learned["calibration_saved"] == str(tmp_path / "cache" / "plan_calibration.json")
    assert a100_store(tmp_path)["deepspeed_zero2 · dpo · 1B-10B"]["overhead_share"] == pytest.approx(0.3, abs=1e-9)
    check = learned["memory_against_plan"]
    assert check["what"] == "peak allocated" and [rank["rank"] for rank in check["over"]] == [0, 1]
    assert "stored for NVIDIA A100-SXM4-80GB" in capsys.readouterr().out
    rows = {row["name"]: row for row in planned(capsys, "--model", "qwen2.5-7b", "--gpus", "2", "--method",
                                                "dpo")["strategies"]}
    # the visible (simulated) A100's calibration, for the 7B DPO plan
    assert rows["ZeRO-2"]["overhead_bytes"] == pytest.approx(0.3 * rows["ZeRO-2"]["per_gpu"]["total_bytes"], rel=1e-6)
    # Off by the recipe key: nothing stored.
    (tmp_path / "cache" / "plan_calibration.json").unlink()
    learn_from_memory(load_memory_report(run), SimpleNamespace(output_dir=str(run), save_calibration=False), "dpo")
    assert not (tmp_path / "cache" / "plan_calibration.json").exists()


@pytest.mark.parametrize("method", ["dpo", "kto", "simpo", "grpo"])
def test_every_shipped_method_recipe_plans_with_what_its_method_holds(method, tmp_path, capsys):
    """The shipped recipes of the methods TRL tokenizes (or completes) while training plan at full length, with
    their method's terms; GRPO's with its recipe's completion length and the group sizes on the recommended row."""
    recipe = tmp_path / f"{method}.yaml"
    recipe.write_text((PROJECT_ROOT / "recipes" / f"{method}.yaml").read_text().replace("outputs/demo", "tiny"))
    plan = planned(capsys, "--recipe", str(recipe), "--gpus", "2", "--gpu-memory", "16")
    terms = plan["strategies"][0]["setup"]["method"]
    assert terms["reference_model"] == (method in ("dpo", "kto"))
    assert terms["completion_length"] == (8 if method == "grpo" else 0)
    assert (plan["group_sizes"] is not None) == (method == "grpo")
    if method == "grpo":
        assert plan["group_sizes"]["asked"] == plan["group_sizes"]["recommended"] == 8
    assert main(["plan", "--recipe", str(recipe), "--gpus", "2", "--gpu-memory", "16"]) == 0
    assert "training " in capsys.readouterr().out  # the data line: pairs, examples or prompts
