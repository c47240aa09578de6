"""FSDP2 on 2 CPU processes through the real Trainer + Accelerate path (Accelerate's one refusal of FSDP on CPU lifted
by tests/fsdp_on_cpu.py): parameters really sharded, the ledger next to the prediction, weights `from_pretrained`
loads at the end, `finetune export` of a sharded checkpoint, resume with the same losses, a DDP run refusing an
FSDP checkpoint, and LoRA under shard-grad-op."""

import json
import math
import shutil

import pytest
import torch
from support import FSDP_ON_CPU, FSDP_SHARD_GRAD_OP_ON_CPU, LORA_DEMO_RUN, assert_succeeded, launch_demo

from finetune import outputs, presets
from finetune.checkpoints import COMPLETE_MARKER
from finetune.export import export

pytestmark = pytest.mark.distributed
RUN = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "1",
       "--warmup_steps", "2"]


def losses(output_dir) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("fsdp") / "whole"
    assert_succeeded(launch_demo(FSDP_ON_CPU["config_file"], output_dir, *RUN, program=FSDP_ON_CPU["program"]))
    return output_dir


def test_fsdp2_trains_with_parameters_really_sharded(fsdp_run):
    effective = outputs.read_record(fsdp_run, outputs.EFFECTIVE_CONFIG)
    running = effective["strategy"]["running"]
    assert (running["strategy"], running["fsdp_sharding"], running["fsdp_version"]) == ("fsdp", "full_shard", 2)
    full = 4 * presets.build_model(presets.build_tokenizer(), seed=0).num_parameters()  # fp32 bytes
    held = [entry["params_bytes"] for entry in effective["ranks"]]
    assert len(held) == 2 and all(abs(bytes_ - full / 2) <= 0.01 * full for bytes_ in held), (held, full)
    logged = losses(fsdp_run)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(loss) for loss in logged.values())
    assert logged[6] < logged[1]


def test_fsdp_ledger_matches_the_prediction_per_rank(fsdp_run):
    ledger_matches_prediction(fsdp_run, "fsdp_full_shard")


def test_fsdp_run_ends_with_loadable_weights_and_its_checkpoint_exports(fsdp_run, tmp_path):
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(fsdp_run)  # consolidated at the end of training
    exported = AutoModelForCausalLM.from_pretrained(export(fsdp_run / "checkpoint-6", tmp_path / "exported"))
    start = presets.build_model(presets.build_tokenizer(), seed=0)
    tokens = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = final(tokens).logits
        assert torch.equal(exported(tokens).logits, logits)  # the step-6 shards are the final weights
        assert not torch.allclose(start(tokens).logits, logits)  # and they trained
    assert (tmp_path / "exported" / "tokenizer.json").is_file()


def test_fsdp_resume_logs_the_uninterrupted_losses_and_a_ddp_run_refuses_the_checkpoint(fsdp_run, tmp_path):
    marker = json.loads((fsdp_run / "checkpoint-3" / COMPLETE_MARKER).read_text())
    assert (marker["strategy"], marker["fsdp_sharding"], marker["world_size"]) == ("fsdp", "full_shard", 2)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(fsdp_run / "checkpoint-3", resumed / "checkpoint-3")
    assert_succeeded(launch_demo(FSDP_ON_CPU["config_file"], resumed, *RUN, "--resume_from_checkpoint", "auto",
                                 program=FSDP_ON_CPU["program"]))
    expected, got = losses(fsdp_run), losses(resumed)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(expected[step], abs=1e-4), (step, expected, got)

    ddp = tmp_path / "ddp"
    ddp.mkdir()
    shutil.copytree(fsdp_run / "checkpoint-3", ddp / "checkpoint-3")
    result = launch_demo("accelerate_configs/cpu_ddp.yaml", ddp, *RUN, "--resume_from_checkpoint", "auto")
    assert result.returncode != 0
    assert result.output.count("finetune: error: ") == 1
    assert ("was saved by FSDP full_shard on 2 rank(s) and this run is DDP or one process on 2 rank(s): the "
            "optimizer states of the two do not convert") in result.output
    assert "[rank0]: Traceback" not in result.output and "[rank1]: Traceback" not in result.output


def ledger_matches_prediction(output_dir, strategy: str) -> None:
    """Up to FSDP2's padding: each parameter's dim 0 is split into equal shards, the last padded."""
    ranks = outputs.read_record(output_dir, outputs.MEMORY_REPORT)["ranks"]
    assert [record["strategy"] for record in ranks] == [strategy] * 2
    for record in ranks:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            measured, predicted = record["measured"][key], record["predicted"][key]
            assert abs(measured - predicted) <= 0.001 * predicted, (record["rank"], key, measured, predicted)


def test_lora_under_fsdp_shard_grad_op_trains_adapters_only_and_saves_them_whole(tmp_path):
    from safetensors.torch import load_file

    output_dir = tmp_path / "lora"
    run = [*LORA_DEMO_RUN, "--max_steps", "6", "--logging_steps", "3"]
    assert_succeeded(launch_demo(FSDP_SHARD_GRAD_OP_ON_CPU["config_file"], output_dir, *run,
                                 program=FSDP_SHARD_GRAD_OP_ON_CPU["program"]))
    running = outputs.read_record(output_dir, outputs.EFFECTIVE_CONFIG)["strategy"]["running"]
    assert (running["strategy"], running["fsdp_sharding"]) == ("fsdp", "shard_grad_op")
    ledger_matches_prediction(output_dir, "fsdp_shard_grad_op")
    summary = outputs.read_record(output_dir, outputs.EVAL_RESULTS)
    assert summary["frozen_weights_unchanged"] is True  # checked on every rank
    adapter = load_file(output_dir / "adapter_model.safetensors")
    model = presets.build_model(presets.build_tokenizer(), seed=0)
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
              and name.startswith("model.layers")]
    assert len(adapter) == 2 * len(linear)  # lora_A and lora_B of every linear layer of the blocks
    assert all(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_B" in name)  # they trained
