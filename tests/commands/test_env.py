"""`finetune env`: the block a bug report asks for, GPUs and a half-built DeepSpeed op included, and no secret."""

import json

import pytest
import torch
from gpu_simulation import A100, simulate_gpus

from finetune.cli import main
from finetune.commands import env

PLANTED = "hf_notarealtokenbutonlyfortestsXYZ123"


@pytest.fixture
def no_default_accelerate_config(monkeypatch, tmp_path):
    monkeypatch.setattr("accelerate.commands.config.default_config_file", str(tmp_path / "default_config.yaml"))
    return tmp_path / "default_config.yaml"


def test_the_block_names_versions_devices_and_settings_and_hides_every_secret(monkeypatch, capsys, tmp_path,
                                                                               no_default_accelerate_config):
    monkeypatch.setenv("HF_TOKEN", PLANTED)
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    (tmp_path / "extensions" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "extensions" / "cpu_adam" / "lock").touch()  # a build stopped half-way
    (tmp_path / "extensions" / "fused_adam").mkdir()
    (tmp_path / "extensions" / "fused_adam" / "fused_adam.so").touch()
    no_default_accelerate_config.write_text(f"distributed_type: MULTI_GPU\nnum_processes: 2\n"
                                            f"hub_token: {PLANTED}\nmain_process_ip: 10.0.0.1\n")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Paste this block into your bug report:")
    assert f"- torch: {torch.__version__}" in out and "- torch build: CPU only" in out
    for package in ("transformers", "accelerate", "deepspeed", "peft", "trl", "bitsandbytes", "flash-attn"):
        assert f"- {package}: " in out
    assert "- GPUs: none visible" in out
    assert "compiled on first use: fused_adam" in out
    assert f"build stopped half-way, its lock left behind (runs needing it wait forever): {tmp_path / 'extensions'}" \
           "/cpu_adam" in out
    assert "    distributed_type: MULTI_GPU" in out and "    hub_token: set (hidden)" in out
    assert "HF_TOKEN=set (hidden)" in out and "WANDB_API_KEY=set (hidden)" in out and "NCCL_DEBUG=INFO" in out
    assert PLANTED not in out and "wandb-secret-value" not in out


def test_json_lists_the_simulated_gpus_and_a_token_shaped_value_is_hidden_anywhere(monkeypatch, capsys,
                                                                                   no_default_accelerate_config):
    simulate_gpus(monkeypatch, A100, count=2, memory_gib=79.3)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setenv("SLURM_JOB_NAME", f"run-{PLANTED}")  # a secret where no name says so
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["GPUs"] == ("2 (0: NVIDIA A100-SXM4-80GB, 79.3 GiB, compute capability 8.0; "
                              "1: NVIDIA A100-SXM4-80GB, 79.3 GiB, compute capability 8.0)")
    assert report["NCCL"] == "2.21.5"
    assert report["Accelerate default config"].startswith("none")
    assert "SLURM_JOB_NAME=run-[hidden token]" in report["Environment"]
    assert PLANTED not in json.dumps(report)


def test_an_unreadable_accelerate_config_is_named_not_a_traceback(capsys, no_default_accelerate_config):
    no_default_accelerate_config.write_text("distributed_type: [unclosed\n")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"- Accelerate default config: {no_default_accelerate_config} (unreadable: " in out


def test_env_help_and_a_wrong_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["env", "--help"])
    assert exit_.value.code == 0 and "Secrets are never printed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["env", "--gpus"])
    assert exit_.value.code == 2 and "unrecognized arguments: --gpus" in capsys.readouterr().err
    assert env.hide_secret_keys({"a": {"api_key": "x", "key_count": None}}) == {
        "a": {"api_key": "set (hidden)", "key_count": None}}
