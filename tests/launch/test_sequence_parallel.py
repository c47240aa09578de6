"""Sequence parallelism (DeepSpeed Ulysses / ALST) through the normal path: each sequence of a batch is split over 2
CPU processes, which train with the losses and gradient norms of one process at the same batch, with SGD (the
update's scale shows unclipped) and with AdamW (clipping active), under ZeRO-2 (the recipe names the size) and under
the shipped `sequence_parallel` config (ZeRO-3, the size from the config); every step runs; the ledger equals the
prediction on each rank."""

import json

import pytest
import torch
from support import assert_succeeded, launch_demo, slack

from finetune import outputs
from finetune.cli import main
from finetune.data.collate import SequenceShardedCollator
from finetune.data.tokenize import IGNORE_INDEX
from finetune.errors import RecipeError
from finetune.launch.parallelism import Parallelism
from finetune.launch.strategies import SHIPPED_BY_NAME
from finetune.memory import Setup, estimate, model_shape
from finetune.train.axes.sequence import ULYSSES_LOSS, SequenceShare, check_loss, ulysses_config

SP_ON_CPU = SHIPPED_BY_NAME["sequence_parallel"].launch(cpu=True)  # ZeRO-3 × SP 2: the GPU config runs on CPU
ZERO2_ON_CPU = SHIPPED_BY_NAME["zero2"].launch(cpu=True)
STEPS = 5
RUN = ["--max_steps", str(STEPS), "--logging_steps", "1", "--per_device_train_batch_size", "8", "--warmup_steps", "0",
       "--eval_on_start", "false", "--generation_eval_samples", "6", "--report_to", "none"]
# SGD without clipping: a gradient off by any factor changes the next loss. AdamW clipped at 1.0 (norms 2.8 to 6.6).
OPTIMIZERS = {"sgd": ["--optim", "sgd", "--learning_rate", "0.2", "--max_grad_norm", "0"],
              "adamw": ["--optim", "adamw_torch", "--max_grad_norm", "1.0"]}


