"""Hub data in its real shapes, offline: a configuration and a split of a dataset repository, a mixture of three
datasets (a hub-shaped folder, a `save_to_disk` folder, a file) with the rows asked of each, the recipe's chat
template, and tokenizing in several processes. The folders are read through the same `datasets.load_dataset` call a
hub id takes (tests/hub_fixtures.save_hub_dataset lays them out as the hub serves them)."""

import json

import pytest
from datasets import Dataset
from hub_fixtures import alpaca_rows, conversation_rows, save_hub_dataset

import finetune.data.loading as loading
from finetune import presets
from finetune.data.cache import cache_key
from finetune.data.summary import fingerprint
from finetune.data.tokenize import _tokenize_split, encode_conversation, prepare_datasets
from finetune.errors import RecipeError
from finetune.models.loading import NAMED_TEMPLATES, load_tokenizer
from finetune.recipe.args import DataArguments, ModelArguments
from finetune.recipe.parse import read_recipe


class OneProcess:
    seed = 0

    def main_process_first(self, desc=""):
        from contextlib import nullcontext

        return nullcontext()


@pytest.fixture
def load_calls(monkeypatch):
    """Every `load_dataset` call the loader makes, with its arguments."""
    calls = []
    real = loading.load_dataset

    def recording(path, *args, **kwargs):
        calls.append({"path": path, **kwargs})
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loading, "load_dataset", recording)
    return calls


@pytest.fixture
def repo(tmp_path):
    return save_hub_dataset(tmp_path / "repo", {
        "default": {"train": conversation_rows(5, tag="d")},
        "other": {"train_sft": conversation_rows(7, tag="o"), "test_sft": conversation_rows(3, tag="t")},
    })


def answers(dataset) -> list[str]:
    return [row["messages"][-1]["content"][::-1] for row in dataset]


def test_a_configuration_and_non_train_splits_load_through_load_dataset(repo, load_calls):
    raw = loading.load_raw_data(DataArguments(dataset=str(repo), dataset_config="other", dataset_split="train_sft",
                                              eval_split="test_sft"))
    source = raw.sources[0]
    assert answers(source.train) == [f"ow{i}" for i in range(7)]
    assert answers(source.eval) == [f"tw{i}" for i in range(3)]
    assert load_calls[0]["path"] == str(repo) and load_calls[0]["name"] == "other"

    default = loading.load_raw_data(DataArguments(dataset=str(repo))).sources[0]
    assert answers(default.train) == [f"dw{i}" for i in range(5)] and default.eval is None

    sliced = loading.load_raw_data(DataArguments(dataset=str(repo), dataset_config="other",
                                                 dataset_split="train_sft[:3]", eval_split="none")).sources[0]
    assert answers(sliced.train) == ["ow0", "ow1", "ow2"] and sliced.eval is None
    assert load_calls[-1]["split"] == "train_sft[:3]"

    with pytest.raises(RecipeError, match=r"has no `train` split \(found: train_sft, test_sft\)"):
        loading.load_raw_data(DataArguments(dataset=str(repo), dataset_config="other"))
    with pytest.raises(RecipeError, match=r"has no `validation` split \(found: train_sft, test_sft\)"):
        loading.load_raw_data(DataArguments(dataset=str(repo), dataset_config="other", dataset_split="train_sft",
                                            eval_split="validation"))


@pytest.fixture
def three_sources(tmp_path, repo):
    """A hub-shaped repository (40 conversations), a `save_to_disk` folder (30 alpaca rows) and a JSONL file (20
    conversations with a column the mixture leaves out)."""
    hub = save_hub_dataset(tmp_path / "chat", {"chat": {"train_sft": conversation_rows(40, tag="h")}})
    saved = tmp_path / "alpaca"
    Dataset.from_list(alpaca_rows(30)).save_to_disk(str(saved))
    file = tmp_path / "more.jsonl"
    file.write_text("".join(json.dumps({**row, "score": 1}) + "\n" for row in conversation_rows(20, tag="f")))
    return hub, saved, file


