"""`method: kto` (TRL's KTOTrainer): from the demo's SFT model, 2 processes under ZeRO-2 on the synthetic pairs, each
pair as two unpaired examples, raise the held-out reward margin from 0; each rank's ledger, the reference model
included, equals the prediction; a resumed run logs the uninterrupted run's losses. Without a launch: unpaired rows
and pairs read as KTO reads them, and what KTO cannot train with refused by name before any process starts."""

import json
import shutil

import pytest
from datasets import Dataset
from support import CPU_LAUNCHES, assert_succeeded, launch_demo, slack

from finetune.checkpoints.complete import COMPLETE_MARKER
from finetune.data.pairs import SOURCE_COLUMN, apply_pair_length_policies, load_preference_data
from finetune.errors import RecipeError
from finetune.memory import model_shape
from finetune.recipe.args import DataArguments
from finetune.recipe.parse import parse_recipe, read_recipe
from finetune.train.methods.kto import KahnemanTverskyOptimization, trl_kto_loss_types

DEMO = "recipes/demo.yaml"
# 60 optimizer steps of 2 x 8 examples (4 pairs' worth a rank), a checkpoint at 30 and 60; the 300 held-out pairs, as
# 600 examples, evaluated before and after in batches of 2 x 50.
KTO_RUN = ["--method", "kto", "--max_steps", "60", "--per_device_train_batch_size", "8", "--learning_rate", "3e-4",
           "--warmup_steps", "0", "--logging_steps", "10", "--eval_on_start", "true", "--max_eval_samples", "300",
           "--per_device_eval_batch_size", "50", "--generation_eval_samples", "0", "--save_strategy", "steps",
           "--save_steps", "30", "--report_to", "none", "--disable_tqdm", "true"]
STATES = ("params_bytes", "grads_bytes", "optimizer_bytes", "reference_bytes")


def launch(output_dir, *extra: str):
    return launch_demo(CPU_LAUNCHES["zero2"], output_dir, *KTO_RUN, *extra)


