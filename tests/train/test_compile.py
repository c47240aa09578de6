"""`torch_compile: true` through Trainer and Accelerate (inductor compiles for the CPU too): the run trains with
eager's losses, and compile.json counts the graphs torch.compile built and names each graph break by its reason;
the pipeline loop, which would ignore the key, refuses it (tests/train/test_pipeline.py)."""

import json

import pytest
import torch

from finetune import outputs
from finetune.cli import main
from finetune.train.compiled import compile_report, describe

# Packed rows: every micro-batch has the same shape, so the model compiles once
RUN = ["--packing", "true", "--max_steps", "3", "--logging_steps", "1", "--eval_on_start", "false",
       "--generation_eval_samples", "0", "--report_to", "none", "--save_strategy", "no", "--max_eval_samples", "8"]


def losses(output_dir) -> list[float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry] + \
        [entry["eval_loss"] for entry in history if "eval_loss" in entry]


def test_a_compiled_run_trains_with_eager_losses_and_reports_its_graphs(tmp_path):
    compiled, eager = tmp_path / "compiled", tmp_path / "eager"
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(compiled), *RUN, "--torch_compile", "true"]) == 0
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(eager), *RUN]) == 0
    assert len(losses(compiled)) == 4  # 3 steps and the final evaluation
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)  # inductor's kernels round differently
    report = outputs.read_record(compiled, outputs.COMPILE)
    assert report["backend"] == "inductor" and report["mode"] == "default"
    assert report["graphs"] >= 1 and report["frames_compiled"] >= 1 and report["compile_seconds"] > 0
    assert report["graph_breaks"] == sum(report["graph_break_reasons"].values())
    assert not (eager / outputs.COMPILE).exists()
    effective = outputs.read_record(compiled, outputs.EFFECTIVE_CONFIG)["values"]
    assert effective["torch_compile"] == {"value": "inductor, mode default", "source": "command line"}


def test_a_graph_break_is_counted_and_named_by_its_reason():
    from torch._dynamo.utils import counters

    counters.clear()
    layer = torch.nn.Linear(4, 4)

    def step(x):
        hidden = layer(x)
        print("a host call dynamo cannot trace")  # splits the function into two graphs
        return hidden.relu().sum()

    torch.compile(step, backend="eager")(torch.randn(2, 4))
    report = compile_report(None, None)
    assert report["graph_breaks"] == 1 and report["graphs"] == 2
    [(reason, count)] = report["graph_break_reasons"].items()
    assert count == 1 and reason.startswith("Failed to trace builtin operator: ") and "`print`" in reason
    assert "1 graph break(s)" in describe(report) and "1 × Failed to trace builtin operator" in describe(report)
