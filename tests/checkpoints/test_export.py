"""`finetune export`: ZeRO-3 shards consolidated and a LoRA adapter merged, both loading with `from_pretrained`
and giving the trained model's logits; pickled weights are refused; help and error paths."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from finetune import presets
from finetune.cli import main

INPUT = torch.tensor([[10, 20, 30, 40, 50, 60, 70]])


def logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=INPUT).logits


@pytest.mark.distributed
def test_zero3_shards_export_to_the_same_model_deepspeed_gathered(deepspeed_runs, tmp_path):
    output_dir = deepspeed_runs["zero3"]["output_dir"]
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(output_dir / "checkpoint-3", checkpoint)
    (checkpoint / "model.safetensors").unlink()  # leave only the ZeRO shards
    assert any(path.name.startswith("global_step") for path in checkpoint.iterdir())
    assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    trained = AutoModelForCausalLM.from_pretrained(output_dir)  # gathered by DeepSpeed at step 3
    torch.testing.assert_close(logits(exported), logits(trained), atol=1e-5, rtol=1e-5)
    assert (tmp_path / "exported" / "model.safetensors").is_file()


@pytest.mark.distributed
def test_merged_lora_loads_and_gives_the_adapted_models_logits(lora_runs, tmp_path):
    from peft import PeftModel

    adapter_dir = lora_runs["zero3"]
    assert main(["export", str(adapter_dir), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    adapted = PeftModel.from_pretrained(presets.build_model(presets.build_tokenizer(), seed=0), adapter_dir)
    torch.testing.assert_close(logits(merged), logits(adapted), atol=1e-5, rtol=1e-5)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert main(["export", str(adapter_dir), str(tmp_path / "adapter"), "--dtype", "bf16"]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()  # kept standalone


def test_pickled_weights_are_refused_not_loaded(tmp_path, capsys):
    source = tmp_path / "run"
    source.mkdir()
    presets.build_model_config(presets.build_tokenizer()).save_pretrained(source)
    (source / "pytorch_model.bin").write_bytes(b"\x80\x04not a model, and never unpickled")
    assert main(["export", str(source), str(tmp_path / "out")]) == 2
    assert "only pickled weights (pytorch_model.bin); they are not loaded" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--help"])
    assert exit_info.value.code == 0 and "--merge-lora" in capsys.readouterr().out
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "holds no model" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--merge-lora"]) == 2
    assert "holds no LoRA adapter" in capsys.readouterr().err


@pytest.mark.distributed
def test_zero3_shards_answer_in_chat_as_the_gathered_model(deepspeed_runs, tmp_path, capsys):
    """`finetune chat` on a ZeRO-3 checkpoint's shards (consolidated as export does) answers as the weights DeepSpeed
    gathered at the same step. Here, not in tests/commands/test_chat.py, so that the chat tests, which read the demo
    run, and the DeepSpeed runs' readers are two worker groups under pytest-xdist (tests/conftest.py)."""
    output_dir = deepspeed_runs["zero3"]["output_dir"]
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(output_dir / "checkpoint-3", checkpoint)
    (checkpoint / "model.safetensors").unlink()  # leave only the ZeRO shards
    outputs = []
    for source in (checkpoint, output_dir):  # the shards, and the weights DeepSpeed gathered at step 3
        assert main(["chat", str(source), "--prompt", "reverse\n\nabc", "--max-new-tokens", "8"]) == 0
        outputs.append(capsys.readouterr())
    assert outputs[0].out == outputs[1].out  # after 3 steps: EOS first, by a logit margin of 0.16
    assert "Processing zero checkpoint" in outputs[0].err  # DeepSpeed's consolidation prints, kept off stdout


def test_a_full_disk_is_one_line_and_leaves_nothing_partial(tmp_path, capsys, monkeypatch):
    """safetensors' quoted ENOSPC halfway through the weights: one line naming the folder, and no half-written file."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    tokenizer = presets.build_tokenizer()
    presets.build_model(tokenizer, seed=0).save_pretrained(tmp_path / "run")

    def full_disk(model, folder, **kwargs):
        (folder / "model.safetensors").write_bytes(b"x" * 2000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 2
    output = capsys.readouterr().err
    assert "Traceback" not in output
    assert output.strip().splitlines()[-1].startswith(f"finetune: error: no space left on {out}: ")
    assert "the exported model needs ~" in output and "nothing partial was left there" in output
    assert not out.exists()
