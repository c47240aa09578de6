"""Pipeline parallelism on torch.distributed.pipelining (finetune.train.axes.pipeline.loop): 2 stages on 2 CPU
processes train with the losses and gradient norms of one process at the same batch, clipping active, under 1F1B on the
tiny preset (its head tied to the embedding, which the first and the last stage both hold) and under GPipe on a
hub-shaped checkpoint (untied, bf16 safetensors); the stages evaluate with the eval losses of one process, log to
TensorBoard and stop on a non-finite loss, as Trainer does; each rank holds its stage, as the estimator predicts; a
resume from a checkpoint's stage files logs the uninterrupted losses; `finetune export` consolidates the stages into the
model a one-process run trains; the same holds for 2 replicas of 2 stages (PP × DP, 4 processes) and for 2 replicas of 2
stages each split over 2 TP ranks (PP × TP × DP, 8 processes); LoRA on 2 stages and on 2 replicas of them trains as
one process does, its final save the adapter a one-process run writes, its stage checkpoints resumed and exported
merged; what the loop does not run is refused by name."""

import json
import shutil
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hub_fixtures import save_hub_model
from support import assert_succeeded, launch_demo

from finetune import outputs
from finetune.checkpoints.complete import COMPLETE_MARKER
from finetune.cli import main
from finetune.errors import RecipeError
from finetune.launch.parallelism import Parallelism
from finetune.launch.strategies import Strategy
from finetune.memory import Setup, estimate, model_shape
from finetune.memory.estimate import layer_weight_cast_bytes, saved_per_layer_bytes
from finetune.train.axes.pipeline import check_pipeline
from finetune.train.axes.pipeline.layout import (
    PipelineLayout,
    pipeline_layer_bytes,
    pipeline_stage_adapters,
    pipeline_stage_elements,
)
from finetune.train.axes.pipeline.stages import stage_layers

STEPS = 6
# 4 micro-batches of 4 a step (global batch 16), the gradient norm (2.4 to 5.8) clipped to 1.0 at every step,
# complete checkpoints at steps 3 and 6.
RUN = ["--max_steps", str(STEPS), "--logging_steps", "1", "--per_device_train_batch_size", "4",
       "--gradient_accumulation_steps", "4", "--max_grad_norm", "1.0", "--warmup_steps", "0", "--eval_on_start",
       "false", "--generation_eval_samples", "0", "--save_strategy", "steps", "--save_steps", "3", "--report_to",
       "none"]
PIPELINE = ["--pipeline_parallel_size", "2"]
# The 1F1B run and its twin evaluate before training, every 3 steps and at the end: 24 held-out rows, the stages' last
# eval step of 16 filled with 8 unlabelled rows, Trainer's in one batch (its eval loss then is the token mean too)
EVALUATED = ["--eval_on_start", "true", "--eval_strategy", "steps", "--eval_steps", "3", "--max_eval_samples", "24",
             "--per_device_eval_batch_size", "24"]
DDP_ON_CPU = "accelerate_configs/cpu_ddp.yaml"  # plain processes, one a stage


