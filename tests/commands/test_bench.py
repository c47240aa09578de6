"""`finetune bench` end to end on a short run of two variants: results read the same way for the plain
baseline and the toolkit, ratios to the baseline, the results file; and its comparisons on given numbers."""

import json

from support import finetune_command, run

from finetune.commands.bench import comparisons


def test_bench_runs_the_baseline_and_a_variant_and_writes_the_results(tmp_path):
    result = run(finetune_command("bench", "--cpu", "--variants", "plain_trainer", "packing", "liger", "--steps", "3",
                                  "--repeats", "1", "--results-dir", str(tmp_path)), timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    record = json.loads(next(tmp_path.glob("cpu-*.json")).read_text())
    assert record["settings"] == {"model": "tiny", "max_seq_length": 256, "micro_batch": 16, "steps": 3, "bf16": False}
    plain, packing = record["variants"]["plain_trainer"], record["variants"]["packing"]
    assert plain["vs_baseline"] == 1.0 and plain["tokens"] > 0 and plain["peak_bytes"] > 0
    assert packing["vs_baseline"] == packing["tokens_per_second"] / plain["tokens_per_second"]
    assert packing["tokens"] > 2 * plain["tokens"]  # 3 steps of 16 packed rows of 256 hold more than 48 examples
    assert record["variants"]["liger"]["skipped"].startswith("Liger kernels are Triton (CUDA)")
    assert "useful tokens/s" in result.output and "× baseline" in result.output


def test_comparisons_give_scaling_efficiency_and_callback_overhead():
    rows = {"plain_trainer": {"tokens_per_second": 100.0}, "finetune": {"tokens_per_second": 120.0},
            "finetune_no_callbacks": {"tokens_per_second": 123.0}, "ddp": {"tokens_per_second": 228.0},
            "liger": {"skipped": "no CUDA"}}
    result = comparisons(rows, processes=2)
    assert result["scaling"] == {"processes": 2, "speedup": 1.9, "efficiency": 0.95}
    assert abs(result["callback_overhead"] - 0.025) < 1e-12
    assert rows["ddp"]["vs_baseline"] == 2.28 and rows["liger"]["vs_baseline"] is None
