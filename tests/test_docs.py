"""Every command in the README and the docs is exercised: each is extracted from the Markdown (fenced shell blocks
and inline code that starts with a program) and run, or, where it needs GPUs or hours, checked piece by piece and
its CPU twin run. A command added to a document without a way to exercise it fails here."""

import os
import re
import runpy
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from accelerate.commands.launch import launch_command_parser
from support import DEMO_SHORT_RUN, PROJECT_ROOT, accelerate_launch_command, assert_succeeded, run

from finetune.cli import build_parser, main
from finetune.configs.lint import lint_file
from finetune.errors import RecipeError
from finetune.recipe.docs import RECIPE_REFERENCE, toolkit_training_fields
from finetune.recipe.parse import parse_recipe

DOCUMENTS = sorted(path.relative_to(PROJECT_ROOT) for path in PROJECT_ROOT.glob("**/*.md")
                   if not {".venv", "outputs", ".git", ".pytest_cache"} & set(path.relative_to(PROJECT_ROOT).parts))
PROGRAMS = ("finetune", "accelerate", "python", "make", "torchrun", "sbatch")
SCRIPT = re.compile(r"^scripts/\S+\.(sh|sbatch)$")
SHELL_BLOCK = re.compile(r"^[ \t]*```(?:bash|sh|shell)\n(.*?)^[ \t]*```", re.S | re.M)
ANY_BLOCK = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
ENVIRONMENT = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)+")
# Slow or GPU-only commands run elsewhere: the test that exercises them for real, or their CPU twin, is named here.
RUN_ELSEWHERE = {
    ("make", "demo"): "tests/train/test_train.py::test_demo_recipe_learns_on_two_processes_under_deepspeed_zero2",
    ("make", "test"): ".ci/run",
    ("make", "install"): "Makefile (a prerequisite of make test)",
    ("finetune", "bench"): "tests/commands/test_bench.py",
    ("finetune", "rendezvous"): "tests/launch/test_multinode.py",
    ("finetune", "serve"): "tests/commands/test_serve.py (a server runs until stopped)",
    ("sbatch", "scripts/slurm/finetune.sbatch"):
        "tests/launch/test_multinode.py::test_slurm_template_starts_one_launcher_per_node_with_its_rank",
}
# docs/troubleshooting.md forces a NaN on purpose: that command must stop with exit status 2.
FORCED_DIVERGENCE = "--learning_rate 1e30"
# The CPU, 2-process twin of each GPU launch config: an Accelerate config and the DeepSpeed JSON swapped in.
CPU_TWINS = {
    "accelerate_configs/ddp.yaml": ("accelerate_configs/cpu_ddp.yaml", None),
    "accelerate_configs/deepspeed_zero2.yaml": ("accelerate_configs/cpu_deepspeed_zero2.yaml", None),
}


def documented_commands() -> list[tuple[str, str]]:
    """(document, command) for every shell line in a fenced block and every inline span starting with a program."""
    found = []
    for document in DOCUMENTS:
        text = (PROJECT_ROOT / document).read_text()
        for block in SHELL_BLOCK.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                command = re.sub(r"\s+#.*$", "", line).strip()
                if command:
                    found.append((str(document), command))
        for span in INLINE.findall(ANY_BLOCK.sub("", text)):
            command = span.removeprefix("on each node: ")
            first = command.split()[0]
            if first in PROGRAMS or SCRIPT.match(first) or ENVIRONMENT.match(command):
                found.append((str(document), command))
    return sorted(set(found))


COMMANDS = documented_commands()


