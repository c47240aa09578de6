"""Real 2-process runs: every DeepSpeed config that can run on CPU trains, the stage really applies (bytes per
rank), a silent FSDP→DDP fallback is caught, a DeepSpeed/Trainer contradiction is reported, DDP on one process
trains, and DeepSpeed written inline in an Accelerate YAML (as `accelerate config` writes it) is linted and runs."""

import json
import math
import shutil
import sys

import pytest
from support import (
    CPU_RUNNABLE_DEEPSPEED,
    DEMO_SHORT_RUN,
    PROJECT_ROOT,
    assert_succeeded,
    error_lines,
    free_port,
    launch_demo,
    run,
)

from finetune.configs import deepspeed_config

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", CPU_RUNNABLE_DEEPSPEED)
def test_deepspeed_config_trains_and_runs_what_it_asks(deepspeed_runs, name):
    run_ = deepspeed_runs[name]
    assert len(run_["losses"]) == run_["steps"] and all(math.isfinite(loss) for loss in run_["losses"])
    strategy = run_["effective"]["strategy"]
    requested, running = strategy["requested"], strategy["running"]
    assert running["strategy"] == "deepspeed"
    assert running["zero_stage"] == requested["zero_stage"] == int(name[4])
    assert running["offload_optimizer"] == ("cpu" if "offload" in name else None)
    assert running["offload_param"] == ("cpu" if name == "zero3_offload" else None)
    assert [entry["rank"] for entry in run_["effective"]["ranks"]] == [0, 1]
    assert (run_["output_dir"] / "model.safetensors").is_file()


def per_rank(runs, name, key):
    return [entry[key] for entry in runs[name]["effective"]["ranks"]]


def test_optimizer_state_bytes_per_rank_halve_from_zero0_to_zero1(deepspeed_runs):
    zero0 = per_rank(deepspeed_runs, "zero0", "optimizer_bytes")
    zero1 = per_rank(deepspeed_runs, "zero1", "optimizer_bytes")
    assert zero0[0] == zero0[1] > 0
    for held in zero1:  # half, up to DeepSpeed's partition alignment padding
        assert abs(held - zero0[0] / 2) <= 0.01 * zero0[0]
    assert per_rank(deepspeed_runs, "zero2", "optimizer_bytes") == zero1


def test_parameters_per_rank_halve_under_zero3(deepspeed_runs):
    full = per_rank(deepspeed_runs, "zero2", "params_bytes")
    for name in ("zero3", "zero3_offload"):
        for held in per_rank(deepspeed_runs, name, "params_bytes"):
            assert abs(held - full[0] / 2) <= 0.01 * full[0]


def test_effective_config_names_the_source_of_each_value(deepspeed_runs):
    values = deepspeed_runs["zero2"]["effective"]["values"]
    assert values["world_size"] == {"value": 2, "source": "Accelerate config (WORLD_SIZE)"}
    assert values["zero_stage"] == {"value": 2, "source": "DeepSpeed JSON deepspeed_configs/zero2.json"}
    assert values["per_device_train_batch_size"]["source"] == ('recipe recipes/demo.yaml → DeepSpeed "auto" filled by '
                                                               'Trainer')
    assert values["learning_rate"] == {"value": 0.002, "source": "recipe recipes/demo.yaml"}
    assert values["global_batch_size"]["value"] == 32
    assert deepspeed_runs["zero2"]["effective"]["deepspeed_mismatches"] == []


def test_deepspeed_json_contradicting_the_recipe_stops_with_both_values(tmp_path):
    contradicting = tmp_path / "zero2_clip.json"
    contradicting.write_text(json.dumps({**deepspeed_config(stage=2), "gradient_clipping": 0.5}))
    output_dir = tmp_path / "out"
    result = launch_demo("accelerate_configs/cpu_deepspeed_zero2.yaml", output_dir, "--max_grad_norm", "1.0",
                    deepspeed_json=str(contradicting))
    assert result.returncode != 0
    (line,) = error_lines(result.output)
    assert line.startswith("finetune: error: the DeepSpeed JSON contradicts the recipe: "
                           "ds gradient_clipping=0.5 vs hf max_grad_norm=1.0")
    effective = json.loads((output_dir / "effective_config.json").read_text())
    assert effective["deepspeed_mismatches"] == ["ds gradient_clipping=0.5 vs hf max_grad_norm=1.0"]
    source = effective["values"]["max_grad_norm"]["source"]
    assert source.startswith(f"DeepSpeed JSON {contradicting} (gradient_clipping=0.5)")
    assert effective["values"]["max_grad_norm"]["source"].endswith("Trainer has 1.0")
    assert not (output_dir / "trainer_state.json").exists()


