import json
import shutil

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from support import PROJECT_ROOT

from finetune import presets
from finetune.cli import main
from finetune.configs import accelerate_config, deepspeed_config
from finetune.configs.lint import (
    lint_accelerate,
    lint_deepspeed,
    lint_file,
    lint_fsdp_wrap_classes,
    parse_with_deepspeed,
)
from finetune.errors import RecipeError
from finetune.generated_files import SHIPPED, expected_files
from finetune.recipe.parse import parse_recipe


def test_shipped_configs_match_the_generator(capsys):
    assert main(["configs", "check", "--root", str(PROJECT_ROOT)]) == 0


def test_check_fails_with_a_diff_on_a_hand_edited_file(tmp_path, capsys):
    for relative in expected_files():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PROJECT_ROOT / relative, tmp_path / relative)
    edited = tmp_path / "deepspeed_configs" / "zero2.json"
    edited.write_text(edited.read_text().replace('"stage": 2', '"stage": 1'))
    assert main(["configs", "check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert '-    "stage": 1,' in out and '+    "stage": 2,' in out


def test_write_then_check_round_trips(tmp_path, capsys):
    assert main(["configs", "write", "--out", str(tmp_path)]) == 0
    assert main(["configs", "check", "--root", str(tmp_path)]) == 0


DEEPSPEED_FILES = [c.path for c in SHIPPED if c.path.endswith(".json")]
ACCELERATE_FILES = [c.path for c in SHIPPED if c.path.endswith(".yaml")]


@pytest.mark.parametrize("path", DEEPSPEED_FILES)
def test_deepspeed_parses_every_shipped_json(path):
    config = json.loads((PROJECT_ROOT / path).read_text())
    parsed = parse_with_deepspeed(config)
    assert parsed.zero_optimization_stage == config["zero_optimization"]["stage"]
    assert lint_file(PROJECT_ROOT / path) == []
    if parsed.zero_optimization_stage == 3:
        assert parsed.zero_config.gather_16bit_weights_on_model_save is True


@pytest.mark.parametrize("path", ACCELERATE_FILES)
def test_accelerate_loads_every_shipped_yaml(path, monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)  # deepspeed_config_file paths are relative to the launch directory
    loaded = load_config_from_file(path)
    assert loaded.num_processes >= 1
    assert lint_file(path) == []


def test_deepspeed_yaml_files_point_at_shipped_json_and_load_zero3_partitioned():
    for config in SHIPPED:
        section = config.make().get("deepspeed_config", {})
        file = section.get("deepspeed_config_file")
        if file:
            assert (PROJECT_ROOT / file).is_file(), config.path
            stage = json.loads((PROJECT_ROOT / file).read_text())["zero_optimization"]["stage"]
            # ZeRO-3 loads under zero.Init: global rank 0 alone reads the checkpoint (docs/memory.md)
            assert section["zero3_init_flag"] is (stage == 3), config.path


@pytest.mark.parametrize(
    "config, message",
    [
        (deepspeed_config(stage=2, offload_param="cpu"), "offload_param` needs ZeRO stage 3 (stage is 2)"),
        ({**deepspeed_config(stage=1), "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
        (deepspeed_config(stage=3, offload_optimizer="nvme"),
         "offload_optimizer` offloads to NVMe without `nvme_path`"),
        ({**deepspeed_config(stage=2), "train_batch_size": 64, "train_micro_batch_size_per_gpu": 16,
          "gradient_accumulation_steps": 1}, "train_batch_size 64 != micro 16 × accumulation 1 × world size 2 = 32"),
        ({**deepspeed_config(stage=2), "zero_optimisation": {}}, "unknown top-level key(s) 'zero_optimisation'"),
        ({**deepspeed_config(stage=2), "zero_optimization": {"stage": 2, "overlap_com": True}},
         "zero_optimization.overlap_com`: Extra inputs are not permitted"),
    ],
    ids=["offload-param-stage2", "fp16-and-bf16", "nvme-without-path", "batch-product", "unknown-key",
         "unknown-zero-key"],
)
def test_each_invalid_deepspeed_combination_is_named(config, message):
    problems = lint_deepspeed(config, world_size=2, source="ds.json")
    assert len(problems) == 1 and message in problems[0], problems


def test_process_count_above_visible_gpus_is_rejected():
    problems = lint_accelerate(accelerate_config("ddp", num_processes=2), visible_devices=1)
    assert problems == ["Accelerate config: 2 process(es) per machine but 1 visible GPU(s); set num_processes "
                        "to the GPU count or fix CUDA_VISIBLE_DEVICES."]
    assert lint_accelerate(accelerate_config("ddp", num_processes=2), visible_devices=2) == []


def test_fsdp_wrap_class_missing_from_the_model_is_named():
    model = presets.build_model(presets.build_tokenizer())
    assert lint_fsdp_wrap_classes(["LlamaDecoderLayer"], model) == []
    problems = lint_fsdp_wrap_classes(["GPT2Block"], model)
    assert problems and "GPT2Block not found in LlamaForCausalLM" in problems[0] and "LlamaDecoderLayer" in problems[0]


def test_finetune_train_lints_the_launchers_deepspeed_json_before_the_process_group(tmp_path, monkeypatch):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(deepspeed_config(stage=1, offload_param="cpu")))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(bad))
    with pytest.raises(RecipeError, match=r"offload_param` needs ZeRO stage 3 \(stage is 1\)"):
        parse_recipe(PROJECT_ROOT / "recipes" / "demo.yaml", ["--output_dir", str(tmp_path)])


def test_lint_command_exit_status(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({**deepspeed_config(stage=2), "fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    assert main(["configs", "lint", str(bad)]) == 1
    assert "both true" in capsys.readouterr().out
    assert main(["configs", "lint", str(PROJECT_ROOT / "deepspeed_configs" / "zero3.json")]) == 0


def test_bf16_communication_hook_without_cuda_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="`ddp_comm_hook: bf16` needs CUDA"):
        parse_recipe(PROJECT_ROOT / "recipes" / "demo.yaml", ["--ddp_comm_hook", "bf16", "--output_dir", str(tmp_path)])


def test_multi_cpu_config_that_would_start_one_process_is_flagged():
    config = {**accelerate_config("ddp", use_cpu=True), "distributed_type": "MULTI_CPU"}
    assert "starts ONE process" in lint_accelerate(config)[0]


@pytest.mark.parametrize("folder", ["deepspeed_configs", "accelerate_configs"])
def test_every_file_a_generated_readme_names_exists(folder):
    import re

    readme = (PROJECT_ROOT / folder / "README.md").read_text()
    named = set(re.findall(r"--(?:config_file|deepspeed_config_file) (\S+)", readme))
    assert named and all((PROJECT_ROOT / path).is_file() for path in named), sorted(named)


def test_configs_write_never_overwrites_a_users_file_without_force(tmp_path, capsys):
    mine = tmp_path / "accelerate_configs" / "ddp.yaml"
    mine.parent.mkdir()
    mine.write_text("mixed_precision: fp16  # mine\n")
    assert main(["configs", "write", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "accelerate_configs/ddp.yaml" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert mine.read_text() == "mixed_precision: fp16  # mine\n"
    assert sorted(path.name for path in tmp_path.rglob("*") if path.is_file()) == ["ddp.yaml"]  # nothing written
    assert main(["configs", "write", "--out", str(tmp_path), "--force"]) == 0
    assert mine.read_text() == expected_files()["accelerate_configs/ddp.yaml"]


def test_configs_write_leaves_identical_files_alone_and_writes_docs_only_into_the_project(tmp_path, capsys):
    assert main(["configs", "write", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "docs").exists()  # the recipe reference and TRL guide belong to the project checkout
    ddp = tmp_path / "accelerate_configs" / "ddp.yaml"
    before = ddp.stat().st_mtime_ns
    capsys.readouterr()
    assert main(["configs", "write", "--out", str(tmp_path)]) == 0
    assert "wrote" not in capsys.readouterr().out and ddp.stat().st_mtime_ns == before


# Llama-3-8B's largest weight, the (untied) embedding and head: 128256 × 4096 = 525,336,576 elements, 262,668,288 a rank
# on 2 GPUs: more than DeepSpeed's default NVMe parameter buffer (1e8).
LLAMA_3_8B_PARTITION_ON_2 = 128256 * 4096 // 2


def test_the_nvme_parameter_buffer_is_sized_from_the_largest_partition_and_a_small_one_is_refused(tmp_path, capsys):
    from finetune.configs.deepspeed import fill_nvme_param_buffer, nvme_param_buffer
    from finetune.memory import model_shape
    from finetune.memory.estimate import largest_partition

    shipped = json.loads((PROJECT_ROOT / "deepspeed_configs" / "zero3_nvme.json").read_text())
    assert nvme_param_buffer(shipped) == "auto" and nvme_param_buffer(deepspeed_config(3)) is None
    assert largest_partition(model_shape("llama-3-8b"), 2) == LLAMA_3_8B_PARTITION_ON_2
    filled = json.loads(json.dumps(shipped))
    fill_nvme_param_buffer(filled, LLAMA_3_8B_PARTITION_ON_2)
    assert filled["zero_optimization"]["offload_param"]["buffer_size"] == LLAMA_3_8B_PARTITION_ON_2
    parse_with_deepspeed(filled)  # DeepSpeed's own config model takes the filled value

    # lint knows the model: "auto" and a large enough number pass, DeepSpeed's default does not (both numbers named)
    assert main(["configs", "lint", "deepspeed_configs/zero3_nvme.json", "--model", "llama-3-8b",
                 "--world-size", "2"]) == 0
    small = json.loads(json.dumps(shipped))
    small["zero_optimization"]["offload_param"]["buffer_size"] = 100_000_000
    (tmp_path / "small.json").write_text(json.dumps(small))
    capsys.readouterr()
    assert main(["configs", "lint", str(tmp_path / "small.json"), "--model", "llama-3-8b", "--world-size", "2"]) == 1
    out = capsys.readouterr().out
    assert "buffer_size` 100,000,000 is smaller than the largest parameter partition, 262,668,288 elements" in out
    assert main(["configs", "lint", str(tmp_path / "small.json"), "--model", "llama-3-8b", "--world-size", "8"]) == 0
    small["zero_optimization"]["offload_param"]["buffer_size"] = "big"
    assert any("give a number of elements" in problem for problem in lint_deepspeed(small))


def test_a_run_sizes_an_auto_nvme_buffer_from_its_model_and_stops_on_a_small_one():
    """`finetune train` fills "auto" from the model it loaded (a Llama-3-8B on the meta device: no memory) and the world
    size it runs, before DeepSpeed starts; the estimator's partition is the real model's."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from finetune.memory.shapes import resolve_config
    from finetune.train.trainer import size_nvme_param_buffer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(resolve_config("llama-3-8b"))
    config = deepspeed_config(3, offload_optimizer="nvme", offload_param="nvme", nvme_path="/local_nvme")
    trainer = SimpleNamespace(is_deepspeed_enabled=True, model=model, args=SimpleNamespace(world_size=2),
                              accelerator=SimpleNamespace(state=SimpleNamespace(
                                  deepspeed_plugin=SimpleNamespace(deepspeed_config=config))))
    size_nvme_param_buffer(trainer)
    assert config["zero_optimization"]["offload_param"]["buffer_size"] == LLAMA_3_8B_PARTITION_ON_2
    config["zero_optimization"]["offload_param"]["buffer_size"] = 100_000_000
    with pytest.raises(RecipeError, match="100,000,000 is smaller than the largest parameter partition, 262,668,288"):
        size_nvme_param_buffer(trainer)
