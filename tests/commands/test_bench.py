"""`finetune bench` end to end on a short run of two variants: results read the same way for the plain
baseline and the toolkit, ratios to the baseline, the results file; and its comparisons on given numbers."""

import json

from support import finetune_command, run

from finetune.bench.harness import variants
from finetune.commands.bench import chosen_variants, comparisons


def test_bench_runs_the_baseline_and_a_variant_and_writes_the_results(tmp_path):
    result = run(finetune_command("bench", "--cpu", "--variants", "plain_trainer", "packing", "trl_sft_packed", "liger",
                                  "--steps", "3", "--repeats", "1", "--results-dir", str(tmp_path)), timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    record = json.loads(next(tmp_path.glob("cpu-*.json")).read_text())
    assert record["settings"] == {"model": "tiny", "max_seq_length": 256, "micro_batch": 16, "steps": 3, "bf16": False}
    plain, packing = record["variants"]["plain_trainer"], record["variants"]["packing"]
    assert plain["vs_baseline"] == 1.0 and plain["tokens"] > 0 and plain["peak_bytes"] > 0
    assert packing["vs_baseline"] == packing["tokens_per_second"] / plain["tokens_per_second"]
    assert packing["tokens"] > 2 * plain["tokens"]  # 3 steps of 16 packed rows of 256 hold more than 48 examples
    assert record["variants"]["liger"]["skipped"].startswith("Liger kernels are Triton (CUDA)")
    # TRL's SFTTrainer on the same packed rows, read the same way, and the ratio to it printed
    trl = record["variants"]["trl_sft_packed"]
    assert trl["tokens"] > 2 * plain["tokens"] and trl["train_loss"] > 0
    assert record["vs_trl"] == {"packing_vs_trl_sft_packed": packing["tokens_per_second"] / trl["tokens_per_second"]}
    assert "packing against TRL's SFTTrainer (trl_sft_packed)" in result.output
    assert "useful tokens/s" in result.output and "× baseline" in result.output


def test_comparisons_give_scaling_efficiency_and_callback_overhead():
    rows = {"plain_trainer": {"tokens_per_second": 100.0}, "finetune": {"tokens_per_second": 120.0},
            "finetune_no_callbacks": {"tokens_per_second": 123.0}, "ddp": {"tokens_per_second": 228.0},
            "liger": {"skipped": "no CUDA"}}
    result = comparisons(rows, processes=2)
    assert result["scaling"] == {"processes": 2, "speedup": 1.9, "efficiency": 0.95}
    assert abs(result["callback_overhead"] - 0.025) < 1e-12
    assert rows["ddp"]["vs_baseline"] == 2.28 and rows["liger"]["vs_baseline"] is None
    assert "vs_trl" not in result  # no peer ran
    rows["trl_sft"] = {"tokens_per_second": 96.0}
    assert comparisons(rows, processes=2)["vs_trl"] == {"finetune_vs_trl_sft": 1.25}


def test_comparisons_give_the_fused_head_and_compile_against_their_twins():
    rows = {"finetune": {"tokens_per_second": 120.0, "peak_bytes": 300}, "finetune_full_logits": {
        "tokens_per_second": 100.0, "peak_bytes": 400}, "packing": {"tokens_per_second": 200.0,
                                                                   "steady_tokens_per_second": 210.0},
        "compile": {"tokens_per_second": 150.0, "steady_tokens_per_second": 252.0,
                    "compile": {"compile_seconds": 41.0, "graphs": 3, "graph_breaks": 1,
                                "graph_break_reasons": {"a reason": 1}}}}
    result = comparisons(rows, processes=2)
    assert result["fused_head"] == {"tokens_per_second": 1.2, "peak_bytes": 0.75}
    assert result["compile"] == {"vs_eager": 1.2, "end_to_end_vs_eager": 0.75, "compile_seconds": 41.0, "graphs": 3,
                                 "graph_breaks": 1, "graph_break_reasons": {"a reason": 1}}
    del rows["packing"]  # nothing eager to compare with
    assert "compile" not in comparisons(rows, processes=2)


def test_the_peers_run_with_peers_or_by_name():
    every = variants(processes=2)
    names = lambda chosen: [variant.name for variant in chosen]  # noqa: E731
    assert not {"trl_sft", "trl_sft_packed"} & set(names(chosen_variants(every, None, peers=False)))
    assert names(chosen_variants(every, None, peers=True))[:8] == [
        "plain_trainer", "finetune", "finetune_no_callbacks", "finetune_full_logits", "packing", "compile", "trl_sft",
        "trl_sft_packed"]
    assert names(chosen_variants(every, ["trl_sft", "plain_trainer"], peers=False)) == ["plain_trainer", "trl_sft"]