def test_fsdp_silently_turned_into_ddp_on_cpu_is_detected(tmp_path):
    result = launch_demo("accelerate_configs/cpu_fsdp.yaml", tmp_path / "out")
    assert result.returncode != 0
    (line,) = error_lines(result.output)
    assert line.startswith("finetune: error: fsdp was requested but Trainer prepared ddp")
    assert "Trainer's use_cpu turns FSDP into DDP" in result.output


def test_a_default_accelerate_config_nobody_named_is_warned_about(tmp_path):
    hf_home = tmp_path / "hf_home"
    (hf_home / "accelerate").mkdir(parents=True)
    default = hf_home / "accelerate" / "default_config.yaml"
    shutil.copy(PROJECT_ROOT / "accelerate_configs" / "cpu_deepspeed_zero2.yaml", default)
    output_dir = tmp_path / "out"
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--main_process_port",
               str(free_port()), "-m", "finetune", "train", "recipes/demo.yaml", "--output_dir", str(output_dir),
               *DEMO_SHORT_RUN]
    result = run(command, timeout=300, env={"HF_HOME": str(hf_home)})
    assert_succeeded(result)
    warning = (f"accelerate launch used its default config {default}, which the command did not name; "
               "pass --config_file to choose one.")
    assert json.loads((output_dir / "effective_config.json").read_text())["warnings"] == [warning]
    assert result.output.count("warning: accelerate launch used its default config") == 1


def test_ddp_gradient_compression_hook_is_registered_on_two_processes(ddp_run):
    effective = json.loads((ddp_run / "effective_config.json").read_text())
    assert effective["strategy"]["running"] == {"strategy": "ddp", "source": "DistributedDataParallel",
                                                "comm_hooks": ["fp16_compress_hook"]}
    assert effective["values"]["world_size"]["value"] == 2


def test_ddp_on_one_process_trains(tmp_path):
    """A user checking one GPU before two: the DDP config with --num_processes 1 is a legitimate run."""
    output_dir = tmp_path / "out"
    assert_succeeded(launch_demo("accelerate_configs/cpu_ddp.yaml", output_dir, num_processes=1))
    effective = json.loads((output_dir / "effective_config.json").read_text())
    assert effective["values"]["world_size"]["value"] == 1
    assert effective["strategy"]["running"]["strategy"] in ("ddp", "single")
    losses = [entry["loss"] for entry in json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
              if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


# What `accelerate config` writes for DeepSpeed when asked for no config file: the settings inline.
ACCELERATE_CONFIG_INLINE = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: {zero3}
{save_16bit}  zero_stage: {stage}
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def inline_deepspeed_yaml(path, stage: int):
    zero3 = stage == 3
    path.write_text(ACCELERATE_CONFIG_INLINE.format(
        stage=stage, zero3=str(zero3).lower(), save_16bit="  zero3_save_16bit_model: true\n" if zero3 else ""))
    return path


@pytest.mark.parametrize("stage", [2, 3])
def test_inline_deepspeed_accelerate_config_is_linted_runs_and_is_named(tmp_path, stage):
    config = inline_deepspeed_yaml(tmp_path / f"zero{stage}_inline.yaml", stage)
    lint = run([sys.executable, "-m", "finetune", "configs", "lint", str(config)], timeout=120)
    assert lint.returncode == 0 and "0 problem(s) in 1 file(s)" in lint.output, lint.output
    output_dir = tmp_path / "out"
    result = launch_demo(str(config), output_dir)
    assert_succeeded(result)
    assert "deepspeed_shm_comm" not in result.output  # DeepSpeed's inference collective is not compiled for training
    effective = json.loads((output_dir / "effective_config.json").read_text())
    source = "Accelerate config (inline deepspeed_config)"
    assert effective["values"]["strategy"] == {"value": "deepspeed", "source": source}
    assert effective["values"]["zero_stage"] == {"value": stage, "source": source}
    assert effective["strategy"]["running"]["zero_stage"] == stage
    if stage == 3:  # really partitioned: each rank holds about half of the fp32 weights
        from finetune import presets

        full = 4 * presets.build_model(presets.build_tokenizer(), seed=0).num_parameters()
        assert all(abs(entry["params_bytes"] - full / 2) <= 0.01 * full for entry in effective["ranks"])


def test_inline_deepspeed_config_with_a_contradiction_is_linted(tmp_path):
    config = inline_deepspeed_yaml(tmp_path / "bad.yaml", 2)
    config.write_text(config.read_text().replace("offload_param_device: none", "offload_param_device: cpu"))
    lint = run([sys.executable, "-m", "finetune", "configs", "lint", str(config)], timeout=120)
    assert lint.returncode == 1
    assert f"{config} (inline deepspeed_config): `zero_optimization.offload_param` needs ZeRO stage 3" in lint.output
