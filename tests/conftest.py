import json
import os

import pytest

# Tests never reach a hub; everything they load is built in code or written to a temporary directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# One 2-process demo run per CPU-runnable DeepSpeed config (fp32, the CPU default), plus two in bf16 mixed
# precision, shared by the strategy and memory tests so the start-up cost is paid once per config.
BF16_RUNS = ["zero2", "zero3"]
# The fp32 ZeRO-3 run also leaves a checkpoint (ZeRO shards) for the export tests.
EXTRA_ARGS = {"zero3": ("--save_strategy", "steps", "--save_steps", "3")}


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory):
    from support import CPU_RUNNABLE_DEEPSPEED, assert_succeeded, launch_demo

    runs = {}
    for name, extra in [*((n, ()) for n in CPU_RUNNABLE_DEEPSPEED), *((n, ("--bf16", "true")) for n in BF16_RUNS)]:
        key = f"{name}_bf16" if extra else name
        output_dir = tmp_path_factory.mktemp(key)
        result = launch_demo("accelerate_configs/cpu_deepspeed_zero2.yaml", output_dir, *extra,
                             *EXTRA_ARGS.get(key, ()), deepspeed_json=f"deepspeed_configs/{name}.json")
        assert_succeeded(result)
        state = json.loads((output_dir / "trainer_state.json").read_text())
        runs[key] = {
            "effective": json.loads((output_dir / "effective_config.json").read_text()),
            "losses": [entry["loss"] for entry in state["log_history"] if "loss" in entry],
            "log_history": state["log_history"],
            "output_dir": output_dir,
        }
    return runs


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """A short 2-process DDP run (gloo) with an fp16 gradient-compression hook; returns its output_dir."""
    from support import assert_succeeded, launch_demo

    output_dir = tmp_path_factory.mktemp("ddp")
    assert_succeeded(launch_demo("accelerate_configs/cpu_ddp.yaml", output_dir, "--ddp_comm_hook", "fp16"))
    return output_dir


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory):
    """Short 2-process LoRA runs of the demo recipe under DDP, ZeRO-2 and ZeRO-3; their output_dirs."""
    from support import CPU_LAUNCHES, LORA_DEMO_RUN, PLANTED_TOKEN, assert_succeeded, launch_demo

    runs = {}
    for name, launch in CPU_LAUNCHES.items():
        output_dir = tmp_path_factory.mktemp(f"lora_{name}")
        result = launch_demo(launch, output_dir, *LORA_DEMO_RUN,
                             env={"HF_TOKEN": PLANTED_TOKEN})
        assert_succeeded(result)
        assert PLANTED_TOKEN not in result.output
        runs[name] = output_dir
    return runs


@pytest.fixture(scope="session")
def hub_model_dir(tmp_path_factory):
    """A hub-like checkpoint (tests/hub_fixtures.py): Qwen2-shaped, bf16 safetensors, BPE tokenizer, ChatML template
    with tools."""
    from hub_fixtures import save_hub_model

    return save_hub_model(tmp_path_factory.mktemp("hub_chatml"), "chatml")


@pytest.fixture(scope="session")
def trained_demo(tmp_path_factory):
    """The demo recipe trained on one process at its global batch (2 processes x 16), cut from 1500 steps to 800:
    reverse exact match 0.92 on the eval split. Chat answers with it (test_chat.py); DPO starts from it
    (test_dpo.py), as a user's preference run starts from their SFT run."""
    from support import PROJECT_ROOT, assert_succeeded, finetune_command, run

    output_dir = tmp_path_factory.mktemp("sft_demo")
    assert_succeeded(run(finetune_command("train", "recipes/demo.yaml", "--output_dir", str(output_dir),
                                          "--per_device_train_batch_size", "32", "--max_steps", "800",
                                          "--eval_on_start", "false", "--generation_eval_samples", "0",
                                          "--max_eval_samples", "10", "--logging_steps", "200", "--report_to", "none",
                                          "--disable_tqdm", "true"), timeout=600, cwd=PROJECT_ROOT))
    return output_dir
