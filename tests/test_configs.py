import shutil

from finetune.cli import main
from finetune.configs.files import shipped_configs
from finetune.testing import PROJECT_ROOT


def test_shipped_configs_match_the_generator(capsys):
    assert main(["configs", "check", "--root", str(PROJECT_ROOT)]) == 0


def test_check_fails_with_a_diff_on_a_hand_edited_file(tmp_path, capsys):
    for relative in shipped_configs():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PROJECT_ROOT / relative, tmp_path / relative)
    edited = tmp_path / "deepspeed_configs" / "zero2.json"
    edited.write_text(edited.read_text().replace('"stage": 2', '"stage": 1'))
    assert main(["configs", "check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert '-    "stage": 1,' in out and '+    "stage": 2,' in out


def test_write_then_check_round_trips(tmp_path, capsys):
    assert main(["configs", "write", "--out", str(tmp_path)]) == 0
    assert main(["configs", "check", "--root", str(tmp_path)]) == 0
