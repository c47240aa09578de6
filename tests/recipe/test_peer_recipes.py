"""Recipes of other tools, loaded as they are: the alignment-handbook's SFT and DPO recipes (zephyr, smollm2), an
axolotl config and a LLaMA-Factory config, each written for these tests in its tool's shape (tests/fixtures/peers).
Each trains with only the model and the data overridden: the model by a hub-shaped local checkpoint (bf16
safetensors, BPE tokenizer with ChatML's special tokens), the data by local folders in the hub's layout standing in
for the hub ids (the recipe's own mixture, each `id` replaced). What became of each key is read back from
`effective_config.json`."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from hub_fixtures import alpaca_rows, conversation_rows, preference_rows, save_hub_dataset
from support import PROJECT_ROOT

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe.parse import parse_recipe, read_recipe

PEERS = PROJECT_ROOT / "tests" / "fixtures" / "peers"


@pytest.fixture(scope="module")
def hub_data(tmp_path_factory):
    """Local stand-ins for the hub datasets the recipes name, in the hub's layout."""
    root = tmp_path_factory.mktemp("hub_data")
    return {
        "HuggingFaceH4/ultrachat_200k": save_hub_dataset(root / "ultrachat", {"default": {
            "train_sft": conversation_rows(40, tag="u"), "test_sft": conversation_rows(16, start=40, tag="u")}}),
        "HuggingFaceH4/ultrafeedback_binarized": save_hub_dataset(root / "ultrafeedback", {"default": {
            "train_prefs": preference_rows(24), "test_prefs": preference_rows(8, start=24)}}),
        "HuggingFaceTB/smoltalk": save_hub_dataset(root / "smoltalk", {"all": {
            "train": conversation_rows(32, tag="s"), "test": conversation_rows(8, start=32, tag="s")}}),
        "teknium/GPT4-LLM-Cleaned": save_hub_dataset(root / "gpt4llm", {"default": {"train": alpaca_rows(40)}}),
        "tatsu-lab/alpaca": save_hub_dataset(root / "alpaca", {"default": {"train": alpaca_rows(40)}}),
    }


def local_mixture(recipe: Path, hub_data: dict, *overrides: str, **changes) -> str:
    """The recipe's own dataset mixture (as finetune reads it) with each hub id replaced by its local stand-in."""
    mixture = read_recipe(recipe, list(overrides)).data.mixture.to_dict()
    for entry in mixture["datasets"]:
        entry["path"] = str(hub_data[entry["path"]])
    return json.dumps({**mixture, **changes})


def train(recipe: Path, output_dir: Path, *overrides: str) -> dict:
    assert main(["train", str(recipe), "--output_dir", str(output_dir), *overrides]) == 0
    effective = json.loads((output_dir / "effective_config.json").read_text())
    losses = [entry.get("loss", entry.get("train_loss")) for entry in json.loads(
        (output_dir / "trainer_state.json").read_text())["log_history"] if "loss" in entry or "train_loss" in entry]
    assert losses and all(0 < loss < 20 for loss in losses)
    return effective


def saved_template(output_dir: Path) -> str:
    jinja = output_dir / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else json.loads(
        (output_dir / "tokenizer_config.json").read_text())["chat_template"]


def recipe_value(recipe: Path, key: str):
    import yaml

    return yaml.safe_load(recipe.read_text())[key]


def test_handbook_zephyr_sft_trains_with_its_template_and_mixture(tmp_path, hub_model_dir, hub_data, capsys):
    recipe = PEERS / "handbook_zephyr_sft.yaml"
    effective = train(recipe, tmp_path, "--model_name_or_path", str(hub_model_dir),
                      "--dataset_mixture", local_mixture(recipe, hub_data, test_split_size=8))
    values = effective["values"]
    template = recipe_value(recipe, "chat_template")
    assert values["chat_template"]["value"] == template and len(values["chat_template"]["sha256"]) == 16
    assert saved_template(tmp_path) == template  # chat and serving render as training did
    assert [entry["split"] for entry in values["dataset_mixture"]["value"]["datasets"]] == ["train_sft", "test_sft"]
    summary = json.loads((tmp_path / "data_summary.json").read_text())
    assert summary["train_rows"] == 48 and summary["eval_rows"] == 8  # 40 + 16 pooled, 8 held out
    assert "'s warmup_ratio" in values["warmup_steps"]["source"]
    assert effective["foreign_keys"]["renamed"]["warmup_ratio"] == "warmup_steps"
    assert any(note.startswith("`overwrite_output_dir: true`") for note in effective["foreign_keys"]["noted"])