def history(output_dir) -> list[dict]:
    return [entry for entry in json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
            if "loss" in entry]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1F1B on the tiny preset and GPipe on a hub-shaped checkpoint, each with its one-process twin (in this process,
    through Trainer); and the 1F1B run resumed from its step-3 checkpoint alone."""
    hub = save_hub_model(tmp_path_factory.mktemp("hub_untied"))
    done = {}
    for name, extra in (("1f1b", EVALUATED),
                        ("gpipe", ["--pipeline_schedule", "gpipe", "--pipeline_step_length", "max_seq_length",
                                   "--model_name_or_path", str(hub)])):
        output_dir = tmp_path_factory.mktemp(f"pp_{name}")
        tracked = ["--report_to", "tensorboard", "mlflow"] if name == "1f1b" else []
        env = {"MLFLOW_TRACKING_URI": (output_dir / "mlruns").as_uri(), "MLFLOW_EXPERIMENT_NAME": "pipeline",
               "MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow 3 refuses its file store unless told
        assert_succeeded(launch_demo(DDP_ON_CPU, output_dir, *RUN, *PIPELINE, *extra, *tracked, env=env))
        one = tmp_path_factory.mktemp(f"one_{name}")
        assert main(["train", "recipes/demo.yaml", "--output_dir", str(one), *RUN,
                     *[arg for arg in extra if arg not in ("--pipeline_schedule", "gpipe", "--pipeline_step_length",
                                                           "max_seq_length")]]) == 0
        done[name], done[f"{name}_one"] = output_dir, one
    resumed = tmp_path_factory.mktemp("pp_resumed")
    shutil.copytree(done["1f1b"] / "checkpoint-3", resumed / "checkpoint-3")
    done["resume_output"] = launch_demo(DDP_ON_CPU, resumed, *RUN, *PIPELINE, *EVALUATED, "--resume_from_checkpoint",
                                        "auto")
    done["resumed"] = resumed
    return done


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_two_stages_train_with_the_losses_of_one_process(runs, name):
    staged, one = history(runs[name]), history(runs[f"{name}_one"])
    assert [entry["step"] for entry in staged] == list(range(1, STEPS + 1))
    for a, b in zip(staged, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # over both stages, the tied weight once
        assert a["grad_norm"] > 1.0  # clipping active at every step
        assert a["learning_rate"] == pytest.approx(b["learning_rate"])
    assert staged[-1]["loss"] < staged[0]["loss"] - 0.5
    effective = json.loads((runs[name] / outputs.EFFECTIVE_CONFIG).read_text())
    assert effective["pipeline"]["schedule"] == name and effective["pipeline"]["micro_batches"] == 4
    assert effective["pipeline"]["bubble_fraction"] == pytest.approx(1 / 5)  # (p − 1) / (m + p − 1)
    # the effective configuration a Trainer run writes, value for value where the two runs agree
    twin = json.loads((runs[f"{name}_one"] / outputs.EFFECTIVE_CONFIG).read_text())["values"]
    for key in ("seed", "model_name_or_path", "precision", "trainable_weights", "per_device_train_batch_size",
                "gradient_accumulation_steps", "learning_rate", "max_grad_norm", "global_batch_size"):
        assert effective["values"][key]["value"] == twin[key]["value"], key
    assert effective["values"]["global_batch_size"]["value"] == 16  # one pipeline: 4 micro-batches of 4
    assert effective["values"]["strategy"] == {"value": "pipeline", "source": "the recipe"}
    assert effective["strategy"]["running"] == {"strategy": "pipeline", "pipeline_parallel_size": 2,
                                                "source": "the recipe"}


@pytest.fixture(scope="module")
def two_replicas_twin(tmp_path_factory):
    """A hub-shaped bf16 checkpoint (4 heads, 2 key/value heads, MLP width 128: split 2 ways whole) and its
    one-process run at the global batch of 2 replicas (4 × 4 micro-batches × 2 replicas = 4 × 8 accumulated)."""
    hub = save_hub_model(tmp_path_factory.mktemp("hub_replicated"))
    one = tmp_path_factory.mktemp("two_replicas_one")
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(one), *RUN, *held_whole(hub),
                 "--gradient_accumulation_steps", "8"]) == 0
    return hub, one


def held_whole(hub) -> list[str]:
    return ["--model_name_or_path", str(hub), "--save_dtype", "float32"]  # the fp32 masters, to compare exactly


def launch_and_resume(tmp_path_factory, name: str, hub, processes: int, *extra: str) -> dict:
    """A pipeline launch of `processes` from `hub` and the same launch resumed from its step-3 checkpoint, with the
    first launch's wall time (seconds)."""
    pipeline, resumed = (tmp_path_factory.mktemp(f"{name}{suffix}") for suffix in ("", "_resumed"))
    started = time.monotonic()
    assert_succeeded(launch_demo(DDP_ON_CPU, pipeline, *RUN, *PIPELINE, *held_whole(hub), *extra,
                                 num_processes=processes))
    wall = time.monotonic() - started
    shutil.copytree(pipeline / "checkpoint-3", resumed / "checkpoint-3")
    assert_succeeded(launch_demo(DDP_ON_CPU, resumed, *RUN, *PIPELINE, *held_whole(hub), *extra,
                                 "--resume_from_checkpoint", "auto", num_processes=processes))
    return {"pipeline": pipeline, "resumed": resumed, "wall_seconds": wall}


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, two_replicas_twin):
    """PP 2 × DP 2 on 4 processes, beside its one-process twin, and resumed from its step-3 checkpoint."""
    hub, one = two_replicas_twin
    return {**launch_and_resume(tmp_path_factory, "pp2_dp2", hub, 4), "one": one}


@pytest.fixture(scope="module")
def three_d(tmp_path_factory, two_replicas_twin):
    """PP 2 × TP 2 × DP 2 on 8 processes (each stage's layers split over 2 ranks), beside the same one-process twin,
    and resumed from its step-3 checkpoint."""
    hub, one = two_replicas_twin
    return {**launch_and_resume(tmp_path_factory, "pp2_tp2_dp2", hub, 8, "--tensor_parallel_size", "2"), "one": one}


def assert_trains_as_one_process(runs, tmp_path, ranks_layers, **recorded):
    """Losses and gradient norms (clipping active) of the one-process twin; each rank's memory as planned; a resume
    from step 3 logging the uninterrupted losses; `finetune export` of checkpoint-6 giving the final save's logits
    and the one-process model's."""
    from transformers import AutoModelForCausalLM

    staged, one = history(runs["pipeline"]), history(runs["one"])
    assert [entry["step"] for entry in staged] == list(range(1, STEPS + 1))
    for a, b in zip(staged, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # over the stages, after the replicas' sum
        assert a["grad_norm"] > 1.0  # clipping active at every step
    effective = json.loads((runs["pipeline"] / outputs.EFFECTIVE_CONFIG).read_text())
    assert effective["pipeline"]["replicas"] == 2
    for key, value in recorded.items():
        assert effective["pipeline"][key] == value, key
    assert effective["values"]["world_size"]["value"] == len(ranks_layers)
    report = json.loads((runs["pipeline"] / outputs.MEMORY_REPORT).read_text())["ranks"]
    assert [rank["layers"] for rank in report] == ranks_layers
    for rank in report:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "recv_buffers_bytes"):
            assert rank["measured"][key] == rank["predicted"][key], (rank["rank"], key)
    resumed = history(runs["resumed"])
    assert [entry["loss"] for entry in resumed[3:]] == pytest.approx([entry["loss"] for entry in staged[3:]],
                                                                     abs=1e-6)
    assert main(["export", str(runs["pipeline"] / "checkpoint-6"), str(tmp_path / "exported")]) == 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    exported, final, alone = (AutoModelForCausalLM.from_pretrained(path)(ids).logits.detach()
                              for path in (tmp_path / "exported", runs["pipeline"], runs["one"]))
    # the stages' fp32 masters, not rounded to the bf16 the checkpoint's config names: the run's own final save
    assert exported.dtype == torch.float32 and torch.equal(exported, final)
    assert torch.allclose(exported, alone, atol=1e-4)
    return report


