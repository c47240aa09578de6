"""Precision on the path real users take: a hub checkpoint stored in bf16 (tests/hub_fixtures.py) trained under bf16
mixed precision keeps fp32 master weights (finetune.models.loading.trainable_dtype), so every weight moves as it does
from
the same model stored in fp32; `pure_bf16` is asked for by name; the ledger equals the prediction in both."""

import json

import pytest
import torch
from hub_fixtures import save_hub_model
from safetensors.torch import load_file
from support import CPU_LAUNCHES, assert_succeeded, finetune_command, launch_demo, run

from finetune import presets
from finetune.cli import main
from finetune.errors import RecipeError
from finetune.launch.strategies import Strategy
from finetune.models.loading import (
    hold_trainable_parameters,
    load_model,
    load_tokenizer,
    materialize_empty_parameters,
    sharded_from_rank_zero,
    trainable_dtype,
)
from finetune.recipe.args import ModelArguments
from finetune.recipe.parse import parse_recipe

STATES = ("params_bytes", "grads_bytes", "optimizer_bytes")
# lr 2e-5 on weights of ~0.02: each update is far below half a bf16 step, the case pure bf16 rounds away.
FIVE_SMALL_STEPS = ["--max_steps", "5", "--learning_rate", "2e-5", "--warmup_steps", "0", "--logging_steps", "1",
                    "--per_device_train_batch_size", "4", "--eval_on_start", "false", "--generation_eval_samples", "0",
                    "--bf16", "true"]


@pytest.fixture(scope="module")
def fp32_model_dir(tmp_path_factory):
    """The same model as `hub_model_dir` (same seed), stored in fp32."""
    return save_hub_model(tmp_path_factory.mktemp("hub_fp32"), "chatml", dtype="float32")


def train_single(model_dir, output_dir, *extra):
    command = finetune_command("train", "recipes/demo.yaml", "--model_name_or_path", str(model_dir),
                               "--output_dir", str(output_dir), *FIVE_SMALL_STEPS, *extra)
    assert_succeeded(run(command))
    return output_dir


def moved_fraction(model_dir, output_dir) -> dict[str, float]:
    """Per tensor, the fraction of weights the run changed (compared in fp32)."""
    before, after = load_file(model_dir / "model.safetensors"), load_file(output_dir / "model.safetensors")
    return {name: (before[name].float() != after[name].float()).float().mean().item() for name in before}


def ledger(output_dir) -> list[dict]:
    return json.loads((output_dir / "memory_report.json").read_text())["ranks"]