@pytest.mark.parametrize("name", ["handbook_zephyr_dpo.yaml", "handbook_smollm2_dpo.yaml"])
def test_handbook_dpo_recipes_train_on_their_mixture(tmp_path, hub_model_dir, hub_data, monkeypatch, name):
    recipe = PEERS / name
    # the published smollm2 recipe is run as the handbook's scripts/dpo.py runs it, offline
    published = ["--method", "dpo", "--push_to_hub", "false"] if "method" not in yaml.safe_load(
        recipe.read_text()) else []
    monkeypatch.setenv("WANDB_MODE", "disabled")  # its `report_to: [tensorboard, wandb]`, with no W&B account here
    effective = train(recipe, tmp_path, "--model_name_or_path", str(hub_model_dir), *published,
                      "--dataset_mixture", local_mixture(recipe, hub_data, *published, test_split_size=8))
    assert effective["values"]["max_seq_length"]["value"] == 1024
    assert any(note.startswith("`max_prompt_length: 512` (TRL 1.16 has no separate prompt limit")
               for note in effective["foreign_keys"]["noted"])
    summary = json.loads((tmp_path / "data_summary.json").read_text())
    assert summary["train_rows"] == 24 and summary["eval_rows"] == 8


def test_an_axolotl_config_trains_with_its_keys_read_into_ours(tmp_path, hub_model_dir, hub_data):
    recipe = PEERS / "axolotl_lora.yml"
    effective = train(recipe, tmp_path, "--model_name_or_path", str(hub_model_dir),
                      "--dataset_mixture", local_mixture(recipe, hub_data))
    foreign, values = effective["foreign_keys"], effective["values"]
    assert foreign["read_as"] == "axolotl config"
    assert {"sequence_len": "max_seq_length", "micro_batch_size": "per_device_train_batch_size",
            "num_epochs": "num_train_epochs", "sample_packing": "packing", "optimizer": "optim",
            "lr_scheduler": "lr_scheduler_type", "val_set_size": "eval_split_ratio"}.items() <= foreign[
        "renamed"].items()
    assert foreign["read_into"]["adapter"] == {"use_lora": True}
    assert foreign["read_into"]["evals_per_epoch"] == {"eval_strategy": "steps", "eval_steps": 0.25}
    assert foreign["read_into"]["datasets"]["dataset_mixture"]["datasets"][0]["format"] == "alpaca"
    noted = " ".join(foreign["noted"])
    assert "`special_tokens: {'pad_token': '<|end_of_text|>'}` (the tokenizer's pad token" in noted
    assert "`model_type: AutoModelForCausalLM`" in noted and "`loss_watchdog_threshold: 5.0`" in noted
    assert values["max_seq_length"]["value"] == 2048 and "given as axolotl's sequence_len" in values[
        "max_seq_length"]["source"]
    assert (tmp_path / "adapter_config.json").is_file()
    summary = json.loads((tmp_path / "data_summary.json").read_text())
    assert summary["eval_rows"] == 4 and summary["packing"]["train"]["examples"] == 36


def factory_data(folder: Path) -> Path:
    """LLaMA-Factory's `data` folder: dataset_info.json naming two alpaca files, one with columns of its own."""
    folder.mkdir()
    (folder / "identity.json").write_text(json.dumps(alpaca_rows(12)))
    renamed = [{"question": row["instruction"], "answer": row["output"]} for row in alpaca_rows(30, start=12)]
    (folder / "alpaca_en_demo.json").write_text(json.dumps(renamed))
    (folder / "c4_demo.jsonl").write_text("".join(json.dumps({"text": f"{row['instruction']} {row['output']}"}) + "\n"
                                                  for row in alpaca_rows(20)))
    (folder / "dataset_info.json").write_text(json.dumps({
        "identity": {"file_name": "identity.json"},
        "alpaca_en_demo": {"file_name": "alpaca_en_demo.json", "columns": {"prompt": "question", "response": "answer"}},
        "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},  # as LLaMA-Factory's data/ lists it
    }))
    return folder