@pytest.mark.distributed
def test_two_replicas_of_two_stages_train_with_the_losses_of_one_process(replicated, tmp_path):
    # replica r: ranks 2r, 2r + 1
    assert_trains_as_one_process(replicated, tmp_path, [[0, 1], [1, 2], [0, 1], [1, 2]], tensor_parallel_size=1)


@pytest.mark.distributed
def test_two_replicas_of_two_stages_split_over_two_tp_ranks_train_with_the_losses_of_one_process(three_d, tmp_path):
    """PP 2 × TP 2 × DP 2: rank 4r + 2s + k is tensor rank k of stage s in replica r. Each rank holds its stage's
    layer matrices (and q, k, v biases) halved, the norms, embedding and head whole, as the plan says; the
    checkpoint's stage files hold the weights whole, as without TP. (On 2 CPU cores one launch of 8 processes takes
    35 to 50 s; the fixture's two launches 67 s, 86 s with the one-process twin.)"""
    from safetensors import safe_open

    stages = [[0, 1], [0, 1], [1, 2], [1, 2]]
    report = assert_trains_as_one_process(three_d, tmp_path, stages * 2, tensor_parallel_size=2)
    assert all(rank["predicted"]["estimate"]["setup"]["tensor_parallel_size"] == 2 for rank in report)
    whole = json.loads((three_d["one"] / outputs.MEMORY_REPORT).read_text())["ranks"][0]["measured"]["params_bytes"]
    assert sum(rank["measured"]["params_bytes"] for rank in report[:4]) > whole  # the ends are held on both TP ranks
    assert sum(rank["measured"]["params_bytes"] for rank in report[:4:2]) < whole  # the layers are split
    with safe_open(str(three_d["pipeline"] / "checkpoint-3" / "pipeline_stage_00.safetensors"), "pt") as stage:
        assert stage.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [64, 64]
        assert stage.get_slice("model.layers.0.mlp.down_proj.weight").get_shape() == [64, 128]


# LoRA (rank 16 on every linear of the blocks, no dropout: its masks are drawn per rank) on the bf16 checkpoint read
# in fp32, clipped at 0.5 (its gradient norms run 0.77 to 1.2 at 1.0)
LORA = ["--use_lora", "true", "--lora_dropout", "0", "--torch_dtype", "float32", "--max_grad_norm", "0.5"]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """LoRA on 2 stages (2 processes), resumed from its step-3 checkpoint, beside its one-process twin at the same
    global batch (4 micro-batches of 4)."""
    hub = save_hub_model(tmp_path_factory.mktemp("hub_lora"))
    one = tmp_path_factory.mktemp("lora_one")
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(one), *RUN, *held_whole(hub), *LORA]) == 0
    return {**launch_and_resume(tmp_path_factory, "pp2_lora", hub, 2, *LORA), "one": one, "hub": hub}


def adapted_logits(hub, adapter_dir) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir)(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])).logits.detach()


@pytest.mark.distributed
def test_lora_on_two_stages_trains_saves_resumes_and_exports_as_one_process(lora_runs, tmp_path):
    """The adapters' losses and gradient norms (clipping active) are one process's; each rank holds its stage's
    frozen base and trains its adapters, as planned; the final save is the adapter a one-process run writes, for the
    whole model; a resume from the stages' checkpoint logs the uninterrupted losses; `finetune export --merge-lora`
    of a stage checkpoint gives the one-process model merged."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    staged, one = history(lora_runs["pipeline"]), history(lora_runs["one"])
    assert [entry["step"] for entry in staged] == list(range(1, STEPS + 1))
    for a, b in zip(staged, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["grad_norm"] > 0.5  # clipping active at every step
    assert staged[-1]["loss"] < staged[0]["loss"]
    resumed = history(lora_runs["resumed"])
    assert [entry["loss"] for entry in resumed[3:]] == pytest.approx([entry["loss"] for entry in staged[3:]],
                                                                     abs=1e-6)
    report = json.loads((lora_runs["pipeline"] / outputs.MEMORY_REPORT).read_text())["ranks"]
    assert [rank["layers"] for rank in report] == [[0, 1], [1, 2]]
    for rank in report:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "recv_buffers_bytes"):
            assert rank["measured"][key] == rank["predicted"][key], (rank["rank"], key)
        # fp32 adapters of r 16 on one layer: q, o (64 → 64), k, v (64 → 32), gate, up, down (64 ↔ 128)
        assert rank["measured"]["grads_bytes"] == 4 * 16 * (2 * 128 + 2 * 96 + 3 * 192)
    with safe_open(str(lora_runs["pipeline"] / "checkpoint-3" / "pipeline_stage_01.safetensors"), "pt") as stage:
        assert stage.keys() and all(".lora_" in name and "layers.1." in name for name in stage.keys())
    final = lora_runs["pipeline"]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {path.name for path in final.iterdir()}
    assert not list(final.glob("model*.safetensors*"))
    assert torch.allclose(adapted_logits(lora_runs["hub"], final), adapted_logits(lora_runs["hub"], lora_runs["one"]),
                          atol=1e-4)
    for source, out in ((final / "checkpoint-6", "staged"), (lora_runs["one"] / "checkpoint-6", "alone")):
        assert main(["export", str(source), str(tmp_path / out), "--merge-lora"]) == 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    staged_merged, alone_merged = (AutoModelForCausalLM.from_pretrained(tmp_path / out)(ids).logits.detach()
                                   for out in ("staged", "alone"))
    assert not any((tmp_path / "staged").glob("adapter_*"))  # merged: a plain model
    assert torch.allclose(staged_merged, alone_merged, atol=1e-4)


@pytest.mark.distributed
def test_lora_on_two_replicas_of_two_stages_trains_as_one_process(lora_runs, tmp_path_factory):
    """PP 2 × DP 2 (4 processes): each stage's adapter gradients summed over its replicas before clipping, beside the
    one-process run at the global batch of both replicas (4 × 4 micro-batches × 2); each rank's ledger as planned."""
    hub = lora_runs["hub"]
    one, pipeline = tmp_path_factory.mktemp("lora_dp_one"), tmp_path_factory.mktemp("pp2_dp2_lora")
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(one), *RUN, *held_whole(hub), *LORA,
                 "--gradient_accumulation_steps", "8", "--save_strategy", "no"]) == 0
    assert_succeeded(launch_demo(DDP_ON_CPU, pipeline, *RUN, *PIPELINE, *held_whole(hub), *LORA, "--save_strategy",
                                 "no", num_processes=4))
    staged, alone = history(pipeline), history(one)
    assert [entry["step"] for entry in staged] == list(range(1, STEPS + 1))
    for a, b in zip(staged, alone, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["grad_norm"] > 0.5
    report = json.loads((pipeline / outputs.MEMORY_REPORT).read_text())["ranks"]
    assert [rank["layers"] for rank in report] == [[0, 1], [1, 2]] * 2
    for rank in report:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "recv_buffers_bytes"):
            assert rank["measured"][key] == rank["predicted"][key], (rank["rank"], key)
    assert (pipeline / "adapter_model.safetensors").is_file()