@pytest.fixture(scope="module")
def kto_run(trained_demo, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("kto_zero2")
    assert_succeeded(launch(output_dir, "--model_name_or_path", str(trained_demo)))
    return output_dir


def results(output_dir) -> dict:
    return json.loads((output_dir / "eval_results.json").read_text())


def losses(output_dir) -> dict[int, float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


@pytest.mark.distributed
def test_kto_raises_the_held_out_reward_margin(kto_run):
    summary = results(kto_run)
    assert summary["method"] == "kto" and summary["world_size"] == 2 and summary["deepspeed_zero_stage"] == 2
    before, after = summary["before"], summary["after"]
    # Before the first step the policy is the reference: every reward is 0, and each loss 1 - sigmoid(0).
    assert (before["step"], before["reward_margin"], before["eval_loss"]) == (0, 0.0, 0.5)
    # Measured on 2 processes: margin 0 -> 0.530, eval loss 0.5 -> 0.442 (one process at the same global batch: 0.497
    # and 0.441; at 1e-3 the margin reaches 0.90 but the desirable completions' own log-probability falls from -0.05
    # to -6).
    assert after["step"] == 60 and after["reward_margin"] > 0.3 and after["eval_loss"] < 0.47, after
    for step in (30, 60):
        marker = json.loads((kto_run / f"checkpoint-{step}" / COMPLETE_MARKER).read_text())
        assert (marker["step"], marker["world_size"]) == (step, 2)
    data = json.loads((kto_run / "data_summary.json").read_text())
    (source,) = data["sources"]
    assert source["format"] == "synthetic_pairs" and source["train"]["examples"] == 2 * source["train"]["rows"]
    assert source["train"]["desirable"] == source["train"]["rows"] and source["eval"]["examples"] == 600


@pytest.mark.distributed
def test_ledger_equals_the_prediction_on_every_rank_reference_model_included(kto_run):
    ranks = json.loads((kto_run / "memory_report.json").read_text())["ranks"]
    assert [record["rank"] for record in ranks] == [0, 1]
    whole = 4 * model_shape("tiny").num_parameters  # fp32 on CPU; ZeRO-2's reference is an inference engine, whole
    for record in ranks:
        measured, predicted = record["measured"], record["predicted"]
        assert predicted["reference_bytes"] == whole, predicted
        for key in STATES:
            assert abs(measured[key] - predicted[key]) <= slack(key, "zero2"), (record["rank"], key, measured,
                                                                                 predicted)
    report = (kto_run / "memory_report.md").read_text()
    assert all(f"| {rank} | reference model |" in report for rank in (0, 1))


@pytest.mark.distributed
def test_a_resumed_kto_run_logs_the_uninterrupted_runs_losses(kto_run, trained_demo, tmp_path):
    """Resumed from its step-30 checkpoint (the later one and the final files removed, as a run killed after step 30
    leaves its folder), the run reads the examples in the same order and logs the losses of steps 40 to 60 again."""
    resumed = tmp_path / "resumed"
    shutil.copytree(kto_run / "checkpoint-30", resumed / "checkpoint-30")
    result = launch(resumed, "--model_name_or_path", str(trained_demo), "--resume_from_checkpoint", "auto")
    assert_succeeded(result)
    assert f"resuming from {resumed / 'checkpoint-30'}" in result.output
    then, now = losses(kto_run), losses(resumed)
    assert sorted(now) == sorted(then) == [10, 20, 30, 40, 50, 60]
    assert [now[step] for step in (40, 50, 60)] == pytest.approx([then[step] for step in (40, 50, 60)], rel=1e-5)
    assert results(resumed)["after"]["reward_margin"] == pytest.approx(results(kto_run)["after"]["reward_margin"],
                                                                       abs=1e-6)


def write_rows(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_unpaired_rows_and_pairs_are_read_as_examples_shuffled_with_the_seed(tmp_path):
    unpaired = write_rows(tmp_path / "unpaired.jsonl", [
        {"prompt": f"{i}+1=", "completion": str(i + 1 + (i % 2)), "label": i % 2 == 0} for i in range(6)]
        + [{"prompt": "x", "completion": " ", "label": True}])
    pairs = write_rows(tmp_path / "pairs.jsonl", [
        {"prompt": f"{i}+2=", "chosen": str(i + 2), "rejected": str(i + 3)} for i in range(4)])
    data_args = DataArguments(mix_files=[unpaired, pairs])
    data = load_preference_data(data_args, seed=0, unpaired=True)
    first, second = data.summary["sources"]
    assert (first["format"], first["train"]["examples"], first["train"]["desirable"]) == ("unpaired", 6, 3)
    assert first["train"]["dropped"]["empty_answer"] == 1  # an empty completion, dropped and counted
    assert (second["format"], second["train"]["examples"], second["train"]["desirable"]) == ("pairs", 8, 4)
    assert set(data.train.column_names) == {"prompt", "completion", "label", SOURCE_COLUMN}
    # Unpairing puts a batch of pairs' desirable examples first; KTO reads in order, so the seed shuffles them.
    synthetic = load_preference_data(read_recipe(DEMO, ["--method", "kto"]).data, seed=0, unpaired=True)
    assert len(synthetic.train) == 12000 and sum(synthetic.train["label"]) == 6000
    assert 0 < sum(synthetic.train["label"][:16]) < 16
    again = load_preference_data(read_recipe(DEMO, ["--method", "kto"]).data, seed=0, unpaired=True)
    assert again.train["completion"][:50] == synthetic.train["completion"][:50]


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt": "2+2=", "completion": "4"}],
     r"has a `completion` column, read as unpaired examples, but no `label` column: each row needs"),
    ([{"completion": "4", "label": True}], r"but no `prompt` column"),
    ([{"prompt": "2+2=", "completion": "4", "label": 1}], r"row 0 has `label: 1`; a label is true .* or false"),
    ([{"prompt": "2+2=", "completion": "4", "label": "yes"}], r"row 0 has `label: 'yes'`"),
    ([{"prompt": "2+2=", "output": "4"}], r"trains on unpaired examples or preference pairs, but the data's columns "
                                          r"are output, prompt; expected one of: unpaired: prompt, completion, label"),
])
def test_unpaired_rows_without_a_true_or_false_label_are_refused_naming_what_is_missing(tmp_path, rows, message):
    data_args = DataArguments(train_file=write_rows(tmp_path / "data.jsonl", rows))
    with pytest.raises(RecipeError, match=message):
        load_preference_data(data_args, seed=0, unpaired=True)