@pytest.mark.parametrize("text, message", [
    ("base_model: x\nadapter: ia3\n", "axolotl's `adapter` in .*: finetune trains LoRA .* `ia3` is not one of them"),
    ("base_model: x\ndatasets:\n  - path: d\n    type: oasst\n", "has `type: oasst`; finetune reads alpaca, "
                                                                    "chat_template, completion"),
    ("base_model: x\nspecial_tokens:\n  bos_token: <s>\n", "`bos_token` would add or change a special token"),
    ("base_model: x\nload_in_8bit: true\n", "axolotl's `load_in_8bit: true` .* is not supported: an 8-bit base"),
    ("stage: ppo\n", "LLaMA-Factory's `stage` in .*: finetune trains `sft`, `dpo`, `reward`, .*; stage `ppo`"),
    ("stage: sft\nfinetuning_type: freeze\n", "`freeze` is not supported"),
    ("stage: sft\ndataset: nowhere\ndataset_dir: missing\n", "need `missing/dataset_info.json`"),
    ("base_model: x\ncutoff_len: 512\n", "mixes keys of axolotl \\(base_model\\) and LLaMA-Factory \\(cutoff_len\\)"),
    ("base_model: x\nadapter: lora\nuse_lora: false\n", "gives `use_lora: false` and axolotl's `adapter`"),
    ("base_model: x\nearly_stopping_patience: 3\n", "axolotl's `early_stopping_patience: 3` .* is not supported: "
                                                     "training runs the steps it is given"),
    ("base_model: x\ngroup_by_length: true\n", "`group_by_length: true` .* is not supported: batches are drawn"),
])
def test_a_key_finetune_cannot_honour_is_refused_naming_the_tool_and_the_reason(tmp_path, text, message):
    recipe = tmp_path / "config.yaml"
    recipe.write_text(text)
    with pytest.raises(RecipeError, match=message):
        read_recipe(recipe, [])


