"""Two 2-process runs shared by several assertions: under DDP, `finetune train` reading the cache `finetune preprocess`
wrote, with DoRA, rsLoRA and `modules_to_save`, reporting to TensorBoard (the default); and the same adapters under
DeepSpeed ZeRO-3."""

import json

import pytest
import torch
from safetensors.torch import load_file
from support import CPU_LAUNCHES, DEMO_SHORT_RUN, assert_succeeded, finetune_command, launch_demo, run

from finetune import presets
from finetune.checkpoints.export import load_for_export
from finetune.memory.estimate import Setup, lora_trainable_parameters
from finetune.memory.shapes import model_shape

pytestmark = pytest.mark.distributed

ADAPTERS = ["--use_lora", "true", "--lora_r", "8", "--use_dora", "true", "--use_rslora", "true",
            "--modules_to_save", "lm_head", "--learning_rate", "1e-2", "--max_steps", "6", "--logging_steps", "2"]
STRATEGIES = ["ddp", "zero3"]


@pytest.fixture(scope="module")
def adapter_runs(tmp_path_factory):
    runs = {}
    for name in STRATEGIES:
        output_dir = tmp_path_factory.mktemp(f"adapters_{name}")
        if name == "ddp":  # tokenized once, ahead of the launch, with the keys the run will use
            assert_succeeded(run(finetune_command("preprocess", "recipes/demo.yaml", "--output_dir", str(output_dir),
                                                  *DEMO_SHORT_RUN, *ADAPTERS), timeout=300))
        result = launch_demo(CPU_LAUNCHES[name], output_dir, *ADAPTERS)
        assert_succeeded(result)
        runs[name] = {"dir": output_dir, "output": result.output}
    return runs


def read(output_dir, name):
    return json.loads((output_dir / name).read_text())


def logged(output_dir, key):
    history = read(output_dir, "trainer_state.json")["log_history"]
    return [(entry["step"], entry[key]) for entry in history if key in entry]


def test_both_ranks_read_the_preprocessed_data_and_neither_tokenizes(adapter_runs):
    ddp = adapter_runs["ddp"]
    summary = read(ddp["dir"], "data_summary.json")
    assert summary["preprocessed"]["dir"] == str(ddp["dir"] / "preprocessed")
    assert summary["train_from_cache_by_rank"] == [True, True]
    assert "reading the preprocessed data in" in ddp["output"] and "on every rank: no tokenizing" in ddp["output"]
    assert "tokenizing train" not in ddp["output"]  # the progress bar of tokenizing, on any rank


def test_the_tensorboard_event_file_holds_loss_learning_rate_memory_and_throughput(adapter_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output_dir = adapter_runs["ddp"]["dir"]
    (run_dir,) = (output_dir / "runs").iterdir()  # rank 0 writes, once
    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for tag, key in (("train/loss", "loss"), ("train/learning_rate", "learning_rate")):
        expected = logged(output_dir, key)  # event files hold float32
        assert [step for step, _ in scalars[tag]] == [step for step, _ in expected] == [2, 4, 6]
        assert [value for _, value in scalars[tag]] == pytest.approx([value for _, value in expected], rel=1e-6)
    measured = read(output_dir, "memory_report.json")["ranks"][0]["measured"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert scalars[f"train/memory/{key}"] == [(2, measured[key])]
    tokens_per_second = scalars["train/throughput/tokens_per_second"]
    assert [step for step, _ in tokens_per_second] == [2, 4, 6] and all(value > 0 for _, value in tokens_per_second)
    assert "train/throughput/step_seconds" in scalars


@pytest.mark.parametrize("name", STRATEGIES)
def test_dora_rslora_and_saved_modules_train_with_the_base_frozen_and_the_ledger_as_predicted(adapter_runs, name):
    output_dir = adapter_runs[name]["dir"]
    config = read(output_dir, "adapter_config.json")
    assert config["use_dora"] and config["use_rslora"] and config["modules_to_save"]
    assert read(output_dir, "eval_results.json")["frozen_weights_unchanged"] is True
    losses = [loss for _, loss in logged(output_dir, "loss")]
    assert len(losses) == 3 and losses[-1] < losses[0]

    # The trained parts moved from where peft starts them: DoRA's magnitudes from the base rows' norms, the saved
    # head from the base head (tied to the embedding in the tiny model).
    saved = load_file(output_dir / "adapter_model.safetensors")
    base = presets.build_model(presets.build_tokenizer(), seed=0)
    magnitude = saved["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"]
    initial = torch.linalg.norm(base.model.layers[0].self_attn.q_proj.weight, dim=1)
    assert magnitude.shape == initial.shape and not torch.allclose(magnitude, initial, atol=1e-4)
    assert not torch.allclose(saved["base_model.model.lm_head.weight"], base.lm_head.weight, atol=1e-4)

    # Each rank held what the estimator predicts, and the planner's count of trainable parameters is the model's.
    for rank in read(output_dir, "memory_report.json")["ranks"]:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert rank["measured"][key] == rank["predicted"][key], (rank["rank"], key)
        trainable = rank["predicted"]["estimate"]["trainable_parameters"]
    planned = Setup(lora_rank=8, dora=True, lora_modules_to_save=("lm_head",))
    assert lora_trainable_parameters(model_shape(presets.TINY_MODEL), planned) == trainable


def test_a_dora_adapter_merged_for_inference_gives_the_adapters_logits(adapter_runs):
    output_dir = adapter_runs["ddp"]["dir"]
    adapted, _ = load_for_export(output_dir, merge_lora=False, base_model=None, seed=0)
    merged, _ = load_for_export(output_dir, merge_lora=True, base_model=None, seed=0)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        assert torch.allclose(adapted.eval()(ids).logits, merged.eval()(ids).logits, atol=1e-4)
    base = presets.build_model(presets.build_tokenizer(), seed=0).eval()
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, merged(ids).logits, atol=1e-3)