def test_a_three_dataset_mixture_keeps_the_rows_asked_of_each_and_holds_out_eval_in_proportion(
        three_sources, load_calls):
    hub, saved, file = three_sources
    mixture = {"datasets": [
        {"id": str(hub), "config": "chat", "split": "train_sft", "columns": ["messages"], "weight": 0.5},
        {"id": str(saved), "rows": 10},
        {"path": str(file), "columns": ["messages"], "weight": 1.0},
    ], "seed": 3, "test_split_size": 5}
    data_args = DataArguments(dataset_mixture=mixture, max_seq_length=64)
    raw = loading.load_raw_data(data_args)
    assert [(len(source.train), len(source.eval)) for source in raw.sources] == [(18, 2), (9, 1), (18, 2)]
    assert any(call["path"] == str(hub) and call["name"] == "chat" for call in load_calls)
    assert raw.sources[2].train.column_names == ["messages"]  # `columns` kept only these
    kept = sorted(answers(raw.sources[0].train) + answers(raw.sources[0].eval))
    assert len(kept) == 20 and set(kept) < {f"hw{i}" for i in range(40)}  # a seeded half, not the first 20
    assert kept != sorted(f"hw{i}" for i in range(20))
    again = loading.load_raw_data(DataArguments(dataset_mixture=mixture, max_seq_length=64)).sources[0]
    assert answers(again.train) == answers(raw.sources[0].train)  # the seed decides the half

    prepared = prepare_datasets(raw, presets.build_tokenizer(), data_args, OneProcess())
    assert [source["format"] for source in prepared.summary["sources"]] == ["messages", "alpaca", "messages"]
    assert prepared.summary["train_rows"] == 45 and prepared.summary["eval_rows"] == 5  # concatenated, not drawn

    shares = dict(mixture, datasets=[{k: v for k, v in entry.items() if k not in ("weight", "rows")} | {"fraction": f}
                                     for entry, f in zip(mixture["datasets"], (2, 1, 1))], test_split_size=None)
    by_share = loading.load_raw_data(DataArguments(dataset_mixture=shares))
    assert [len(source.train) for source in by_share.sources] == [40, 20, 20]  # 2:1:1, no row repeated


@pytest.mark.parametrize("mixture, message", [
    ({"datasets": [{"id": "x", "weight": 1.5}]}, r"`weight: 1.5` must be in \(0, 1\]"),
    ({"datasets": [{"id": "x", "fraction": 1}, {"id": "y"}]}, "must be given for every dataset or for none"),
    ({"datasets": [{"config": "x"}]}, "names no dataset: give `id`"),
    ({"datasets": [{"id": "x", "weights": 1}]}, r"unknown key\(s\) weights"),
    ({"datasets": [{"id": "x", "rows": 5, "weight": 0.5}]}, "gives `weight` and `rows`; give one"),
    ({"dataset": []}, r"unknown key\(s\) dataset"),
    ({"datasets": [{"id": "x"}], "test_split_size": 2.5}, "a fraction in \\(0, 1\\) or a whole count"),
    ({"datasets": [{"id": "x", "rows": 2.7}]}, r"^`dataset_mixture` dataset 1 \(x\): `rows: 2.7` is not a whole"),
    ({"datasets": [{"id": "x"}, {"id": "y", "weight": float("nan")}]},
     r"^`dataset_mixture` dataset 2 \(y\): `weight: nan` must be in \(0, 1\]"),
    ({"datasets": [{"id": "x", "weight": 0}]}, r"^`dataset_mixture` dataset 1 \(x\): `weight: 0` must be in"),
    ({"datasets": [{"id": "x", "weight": "half"}]}, r"^`dataset_mixture` dataset 1 \(x\): `weight: half` is not a "),
    ({"datasets": [{"id": "x", "fraction": float("inf")}]}, r"`fraction: inf` must be a positive finite number"),
    ({"datasets": [{"id": "x", "rows": True}]}, r"`rows: True` is not a number"),
])
def test_a_malformed_mixture_is_refused_naming_the_entry_and_key(mixture, message):
    with pytest.raises(RecipeError, match=message):
        DataArguments(dataset_mixture=mixture)


def test_a_mixture_column_that_is_not_there_is_named(three_sources):
    hub, _, _ = three_sources
    mixture = {"datasets": [{"id": str(hub), "config": "chat", "split": "train_sft", "columns": ["conversations"]}]}
    with pytest.raises(RecipeError, match=r"has no column `conversations` \(`columns`; it has messages\)"):
        loading.load_raw_data(DataArguments(dataset_mixture=mixture))


