"""`finetune train` end to end: one process through the real from_pretrained path, and the demo recipe on
2 processes under DeepSpeed ZeRO-2 (the main job)."""

import json
import math

import pytest
from support import assert_succeeded, finetune_command, run

from finetune import presets


def logged_losses(output_dir):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return state, [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def test_local_model_directory_trains_through_from_pretrained(tmp_path):
    model_dir = tmp_path / "model"
    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer)
    model.config.num_hidden_layers = 1  # a shape the preset never has, to prove this directory was used
    model.model.layers = model.model.layers[:1]
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": "reverse", "input": w, "output": w[::-1]}) + "\n"
                            for w in ("abc", "hello", "xyz", "tiny")))
    output_dir = tmp_path / "out"

    result = run(finetune_command(
        "train", "recipes/demo.yaml", "--model_name_or_path", str(model_dir), "--train_file", str(data),
        "--eval_file", str(data), "--max_steps", "3", "--per_device_train_batch_size", "2",
        "--logging_steps", "1", "--output_dir", str(output_dir),
    ), timeout=300)

    assert_succeeded(result)
    state, losses = logged_losses(output_dir)
    assert state["global_step"] == 3 and len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert json.loads((output_dir / "config.json").read_text())["num_hidden_layers"] == 1
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "tokenizer.json").is_file()
    summary = json.loads((output_dir / "eval_results.json").read_text())
    assert summary["world_size"] == 1 and summary["deepspeed_zero_stage"] is None
    assert set(summary["before"]["exact_match"]) == {"all"}


def test_packed_training_learns_and_reports_its_rows(tmp_path):
    output_dir = tmp_path / "out"
    result = run(finetune_command(
        "train", "recipes/demo.yaml", "--packing", "true", "--max_seq_length", "256",
        "--per_device_train_batch_size", "2", "--max_steps", "60", "--logging_steps", "20",
        "--max_eval_samples", "50", "--generation_eval_samples", "4", "--output_dir", str(output_dir),
    ), timeout=300)
    assert_succeeded(result)
    _, losses = logged_losses(output_dir)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    packing = json.loads((output_dir / "data_summary.json").read_text())["packing"]
    assert packing["train"]["examples"] == 6000 and packing["train"]["fill"] > 0.95
    assert packing["train"]["rows"] < 6000 * 25 / 256 * 1.1  # about 25 tokens an example, rows of 256
    assert "Packed train: 6,000 examples →" in result.output


@pytest.mark.distributed
def test_demo_recipe_learns_on_two_processes_under_deepspeed_zero2(demo_run):
    """The main job exactly as `make demo` runs it on a machine without GPUs (conftest.demo_run)."""
    output_dir, result = demo_run.output_dir, demo_run.result
    assert_succeeded(result)

    summary = json.loads((output_dir / "eval_results.json").read_text())
    assert summary["world_size"] == 2 and summary["deepspeed_zero_stage"] == 2
    before, after = summary["before"], summary["after"]
    assert before["step"] == 0 and after["step"] == 1500
    assert after["eval_loss"] < 0.25 * before["eval_loss"]
    assert after["exact_match"]["reverse"] >= 0.9
    assert all(after["exact_match"][task] > before["exact_match"][task] for task in ("reverse", "sort"))

    state, losses = logged_losses(output_dir)
    assert state["global_step"] == 1500 and len(losses) == 15
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.2 * losses[0]
    assert "Before vs after training" in result.output and "exact match: reverse" in result.output
    data = json.loads((output_dir / "data_summary.json").read_text())
    assert data["sources"][0]["train"]["rows_kept"] == 6000 and data["train_rows"] == 6000
    assert data["train_from_cache_by_rank"][1] is True  # rank 1 read what rank 0 tokenized
    assert [r["rank"] for r in json.loads((output_dir / "memory_report.json").read_text())["ranks"]] == [0, 1]
    # One command: `finetune train` planned the run, printed the launch it became, and held the memory against it.
    plan = json.loads((output_dir / "effective_config.json").read_text())["plan"]
    assert plan["strategy"] == "zero2" and plan["processes"] == 2 and plan["fits"]
    assert plan["chosen_by"] == "named by the recipe recipes/demo.yaml"
    assert plan["predicted"]["model_states_bytes"] > 0
    assert f"launch: {plan['launch']}" in result.output
    assert plan["launch"].startswith("accelerate launch --config_file accelerate_configs/cpu_deepspeed_zero2.yaml "
                                     "--num_processes 2 --deepspeed_config_file deepspeed_configs/zero2.json")
    assert summary["memory_against_plan"]["over"] == []