def test_lora_adapters_of_a_stage_built_on_the_meta_device_start_as_one_process(tmp_path):
    """peft draws every adapter on the CPU and drops the values on the meta device: each stage draws them again, so
    its adapters (bf16-rounded as peft casts them to a bf16 base) and its base weights are the whole model's."""
    from transformers import set_seed

    from finetune.models.loading import hold_trainable_parameters, load_model
    from finetune.models.lora import apply_lora
    from finetune.train.axes.pipeline.stages import build_stage, fill_from_checkpoint, initialise_adapters

    hub = save_hub_model(tmp_path / "hub")
    model_args = SimpleNamespace(model_name_or_path=str(hub), torch_dtype="auto", attn_implementation="sdpa",
                                 trust_remote_code=False)
    lora = SimpleNamespace(lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules=None, use_dora=False,
                           use_rslora=False, modules_to_save=None)

    def adapted(shapes_only: bool):
        set_seed(3)
        model = apply_lora(load_model(model_args, None, shapes_only=shapes_only), lora)
        hold_trainable_parameters(model, torch.float32)
        return model

    whole = dict(adapted(False).named_parameters())
    for index in (0, 1):
        model = adapted(True)
        stage = build_stage(model, index, 2)
        initialise_adapters(model, stage, 3)
        fill_from_checkpoint(stage, str(hub))
        assert len(stage.trained) == 14 and all(".lora_" in name for name, _ in stage.trained)
        for name, parameter in stage.named:
            assert parameter.dtype == whole[name].dtype and torch.equal(parameter, whole[name]), name
    with pytest.raises(RuntimeError, match="random generator was used"):
        model = adapted(True)
        torch.rand(1)
        initialise_adapters(model, build_stage(model, 0, 2), 3)


def evaluations(output_dir) -> list[tuple[int, float]]:
    return [(entry["step"], entry["eval_loss"]) for entry in
            json.loads((output_dir / "trainer_state.json").read_text())["log_history"] if "eval_loss" in entry]


@pytest.mark.distributed
def test_the_stages_evaluate_and_report_to_the_trackers_as_trainer_does(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    staged, one = evaluations(runs["1f1b"]), evaluations(runs["1f1b_one"])
    assert [step for step, _ in staged] == [step for step, _ in one] == [0, 3, 6, 6]  # start, every 3, final
    assert [loss for _, loss in staged] == pytest.approx([loss for _, loss in one], abs=1e-5)
    summary = json.loads((runs["1f1b"] / outputs.EVAL_RESULTS).read_text())
    assert summary["before"]["step"] == 0 and summary["after"]["eval_loss"] == pytest.approx(staged[-1][1])
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]
    [events] = (runs["1f1b"] / "runs").iterdir()  # rank 0's TensorBoard writer, as Trainer's
    tensorboard = EventAccumulator(str(events))
    tensorboard.Reload()
    logged = [entry["loss"] for entry in history(runs["1f1b"])]
    assert [event.value for event in tensorboard.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)
    assert [event.step for event in tensorboard.Scalars("eval/loss")] == [0, 3, 6, 6]
    # MLflow's run holds the effective configuration as its params, as a Trainer run's does (finetune.train.tracking)
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient((runs["1f1b"] / "mlruns").as_uri())
        (run,) = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    effective = json.loads((runs["1f1b"] / outputs.EFFECTIVE_CONFIG).read_text())["values"]
    for key in ("strategy", "global_batch_size", "learning_rate", "precision"):
        assert run.data.params[f"finetune/{key}"] == str(effective[key]["value"]), key
    assert [metric.value for metric in client.get_metric_history(run.info.run_id, "loss")] == \
        pytest.approx(logged, rel=1e-6)


