"""QLoRA under every shipped strategy, at the recipe level (the 4-bit kernels need CUDA; the GPU run is
benchmarks/gpu_check.sh): where parameters are sharded (FSDP, ZeRO-3) the 4-bit weights are stored in the compute dtype
and the strategy places them; a mixed precision that would cast them is refused while parsing the recipe."""

import importlib.util
import sys

import pytest
import torch
from gpu_simulation import A100, T4, simulate_gpus
from support import PROJECT_ROOT, run
from transformers import BitsAndBytesConfig

from finetune.errors import RecipeError
from finetune.launch.strategies import SHIPPED, SHIPPED_BY_NAME
from finetune.models.lora import qlora_compute_dtype, qlora_load
from finetune.recipe.parse import parse_recipe

SHARDED = {"zero3", "zero3_offload", "zero3_nvme", "zero3_zeropp", "sequence_parallel", "fsdp_full_shard",
           "fsdp_shard_grad_op", "fsdp_hybrid_shard"}  # sequence_parallel: SP beside ZeRO-3


# QLoRA under tensor parallelism is refused before loading (finetune.launch.parallelism: no adapters on TP layers).
@pytest.mark.parametrize("row", [row for row in SHIPPED if row.kind != "tensor_parallel"], ids=lambda row: row.name)
def test_sharded_strategies_store_the_4bit_weights_in_the_compute_dtype(row):
    for torch_dtype, compute in (("bfloat16", torch.bfloat16), ("auto", torch.bfloat16), ("float16", torch.float16)):
        load = qlora_load(row.strategy, torch_dtype, local_rank=1)
        config = BitsAndBytesConfig(**load.quantization)  # what from_pretrained is given
        assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
        assert config.bnb_4bit_compute_dtype == compute and load.dtype == compute
        if row.name in SHARDED:
            assert config.bnb_4bit_quant_storage == compute  # FSDP and ZeRO-3 shard floating-point tensors only
            assert load.device_map is None and not load.prepare_for_kbit  # the strategy places the shards
        else:
            assert config.bnb_4bit_quant_storage == torch.uint8  # bitsandbytes' default
            assert load.device_map == {"": 1} and load.prepare_for_kbit  # the whole model on this rank's GPU


@pytest.fixture
def qlora_possible(monkeypatch):
    """As on a CUDA machine with bitsandbytes: the recipe checks that follow the hardware check are reached."""
    monkeypatch.chdir(PROJECT_ROOT)
    simulate_gpus(monkeypatch, A100, count=8)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes"
                        else find_spec(name, *a))
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def launched_as(monkeypatch, name: str) -> None:
    """The variables `accelerate launch` hands a process of the shipped strategy `name`."""
    row = SHIPPED_BY_NAME[name]
    if row.kind == "deepspeed":
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", row.deepspeed_file)
    else:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        monkeypatch.setenv("FSDP_VERSION", "2")
        monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", str(row.fsdp_sharding == "full_shard").lower())


@pytest.mark.parametrize("name", ["zero3", "fsdp_full_shard"])
def test_a_mixed_precision_that_would_cast_sharded_4bit_weights_is_refused_while_parsing(qlora_possible, name):
    launched_as(qlora_possible, name)
    recipe = parse_recipe("recipes/demo.yaml", ["--use_qlora", "true", "--torch_dtype", "bfloat16", "--bf16", "true"])
    assert recipe.lora.use_lora and recipe.strategy.shards_parameters
    with pytest.raises(RecipeError, match=r"stored as fp16 so that they can be sharded .* bf16 mixed precision would "
                                          r"cast them .* Train with `fp16: true`, or set `torch_dtype` to match bf16"):
        parse_recipe("recipes/demo.yaml", ["--use_qlora", "true", "--torch_dtype", "float16", "--bf16", "true"])
    qlora_possible.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # from the Accelerate config this time
    with pytest.raises(RecipeError, match=r"stored as bf16 .* fp16 mixed precision"):
        parse_recipe("recipes/demo.yaml", ["--use_qlora", "true", "--torch_dtype", "bfloat16"])


def test_unsharded_strategies_take_any_mixed_precision_with_qlora(qlora_possible):
    launched_as(qlora_possible, "zero2")
    recipe = parse_recipe("recipes/demo.yaml", ["--use_qlora", "true", "--torch_dtype", "float16", "--bf16", "true"])
    assert not recipe.strategy.shards_parameters  # each rank holds the whole 4-bit model, computing under autocast


def test_the_gpu_check_says_it_needs_a_gpu_here():
    result = run([sys.executable, "benchmarks/gpu_check.py"], timeout=120)
    assert result.returncode == 2 and "no CUDA GPU visible" in result.output


@pytest.mark.parametrize("gpu, compute", [(T4, torch.float16), (A100, torch.bfloat16)], ids=["T4", "A100"])
def test_qlora_computes_in_the_half_dtype_the_gpu_has(monkeypatch, gpu, compute):
    """`torch_dtype: auto` (and float32) on a T4: the 4-bit base reaches BitsAndBytesConfig computing in fp16."""
    simulate_gpus(monkeypatch, gpu)
    for torch_dtype in ("auto", "float32"):
        load = qlora_load(SHIPPED_BY_NAME["single"].strategy, torch_dtype)
        assert BitsAndBytesConfig(**load.quantization).bnb_4bit_compute_dtype == compute and load.dtype == compute
    assert qlora_compute_dtype("float16") == torch.float16 and qlora_compute_dtype("bfloat16") == torch.bfloat16


def test_qlora_asked_to_compute_in_bf16_on_a_t4_is_refused_while_parsing(qlora_possible):
    simulate_gpus(qlora_possible, T4)
    with pytest.raises(RecipeError, match=r"`torch_dtype: bfloat16` computes in bf16, which Tesla T4 \(compute "
                                          r"capability 7.5\) does not have: set `torch_dtype: float16` or `auto`"):
        parse_recipe("recipes/demo.yaml", ["--use_qlora", "true", "--torch_dtype", "bfloat16"])


def test_the_gpu_checks_sharded_rows_on_one_gpu_say_they_shard_nothing():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", PROJECT_ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.sharding_note("fsdp_full_shard", 1).startswith("not sharded: one process")
    assert gpu_check.sharding_note("zero3", 1).startswith("not sharded: one process")
    assert gpu_check.sharding_note("zero3", 2) is None and gpu_check.sharding_note("single", 1) is None
