"""`finetune plan` for a named or visible GPU: the precision it has (fp16 on a T4), a QLoRA launch that loads 4-bit."""

import json

import pytest
from gpu_simulation import T4, simulate_gpus

from finetune.cli import main
from finetune.devices import KNOWN_GPUS
from finetune.plan import PlanRequest, make_plan

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