@pytest.mark.distributed
def test_a_non_finite_loss_stops_every_stage_in_one_line(tmp_path):
    result = launch_demo(DDP_ON_CPU, tmp_path, *RUN, *PIPELINE, "--learning_rate", "1e8", "--max_grad_norm", "0",
                         "--save_strategy", "no")
    assert result.returncode != 0
    assert "finetune: error: training diverged at step" in result.output, result.output[-3000:]
    assert not (tmp_path / "model.safetensors.index.json").exists()  # nothing written as if it had trained


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_each_rank_holds_its_stage_as_predicted(runs, name):
    report = json.loads((runs[name] / outputs.MEMORY_REPORT).read_text())["ranks"]
    layers = 3 if name == "1f1b" else 2
    hidden = json.loads((runs[f"{name}_one"] / "config.json").read_text())["hidden_size"]
    assert [rank["layers"] for rank in report] == [[bound.start, bound.stop] for bound in stage_layers(layers, 2)]
    for rank in report:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "recv_buffers_bytes"):
            assert rank["measured"][key] == rank["predicted"][key], (rank["rank"], key)
        # torch's receive buffers: 4 micro-batches of 4 × the longest step's length hidden states in fp32, one
        # direction a stage; 1F1B pads each step to its longest row (a multiple of 8), GPipe's run every step to
        # max_seq_length (`pipeline_step_length: max_seq_length`)
        tokens = rank["tokens"]
        longest = tokens["longest_step"]
        assert rank["measured"]["recv_buffers_bytes"] == 4 * 4 * longest * hidden * 4
        if name == "1f1b":
            assert longest % 8 == 0 and longest < 64 and tokens["computed"] < STEPS * 16 * longest
        else:
            assert longest == 64 and tokens["computed"] == STEPS * 16 * 64
        assert tokens["rows"] < tokens["computed"]
    whole = sum(rank["measured"]["params_bytes"] for rank in report) // 4
    config = json.loads((runs[f"{name}_one"] / "config.json").read_text())
    embedding = config["vocab_size"] * config["hidden_size"]
    held = json.loads((runs[f"{name}_one"] / outputs.MEMORY_REPORT).read_text())["ranks"][0]["measured"]
    # the stages together hold the model once, and a tied embedding twice (first and last stage)
    assert whole == held["params_bytes"] // 4 + (embedding if config["tie_word_embeddings"] else 0)


