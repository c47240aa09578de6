"""Tensor parallelism through the normal path: `finetune train` launched under the shipped TP configs' CPU twins
(finetune.testing.parallelism_on_cpu), the model loaded sharded by Transformers' `DistributedConfig`. TP 2 on the
tiny preset (2 processes, tied embeddings) and TP 2 × FSDP2 2 on a hub-shaped checkpoint (4 processes, untied head,
grouped-query attention, bf16 safetensors) train with the losses of one process at the same global batch, clipping
active; each rank holds its slices (DTensor local shapes, the ledger equal to the prediction); a resume of either
logs the uninterrupted losses; the gathered weights export to the one-process model; what cannot work is refused
before any process group, in one line."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from hub_fixtures import save_hub_model
from support import assert_succeeded, gathered_weights_peaks, launch_demo, measuring_gathers

from finetune import outputs
from finetune.checkpoints.complete import COMPLETE_MARKER
from finetune.checkpoints.sharded_state import STATE_FOLDER
from finetune.cli import main
from finetune.errors import RecipeError
from finetune.launch.parallelism import Parallelism
from finetune.launch.strategies import SHIPPED_BY_NAME
from finetune.memory import model_shape
from finetune.memory.estimate import Setup, fsdp_gathered_weights_bytes
from finetune.memory.shapes import resolve_config
from finetune.recipe.parse import parse_recipe
from finetune.train.axes.context import ON_CPU
from finetune.train.axes.tensor import CPU_MESH_ALLOWED, TensorArguments, TensorParallelism, check
from finetune.train.axes.tensor.layout import TensorSplit

TP_ON_CPU = SHIPPED_BY_NAME["tensor_parallel"].launch(cpu=True)
TP_FSDP_ON_CPU = SHIPPED_BY_NAME["tensor_parallel_fsdp"].launch(cpu=True)
# Global batch 16 on every launch; the gradient norm (2.4 to 5.8 over these steps) is clipped to 0.5 at each step.
# Complete checkpoints at steps 3 and 6.
RUN = ["--max_steps", "6", "--logging_steps", "1", "--global_batch_size", "16", "--max_grad_norm", "0.5",
       "--warmup_steps", "0", "--save_strategy", "steps", "--save_steps", "3", "--eval_on_start", "false",
       "--report_to", "none"]
PADDING = 1024  # bytes: FSDP2 pads a rank's shard of an uneven tensor to the largest shard (tests/launch/test_fsdp.py)


def history(output_dir) -> list[dict]:
    return [entry for entry in json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
            if "loss" in entry]


@pytest.fixture(scope="module")
def hub_model(tmp_path_factory):
    return save_hub_model(tmp_path_factory.mktemp("hub_untied"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hub_model):
    """Each launch and its one-process twin (in this process), same recipe and global batch; and the TP × FSDP2 run
    resumed from its step-3 checkpoint (the later one and the final files removed, as a run killed after step 3
    leaves its folder)."""
    hub = ["--model_name_or_path", str(hub_model), "--generation_eval_samples", "0"]
    done = {}
    for name, launch, extra in (("tp", TP_ON_CPU, []), ("tp_fsdp", TP_FSDP_ON_CPU, hub)):
        output_dir = tmp_path_factory.mktemp(name)
        assert_succeeded(launch_demo(launch, output_dir, *RUN, *extra))
        one = tmp_path_factory.mktemp(f"{name}_one")
        assert main(["train", "recipes/demo.yaml", "--output_dir", str(one), *RUN, *extra]) == 0
        done[name], done[f"{name}_one"] = output_dir, one
    for name, launch, extra in (("tp", TP_ON_CPU, []), ("tp_fsdp", TP_FSDP_ON_CPU, hub)):
        resumed = tmp_path_factory.mktemp(f"{name}_resumed")
        shutil.copytree(done[name] / "checkpoint-3", resumed / "checkpoint-3")
        done[f"{name}_resume_output"] = launch_demo(launch, resumed, *RUN, *extra, "--resume_from_checkpoint", "auto")
        done[f"{name}_resumed"] = resumed
    return done


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tp", "tp_fsdp"])
def test_tensor_parallel_runs_train_with_the_losses_of_one_process(runs, name):
    sharded, one = history(runs[name]), history(runs[f"{name}_one"])
    assert [entry["step"] for entry in sharded] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(sharded, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["grad_norm"] > 0.5  # clipping was active at every step
        assert a["num_input_tokens_seen"] == b["num_input_tokens_seen"]  # a TP group's batch counted once
    assert sharded[-1]["loss"] < sharded[0]["loss"] - 0.5


@pytest.mark.distributed
@pytest.mark.parametrize("name, world, sizes", [("tp", 2, {"tensor_parallel_size": 2, "dp_shard_size": 1}),
                                                ("tp_fsdp", 4, {"tensor_parallel_size": 2, "dp_shard_size": 2})])
def test_each_rank_holds_its_slices_as_predicted(runs, name, world, sizes):
    effective = outputs.read_record(runs[name], outputs.EFFECTIVE_CONFIG)
    for side in ("requested", "running"):
        assert effective["strategy"][side]["strategy"] == "tensor_parallel"
        assert {key: effective["strategy"][side][key] for key in sizes} == sizes
    assert effective["values"]["global_batch_size"]["value"] == 16
    ranks = effective["ranks"]
    assert [rank["rank"] for rank in ranks] == list(range(world))
    for rank in ranks:  # DTensor local shapes: a column-split projection holds its rows over the TP × FSDP ranks
        local, whole = rank["split_parameters"]["example"]["local"], rank["split_parameters"]["example"]["global"]
        assert local[0] * world == whole[0] and local[1:] == whole[1:], rank
        assert rank["split_parameters"]["count"] > 0
    report = outputs.read_record(runs[name], outputs.MEMORY_REPORT)["ranks"]
    one = outputs.read_record(runs[f"{name}_one"], outputs.MEMORY_REPORT)["ranks"][0]["measured"]
    for record in report:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            measured, predicted = record["measured"][key], record["predicted"][key]
            assert abs(measured - predicted) <= (0 if name == "tp" else PADDING), (record["rank"], key)
            assert measured < one[key] / world * 1.1  # a share, not the whole model
    # every weight is held somewhere: the slices add up to the whole model, norms once on each TP rank
    assert one["params_bytes"] <= sum(record["measured"]["params_bytes"] for record in report) \
        <= one["params_bytes"] * 1.01 + world * PADDING


@pytest.mark.distributed
@pytest.mark.parametrize("name, shard", [("tp", 1), ("tp_fsdp", 2)])
def test_a_resumed_tensor_parallel_run_logs_the_uninterrupted_losses(runs, name, shard):
    output = runs[f"{name}_resume_output"]
    assert_succeeded(output)
    assert f"resuming from {runs[f'{name}_resumed'] / 'checkpoint-3'}" in output.output
    then, now = history(runs[name]), history(runs[f"{name}_resumed"])
    assert [entry["step"] for entry in now] == [1, 2, 3, 4, 5, 6]  # 1 to 3 restored from the checkpoint's state
    for a, b in zip(now[3:], then[3:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"])
    marker = json.loads((runs[name] / "checkpoint-3" / COMPLETE_MARKER).read_text())
    assert (marker["strategy"], marker["tensor_parallel_size"], marker["dp_shard_size"]) == ("tensor_parallel", 2,
                                                                                            shard)
    assert (runs[name] / "checkpoint-3" / STATE_FOLDER / ".metadata").is_file()


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tp", "tp_fsdp"])
def test_the_gathered_weights_and_their_export_are_the_one_process_model(runs, name, tmp_path):
    """The step-6 checkpoints of the sharded run and of its one-process twin export to the same model; the final
    weights are those, in the checkpoint's own dtype (the hub-shaped one is stored in bf16, so rounded to it)."""
    from transformers import AutoModelForCausalLM

    inputs = torch.tensor([[5, 6, 7, 8, 9, 10]])
    logits = {}
    for source in (name, f"{name}_one"):
        assert main(["export", str(runs[source] / "checkpoint-6"), str(tmp_path / source)]) == 0
        logits[source] = AutoModelForCausalLM.from_pretrained(tmp_path / source, dtype=torch.float32)(inputs).logits
    # the same training, on one process; each export rounds the fp32 masters to the checkpoint's dtype (bf16 for the
    # hub-shaped one), where masters 1e-7 apart can fall on neighbouring bf16 values: measured on one CPU, a largest
    # logit gap of 1.6e-4 against a mean of 4e-7
    gap = (logits[name] - logits[f"{name}_one"]).abs()
    assert gap.max() < 5e-4 and gap.mean() < 1e-5
    final = AutoModelForCausalLM.from_pretrained(runs[name], dtype=torch.float32)(inputs).logits
    stored = json.loads((runs[name] / "config.json").read_text())["dtype"]
    assert stored == ("float32" if name == "tp" else "bfloat16")
    assert torch.allclose(final, logits[name], atol=1e-6 if name == "tp" else 5e-2)