def words(command: str) -> list[str]:
    """The command's words without environment assignments, with a usage line's placeholders made concrete."""
    command = ENVIRONMENT.sub("", command).replace("[", "").replace("]", "").replace("FILE...", "FILE")
    return shlex.split(command)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Real things for the placeholders the docs use: a LoRA run's output_dir, a saved model, a data file."""
    root = tmp_path_factory.mktemp("docs")
    run_dir = root / "run"
    assert main(["train", str(PROJECT_ROOT / "recipes/demo.yaml"), "--use_lora", "true", "--max_steps", "2",
                 "--eval_on_start", "false", "--generation_eval_samples", "0", "--output_dir", str(run_dir),
                 "--disable_tqdm", "true"]) == 0
    from finetune import presets

    tokenizer = presets.build_tokenizer()
    presets.build_model(tokenizer).save_pretrained(root / "my-model")
    tokenizer.save_pretrained(root / "my-model")
    from hub_fixtures import save_hub_model

    hub_model = save_hub_model(root / "hub_model", "chatml")  # a GGUF export needs a BPE tokenizer with merges
    data = root / "my_data.jsonl"
    data.write_text('{"prompt": "2+2=", "completion": "4"}\n' * 8)
    return {"OUTPUT_DIR": str(run_dir), "OUT": str(root / "exported"), "FILE": "deepspeed_configs/zero2.json",
            "RECIPE.yaml": "recipes/demo.yaml", "./my-model": str(root / "my-model"), "my_data.jsonl": str(data),
            "N": "2", "root": root, "hub_model": str(hub_model)}


@pytest.fixture(autouse=True)
def process_state_restored():
    """A documented `--full_determinism true` run turns on deterministic algorithms for the whole process (and sets
    environment variables); later tests in this process must not inherit that (it makes every `torch.empty` fill)."""
    environment = dict(os.environ)
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)
    os.environ.clear()
    os.environ.update(environment)


def concrete(argv: list[str], places: dict) -> list[str]:
    argv = [places.get(word, word) for word in argv]
    for index, word in enumerate(argv[:-1]):  # outputs go to a temporary folder, never into the checkout
        if word in ("--output_dir", "--out"):
            argv[index + 1] = str(places["root"] / "outputs" / Path(argv[index + 1]).name)
    return argv


def test_the_docs_have_commands_to_check():
    documents = {document for document, _ in COMMANDS}
    assert {"README.md", "docs/strategies.md", "docs/troubleshooting.md", "notebooks/README.md"} <= documents
    assert len(COMMANDS) > 40