@pytest.mark.distributed
def test_a_resume_from_the_stages_checkpoint_logs_the_uninterrupted_losses(runs):
    checkpoint = runs["1f1b"] / "checkpoint-3"
    assert (checkpoint / COMPLETE_MARKER).is_file()
    assert sorted(path.name for path in checkpoint.glob("pipeline_stage_*")) == [
        "pipeline_stage_00.safetensors", "pipeline_stage_00_state.pt", "pipeline_stage_01.safetensors",
        "pipeline_stage_01_state.pt"]
    assert_succeeded(runs["resume_output"])
    assert f"resuming from {runs['resumed'] / 'checkpoint-3'}" in runs["resume_output"].output
    whole, resumed = history(runs["1f1b"]), history(runs["resumed"])
    assert [entry["step"] for entry in resumed] == list(range(1, STEPS + 1))  # steps 1-3 from the checkpoint
    for a, b in zip(whole[3:], resumed[3:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


@pytest.mark.distributed
def test_export_consolidates_the_stages_into_the_model_one_process_trains(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    assert main(["export", str(runs["1f1b"] / "checkpoint-6"), str(tmp_path / "exported")]) == 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    logits = {name: AutoModelForCausalLM.from_pretrained(path)(ids).logits.detach()
              for name, path in (("exported", tmp_path / "exported"), ("final", runs["1f1b"]),
                                 ("one", runs["1f1b_one"]))}
    assert torch.equal(logits["exported"], logits["final"])  # the run's own consolidation at its end
    assert torch.allclose(logits["exported"], logits["one"], atol=1e-4)
    assert not (runs["1f1b"] / "pipeline_stages").exists()


def test_what_the_pipeline_loop_does_not_run_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = SimpleNamespace(packing=False, padding_free=False, streaming=False)
    ddp = Strategy("ddp")
    asked = {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 4}
    assert check_pipeline(dict(asked), data, False, "sft", Parallelism(), ddp).label == "pp2"
    handed = check_pipeline({**asked, "bf16": True, "pipeline_hand_off_dtype": "BF16"}, data, False, "sft",
                            Parallelism(), ddp)
    assert handed.axis == PipelineLayout(2, "1f1b", "bf16")
    lora = SimpleNamespace(use_lora=True, use_qlora=False, use_dora=False, modules_to_save=None)
    assert check_pipeline(dict(asked), data, True, "sft", Parallelism(), ddp, lora=lora).label == "pp2"
    refusals = [
        ({**asked, "pipeline_parallel_size": 4}, {}, "launch has 2 process.*launch a multiple of 4"),
        (asked, {"strategy": Strategy("deepspeed", zero_stage=2)}, "not under a DeepSpeed or FSDP config"),
        (asked, {"lora": SimpleNamespace(**{**vars(lora), "use_qlora": True})}, "with QLoRA \\(its 4-bit base"),
        (asked, {"lora": SimpleNamespace(**{**vars(lora), "use_dora": True})}, "with `use_dora`"),
        (asked, {"lora": SimpleNamespace(**{**vars(lora), "modules_to_save": ["lm_head"]})}, "with `modules_to_save`"),
        (asked, {"method": "dpo"}, "`method: dpo`"),
        (asked, {"data": SimpleNamespace(packing=True, padding_free=False, streaming=False)}, "packed"),
        ({**asked, "gradient_accumulation_steps": 1}, {}, "needs at least 2 micro-batches"),
        ({**asked, "pipeline_schedule": "interleaved"}, {}, "not one of gpipe, 1f1b"),
        ({**asked, "pipeline_step_length": "shortest"}, {}, "`pipeline_step_length: shortest` is not one of longest, "
                                                             "max_seq_length"),
        ({**asked, "pipeline_hand_off_dtype": "fp8"}, {}, "`pipeline_hand_off_dtype: fp8` is not one of fp32, bf16"),
        ({**asked, "pipeline_hand_off_dtype": "bf16"}, {}, "computing in fp32 would not do: set `bf16: true`"),
        (asked, {"parallelism": Parallelism(sequence_parallel_size=2)}, "sequence_parallel_size 2 beside it"),
        (asked, {"parallelism": Parallelism(context_parallel_size=2)}, "context_parallel_size 2 beside it"),
        (asked, {"parallelism": Parallelism(tensor_parallel_size=2)},
         "launch has 2 process.*multiple of 2 × tensor_parallel_size 2 = 4"),
        ({**asked, "torch_compile": True}, {}, "`torch_compile` \\(its stages run eagerly\\)"),
        ({**asked, "save_on_each_node": True}, {}, "`save_on_each_node`.*nodes must share"),
    ]
    for inputs, changes, message in refusals:
        call = {"data": data, "method": "sft", "parallelism": Parallelism(), "strategy": ddp, "lora": None,
                **changes}
        with pytest.raises(RecipeError, match=message):
            check_pipeline(dict(inputs), call["data"], call["lora"] is not None, call["method"],
                           call["parallelism"], call["strategy"], lora=call["lora"])
    monkeypatch.setenv("WORLD_SIZE", "8")  # 2 replicas of 2 stages, each split over 2 TP ranks
    split = check_pipeline(dict(asked), data, False, "sft", Parallelism(tensor_parallel_size=2), ddp)
    assert (split.kind, split.axis) == ("pipeline", PipelineLayout(2, "1f1b", tensor=2))
    with pytest.raises(RecipeError, match="with LoRA and `tensor_parallel_size`"):
        check_pipeline(dict(asked), data, True, "sft", Parallelism(tensor_parallel_size=2), ddp, lora=lora)


def test_a_tp_size_the_stages_cannot_split_is_refused_by_name(tmp_path):
    """Beside a pipeline the TP size is checked against the model before any process group: whole heads and key/value
    heads on each rank, and an even cut of the MLP's width; what is accepted loads nothing sharded."""
    from finetune.recipe.preflight import check_parallelism
    from finetune.train.axes.pipeline import PipelineArguments, PipelineParallelism
    from finetune.train.axes.tensor import TensorArguments, TensorParallelism

    model = SimpleNamespace(model_name_or_path=str(save_hub_model(tmp_path / "hub", num_attention_heads=4,
                                                                  num_key_value_heads=4, intermediate_size=130)))
    ddp = Strategy("ddp")
    sections = SimpleNamespace(model=model, axes=(PipelineParallelism(PipelineArguments(pipeline_parallel_size=2)),))
    for tensor, message in ((3, "does not divide the model's num_attention_heads \\(4\\)"),
                            (4, "does not divide the model's MLP width \\(intermediate_size 130\\)")):
        parallelism = check_parallelism({"tensor_parallel_size": tensor}, model, inside_stages=True)
        with pytest.raises(RecipeError, match=f"`tensor_parallel_size: {tensor}` {message}"):
            TensorParallelism(TensorArguments(tensor)).check(sections, parallelism, ddp)
    parallelism = check_parallelism({"tensor_parallel_size": 2}, model, inside_stages=True)
    assert parallelism.size("tensor_parallel_size") == 2 and parallelism.dp_shard_size == 1
    assert TensorParallelism(TensorArguments(2)).check(sections, parallelism, ddp) == ddp  # nothing loads sharded


def test_the_estimator_gives_each_stage_its_layers_and_ends():
    shape = model_shape("llama-3-8b")  # 32 layers, untied
    stages = [pipeline_stage_elements(shape, Setup(strategy="pipeline", axis=PipelineLayout(4), rank=rank))
              for rank in range(4)]
    assert sum(stages) == shape.num_parameters
    embedding = shape.vocab_size * shape.hidden_size
    assert stages[1] == stages[2] == 8 * shape.layer_parameters
    assert stages[0] == stages[1] + embedding
    one = estimate(shape, Setup(strategy="pipeline", axis=PipelineLayout(4), rank=1, gradient_accumulation_steps=8,
                                sequence_length=4096))
    gpipe = estimate(shape, Setup(strategy="pipeline", axis=PipelineLayout(4, "gpipe"), rank=1,
                                  gradient_accumulation_steps=8, sequence_length=4096))
    # 8 micro-batches' activations in flight, not 3; the weights' bf16 casts and the receive buffers the same
    setup = Setup(strategy="pipeline", axis=PipelineLayout(4), rank=1, sequence_length=4096)
    casts = layer_weight_cast_bytes(shape, setup)
    assert casts == 2 * shape.layer_parameters - 2 * 2 * shape.hidden_size  # every weight but the 2 norms', in bf16
    per_micro_batch = 8 * (saved_per_layer_bytes(shape, setup) - casts)  # stage 1 holds 8 layers
    assert gpipe.activations_bytes - one.activations_bytes == pytest.approx((8 - 3) * per_micro_batch)


def test_the_estimator_gives_each_lora_stage_its_frozen_base_and_its_layers_adapters():
    shape = model_shape("llama-3-8b")  # 32 layers, 7 linears each
    setups = [Setup(strategy="pipeline", axis=PipelineLayout(4), rank=rank, lora_rank=16) for rank in range(4)]
    adapters = [pipeline_stage_adapters(shape, setup) for setup in setups]
    assert sum(adapters) == shape.lora_parameters(16) and adapters[1] == adapters[0]  # 8 layers each
    stage = estimate(shape, setups[1])
    assert stage.params_bytes == 2 * pipeline_stage_elements(shape, setups[1]) + 4 * adapters[1]  # bf16 base, fp32
    assert (stage.grads_bytes, stage.optimizer_bytes) == (4 * adapters[1], 8 * adapters[1])  # adapters; Adam's 2
    full = estimate(shape, replace(setups[1], lora_rank=0))
    assert stage.loaded_rank_bytes[1] < full.loaded_rank_bytes[1]  # the base is not cast to fp32 masters


def test_the_pipeline_holds_one_cast_of_each_weight_for_every_micro_batch_in_flight():
    """The loop runs a step's schedule inside one autocast context, whose cache keeps one bf16 cast of each fp32
    weight for every micro-batch's backward: measured with 4 forwards' graphs held on fake tensors at Llama-3-8B
    width (512 tokens), a layer saves 888 MiB, as `pipeline_layer_bytes` counts, not 4 × 534 MiB."""
    from finetune.memory.saved import measure

    shape = model_shape("llama-3-8b")
    measured = {}
    for precision in ("bf16", "fp32"):  # fp32: no casts, so 4 micro-batches hold 4 × one's bytes
        setup = Setup(strategy="pipeline", num_gpus=2, axis=PipelineLayout(2), precision=precision,
                      sequence_length=512, gradient_accumulation_steps=4)
        measured[precision] = measure("llama-3-8b", setup, loss=False, micro_batches=4).per_layer
        assert pipeline_layer_bytes(shape, setup, 4) == pytest.approx(measured[precision], rel=0.01), precision
    one = measure("llama-3-8b", replace(setup, precision="bf16"), loss=False).per_layer
    assert measured["bf16"] < 0.45 * 4 * one  # 888 MiB against 4 × 534


def test_the_plans_pipeline_row_plans_max_seq_length_without_checkpointing_and_the_steps_padding(capsys):
    """The loop pads each step to its longest row and refuses gradient checkpointing: the PP row plans a step at
    `max_seq_length` (the longest it can be) without checkpointing, whatever the request says, and says what the
    padding costs on the data's own lengths: the expected longest of a step's rows over their mean."""
    from finetune.plan.decision_tree import PlanRequest, make_plan

    request = dict(model="llama-3-8b", gpus=8, gpu_memory_gib=80, sequence_length=4096, global_batch_size=32)
    plain = make_plan(PlanRequest(**request))
    even = make_plan(PlanRequest(**request, gradient_checkpointing=True, token_lengths=[1024] * 100))
    mixed = make_plan(PlanRequest(**request, token_lengths=[100] * 90 + [1000] * 10))
    rows = [next(row for row in plan["axes"] if row["key"] == "pipeline") for plan in (plain, even, mixed)]
    assert rows[0]["estimate"].activations_bytes == rows[1]["estimate"].activations_bytes
    setup = rows[1]["estimate"].setup
    assert setup.sequence_length == 4096 and not setup.gradient_checkpointing
    assert rows[1]["padding_factor"] == pytest.approx(1.0)  # every row 1,024 tokens: no padding
    # a step of n rows is 1,000 long unless all n are 100 (padded to 104): (104·0.9ⁿ + 1000·(1 − 0.9ⁿ)) / 190
    n = setup.micro_batch_size * setup.gradient_accumulation_steps
    expected = (104 * 0.9 ** n + 1000 * (1 - 0.9 ** n)) / 190
    assert rows[2]["padding_factor"] == pytest.approx(expected) and expected > 4
    trainer = (104 * 0.9 ** setup.micro_batch_size + 1000 * (1 - 0.9 ** setup.micro_batch_size)) / 190
    assert f"padded to its longest: {expected:.2f}× the data's tokens" in rows[2]["cost"]
    assert f"(Trainer pads each micro-batch of {setup.micro_batch_size}: {trainer:.2f}×)" in rows[2]["cost"]
    assert "padding_factor" not in rows[0]  # no data: nothing to say


def test_a_decoder_the_stages_cannot_rerun_is_refused_by_name():
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.axes.pipeline.stages import build_stage

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 128}
    gemma = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma", **small))
    with pytest.raises(RecipeError, match="this model is `gemma`, whose forward does more"):
        build_stage(gemma, 0, 2)
    qwen3 = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **small))
    assert len(build_stage(qwen3, 1, 2).module.layers) == 1
    mixed = AutoConfig.for_model("qwen3", **small, layer_types=["sliding_attention", "full_attention"],
                                 use_sliding_window=True, sliding_window=8)
    with pytest.raises(RecipeError, match="mixes full_attention, sliding_attention layers"):
        build_stage(AutoModelForCausalLM.from_config(mixed), 0, 2)


