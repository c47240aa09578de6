"""The model loader's refusals that need no model: a path-like name that names no folder stops at once instead of
waiting on the hub's retries."""

import time

import pytest

from finetune.errors import RecipeError
from finetune.models.loading import check_local_path, load_tokenizer, looks_local
from finetune.recipe.args import ModelArguments


def test_a_misspelled_local_model_folder_is_named_at_once_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    started = time.monotonic()
    with pytest.raises(RecipeError, match=r"^`model_name_or_path: models/my-modle`: no such directory; give the "
                                          r"folder holding config.json"):
        load_tokenizer(ModelArguments(model_name_or_path="models/my-modle"))
    assert time.monotonic() - started < 5
    check_local_path("models/my-model", "model_name_or_path")  # the folder that is there passes


@pytest.mark.parametrize("name, local", [
    ("Qwen/Qwen2.5-0.5B", False), ("gpt2", False), ("models/x", True), ("./x", True), ("~/x", True), ("/x", True),
    ("a/b/c", True),
])
def test_a_name_is_local_when_it_can_only_be_a_path(tmp_path, monkeypatch, name, local):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert looks_local(name) is local


def test_a_chat_template_file_that_is_not_utf8_is_named_with_the_byte_offset(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_bytes("{% for m in messages %}{{ m['content'] }} ".encode() + b"caf\xe9{% endfor %}")
    with pytest.raises(RecipeError, match=rf"^`chat_template: {template}`: the file is not UTF-8 text \(byte 0xe9 at "
                                          r"offset 45\); save it as UTF-8"):
        ModelArguments(chat_template=str(template))