@pytest.mark.parametrize("document,command", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command_is_exercised(document, command, places, monkeypatch, capsys):
    monkeypatch.chdir(PROJECT_ROOT)
    argv = concrete(words(command), places)
    program, rest = argv[0], argv[1:]
    elsewhere = RUN_ELSEWHERE.get((program, rest[0] if rest else ""))
    if program == "make":
        assert elsewhere, f"no test runs `{command}`"
        target = rest[0]
        assert re.search(rf"^{target}:", (PROJECT_ROOT / "Makefile").read_text(), re.M)
        if target == "test":
            assert "make test" in (PROJECT_ROOT / ".ci/run").read_text()
        if target == "demo":
            assert "test_demo_recipe_learns_on_two_processes_under_deepspeed_zero2" in (
                PROJECT_ROOT / "tests/train/test_train.py").read_text()
            assert "exec finetune train recipes/demo.yaml --gpus" in (PROJECT_ROOT / "scripts/demo.sh").read_text()
    elif program == "sbatch":  # SLURM's options, then the template, then what it passes to the launch script
        position = next(index for index, word in enumerate(rest) if word.startswith("scripts/"))
        template = (PROJECT_ROOT / rest[position]).read_text()
        assert all(f"#SBATCH {option.split('=')[0]}=" in template for option in rest[:position]), command
        parse_recipe(rest[position + 1], rest[position + 2:])
    elif SCRIPT.match(program):
        check_script(argv, places)
    elif program == "finetune":
        check_finetune(rest, elsewhere, places, capsys)
    elif program == "accelerate" and rest[:1] == ["launch"] and len(rest) > 1:
        check_launch(rest[1:], places)
    elif program in ("accelerate", "python"):
        check_help_lists_the_options(argv, monkeypatch, capsys)
    else:
        pytest.fail(f"{document}: no way to exercise `{command}`")


# A `finetune train` with one of these launches itself: checked by its dry run, whose `accelerate launch` is then
# checked as a documented one (the demo's runs for real: tests/train/test_train.py).
SELF_LAUNCH_OPTIONS = ("--gpus", "--strategy", "--nnodes", "--dry-run")


def check_self_launch(argv: list[str], places: dict, capsys) -> None:
    argv = list(argv)
    if "--model_name_or_path" in argv and not Path(argv[argv.index("--model_name_or_path") + 1]).exists():
        argv[argv.index("--model_name_or_path") + 1] = "tiny"  # planned offline: a hub id's config cannot be fetched
    status = main([*argv, *([] if "--dry-run" in argv else ["--dry-run"])])
    output = capsys.readouterr()
    assert status == 0, output.out[-3000:] + output.err[-3000:]
    assert output.out.startswith("plan: "), output.out
    launch = next(line for line in output.out.splitlines() if line.startswith("launch: "))
    if launch != "launch: none, one process runs here":
        check_launch(shlex.split(launch.removeprefix("launch: "))[2:], places)


def check_finetune(argv: list[str], elsewhere: str | None, places: dict, capsys) -> None:
    if argv[:1] == ["train"] and set(SELF_LAUNCH_OPTIONS) & set(argv):
        check_self_launch(argv, places, capsys)
        return
    bare = len(argv) <= 1  # `finetune`, `finetune train`: a name in a sentence, not a call
    if bare or elsewhere:
        try:
            build_parser().parse_args([*argv, *(["--help"] if bare else [])])
        except SystemExit as exit:
            assert exit.code == 0, capsys.readouterr().err
        return
    if argv[:2] == ["configs", "write"] and "--out" not in argv:
        argv = [*argv, "--out", str(places["root"] / "configs")]  # not over the checkout
    if "--gguf" in argv:  # the demo's byte tokenizer has no merges, which GGUF needs (refused, and tested so)
        argv = [places["hub_model"] if word == places["OUTPUT_DIR"] else word for word in argv]
    expected = 2 if FORCED_DIVERGENCE in " ".join(argv) else 0
    status = main(argv)
    output = capsys.readouterr()
    assert status == expected, output.out[-3000:] + output.err[-3000:]
    if expected == 2:  # docs/troubleshooting.md forces a divergence on purpose
        assert "training diverged at step" in output.err


def check_script(argv: list[str], places: dict) -> None:
    """A launch script, run with FINETUNE_DRY_RUN=1: it accepts the documented options and prints the commands it
    would run, and each of those is checked like a documented command."""
    script = PROJECT_ROOT / argv[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{argv[0]} is missing or not executable"
    if argv[0].endswith(".sbatch"):
        return  # rendered for 2 nodes under a stand-in srun by tests/launch/test_multinode.py
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "FINETUNE_DRY_RUN": "1"}
    arguments = argv[1:] or ["--help"]
    result = subprocess.run([str(script), *arguments], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines() if argv[1:] else []:
        words_ = shlex.split(line)
        if words_[:2] == ["accelerate", "launch"]:
            check_launch(words_[2:], places)
        elif words_[:2] == ["finetune", "rendezvous"]:
            build_parser().parse_args(words_[1:])
        elif words_[:1] == ["deepspeed"]:
            module = words_.index("--module")
            assert words_[module + 1:module + 3] == ["finetune", "train"]
            train = words_[module + 3:]
            at = train.index("--deepspeed")
            assert lint_file(PROJECT_ROOT / train[at + 1]) == []
            # Without the JSON: TrainingArguments(deepspeed=ZeRO-3 JSON) would switch on zero.Init for the process.
            parse_recipe(train[0], train[1:at] + train[at + 2:])


def split_launch(argv: list[str]) -> tuple[list[str], list[str]]:
    """Launcher options, then the `finetune train` arguments (`finetune.testing.fsdp_on_cpu train` for FSDP on CPU)."""
    module = argv.index("-m")
    assert argv[module + 1] in ("finetune", "finetune.testing.fsdp_on_cpu", "finetune.testing.parallelism_on_cpu") \
        and argv[module + 2] == "train", argv
    return argv[:module], argv[module + 3:]


def check_launch(argv: list[str], places: dict) -> None:
    """A launch is checked piece by piece: Accelerate's own parser takes the launcher options, the config (and any
    DeepSpeed JSON) pass the lint, and the recipe with its overrides parses as `finetune train` would."""
    launcher, train = split_launch(argv)
    launch_command_parser().parse_args([*launcher, "-m", "finetune", "train", *train])
    options = dict(zip(launcher[::2], launcher[1::2]))
    for path in (options["--config_file"], options.get("--deepspeed_config_file")):
        if path is not None:
            assert lint_file(PROJECT_ROOT / path) == [], path
    try:
        parse_recipe(train[0], train[1:])
    except RecipeError as error:  # an option only a GPU can honour is refused on this machine, by name; one sized
        # by the launch's process count (a pipeline's stages) is refused in this one process, naming the count
        one_process = "but the launch has 1 process(es)" in str(error)
        assert one_process or ("needs CUDA" in str(error) and not torch.cuda.is_available()), error


@pytest.mark.distributed
@pytest.mark.launcher
def test_the_readme_two_gpu_launch_runs_on_its_cpu_twin(places, tmp_path):
    """The README's 2-GPU command, as written but on the CPU twin of its config, the tiny model and a few steps."""
    command = next(c for d, c in COMMANDS if d == "README.md" and "accelerate_configs/ddp.yaml" in c)
    launcher, train = split_launch(words(command)[2:])
    config, _ = CPU_TWINS[dict(zip(launcher[::2], launcher[1::2]))["--config_file"]]
    overrides = concrete(train[1:], places)
    overrides[overrides.index("--model_name_or_path") + 1] = "tiny"
    overrides[overrides.index("--output_dir") + 1] = str(tmp_path / "run")
    result = run(accelerate_launch_command(config, "train", train[0], *overrides, *DEMO_SHORT_RUN,
                                           "--max_seq_length", "64"))
    assert_succeeded(result)
    plan = (tmp_path / "run" / "batch_plan.json").read_text()
    assert '"global_batch_size": 32' in plan and '"world_size": 2' in plan


def check_help_lists_the_options(argv: list[str], monkeypatch, capsys) -> None:
    """A script or tool too slow to run here: it exists, its --help works and names every option the docs pass."""
    if argv[0] == "python":
        monkeypatch.setattr(sys, "argv", [argv[1], "--help"])
        entry = partial(runpy.run_path, str(PROJECT_ROOT / argv[1]), run_name="__main__")
    else:
        from accelerate.commands.accelerate_cli import main as accelerate_main

        monkeypatch.setattr(sys, "argv", ["accelerate", argv[1], "--help"])
        entry = accelerate_main
    with pytest.raises(SystemExit) as exit:
        entry()
    help_text = capsys.readouterr().out
    assert exit.value.code in (0, None), help_text
    for option in (word for word in argv[2:] if word.startswith("--")):
        assert option in help_text, f"{option} is not an option of {argv[1]}"


def test_recipe_reference_documents_every_toolkit_key():
    from dataclasses import fields

    from finetune.recipe.args import DataArguments, LoraArguments, ModelArguments

    text = (PROJECT_ROOT / RECIPE_REFERENCE).read_text()
    keys = [f.name for section in (ModelArguments, DataArguments, LoraArguments) for f in fields(section)]
    changed, added = toolkit_training_fields()
    keys += [f.name for f, _ in changed] + [f.name for f in added] + ["use_cpu", "learning_rate", "deepspeed"]
    missing = [key for key in keys if f"| `{key}` |" not in text]
    assert not missing and "logging_nan_inf_filter" in keys