@pytest.mark.parametrize("tied", [True, False])
def test_each_stage_reads_its_own_tensors_from_the_checkpoint_held_in_fp32(tmp_path, tied):
    """A checkpoint's stages are built on the meta device and filled by name from its safetensors (a tied head is
    the embedding the last stage reads under its own name); the other stages' weights stay unread."""
    from transformers import AutoModelForCausalLM

    from finetune.models.loading import hold_trainable_parameters, load_model
    from finetune.train.axes.pipeline.stages import cut_stage, loads_stage_only

    hub = save_hub_model(tmp_path, tie_word_embeddings=tied, num_hidden_layers=3)
    whole = dict(AutoModelForCausalLM.from_pretrained(hub, dtype="auto").named_parameters())
    model_args = SimpleNamespace(model_name_or_path=str(hub), torch_dtype="auto", attn_implementation=None,
                                 trust_remote_code=False)
    recipe = SimpleNamespace(model=model_args, data=SimpleNamespace(max_seq_length=64),
                             strategy=Strategy("pipeline", axis=PipelineLayout(2)))
    assert loads_stage_only(model_args)
    held = []
    for rank in (0, 1):
        model = load_model(model_args, None, shapes_only=True)
        hold_trainable_parameters(model, torch.float32)  # as SFT holds a full fine-tune's weights
        stage = cut_stage(recipe, model, rank)
        assert stage.shape.num_layers == 3 and list(stage.layers) == [[0, 1], [2]][rank]
        for name, parameter in stage.named:
            assert parameter.dtype == torch.float32 and torch.equal(parameter, whole[name].float()), name
        assert all(parameter.is_meta or parameter.numel() == 0 for parameter in model.parameters()
                   if id(parameter) not in {id(p) for _, p in stage.named})  # the other stage: never read
        held.append({name for name, _ in stage.named})
    assert held[0] | held[1] == set(whole) and (held[0] & held[1]) == ({"model.embed_tokens.weight"} if tied else set())
    if tied:
        assert stage.module.lm_head.weight is stage.tied