def history(output_dir) -> list[dict]:
    return [entry for entry in json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
            if "loss" in entry]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """SGD under ZeRO-2 with `--sequence_parallel_size 2`, AdamW under the shipped config; each with its one-process
    twin (in this process) at the same batch of 8 sequences."""
    done = {}
    for name, launch, extra in (("sgd", ZERO2_ON_CPU, ["--sequence_parallel_size", "2"]), ("adamw", SP_ON_CPU, [])):
        output_dir = tmp_path_factory.mktemp(f"sp_{name}")
        assert_succeeded(launch_demo(launch, output_dir, *RUN, *OPTIMIZERS[name], *extra))
        one = tmp_path_factory.mktemp(f"one_{name}")
        assert main(["train", "recipes/demo.yaml", "--output_dir", str(one), *RUN, *OPTIMIZERS[name]]) == 0
        done[name], done[f"{name}_one"] = output_dir, one
    return done


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sequence_parallel_trains_every_step_with_the_losses_of_one_process(runs, name):
    split, one = history(runs[name]), history(runs[f"{name}_one"])
    assert [entry["step"] for entry in split] == list(range(1, STEPS + 1))
    for a, b in zip(split, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    if name == "adamw":
        assert all(entry["grad_norm"] > 1.0 for entry in split)  # clipping active at every step
    assert split[-1]["loss"] < split[0]["loss"] - 0.5


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sequence_parallel_records_its_axis_and_one_batch_per_step_and_its_ledger(runs, name):
    output_dir = runs[name]
    effective = json.loads((output_dir / outputs.EFFECTIVE_CONFIG).read_text())
    assert effective["strategy"]["running"]["sequence_parallel_size"] == 2
    # what Ulysses runs, said with why: each micro-batch's own token mean (the default `tokens` cannot run)
    assert effective["values"]["loss_normalization"] == {"value": "micro_batch_mean", "source": ULYSSES_LOSS}
    assert effective["strategy"]["running"]["zero_stage"] == (2 if name == "sgd" else 3)
    plan = json.loads((output_dir / outputs.BATCH_PLAN).read_text())
    assert (plan["world_size"], plan["global_batch_size"]) == (1, 8)  # both ranks work on one batch
    report = json.loads((output_dir / outputs.MEMORY_REPORT).read_text())
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert rank["predicted"]["estimate"]["setup"]["beside"] == [{"sequence_parallel_size": 2}]
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert abs(rank["measured"][key] - rank["predicted"][key]) <= slack(key, f"zero{2 if name == 'sgd' else 3}")


def test_batches_are_cut_evenly_and_keep_their_positions():
    def padded(features):
        longest = max(len(feature["input_ids"]) for feature in features)
        return {"input_ids": torch.tensor([f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]),
                "labels": torch.tensor([f["input_ids"] + [IGNORE_INDEX] * (longest - len(f["input_ids"]))
                                        for f in features]),
                "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"]))
                                                for f in features])}

    features = [{"input_ids": [5, 6, 7, 8, 9]}, {"input_ids": [5, 6]}]
    batch = SequenceShardedCollator(padded, ranks=4, pad_token_id=0)(features)
    assert batch["input_ids"].shape == (2, 8)  # 5 → the next multiple of 4
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    assert batch["labels"][0].tolist() == [5, 6, 7, 8, 9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert batch["attention_mask"][0].tolist() == [1] * 5 + [0] * 3
    fixed = SequenceShardedCollator(padded, ranks=4, pad_token_id=0, length=10)(features)  # gloo: one shape
    assert fixed["input_ids"].shape == (2, 12) and fixed["position_ids"][1].tolist() == list(range(12))


def test_eager_attention_is_refused_for_sequence_parallelism_by_name():
    with pytest.raises(RecipeError, match="`attn_implementation: sdpa`"):
        ulysses_config(2, 1, "eager")
    mesh = Parallelism(sequence_parallel_size=2, dp_shard_size=2)
    config = ulysses_config(mesh.size("sequence_parallel_size"), mesh.data_parallel_size, "sdpa")
    assert (config.sp_size, config.sp_backend, config.data_parallel_size) == (2, "deepspeed", 2)


def test_sequence_parallelism_is_a_size_of_accelerates_mesh_carried_beside_the_engine():
    """Its size resolves with the mesh's (recipe key ↔ Accelerate's `sp_size`), the strategy carries its layout."""
    from finetune.launch.parallelism import from_accelerate_section, variable

    mesh = Parallelism(sequence_parallel_size=2, dp_shard_size=2)
    assert (mesh.total, mesh.ranks_sharing_a_batch, mesh.named) == (4, 2, True)
    assert mesh.by_accelerate_name() == {"dp_shard_size": 2, "sp_size": 2}
    assert variable("sequence_parallel_size") == "PARALLELISM_CONFIG_SP_SIZE"
    assert from_accelerate_section({"parallelism_config_sp_size": 2}, "test") == Parallelism(sequence_parallel_size=2)
    assert mesh.beside_the_engine() == (SequenceShare(2),)
    assert Parallelism(dp_shard_size=2).beside_the_engine() == ()
    shipped = SHIPPED_BY_NAME["sequence_parallel"].strategy
    assert (shipped.label, shipped.describe()) == ("deepspeed_zero3+sp2", "DeepSpeed ZeRO-3 × sequence parallel 2")
    assert shipped.to_dict()["sequence_parallel_size"] == 2
    with pytest.raises(TypeError, match="no mesh axis"):
        Parallelism(sequence_parallel=2)


def test_the_estimator_gives_each_rank_the_activations_of_its_share_of_the_sequence():
    shape = model_shape("llama-3-8b")
    whole = estimate(shape, Setup(strategy="deepspeed", zero_stage=3, num_gpus=8, sequence_length=32768))
    split = estimate(shape, Setup(strategy="deepspeed", zero_stage=3, num_gpus=8, sequence_length=32768,
                                  beside=(SequenceShare(8),)))
    assert split.activations_bytes == pytest.approx(whole.activations_bytes / 8, rel=1e-6)
    assert (split.params_bytes, split.optimizer_bytes) == (whole.params_bytes, whole.optimizer_bytes)


def test_tokens_normalisation_asked_by_name_under_sequence_parallelism_is_refused():
    """DeepSpeed's Ulysses loader hides the labels from Trainer, which then counts no step's tokens: asked for by
    name, `tokens` stops with the fix; by default the run takes `micro_batch_mean` and says why."""
    with pytest.raises(RecipeError, match="Set `loss_normalization: micro_batch_mean`"):
        check_loss({"loss_normalization": "tokens"}, {"loss_normalization": "recipe"}, 2)
    inputs, sources = {}, {}
    check_loss(inputs, sources, 2)
    assert inputs["loss_normalization"] == "micro_batch_mean" and sources["loss_normalization"] == ULYSSES_LOSS


def test_sequence_parallelism_outside_deepspeed_is_refused_by_its_axis(monkeypatch):
    """Ulysses runs under DeepSpeed only: a 2-process launch of plain processes stops before any process group."""
    from finetune.recipe.parse import parse_recipe

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=r"runs through DeepSpeed Ulysses.*not plain processes"):
        parse_recipe("recipes/demo.yaml", ["--sequence_parallel_size", "2"])
