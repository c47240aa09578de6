import importlib.util
import json

from support import PROJECT_ROOT

from finetune import presets


def load_generator():
    script = PROJECT_ROOT / "scripts" / "make_synthetic_data.py"
    spec = importlib.util.spec_from_file_location("make_synthetic_data", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_dataset_is_what_the_script_writes(tmp_path):
    load_generator().write_splits(tmp_path)
    for split in ("train", "eval"):
        shipped = presets.synthetic_data_dir() / f"{split}.jsonl"
        assert (tmp_path / f"{split}.jsonl").read_bytes() == shipped.read_bytes()


def test_answers_are_correct_and_eval_inputs_are_held_out():
    rows = {
        split: [json.loads(line) for line in (presets.synthetic_data_dir() / f"{split}.jsonl").open()]
        for split in ("train", "eval")
    }
    for row in rows["train"] + rows["eval"]:
        if row["task"] == "reverse":
            assert row["output"] == row["input"][::-1]
        elif row["task"] == "sort":
            assert row["output"] == "".join(sorted(row["input"]))
        else:
            left, right = row["input"].split("+")
            assert int(row["output"]) == int(left) + int(right)
    for task in ("reverse", "sort", "add"):
        train_inputs = {row["input"] for row in rows["train"] if row["task"] == task}
        eval_inputs = {row["input"] for row in rows["eval"] if row["task"] == task}
        assert len(eval_inputs) == 100
        assert not train_inputs & eval_inputs