def test_a_mixture_reads_from_the_recipe_as_a_mapping_or_from_a_file_on_the_command_line(tmp_path, three_sources):
    hub, saved, _ = three_sources
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: tiny\ndataset_mixture:\n  datasets:\n    - id: {saved}\n      rows: 4\n")
    assert read_recipe(recipe, []).data.mixture.entries[0].rows == 4
    mixture = tmp_path / "mixture.yaml"
    mixture.write_text(f"datasets:\n  - id: {hub}\n    config: chat\n    split: train_sft\n")
    data = read_recipe(recipe, ["--dataset_mixture", str(mixture)]).data
    assert data.mixture.entries[0].path == str(hub) and data.mixture.entries[0].config == "chat"
    with pytest.raises(RecipeError, match="give `dataset_mixture` or one of `dataset`, `train_file`"):
        read_recipe(recipe, ["--dataset", str(saved)])


CUSTOM = presets.CHAT_TEMPLATE.replace("<|{{ message['role'] }}|>", "[{{ message['role'] }}] ")


def test_the_recipes_chat_template_renders_the_conversations_and_changes_the_cache_key(tmp_path):
    conversation = conversation_rows(1)[0]["messages"]
    own = load_tokenizer(ModelArguments())
    custom = load_tokenizer(ModelArguments(chat_template=CUSTOM))
    assert custom.chat_template == CUSTOM and own.chat_template == presets.CHAT_TEMPLATE
    ids, labels = encode_conversation(conversation, custom)  # spans found and verified under the new template
    assert custom.decode(ids).startswith("[user] reverse w0") and not own.decode(
        encode_conversation(conversation, own)[0]).startswith("[user]")
    assert custom.decode([i for i, label in zip(ids, labels) if label != -100]).startswith("0w")
    template_file = tmp_path / "template.jinja"
    template_file.write_text(CUSTOM)
    assert load_tokenizer(ModelArguments(chat_template=str(template_file))).chat_template == CUSTOM
    assert load_tokenizer(ModelArguments(chat_template="chatml")).chat_template == NAMED_TEMPLATES["chatml"]
    assert load_tokenizer(ModelArguments(chat_template="tokenizer_default")).chat_template == presets.CHAT_TEMPLATE
    data_args = DataArguments()
    assert cache_key(data_args, custom, 0)["chat_template"] != cache_key(data_args, own, 0)["chat_template"]
    with pytest.raises(RecipeError, match="`chat_template: llama9` is neither a Jinja template .* nor one of chatml, "
                                          "tokenizer_default"):
        ModelArguments(chat_template="llama9")


def test_tokenizing_in_two_processes_writes_the_same_rows_and_names_a_bad_example(tmp_path):
    tokenizer = presets.build_tokenizer()
    rows = Dataset.from_list(conversation_rows(40))
    one, one_summary = _tokenize_split(rows, "train", tokenizer, DataArguments(max_seq_length=64), "messages")
    two, two_summary = _tokenize_split(rows, "train", tokenizer, DataArguments(max_seq_length=64, dataset_num_proc=2),
                                       "messages")
    assert fingerprint(one) == fingerprint(two) and one_summary["tokens"] == two_summary["tokens"]
    broken = Dataset.from_list(conversation_rows(39) + [{"messages": [{"role": "user", "content": "hi"},
                                                                      {"role": "wizard", "content": "?"}]}])
    with pytest.raises(RecipeError, match="train example 40: "):
        _tokenize_split(broken, "train", tokenizer, DataArguments(max_seq_length=64, dataset_num_proc=2), "messages")


def test_trls_top_level_mixture_reads_into_ours_and_a_held_out_count_is_shared_in_proportion(tmp_path, three_sources):
    hub, saved, _ = three_sources
    recipe = tmp_path / "trl.yaml"
    recipe.write_text(f"model_name_or_path: tiny\ndatasets:\n  - path: {hub}\n    name: chat\n    split: train_sft\n"
                      f"  - path: {saved}\ntest_split_size: 7\n")
    data = read_recipe(recipe, []).data
    assert [entry.path for entry in data.mixture.entries] == [str(hub), str(saved)]
    raw = loading.load_raw_data(data)
    assert [len(source.eval) for source in raw.sources] == [4, 3]  # 7 rows of 70, in proportion to 40 and 30
    assert sum(len(source.train) for source in raw.sources) == 63