def test_tied_embeddings_under_tensor_parallel_with_fsdp_are_refused_naming_the_defect():
    tied = resolve_config("tiny")
    with pytest.raises(RecipeError, match="stale copy of the shared weight") as refused:
        check(Parallelism(tensor_parallel_size=2, dp_shard_size=2), tied, strategy_kind="ddp", use_lora=False)
    assert "dp_shard_size: 1" in str(refused.value)
    check(Parallelism(tensor_parallel_size=2), tied, strategy_kind="ddp", use_lora=False)  # TP alone is correct


@pytest.mark.parametrize("overrides, message", [
    (["--context_parallel_size", "2"], ON_CPU),
    (["--tensor_parallel_size", "3"], "does not divide the model's num_attention_heads (4)"),
    (["--tensor_parallel_size", "2"], "= 2, but the launch has 1 process"),
    (["--dp_shard_size", "2"], "names none of them"),
    (["--tensor_parallel_size", "abc"], "tensor_parallel_size"),
])
def test_parallelism_a_launch_cannot_run_stops_in_one_line(overrides, message, capsys):
    assert main(["train", "recipes/demo.yaml", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_tensor_parallel_under_deepspeed_with_lora_or_compiled_is_refused():
    config = resolve_config("tiny")
    with pytest.raises(RecipeError, match="not under a DeepSpeed or FSDP config"):
        check(Parallelism(tensor_parallel_size=2), config, strategy_kind="deepspeed", use_lora=False)
    with pytest.raises(RecipeError, match="adapters on tensor-parallel layers"):
        check(Parallelism(tensor_parallel_size=2), config, strategy_kind="ddp", use_lora=True)
    with pytest.raises(RecipeError, match=r"`torch_compile: true` with `tensor_parallel_size: 2`.*pytorch#119071"):
        check(Parallelism(tensor_parallel_size=2), config, strategy_kind="tensor_parallel", use_lora=False,
              compiled=True)


def test_the_sizes_an_accelerate_config_exports_are_checked_as_the_recipes_are(monkeypatch):
    from finetune.launch.strategies import Strategy
    from finetune.recipe.args import ModelArguments
    from finetune.recipe.preflight import check_parallelism

    def check_parallelism_and_tensor(inputs):  # the sizes resolved, then the tensor axis's own check, as parsing does
        parallelism = check_parallelism(inputs, ModelArguments())
        sections = SimpleNamespace(model=ModelArguments(), axes=(), training_inputs=inputs, sources={},
                                   lora=SimpleNamespace(use_lora=False, use_qlora=False))
        axis = TensorParallelism(TensorArguments(parallelism.size("tensor_parallel_size")))
        return parallelism, axis.check(sections, parallelism, Strategy("ddp"))

    for variable, value in (("WORLD_SIZE", "4"), ("ACCELERATE_USE_PARALLELISM_CONFIG", "true"),
                            ("PARALLELISM_CONFIG_TP_SIZE", "2"), ("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")):
        monkeypatch.setenv(variable, value)  # what `accelerate launch` exports for tensor_parallel_fsdp.yaml
    with pytest.raises(RecipeError, match="Accelerate builds a tensor-parallel mesh for GPUs only"):
        check_parallelism_and_tensor({})  # CPU processes, not the CPU twin's program
    monkeypatch.setenv(CPU_MESH_ALLOWED, "1")  # as finetune.testing.parallelism_on_cpu sets it
    with pytest.raises(RecipeError, match="stale copy"):  # the tiny preset ties its embeddings
        check_parallelism_and_tensor({})
    with pytest.raises(RecipeError, match="`tensor_parallel_size: 4` in the recipe, but the Accelerate config"):
        check_parallelism_and_tensor({"tensor_parallel_size": "4"})
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match="`method: dpo` with tensor_parallel_size 2: only supervised"):
        parse_recipe("recipes/dpo.yaml", ["--output_dir", "unused", "--model_name_or_path", "tiny"])
    parallelism, strategy = check_parallelism_and_tensor({"save_strategy": "steps"})
    assert parallelism == Parallelism(tensor_parallel_size=2) and strategy.label == "tp2"


def test_tensor_parallel_on_an_architecture_without_a_tp_plan_is_refused_before_the_launch(tmp_path, monkeypatch,
                                                                                           capsys):
    from transformers import GPT2Config

    from finetune.cli import main

    model = tmp_path / "gpt2-tiny"
    GPT2Config(n_layer=2, n_embd=64, n_head=4).save_pretrained(model)  # GPT-2: no base_model_tp_plan
    monkeypatch.setattr("os.execve", lambda *args: pytest.fail(f"launched: {args[1]}"))
    assert main(["train", "recipes/demo.yaml", "--gpus", "2", "--tensor_parallel_size", "2", "--model_name_or_path",
                 str(model), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the model's architecture (gpt2) has no tensor-parallel plan in Transformers" in err[0]
    with pytest.raises(RecipeError, match="base_model_tp_plan is None"):  # on every rank too, before loading
        check(Parallelism(tensor_parallel_size=2), resolve_config(str(model)), strategy_kind="ddp", use_lora=False)


@pytest.mark.distributed
def test_tp_with_fsdp2_under_bf16_gathers_the_slices_in_bf16_and_trains_as_one_process(hub_model, runs, tmp_path):
    """Under bf16, FSDP2 over the TP slices all-gathers them in bf16 and reduces their gradients in fp32 (Transformers'
    bf16 policy, as Accelerate's FSDP2 runs): half the bytes of gathering the fp32 masters, which an fp32 run still
    gathers. The run trains as one process under bf16 autocast does, within bf16's rounding; the masters stay fp32."""
    extra = ["--model_name_or_path", str(hub_model), "--generation_eval_samples", "0", "--bf16", "true",
             "--max_steps", "3", "--save_strategy", "no"]
    output_dir, one = tmp_path / "tp_fsdp_bf16", tmp_path / "one_bf16"
    launch, env = measuring_gathers(TP_FSDP_ON_CPU, tmp_path / "gathers")
    assert_succeeded(launch_demo(launch, output_dir, *RUN, *extra, env=env))
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(one), *RUN, *extra]) == 0
    gathered = {name: {rank["split_parameters"]["fsdp_gathers_in"]
                       for rank in outputs.read_record(folder, outputs.EFFECTIVE_CONFIG)["ranks"]}
                for name, folder in (("bf16", output_dir), ("fp32", runs["tp_fsdp"]))}
    assert gathered == {"bf16": {"bfloat16"}, "fp32": {"float32"}}
    effective = outputs.read_record(output_dir, outputs.EFFECTIVE_CONFIG)
    assert effective["values"]["trainable_weights"]["value"] == "float32"
    # What FSDP2 held gathered at once on each rank (finetune.testing.fsdp_gathers) is what the plan counts: twice
    # the largest group's TP slice in bf16, here the tail (final norm and head, kept from the forward's end to its
    # backward) at its copy-out; the untied hub model's vocabulary of 600 rows is cut 300 a TP rank.
    shape = model_shape(str(hub_model))
    planned = fsdp_gathered_weights_bytes(shape, Setup(strategy="tensor_parallel", num_gpus=4, axis=TensorSplit(2, 2),
                                                       precision="bf16"))
    assert planned == 2 * 2 * (300 * shape.hidden_size + shape.hidden_size)
    measured = gathered_weights_peaks(tmp_path / "gathers")
    assert len(measured) == 4 and all(0 <= bytes_ - planned <= PADDING for bytes_ in measured), (measured, planned)
    for a, b in zip(history(output_dir), history(one), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