def test_dataset_info_columns_and_sharegpt_tags_become_our_formats(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "dataset_info.json").write_text(json.dumps({
        "chats": {"file_name": "chats.json", "formatting": "sharegpt", "columns": {"messages": "conversations"}},
        "ultra": {"hf_hub_url": "HuggingFaceH4/ultrachat_200k", "split": "train_sft", "formatting": "sharegpt",
                  "columns": {"messages": "messages"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant"}},
    }))
    recipe = tmp_path / "config.yaml"
    recipe.write_text(f"stage: sft\ndataset: chats, ultra\ndataset_dir: {folder}\nfinetuning_type: full\n")
    sections = read_recipe(recipe, [])
    chats, ultra = sections.data.mixture.entries
    assert (chats.format, chats.path) == ("sharegpt", str(folder / "chats.json"))
    assert (ultra.format, ultra.path, ultra.split) == ("messages", "HuggingFaceH4/ultrachat_200k", "train_sft")
    assert sections.lora.use_lora is False  # `finetuning_type: full`


def test_a_stray_key_of_another_tool_is_read_as_ours_and_keeps_finetunes_defaults(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: x\ntrain_file: {tmp_path / 'data.jsonl'}\nuse_lora: true\nlora_rank: 16\n")
    sections = read_recipe(recipe, ["--cutoff_len", "64"])
    assert (sections.lora.lora_r, sections.lora.lora_alpha, sections.lora.lora_dropout) == (16, 32, 0.05)
    assert sections.data.max_seq_length == 64
    assert sections.foreign_keys["read_as"] == "finetune / TRL recipe" and not sections.foreign_keys["tool_defaults"]
    out = capsys.readouterr().out
    assert "is read as a finetune recipe (1 of the 4 keys that are not Trainer's is LLaMA-Factory's)" in out
    assert "`lora_rank` is LLaMA-Factory's name for `lora_r`: read as lora_r" in out
    assert "on the command line, `cutoff_len` is LLaMA-Factory's name for `max_seq_length`" in out


def test_a_tools_config_is_read_as_its_own_saying_so_and_its_renamed_keys_work_on_the_command_line(capsys):
    sections = read_recipe(PEERS / "axolotl_lora.yml", ["--sequence_len", "512"])
    assert sections.data.max_seq_length == 512 and sections.sources["max_seq_length"].endswith(
        "(given as axolotl's sequence_len)")
    assert re.search(r"is read as an axolotl config \(\d+ of the \d+ keys that are not Trainer's are axolotl's\)",
                     capsys.readouterr().out)


NULLS_OF_THE_LLAMA_3_EXAMPLES = ("`early_stopping_patience: null` (unset)", "`xformers_attention: null` (unset)",
                                 "`wandb_project: null` (unset)")
KERNELS_NOTE = "(axolotl's fused LoRA kernels (Triton, CUDA) are not used; peft's LoRA layers compute the same outputs)"
LLAMA_3_TARGETS = {"gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj"}


@pytest.mark.parametrize("name, notes", [
    ("axolotl_llama3_lora_1b.yml", (*NULLS_OF_THE_LLAMA_3_EXAMPLES, "`lora_fan_in_fan_out: null` (unset)",
                                    "`group_by_length: false` (batches are drawn at random")),
    ("axolotl_llama3_fft_8b.yaml", (*NULLS_OF_THE_LLAMA_3_EXAMPLES, "`group_by_length: false` (batches are drawn at "
                                    "random")),
    ("axolotl_llama3_lora_1b_kernels.yml", ("`wandb_project: null` (unset)", f"`lora_mlp_kernel: true` {KERNELS_NOTE}",
                                            f"`lora_qkv_kernel: true` {KERNELS_NOTE}",
                                            f"`lora_o_kernel: true` {KERNELS_NOTE}",
                                            "`loss_watchdog_threshold: 5.0` (finetune stops a run whose loss "
                                            "diverges")),
])
def test_axolotls_published_examples_train_their_nulls_unset_and_their_cpu_less_keys_said(
        tmp_path, hub_model_dir, hub_data, monkeypatch, name, notes):
    recipe = PEERS / name
    monkeypatch.chdir(tmp_path)  # its `dataset_prepared_path: last_run_prepared` is relative, as axolotl reads it
    model_and_data = ["--model_name_or_path", str(hub_model_dir), "--dataset_mixture", local_mixture(recipe, hub_data)]
    if importlib.util.find_spec("bitsandbytes") is None:  # its 8-bit optimizer: one line, before loading
        with pytest.raises(RecipeError, match=r"^`optim: (adamw|paged_adamw)_8bit` keeps its states with bitsandbytes, "
                                              r"which is not installed here: .* or give `optim: adamw_torch`"):
            parse_recipe(recipe, model_and_data)
        model_and_data += ["--optimizer", "adamw_torch"]
    effective = train(recipe, tmp_path / "out", *model_and_data, "--max_steps", "2")
    noted = effective["foreign_keys"]["noted"]
    for note in notes:
        assert any(line.startswith(note) for line in noted), (note, noted)
    assert effective["values"]["eval_split_ratio"]["value"] == recipe_value(recipe, "val_set_size")
    if "fft" in name:  # all weights trained
        assert not (tmp_path / "out" / "adapter_config.json").exists()
        return
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == LLAMA_3_TARGETS
    given = yaml.safe_load(recipe.read_text())
    assert adapter["lora_dropout"] == given.get("lora_dropout", 0.0)  # axolotl's default where the example has none


def test_an_axolotl_config_with_fsdp_and_deepspeed_is_refused_in_one_line(tmp_path):
    recipe = tmp_path / "config.yaml"
    zero2 = PROJECT_ROOT / "deepspeed_configs" / "zero2.json"
    recipe.write_text(f"base_model: tiny\nsequence_len: 64\nfsdp:\n  - full_shard\ndeepspeed: {zero2}\n")
    with pytest.raises(RecipeError, match=r"^`fsdp: \['full_shard'\]` and `deepspeed: .*zero2.json` ask for two "
                                          r"sharding engines; keep one"):
        parse_recipe(recipe, [])


@pytest.mark.parametrize("name, rows, data_format", [("llamafactory_llama3_lora_sft.yaml", 42, "alpaca"),
                                                     ("llamafactory_llama3_lora_pretrain.yaml", 20, "text")])
def test_llama_factorys_published_lora_examples_train(tmp_path, hub_model_dir, monkeypatch, name, rows, data_format):
    factory_data(tmp_path / "data")  # its `data/dataset_info.json`, from the working directory
    monkeypatch.chdir(tmp_path)
    effective = train(PEERS / name, tmp_path / "out", "--model_name_or_path", str(hub_model_dir), "--max_steps", "2")
    foreign = effective["foreign_keys"]
    assert foreign["read_as"] == "LLaMA-Factory config" and foreign["read_into"]["finetuning_type"] == {
        "use_lora": True}
    assert {entry["format"] for entry in foreign["read_into"]["dataset"]["dataset_mixture"]["datasets"]} == {
        data_format}
    assert json.loads((tmp_path / "out" / "data_summary.json").read_text())["train_rows"] == rows
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)  # LLaMA-Factory's default alpha: twice the rank
    assert foreign["tool_defaults"] == {"lora_alpha": 16, "lora_dropout": 0.0}
    assert effective["values"]["lora_alpha"]["source"].startswith("LLaMA-Factory's default")
    assert {"cutoff_len": "max_seq_length", "lora_rank": "lora_r", "lora_target": "lora_target_modules",
            "preprocessing_num_workers": "dataset_num_proc"}.items() <= foreign["renamed"].items()
    entries = foreign["read_into"]["dataset"]["dataset_mixture"]["datasets"]
    assert all(entry["rows"] == 1000 for entry in entries)  # `max_samples`: each dataset's first rows
    if name.endswith("_sft.yaml"):
        assert entries[1]["rename"] == {"question": "instruction", "answer": "output"}
        assert any(note.startswith("`template: llama3` (the tokenizer's own chat template") for note in foreign[
            "noted"])


def test_the_handbooks_published_smollm2_sft_recipe_trains(tmp_path, hub_model_dir, hub_data, monkeypatch, capsys):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # as the test suite runs
    monkeypatch.setenv("WANDB_MODE", "disabled")  # its `report_to: [tensorboard, wandb]`, with no W&B account here
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    recipe = PEERS / "handbook_smollm2_sft_published.yaml"
    model_and_data = ["--model_name_or_path", str(hub_model_dir), "--dataset_name",
                      str(hub_data["HuggingFaceTB/smoltalk"]), "--max_steps", "2"]
    # its `push_to_hub: true`, offline here, and `attn_implementation: flash_attention_2` without flash-attn: one
    # line each, before anything is written, and the run trains with each turned off
    assert main(["train", str(recipe), "--output_dir", str(tmp_path / "refused"), *model_and_data]) == 2
    assert "finetune: error: `push_to_hub: true` but the hub is offline here" in capsys.readouterr().err
    model_and_data += ["--push_to_hub", "false"]
    if importlib.util.find_spec("flash_attn") is None:
        assert main(["train", str(recipe), "--output_dir", str(tmp_path / "refused"), *model_and_data]) == 2
        assert "error: `attn_implementation: flash_attention_2` cannot be used here" in capsys.readouterr().err
        model_and_data += ["--attn_implementation", "sdpa"]
    effective = train(recipe, tmp_path / "out", *model_and_data)
    assert effective["values"]["max_seq_length"]["value"] == 8192
    renamed = effective["foreign_keys"]["renamed"]
    assert renamed["dataset_train_split"] == "dataset_split" and renamed["dataset_test_split"] == "eval_split"
    summary = json.loads((tmp_path / "out" / "data_summary.json").read_text())
    assert summary["train_rows"] == 32 and summary["eval_rows"] == 8  # config `all`, splits train and test
    assert saved_template(tmp_path / "out") == recipe_value(recipe, "chat_template")


def test_axolotls_published_8_bit_lora_example_is_refused_naming_what_trains_instead():
    with pytest.raises(RecipeError, match=r"^axolotl's `load_in_8bit: true` in recipe .*instruct_lora_8b.yml. is not "
                                          r"supported: an 8-bit base is not supported; `adapter: qlora` trains on a "
                                          r"4-bit NF4 base\.$"):
        read_recipe(PEERS / "axolotl_llama3_instruct_lora_8b.yml", [])
