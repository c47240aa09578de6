"""LoRA under DDP, ZeRO-2 and ZeRO-3 on 2 CPU processes (loss goes down, only adapters change, the saved adapter
is complete), the QLoRA-without-CUDA error, and safety defaults (remote code off, no token in any saved file)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from support import CPU_LAUNCHES, PLANTED_TOKEN

from finetune.cli import main
from finetune.recipe.parse import parse_recipe


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_qlora_without_cuda_stops_before_loading_anything(capsys):
    assert main(["train", "recipes/demo.yaml", "--use_qlora", "true"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("finetune: error: `use_qlora: true` needs a CUDA GPU (bitsandbytes' 4-bit kernels) and none is "
                     "visible; use `use_lora: true` without QLoRA here, or run on a GPU.")


def test_remote_code_is_off_unless_the_recipe_turns_it_on():
    assert parse_recipe("recipes/demo.yaml").model.trust_remote_code is False
    assert parse_recipe("recipes/demo.yaml", ["--trust_remote_code", "true"]).model.trust_remote_code is True


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CPU_LAUNCHES))
def test_lora_trains_only_its_adapters_under_each_strategy(lora_runs, name):
    output_dir = lora_runs[name]
    state = json.loads((output_dir / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    summary = json.loads((output_dir / "eval_results.json").read_text())
    assert summary["world_size"] == 2
    assert summary["frozen_weights_unchanged"] is True  # checked on every rank, ZeRO-3 partitions included
    adapter = load_file(output_dir / "adapter_model.safetensors")
    lora_b = [tensor for key, tensor in adapter.items() if "lora_B" in key]
    # Complete (never empty under ZeRO-3): A and B for the 7 linear layers of each of the 3 blocks, all trained.
    assert len(adapter) == 2 * 7 * 3 and all(tensor.abs().sum() > 0 for tensor in lora_b)
    assert not (output_dir / "model.safetensors").exists()


@pytest.mark.distributed
def test_a_token_in_the_environment_lands_in_no_file(lora_runs):
    files = [path for output_dir in lora_runs.values() for path in output_dir.rglob("*") if path.is_file()]
    assert len(files) > 30  # adapters, tokenizer, trainer state, training_args.bin, reports
    assert not [path for path in files if PLANTED_TOKEN.encode() in path.read_bytes()]


@pytest.mark.parametrize("launch", [[], ["--gpus", "2"]])
def test_a_misspelled_target_module_stops_the_dry_run_in_one_line(capsys, launch):
    assert main(["train", "recipes/demo.yaml", "--dry-run", *launch, "--use_lora", "true",
                 "--lora_target_modules", "q_prj", "v_proj"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("finetune: error: `lora_target_modules: q_prj` matches no module of LlamaForCausalLM "
                            "(did you mean `q_proj`?)") and "\n" not in error
