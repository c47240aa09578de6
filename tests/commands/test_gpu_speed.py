"""benchmarks/gpu_speed.py (the bench's GPU speed check) proven on CPU processes: `--cpu` runs the same code at the
tiny width and writes the JSON its docstring documents; without CUDA and without `--cpu` it says what to do."""

import importlib.util
import json
import sys

import pytest
from support import PROJECT_ROOT, model_shape, run

CPU_ROWS = ["plain_trainer", "finetune", "full_logits", "liger", "compile"]


def documented_keys() -> str:
    spec = importlib.util.spec_from_file_location("gpu_speed", PROJECT_ROOT / "benchmarks" / "gpu_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.__doc__


# No catalogue row serves: the script launches its own rows (three real training processes, one after another).
@pytest.mark.distributed
def test_the_cpu_path_runs_its_rows_and_writes_the_documented_json(tmp_path):
    result = run([sys.executable, "benchmarks/gpu_speed.py", "--cpu", "--rows", *CPU_ROWS, "--results-dir",
                  str(tmp_path)], timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    record = json.loads(next(tmp_path.glob("gpu-speed-cpu-*.json")).read_text())
    documented = documented_keys()
    assert set(record) == {"date", "device", "device_name", "peak_tflops", "command", "versions", "settings",
                           "wall_seconds", "models"}
    for key in [*record, *record["settings"], *record["versions"]]:
        assert f'"{key}"' in documented, key
    assert record["command"] == f"python benchmarks/gpu_speed.py --cpu --rows {' '.join(CPU_ROWS)}"  # no machine path
    assert record["settings"] == {"max_seq_length": 128, "micro_batch": 4, "steps": 12, "examples": 192, "bf16": False}
    assert record["device_name"] == "cpu" and record["peak_tflops"] is None and record["versions"]["torch"]
    assert list(record["models"]) == ["tiny"]
    tiny = model_shape("tiny")
    assert record["models"]["tiny"]["shape"] == {"num_parameters": tiny.num_parameters, "hidden_size": tiny.hidden_size,
                                                 "num_layers": tiny.num_layers, "vocab_size": tiny.vocab_size}
    rows = record["models"]["tiny"]["rows"]
    assert list(rows) == CPU_ROWS
    for name in ("plain_trainer", "finetune", "full_logits"):
        row = rows[name]
        for key in row:
            assert f'"{key}"' in documented, key
        assert row["status"] == "ran" and "reason" not in row, name
        assert row["tokens_per_second"] > 0 and row["steady_tokens_per_second"] > 0 and row["tflops_per_device"] > 0
        assert row["mfu"] is None  # no peak is known for a CPU
        assert row["train_loss"] > 0 and row["wall_seconds"] > 0
        # the resident set on a CPU, no reserved pool, so no ratio to the plan's device bytes
        assert row["peak_kind"] == "cpu_max_rss" and row["peak_allocated_bytes"] > 0
        assert row["peak_reserved_bytes"] is None and row["allocated_over_predicted"] is None
        assert row["predicted_peak_bytes"] == row["predicted_parts"]["total_bytes"] > 0
        assert row["predicted_parts"]["params_bytes"] == 4 * tiny.num_parameters  # fp32 on a CPU
    # The baseline is planned by the script, finetune's rows by their own memory report; the full logits cost memory
    # the fused head does not hold.
    assert rows["plain_trainer"]["prediction"] == "estimate"
    assert rows["finetune"]["prediction"] == rows["full_logits"]["prediction"] == "memory_report"
    assert rows["full_logits"]["predicted_peak_bytes"] > rows["finetune"]["predicted_peak_bytes"]
    assert "the full logits held" in rows["full_logits"]["plan_assumes"]
    assert "TRL's fused LM head (no logits held)" in rows["finetune"]["plan_assumes"]
    assert rows["liger"] == {"what": "finetune train, Liger kernels", "status": "skipped",
                             "reason": "Liger kernels are Triton (CUDA); no CUDA here"}
    assert rows["compile"]["status"] == "skipped" and rows["compile"]["reason"].endswith("; no CUDA here")


def test_the_gpu_speed_check_without_cuda_asks_for_cpu(tmp_path):
    result = run([sys.executable, "benchmarks/gpu_speed.py", "--results-dir", str(tmp_path)], timeout=120)
    assert result.returncode == 2 and "no CUDA GPU visible; `--cpu` runs the same rows" in result.output
    assert not any(tmp_path.iterdir())