def test_a_resume_under_another_stage_count_or_tp_split_is_refused_by_name(tmp_path):
    """Each stage's optimizer file lists the moments in the order its TP split groups the parameters: a checkpoint
    resumes only under its own stages and split (a whole-model export starts afresh under any)."""
    from finetune.train.axes.pipeline.loop import PipelineTrainer

    (tmp_path / COMPLETE_MARKER).write_text(json.dumps({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}))
    for stages, tensor in ((2, 1), (4, 2)):
        trainer = SimpleNamespace(stage=SimpleNamespace(count=stages), tensor_parallel=tensor)
        with pytest.raises(RecipeError, match="holds 2 stage.* split over 2 TP.*`tensor_parallel_size: 2`"):
            PipelineTrainer.check_resumed_layout(trainer, tmp_path)
    PipelineTrainer.check_resumed_layout(SimpleNamespace(stage=SimpleNamespace(count=2), tensor_parallel=2), tmp_path)


def test_a_tp_plan_style_the_stages_do_not_run_is_refused_by_name():
    """The stages split layers with torch's column- and row-parallel linears (and keep Qwen3's q/k norms whole, their
    gradients summed); another style of the model's TP plan is named, before any weight is split."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.axes.pipeline.stages import build_stage, split_layers

    config = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, vocab_size=128)
    stage = build_stage(AutoModelForCausalLM.from_config(config), 0, 2)
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.gate_proj": "local_colwise"}
    with pytest.raises(RecipeError, match="splits `layers.\\*.mlp.gate_proj` as `local_colwise`"):
        split_layers(stage, None, config)


def test_a_pipeline_checkpoint_is_checked_and_described_from_its_marker(tmp_path):
    """The checkpoints layer names no axis: a pipeline's marker lists the files a resume needs (each stage's weights
    and optimizer), a missing one is named, a listed path outside the folder is never looked for, and a layout
    message gives the sizes it records."""
    from finetune.checkpoints.complete import describe_layout, files_a_resume_needs, mark_complete, resume_damage
    from finetune.checkpoints.pipeline_stages import stage_checkpoint_files

    layout = {"world_size": 8, "strategy": "pipeline", "zero_stage": None, "pipeline_parallel_size": 2,
              "tensor_parallel_size": 2, "sequences_per_step": 8, "files": stage_checkpoint_files(2)}
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    mark_complete(folder, 3, {**layout, "files": [*layout["files"], "../outside.pt"]}, {})
    assert files_a_resume_needs(folder) == [["trainer_state.json"], ["pipeline_stage_00.safetensors"],
                                            ["pipeline_stage_00_state.pt"], ["pipeline_stage_01.safetensors"],
                                            ["pipeline_stage_01_state.pt"]]
    (folder / "trainer_state.json").write_text("{}")
    assert "pipeline_stage_00.safetensors" in resume_damage(folder)
    assert describe_layout(layout) == "pipeline (pipeline_parallel_size 2, tensor_parallel_size 2) on 8 rank(s)"


@pytest.mark.distributed
def test_a_bf16_hand_off_trains_as_one_bf16_process_with_half_the_receive_buffers(tmp_path):
    """`pipeline_hand_off_dtype: bf16` under bf16 mixed precision: the hidden states and their gradients pass between
    the stages in bf16, so torch's receive buffers hold half the bytes (as the estimator predicts), and the run
    trains as one bf16 process does, within the rounding of one hand-off a step."""
    staged, one = tmp_path / "staged", tmp_path / "one"
    bf16 = ["--bf16", "true", "--save_strategy", "no"]
    assert_succeeded(launch_demo(DDP_ON_CPU, staged, *RUN, *PIPELINE, *bf16, "--pipeline_hand_off_dtype", "bf16"))
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(one), *RUN, *bf16]) == 0
    losses, twin = [entry["loss"] for entry in history(staged)], [entry["loss"] for entry in history(one)]
    # measured here: 1.3e-4 at worst, and 8.4e-5 with an fp32 hand-off (bf16 autocast over rows padded otherwise)
    assert losses == pytest.approx(twin, rel=1e-3) and losses[-1] < losses[0] - 0.5
    hidden = json.loads((one / "config.json").read_text())["hidden_size"]
    for rank in json.loads((staged / outputs.MEMORY_REPORT).read_text())["ranks"]:
        measured, predicted = rank["measured"]["recv_buffers_bytes"], rank["predicted"]["recv_buffers_bytes"]
        assert measured == predicted == 4 * 4 * rank["tokens"]["longest_step"] * hidden * 2  # bf16: 2 bytes
    effective = json.loads((staged / outputs.EFFECTIVE_CONFIG).read_text())
    assert effective["pipeline"]["hand_off_dtype"] == "bf16"
