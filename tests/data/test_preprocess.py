"""`finetune preprocess` and the cache `finetune train` reads (finetune.data.cache): the same rows as tokenizing, never
served stale (data, template, length settings), refused where it would overwrite something else. The 2-process read
is in tests/models/test_adapters_distributed.py, shared with other assertions."""

import json

import pytest
from support import PROJECT_ROOT

from finetune import outputs
from finetune.cli import main
from finetune.data import cache
from finetune.data.cache import KEY_FILE, cache_dir, load_preprocessed, save_preprocessed
from finetune.data.pipeline import read_preprocessed, tokenize_data
from finetune.errors import RecipeError
from finetune.models.loading import load_tokenizer
from finetune.recipe.parse import parse_recipe

DEMO = PROJECT_ROOT / "recipes" / "demo.yaml"
SMALL = ["--max_steps", "2", "--generation_eval_samples", "4"]


def preprocess(output_dir, *overrides) -> int:
    return main(["preprocess", str(DEMO), "--output_dir", str(output_dir), *SMALL, *overrides])


def recipe_and_tokenizer(output_dir, *overrides):
    recipe = parse_recipe(DEMO, ["--output_dir", str(output_dir), *SMALL, *overrides])
    return recipe, load_tokenizer(recipe.model)


def test_preprocess_help_names_the_cache_and_its_key(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["preprocess", "--help"])
    assert exit_.value.code == 0
    assert "preprocessed_dir" in capsys.readouterr().out


def test_train_reads_the_rows_tokenizing_would_give_without_tokenizing(tmp_path, capsys):
    assert preprocess(tmp_path) == 0
    assert "wrote the preprocessed data to" in capsys.readouterr().out
    recipe, tokenizer = recipe_and_tokenizer(tmp_path)
    cached = read_preprocessed(recipe, tokenizer)
    assert "reading the preprocessed data in" in capsys.readouterr().out
    fresh = tokenize_data(recipe, tokenizer)
    assert cached.summary["preprocessed"]["dir"] == str(tmp_path / outputs.PREPROCESSED)
    assert cached.summary["train_fingerprint"] == fresh.summary["train_fingerprint"]
    assert cached.train[:5] == fresh.train[:5] and cached.eval[:5] == fresh.eval[:5]
    assert len(cached.train) == len(fresh.train) and cached.generation_examples == fresh.generation_examples
    assert len(cached.generation_examples) == 4


def test_packed_rows_are_cached_packed(tmp_path):
    assert preprocess(tmp_path, "--packing", "true") == 0
    recipe, tokenizer = recipe_and_tokenizer(tmp_path, "--packing", "true")
    cached, fresh = read_preprocessed(recipe, tokenizer), tokenize_data(recipe, tokenizer)
    assert cached.summary["train_fingerprint"] == fresh.summary["train_fingerprint"]
    assert len(cached.train) == len(fresh.train) < 6000  # packed: fewer rows than examples


@pytest.mark.parametrize("change, named", [
    (["--max_seq_length", "48"], "`max_seq_length` is 48 (the cache has 64)"),
    (["--overlong_policy", "drop"], "`overlong_policy` is drop (the cache has truncate)"),
    (["--packing", "true"], "`packing` is True (the cache has False)"),
])
def test_a_changed_length_or_data_setting_is_never_served_stale(tmp_path, capsys, change, named):
    assert preprocess(tmp_path) == 0
    recipe, tokenizer = recipe_and_tokenizer(tmp_path, *change)
    capsys.readouterr()
    assert read_preprocessed(recipe, tokenizer) is None
    out = capsys.readouterr().out
    assert "is stale" in out and named in out and "tokenizing as usual" in out