def test_a_bf16_checkpoint_trains_with_fp32_master_weights_as_the_fp32_checkpoint_does_and_saves_bf16(
        hub_model_dir, fp32_model_dir, tmp_path):
    from_bf16 = train_single(hub_model_dir, tmp_path / "bf16", "--save_strategy", "steps", "--save_steps", "5")
    from_fp32 = train_single(fp32_model_dir, tmp_path / "fp32")
    # the checkpoint keeps the fp32 masters (resuming reads them): every weight moved as from the fp32 checkpoint
    masters = from_bf16 / "checkpoint-5"
    moved_bf16, moved_fp32 = moved_fraction(hub_model_dir, masters), moved_fraction(fp32_model_dir, from_fp32)
    for name, fraction in moved_fp32.items():  # only embedding rows of unseen tokens keep still, in both
        assert moved_bf16[name] == pytest.approx(fraction, abs=1e-3), name
    assert sum(moved_bf16.values()) / len(moved_bf16) > 0.9
    assert {tensor.dtype for tensor in load_file(masters / "model.safetensors").values()} == {torch.float32}
    # the final model is written as the checkpoint came (bf16 in, bf16 out: the masters rounded), fp32 in stays fp32
    final, rounded = load_file(from_bf16 / "model.safetensors"), load_file(masters / "model.safetensors")
    assert {tensor.dtype for tensor in final.values()} == {torch.bfloat16}
    assert all(torch.equal(final[name], rounded[name].to(torch.bfloat16)) for name in final)
    assert json.loads((from_bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert {tensor.dtype for tensor in load_file(from_fp32 / "model.safetensors").values()} == {torch.float32}
    # `finetune export` of the checkpoint follows the run's save_dtype; `--dtype` or `save_dtype: float32` keep fp32
    assert main(["export", str(masters), str(tmp_path / "exported")]) == 0
    assert {tensor.dtype for tensor in load_file(tmp_path / "exported" / "model.safetensors").values()} == {
        torch.bfloat16}
    assert main(["export", str(masters), str(tmp_path / "exported_fp32"), "--dtype", "fp32"]) == 0
    assert {tensor.dtype for tensor in load_file(tmp_path / "exported_fp32" / "model.safetensors").values()} == {
        torch.float32}

    effective = json.loads((from_bf16 / "effective_config.json").read_text())["values"]
    assert effective["precision"]["value"] == "bf16" and effective["trainable_weights"]["value"] == "float32"
    (record,) = ledger(from_bf16)
    parameters = sum(tensor.numel() for tensor in load_file(hub_model_dir / "model.safetensors").values())
    assert record["measured"]["params_bytes"] == 4 * parameters  # fp32 weights,
    assert record["measured"]["optimizer_bytes"] == 8 * parameters  # fp32 Adam moments
    for key in STATES:
        assert record["measured"][key] == record["predicted"][key], key


def test_pure_bf16_is_asked_for_by_name_holds_8_bytes_per_parameter_and_rounds_small_updates_away(
        hub_model_dir, tmp_path):
    output_dir = train_single(hub_model_dir, tmp_path / "pure", "--pure_bf16", "true")
    moved = moved_fraction(hub_model_dir, output_dir)
    assert sum(moved.values()) / len(moved) < 0.5  # why it is not the default
    (record,) = ledger(output_dir)
    parameters = sum(tensor.numel() for tensor in load_file(hub_model_dir / "model.safetensors").values())
    assert record["measured"]["params_bytes"] == 2 * parameters
    assert record["measured"]["optimizer_bytes"] == 4 * parameters
    for key in STATES:
        assert record["measured"][key] == record["predicted"][key], key


@pytest.mark.distributed
def test_ddp_on_a_bf16_checkpoint_holds_fp32_states_equal_to_the_prediction_on_every_rank(hub_model_dir, tmp_path):
    output_dir = tmp_path / "ddp"
    assert_succeeded(launch_demo(CPU_LAUNCHES["ddp"], output_dir, "--model_name_or_path", str(hub_model_dir),
                                 *FIVE_SMALL_STEPS, "--per_device_train_batch_size", "2",
                                 "--save_dtype", "float32"))  # the masters themselves: bf16 would round them back
    parameters = sum(tensor.numel() for tensor in load_file(hub_model_dir / "model.safetensors").values())
    records = ledger(output_dir)
    assert [record["rank"] for record in records] == [0, 1]
    for record in records:
        assert record["strategy"] == "ddp"
        assert record["measured"]["params_bytes"] == 4 * parameters
        assert record["measured"]["optimizer_bytes"] == 8 * parameters
        for key in STATES:
            assert record["measured"][key] == record["predicted"][key], (record["rank"], key)
    moved = moved_fraction(hub_model_dir, output_dir)
    for name, fraction in moved.items():
        if "embed_tokens" not in name:  # pure bf16 moved ~20% of these
            assert fraction > 0.95, name


def test_lora_on_a_bf16_checkpoint_keeps_the_base_in_bf16_and_trains_fp32_adapters(hub_model_dir):
    from transformers import AutoModelForCausalLM

    from finetune.models.lora import apply_lora
    from finetune.recipe.args import LoraArguments

    model = apply_lora(AutoModelForCausalLM.from_pretrained(hub_model_dir), LoraArguments(use_lora=True, lora_r=4))
    hold_trainable_parameters(model, trainable_dtype(Strategy("ddp"), "bf16"))
    dtypes = {(parameter.requires_grad, parameter.dtype) for parameter in model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}


@pytest.mark.parametrize("strategy, precision, pure, held", [
    (Strategy("single"), "bf16", False, torch.float32),
    (Strategy("ddp"), "fp16", False, torch.float32),
    (Strategy("ddp"), "no", False, torch.float32),  # fp32 training of a bf16 checkpoint is fp32 too
    (Strategy("fsdp", fsdp_sharding="full_shard"), "bf16", False, torch.float32),
    (Strategy("deepspeed", zero_stage=2), "bf16", False, None),  # DeepSpeed keeps its own fp32 master
    (Strategy("deepspeed", zero_stage=3), "no", False, torch.float32),
    (Strategy("ddp"), "bf16", True, torch.bfloat16),
])
def test_trainable_parameters_are_held_in_fp32_unless_the_strategy_keeps_masters_or_pure_bf16(
        strategy, precision, pure, held):
    assert trainable_dtype(strategy, precision, pure) == held


def test_tied_weights_stay_tied_when_upcast():
    from finetune import presets

    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer, dtype=torch.bfloat16)
    assert hold_trainable_parameters(model, torch.float32) == model.num_parameters()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32


def test_ranks_that_get_their_weights_from_rank_0_build_shapes_only_with_ties_kept(tmp_path):
    """FSDP2 with `fsdp_cpu_ram_efficient_loading`: ranks ≠ 0 build the model on the meta device, a tied head still
    tied (Accelerate maps optimizer parameters to shards by address), then give it empty CPU storage."""
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
    assert sharded_from_rank_zero({**env, "RANK": "1"}) and not sharded_from_rank_zero({**env, "RANK": "0"})
    assert not sharded_from_rank_zero({**env, "RANK": "1", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"})
    assert not sharded_from_rank_zero({**env, "RANK": "1", "FSDP_VERSION": "1"})
    tied = save_hub_model(tmp_path / "tied", "chatml", tie_word_embeddings=True)
    for name in (presets.TINY_MODEL, str(tied)):
        model_args = ModelArguments(model_name_or_path=name)
        tokenizer = load_tokenizer(model_args)
        shapes, real = load_model(model_args, tokenizer, shapes_only=True), load_model(model_args, tokenizer)
        assert all(parameter.is_meta for parameter in shapes.parameters())
        assert [(key, p.shape, p.dtype) for key, p in shapes.named_parameters()] == \
            [(key, p.shape, p.dtype) for key, p in real.named_parameters()]
        assert shapes.lm_head.weight is shapes.get_input_embeddings().weight, name
        assert shapes.generation_config.eos_token_id == real.generation_config.eos_token_id
        assert materialize_empty_parameters(shapes) == len(list(real.parameters()))
        assert shapes.lm_head.weight is shapes.get_input_embeddings().weight
        assert not any(parameter.is_meta for parameter in shapes.parameters())


@pytest.mark.parametrize("overrides, message", [
    (["--pure_bf16", "true", "--deepspeed", "deepspeed_configs/zero2.json"], "DeepSpeed ZeRO-2"),
    (["--pure_bf16", "true", "--fp16", "true"], "fp16"),
])
def test_pure_bf16_is_refused_where_it_would_do_nothing_or_contradict(overrides, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe("recipes/demo.yaml", overrides)
