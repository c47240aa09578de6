import pytest
from support import PROJECT_ROOT, accelerate_launch_command, error_lines, finetune_command, run

from finetune.cli import main


def test_top_level_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "configs", "plan", "report"):
        assert command in out


def test_train_help_and_recipe_keys(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "RECIPE" in capsys.readouterr().out.upper()
    assert main(["train", "--help-keys"]) == 0
    keys = capsys.readouterr().out
    for key in ("--model_name_or_path", "--max_seq_length", "--lora_r", "--learning_rate", "--deepspeed"):
        assert key in keys


def test_train_without_recipe_is_a_one_line_error(capsys):
    assert main(["train"]) == 2
    assert capsys.readouterr().err.strip() == ("finetune: error: `finetune train` needs a recipe: "
                                               "finetune train recipes/demo.yaml")


def test_bad_recipe_exits_non_zero_with_one_line_and_no_traceback(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model_name_or_path: tiny\nlearning_rat: 0.1\n")
    result = run(finetune_command("train", str(recipe)), timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("finetune: error:")]
    assert lines == [f"finetune: error: unknown key `learning_rat` in recipe `{recipe}` (did you mean "
                     "`learning_rate`?)."]


@pytest.mark.distributed
def test_bad_recipe_under_a_two_process_launch_is_reported_once(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train_file: missing.jsonl\n")
    command = accelerate_launch_command("accelerate_configs/cpu_deepspeed_zero2.yaml", "train", str(recipe))
    result = run(command, timeout=180, cwd=PROJECT_ROOT)
    assert result.returncode != 0
    assert error_lines(result.output) == [
        "finetune: error: `train_file: missing.jsonl` does not exist or is not a file."]
    assert "traceback : finetune: error: `train_file: missing.jsonl`" in result.output  # the launcher's summary
    assert "tokenizing" not in result.output  # stopped before any work, let alone a process group


def test_configs_help_lists_its_actions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["configs", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "write" in out and "check" in out and "lint" in out


def test_configs_lint_of_a_missing_file_fails(tmp_path, capsys):
    assert main(["configs", "lint", str(tmp_path / "nope.json")]) == 1
    assert f"{tmp_path / 'nope.json'}: no such file." in capsys.readouterr().out


def test_bench_help_and_an_unknown_variant(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "plain Trainer baseline" in capsys.readouterr().out
    assert main(["bench", "--cpu", "--variants", "finetune", "zero5"]) == 2
    assert "finetune: error: unknown variant(s) zero5; choose from plain_trainer, finetune" in capsys.readouterr().err


def test_rendezvous_help_and_a_node_rank_outside_the_job(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["rendezvous", "--help"])
    assert exit.value.code == 0 and "--main-addr" in capsys.readouterr().out
    command = ["rendezvous", "--nnodes", "2", "--node-rank", "5", "--main-addr", "127.0.0.1", "--main-port", "1"]
    assert main(command) == 2
    assert "node rank 5 is not in 0..1" in capsys.readouterr().err
    for option, value, message in (("--main-port", "70000", "`--main-port 70000` is not a TCP port"),
                                   ("--main-addr", "no such host!", "is not an address this machine can resolve")):
        bad = [*command[:command.index(option) + 1], value, *command[command.index(option) + 2:]]
        bad[bad.index("--node-rank") + 1] = "1"
        assert main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