def test_a_changed_chat_template_tokenizer_or_data_file_is_never_served_stale(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {i}", "output": str(i)}) + "\n" for i in range(20)))
    assert preprocess(tmp_path, "--train_file", str(data)) == 0
    recipe, tokenizer = recipe_and_tokenizer(tmp_path, "--train_file", str(data))
    directory = cache_dir(recipe.data, tmp_path)
    assert load_preprocessed(directory, recipe.data, tokenizer, 0)[0] is not None

    templated = load_tokenizer(recipe.model)
    templated.chat_template = tokenizer.chat_template.replace("\n", "\n\n", 1) + " "
    assert load_preprocessed(directory, recipe.data, templated, 0)[1].endswith("(`chat_template` changed)")
    renamed = load_tokenizer(recipe.model)
    renamed.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert "`tokenizer` changed" in load_preprocessed(directory, recipe.data, renamed, 0)[1]
    with data.open("a") as file:
        file.write(json.dumps({"instruction": "say 20", "output": "20"}) + "\n")
    assert "`train_file` changed" in load_preprocessed(directory, recipe.data, tokenizer, 0)[1]


def test_without_a_cache_no_data_file_is_hashed(tmp_path, monkeypatch):
    recipe, tokenizer = recipe_and_tokenizer(tmp_path)

    def hashing(*args):
        raise AssertionError("the cache key (a digest of every data file) was computed with no cache to compare")

    monkeypatch.setattr(cache, "cache_key", hashing)
    assert load_preprocessed(tmp_path / "none", recipe.data, tokenizer, 0) == (None, "")
    assert read_preprocessed(recipe, tokenizer) is None


def test_a_damaged_cache_is_named_and_tokenized_instead(tmp_path, capsys):
    assert preprocess(tmp_path) == 0
    summary = tmp_path / outputs.PREPROCESSED / outputs.DATA_SUMMARY
    record = json.loads(summary.read_text())
    record["train_fingerprint"] = "6000 rows, sha256 0000000000000000"
    summary.write_text(json.dumps(record))
    recipe, tokenizer = recipe_and_tokenizer(tmp_path)
    capsys.readouterr()
    assert read_preprocessed(recipe, tokenizer) is None
    assert "do not match their recorded fingerprint (damaged)" in capsys.readouterr().out


def test_a_preprocessed_dir_with_no_cache_is_said_and_one_holding_other_files_is_never_overwritten(tmp_path, capsys):
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    recipe, tokenizer = recipe_and_tokenizer(tmp_path / "out", "--preprocessed_dir", str(elsewhere))
    capsys.readouterr()
    assert read_preprocessed(recipe, tokenizer) is None
    assert f"`preprocessed_dir: {elsewhere}` holds no preprocessed data" in capsys.readouterr().out
    (elsewhere / "notes.txt").write_text("mine")
    assert preprocess(tmp_path / "out", "--preprocessed_dir", str(elsewhere)) == 2
    assert "holds something other than preprocessed data" in capsys.readouterr().err
    assert (elsewhere / "notes.txt").read_text() == "mine" and not (elsewhere / KEY_FILE).exists()


def test_a_new_cache_replaces_the_old_one_whole_and_the_recipe_may_come_after_config(tmp_path):
    assert preprocess(tmp_path) == 0
    assert main(["preprocess", "--config", str(DEMO), "--output_dir", str(tmp_path), *SMALL,
                 "--max_seq_length", "48"]) == 0
    recipe, tokenizer = recipe_and_tokenizer(tmp_path, "--max_seq_length", "48")
    assert read_preprocessed(recipe, tokenizer) is not None
    assert [path.name for path in tmp_path.iterdir()] == [outputs.PREPROCESSED]  # no staging folder left


def test_preprocess_under_a_launcher_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert preprocess(tmp_path) == 2
    assert "`finetune preprocess` runs as one process" in capsys.readouterr().err


def test_saving_refuses_a_folder_that_is_not_a_cache_before_writing_anything(tmp_path):
    (tmp_path / "weights.safetensors").write_text("x")
    with pytest.raises(RecipeError, match="holds something other than preprocessed data"):
        save_preprocessed(None, tmp_path, {})
    assert [path.name for path in tmp_path.iterdir()] == ["weights.safetensors"]


def test_a_hub_like_tokenizer_and_conversations_are_cached_and_a_changed_template_is_stale(tmp_path, hub_model_dir):
    """The real path: a BPE tokenizer with its own ChatML template and OpenAI-style conversations."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                                                     {"role": "assistant", "content": str(2 * i)}]}) + "\n"
                            for i in range(30)))
    keys = ["--model_name_or_path", str(hub_model_dir), "--train_file", str(data), "--eval_split_ratio", "0.2",
            "--generation_eval_samples", "3"]
    assert main(["preprocess", str(DEMO), "--output_dir", str(tmp_path / "out"), *keys]) == 0
    recipe = parse_recipe(DEMO, ["--output_dir", str(tmp_path / "out"), *keys])
    tokenizer = load_tokenizer(recipe.model)
    cached, fresh = read_preprocessed(recipe, tokenizer), tokenize_data(recipe, tokenizer)
    assert cached.summary["train_fingerprint"] == fresh.summary["train_fingerprint"]
    assert cached.train[:3] == fresh.train[:3] and cached.generation_examples == fresh.generation_examples
    assert "<|im_end|>" in tokenizer.decode(cached.train[0]["input_ids"])  # rendered by the fixture's template
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>assistant", "<|im_start|>bot")
    assert "`chat_template` changed" in load_preprocessed(cache_dir(recipe.data, tmp_path / "out"), recipe.data,
                                                          tokenizer, 0)[1]


@pytest.mark.parametrize("where", ["output_dir", "its parent"])
def test_a_preprocessed_dir_that_is_or_holds_the_output_dir_is_refused_and_nothing_is_deleted(tmp_path, capsys,
                                                                                               where):
    output_dir = tmp_path / "run"
    (output_dir / "checkpoint-2").mkdir(parents=True)
    (output_dir / "model.safetensors").write_text("weights")
    (output_dir / KEY_FILE).write_text("{}")  # a cache written there before: its key must not license a delete
    preprocessed_dir = output_dir if where == "output_dir" else tmp_path
    assert preprocess(output_dir, "--preprocessed_dir", str(preprocessed_dir)) == 2
    err = capsys.readouterr().err
    assert f"`preprocessed_dir: {preprocessed_dir}`" in err and f"output_dir {output_dir}" in err
    assert len(err.strip().splitlines()) == 1
    assert (output_dir / "model.safetensors").read_text() == "weights" and (output_dir / "checkpoint-2").is_dir()


def test_a_cache_folder_that_gained_other_files_is_refused_naming_them_and_nothing_is_deleted(tmp_path, capsys):
    elsewhere = tmp_path / "cache"
    assert preprocess(tmp_path / "out", "--preprocessed_dir", str(elsewhere)) == 0
    (elsewhere / "model.safetensors").write_text("weights")
    (elsewhere / "checkpoint-2").mkdir()
    capsys.readouterr()
    assert preprocess(tmp_path / "out", "--preprocessed_dir", str(elsewhere), "--max_seq_length", "48") == 2
    err = capsys.readouterr().err
    assert "checkpoint-2" in err and "model.safetensors" in err and "wrote the preprocessed data" not in err
    assert (elsewhere / "model.safetensors").read_text() == "weights" and (elsewhere / "checkpoint-2").is_dir()
    assert (elsewhere / KEY_FILE).is_file()  # the old cache is left whole too


def test_a_corrupted_cache_is_named_with_the_fix_and_tokenized_instead(tmp_path, capsys):
    assert preprocess(tmp_path) == 0
    for arrow in (tmp_path / outputs.PREPROCESSED / cache.DATASETS).rglob("*.arrow"):
        arrow.write_bytes(b"\x00" * 64)
    recipe, tokenizer = recipe_and_tokenizer(tmp_path)
    capsys.readouterr()
    assert read_preprocessed(recipe, tokenizer) is None
    out = capsys.readouterr().out
    assert f"the preprocessed data in {tmp_path / outputs.PREPROCESSED} is damaged" in out
    assert "`finetune preprocess` with this recipe refreshes it" in out


def test_generation_eval_samples_changes_no_tokenized_row_and_keeps_the_cache(tmp_path):
    assert preprocess(tmp_path) == 0  # SMALL: --generation_eval_samples 4
    for samples in ("2", "7", "0"):
        recipe, tokenizer = recipe_and_tokenizer(tmp_path, "--generation_eval_samples", samples)
        cached, fresh = read_preprocessed(recipe, tokenizer), tokenize_data(recipe, tokenizer)
        assert cached is not None and cached.generation_examples == fresh.generation_examples
        assert len(cached.generation_examples) == int(samples)
