"""Vision-language fine-tuning beyond the shared ZeRO-2 runs (tests/train/test_vision_train.py): ZeRO-3 and FSDP2 on 2
processes with the ledger equal to the plan on both ranks, and the real path, a saved bf16 Qwen2-VL-shaped folder
with its own ChatML template, in fp32 and under bf16 autocast."""

import json

import pytest
from support import assert_succeeded, finetune_command

from finetune.models.vision.presets import build_model, build_processor


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["zero3", "fsdp_full_shard"])
def test_zero3_and_fsdp2_train_it_with_the_ledger_equal_to_the_plan_on_both_ranks(strategy, tmp_path):
    """ZeRO-3 partitions the tiny model built whole (its constructor builds the tower through `_from_config`, which
    would partition that part alone); FSDP2 wraps each vision block as its own unit (the model's `_no_split_modules`)
    and broadcasts rank 0's weights into every rank's shards, the tie kept on the empty ranks."""
    from support import run

    output_dir = tmp_path / strategy
    result = run(finetune_command("train", "recipes/vision.yaml", "--gpus", "2", "--strategy", strategy,
                                  "--output_dir", str(output_dir), "--max_steps", "10", "--eval_on_start", "false"))
    assert_succeeded(result)
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert results["world_size"] == 2 and results["frozen_weights_unchanged"] is True
    ranks = results["memory_against_plan"]["ranks"]
    assert [rank["rank"] for rank in ranks] == [0, 1]
    assert all(rank["ratio"] == pytest.approx(1.0, abs=0.01) for rank in ranks), ranks
    assert results["after"]["eval_loss"] < 4.0  # 5.51 before any step; 3.03 after 10 under either (measured)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_saved_vlm_folder_in_bf16_with_its_own_chatml_template_trains_as_the_tiny_one(precision, tmp_path):
    """The real path: a folder as `save_pretrained` writes a hub vision-language model (bf16 safetensors, its
    processor with its own ChatML template), named by path; in fp32 (no autocast: the frozen bf16 tower is held in
    its trained projector's fp32) and under bf16 autocast."""
    import torch
    from hub_fixtures import VL_CHATML as CHATML

    from finetune.recipe.parse import parse_recipe
    from finetune.train.run import train

    folder = tmp_path / "qwen2-vl-like"
    processor = build_processor()
    processor.tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    processor.chat_template = processor.tokenizer.chat_template = CHATML
    build_model(processor, seed=3, dtype=torch.bfloat16).save_pretrained(folder)
    processor.save_pretrained(folder)
    output_dir = tmp_path / "run"
    recipe = parse_recipe("recipes/vision.yaml", [
        "--model_name_or_path", str(folder), "--output_dir", str(output_dir), "--strategy", "single",
        "--max_steps", "4", "--eval_on_start", "false", "--generation_eval_samples", "4", "--report_to", "none",
        "--disable_tqdm", "true", "--bf16", str(precision == "bf16").lower()])
    summary = train(recipe)
    assert summary["frozen_weights_unchanged"] is True and summary["train_loss"] > 0
    assert "<|im_start|>assistant" in (output_dir / "chat_template.jinja").read_text()  # its own template, saved
    config = json.loads((output_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]


def test_the_gpu_checks_vision_rows_parse_as_recipes():
    """The GPU check's vision-language rows (benchmarks/gpu_check.py) are recipes the toolkit takes: the day a GPU is
    lent they run, not stop on an argument."""
    import importlib.util

    from support import PROJECT_ROOT

    from finetune.recipe.parse import parse_recipe

    spec = importlib.util.spec_from_file_location("gpu_check", PROJECT_ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    rows = {name: extra for name, (_, extra) in gpu_check.CHECKS.items() if name.startswith("vision_")}
    assert sorted(rows) == ["vision_fsdp_full_shard_bf16", "vision_lora_zero2_bf16"]
    for extra in rows.values():
        recipe = parse_recipe("recipes/demo.yaml", [*gpu_check.SHORT, *extra])
        assert recipe.model.model_name_or_path == "tiny-vl" and recipe.data.dataset == "synthetic-shapes"
        assert recipe.model.freeze_vision_tower is True
