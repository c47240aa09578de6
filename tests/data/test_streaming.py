"""`streaming: true` on 2 processes: a run to a token budget, each rank training on rows no other rank sees, and a
resume from its middle checkpoint that reads the stream up to there again and trains on the same rows with the same
losses as the uninterrupted run. Each rank's micro-batches are recorded by `finetune.testing.record_batches` (the
toolkit's collator, wrapped)."""

import json
import shutil

import pytest
from hub_fixtures import conversation_rows
from support import CPU_LAUNCHES, assert_succeeded, run

from finetune.errors import RecipeError
from finetune.recipe.parse import parse_recipe, read_recipe
from finetune.testing.record_batches import RECORD_DIR

RECORDING = ("-m", "finetune.testing.record_batches")
ROW_LENGTH, MICRO_BATCH, PROCESSES = 64, 2, 2
TOKENS_PER_STEP = ROW_LENGTH * MICRO_BATCH * PROCESSES
BUDGET = 5 * TOKENS_PER_STEP + 1  # six steps: the last one partly past the budget


def streamed_run(data, output_dir, records, *extra):
    records.mkdir(exist_ok=True)
    launch = CPU_LAUNCHES["ddp"]._replace(program=RECORDING)
    command = launch.command("train", "recipes/demo.yaml", "--train_file", str(data), "--streaming", "true",
                             "--packing", "true", "--max_seq_length", str(ROW_LENGTH), "--max_tokens", str(BUDGET),
                             "--per_device_train_batch_size", str(MICRO_BATCH), "--gradient_accumulation_steps", "1",
                             "--global_batch_size", str(MICRO_BATCH * PROCESSES), "--logging_steps", "1",
                             "--save_strategy", "steps", "--save_steps", "3", "--warmup_steps", "0",
                             "--output_dir", str(output_dir), *extra)
    result = run(command, timeout=600, env={RECORD_DIR: str(records)})
    assert_succeeded(result)
    return result


def batches(records, rank: int) -> list[list[str]]:
    return [json.loads(line) for line in (records / f"rank{rank}.jsonl").read_text().splitlines()]


def losses(output_dir) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.fixture(scope="module")
def stream_file(tmp_path_factory):
    data = tmp_path_factory.mktemp("stream") / "stream.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in conversation_rows(600, tag="s")))
    return data


@pytest.mark.distributed
def test_a_stream_on_two_processes_trains_to_its_budget_on_disjoint_rows_and_resumes_where_it_stopped(
        tmp_path, stream_file):
    whole = tmp_path / "whole"
    streamed_run(stream_file, whole, tmp_path / "whole_records")
    state = json.loads((whole / "trainer_state.json").read_text())
    assert state["global_step"] == 6  # ⌈budget ÷ tokens a step⌉
    assert 0.8 * 6 * TOKENS_PER_STEP < state["num_input_tokens_seen"] <= 6 * TOKENS_PER_STEP  # packed rows, nearly full
    effective = json.loads((whole / "effective_config.json").read_text())["values"]
    assert effective["max_steps"]["source"].startswith(f"max_tokens {BUDGET:,} ÷ {TOKENS_PER_STEP:,} tokens a step")
    summary = json.loads((whole / "data_summary.json").read_text())
    assert summary["streaming"]["sampled_rows"] == 600 and summary["train_rows"] is None
    # The 6 micro-batches each rank trained on (its data loader fetches one more ahead, to see the stream goes on).
    rank0, rank1 = (batches(tmp_path / "whole_records", rank)[:6] for rank in (0, 1))
    assert len(rank0) == len(rank1) == 6
    seen0, seen1 = {e for batch in rank0 for e in batch}, {e for batch in rank1 for e in batch}
    assert seen0 and seen1 and not seen0 & seen1  # each rank its own rows

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-3", resumed / "checkpoint-3")
    result = streamed_run(stream_file, resumed, tmp_path / "resumed_records", "--resume_from_checkpoint", "auto")
    assert f"resuming from {resumed / 'checkpoint-3'}" in result.output
    whole_losses, resumed_losses = losses(whole), losses(resumed)
    assert sorted(resumed_losses) == [1, 2, 3, 4, 5, 6]  # 1 to 3 from the checkpoint's history
    assert [resumed_losses[step] for step in (4, 5, 6)] == pytest.approx([whole_losses[step] for step in (4, 5, 6)],
                                                                         rel=1e-4)
    for rank, whole_batches in enumerate((rank0, rank1)):  # the stream read again up to the checkpoint, then the
        assert batches(tmp_path / "resumed_records", rank)[:6] == whole_batches  # same rows trained on


def test_importing_the_recorder_leaves_the_collator_of_this_process_alone():
    import finetune.data.collate as collate
    import finetune.testing.record_batches as record_batches

    assert collate.data_collator is not record_batches.recording_collator  # wrapped only when run as `-m`


def test_a_stream_needs_an_end_and_refuses_what_needs_its_length(tmp_path, stream_file):
    base = ["--train_file", str(stream_file), "--streaming", "true", "--max_steps", "-1"]
    with pytest.raises(RecipeError, match="give `max_steps` or a token budget `max_tokens`"):
        parse_recipe("recipes/demo.yaml", base)
    with pytest.raises(RecipeError, match="`eval_split_ratio` cannot be honoured"):
        read_recipe("recipes/demo.yaml", [*base, "--eval_split_ratio", "0.1"])
    with pytest.raises(RecipeError, match="give `max_tokens: 100` or `max_steps: 5`, not both"):
        parse_recipe("recipes/demo.yaml", ["--max_steps", "5", "--max_tokens", "100"])
    recipe = parse_recipe("recipes/demo.yaml", ["--max_tokens", "100000", "--max_seq_length", "128"])
    assert recipe.training.max_steps == -(-100000 // (128 * recipe.batch_plan.global_batch_size))


def test_a_token_budget_on_an_unpacked_stream_is_refused_with_the_reason(stream_file):
    base = ["--train_file", str(stream_file), "--streaming", "true", "--max_tokens", "10000"]
    with pytest.raises(RecipeError, match=r"^`max_tokens: 10000` on a stream counts rows of `max_seq_length` tokens, "
                                          r"which only packed rows fill: .* Set `packing: true`, or give `max_steps`"):
        read_recipe("recipes/demo.yaml", base)
    packed = read_recipe("recipes/demo.yaml", [*base, "--packing", "true"])  # the budget it counts is trained
    assert packed.data.max_tokens == 10000 and packed.data.packing


@pytest.mark.parametrize("key", ["dataset_split", "eval_split"])
def test_a_sliced_split_of_a_stream_is_refused_with_the_fix(stream_file, key):
    from finetune.data.streaming import open_stream
    from finetune.recipe.args import DataArguments

    data_args = DataArguments(train_file=str(stream_file), streaming=True, **{key: "train[:5]"})
    with pytest.raises(RecipeError, match=rf"^`{key}: train\[:5\]`: a stream cannot be sliced .* give the split "
                                          r"`train` and bound the run with `max_steps` or `max_tokens`"):
        open_stream(data_args, getattr(data_args, key))