def test_the_examples_trl_drops_and_truncates_are_counted_per_source():
    """Examples as TRL's KTOTrainer leaves them after tokenizing: (prompt, completion) token counts, `max_seq_length:
    10`; one more example had a prompt of 10 tokens or more, which TRL dropped."""
    tokenized = [(4, 3), (6, 8), (3, 1)]
    rows = Dataset.from_list([{"prompt": "p", "completion": "c", "label": True, SOURCE_COLUMN: 0}] * 4)
    trl_rows = Dataset.from_list([{"prompt_ids": [1] * p, "completion_ids": [2] * c, "label": True,
                                   SOURCE_COLUMN: 0} for p, c in tokenized])
    record = {"rows": 4, "examples": 4, "desirable": 4, "truncated_rows": 0,
              "dropped": {"empty_answer": 0, "overlong": 0, "no_answer_tokens": 0}}
    summary = {"sources": [{"name": "data.jsonl", "format": "unpaired", "train": record, "eval": None}]}
    kept = apply_pair_length_policies(rows, trl_rows, DataArguments(max_seq_length=10), "train", summary,
                                      answers=("completion_ids",), unit="example")
    assert len(kept) == 3 and record["examples"] == 3 and record["truncated_rows"] == 1
    assert record["dropped"]["no_answer_tokens"] == 1
    with pytest.raises(RecipeError, match=r"an example of data.jsonl \(train\) has 14 tokens \(prompt and answer\)"):
        apply_pair_length_policies(rows.select(range(3)), trl_rows, DataArguments(max_seq_length=10,
                                                                                  overlong_policy="error"),
                                   "train", summary, answers=("completion_ids",), unit="example")


def test_the_kto_keys_reach_trls_config_and_the_examples_are_read_in_order(tmp_path):
    recipe = parse_recipe(DEMO, ["--method", "kto", "--beta", "0.2", "--desirable_weight", "1.5",
                                 "--output_dir", str(tmp_path)])
    args = recipe.training
    assert (args.beta, args.loss_type, args.desirable_weight, args.undesirable_weight) == (0.2, "kto", 1.5, 1.0)
    assert args.train_sampling_strategy == "sequential" and args.max_length == recipe.data.max_seq_length
    # No KL term: the order does not matter to the loss, and a micro-batch of one is fine.
    recipe = parse_recipe(DEMO, ["--method", "kto", "--loss_type", "apo_zero_unpaired",
                                 "--per_device_train_batch_size", "1", "--output_dir", str(tmp_path)])
    assert recipe.method.settings.kto_loss_type == "apo_zero_unpaired"  # TRL's `loss_type`, read as ours
    assert recipe.training.train_sampling_strategy == "random"
    assert "given as TRL's loss_type" in recipe.sources["kto_loss_type"]
    assert set(trl_kto_loss_types()) == {"kto", "apo_zero_unpaired"}  # the installed TRL's, as TRL 1.16 has them


@pytest.mark.parametrize(("overrides", "message"), [
    (["--per_device_train_batch_size", "1"], r"^`method: kto` estimates its KL term from each micro-batch's other "
                                             r"examples, so it needs 2 or more examples a device; "
                                             r"`per_device_train_batch_size` is 1 \(command line\)"),
    (["--global_batch_size", "2", "--max_micro_batch_size", "1"], r"`per_device_train_batch_size` is 1 \(batch plan"),
    (["--train_sampling_strategy", "random"], r"`train_sampling_strategy: random` with `method: kto`: TRL's KL term"),
    (["--kto_loss_type", "sigmoid"], r"`kto_loss_type: sigmoid` is not one of kto, apo_zero_unpaired"),
    (["--beta", "-0.1"], r"`beta` must be positive, got -0.1"),
    (["--undesirable_weight", "0"], r"`undesirable_weight` must be positive"),
    (["--packing", "true"], r"`packing` and `padding_free` are for supervised fine-tuning; TRL's KTOTrainer"),
])
def test_what_kto_cannot_train_with_is_refused_by_name_before_any_process_starts(overrides, message, tmp_path):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(DEMO, ["--method", "kto", *overrides, "--output_dir", str(tmp_path)])


def test_kto_holds_a_reference_and_one_sequence_an_example_for_the_backward():
    memory = KahnemanTverskyOptimization.memory
    assert (memory.reference_model, memory.sequences_per_example, memory.logits_held, memory.fused_head) == \
        (True, 1, False, True)
