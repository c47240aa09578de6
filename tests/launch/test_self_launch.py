"""`finetune train RECIPE.yaml` without a launcher: it plans, picks the strategy (named, or `auto`), and becomes
Accelerate's launcher with the shipped config. Real 2-process self-launches are compared with the same runs typed as
`accelerate launch` (the shared `deepspeed_runs`); the choices, commands and refusals are checked by dry runs."""

import json
import os
import shlex
import subprocess

import pytest
from gpu_simulation import A100, simulate_gpus
from support import DEMO_SHORT_RUN, PROJECT_ROOT, assert_succeeded, error_lines, run

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.launch.commands import finetune_command
from finetune.launch.self_launch import LAUNCH_PLAN_ENV, split_launch_options, this_machine
from finetune.plan.launch import plan_launch
from finetune.recipe.parse import parse_recipe

# The launcher tier (`finetune train` launching itself: the real launcher it starts):
# launches are real processes, not forked (tests/support.py).
pytestmark = pytest.mark.launcher

LAUNCHER_VARIABLES = ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_DEEPSPEED",
                      "ACCELERATE_USE_FSDP", LAUNCH_PLAN_ENV, "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID",
                      "SLURM_STEP_ID")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch, tmp_path):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(PROJECT_ROOT)


def dry_run(capsys, *arguments) -> tuple[str, list[str]]:
    """The plan lines and the launch command (as typed) a dry run prints."""
    assert main(["train", "recipes/demo.yaml", *arguments, "--dry-run"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    launch = next(line for line in out.splitlines() if line.startswith("launch: "))
    return out, shlex.split(launch.removeprefix("launch: "))


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_a_named_strategy_launches_its_shipped_cpu_config_on_the_processes_asked_for(capsys):
    out, command = dry_run(capsys, "--gpus", "2")
    assert command[:2] == ["accelerate", "launch"]
    assert option(command, "--config_file") == "accelerate_configs/cpu_deepspeed_zero2.yaml"
    assert option(command, "--deepspeed_config_file") == "deepspeed_configs/zero2.json"
    assert option(command, "--num_processes") == "2" and option(command, "--num_machines") == "1"
    assert command[command.index("-m"):][:4] == ["-m", "finetune", "train", "recipes/demo.yaml"]
    assert "plan: ZeRO-2 (named by the recipe recipes/demo.yaml) on 2 CPU process(es)" in out
    _, command = dry_run(capsys, "--gpus", "2", "--strategy", "zero3")
    assert option(command, "--deepspeed_config_file") == "deepspeed_configs/zero3.json"
    _, command = dry_run(capsys, "--strategy", "fsdp_shard_grad_op", "--gpus", "3")
    assert option(command, "--config_file") == "accelerate_configs/cpu_fsdp_shard_grad_op.yaml"
    assert option(command, "--num_processes") == "3" and "finetune.testing.fsdp_on_cpu" in command
    # Launch options before the recipe work as after it.
    assert main(["train", "--gpus", "2", "--dry-run", "recipes/demo.yaml", "--strategy", "ddp"]) == 0
    assert "--config_file accelerate_configs/cpu_ddp.yaml --num_processes 2" in capsys.readouterr().out


def test_outside_the_checkout_the_generators_configs_are_written_to_the_cache(tmp_path, monkeypatch, capsys):
    from finetune.generated_files import expected_files

    monkeypatch.chdir(tmp_path)
    recipe = str(PROJECT_ROOT / "recipes/demo.yaml")
    assert main(["train", recipe, "--gpus", "2", "--strategy", "zero3_offload", "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out.split("launch: ")[-1])
    config, deepspeed = option(command, "--config_file"), option(command, "--deepspeed_config_file")
    assert config.startswith(str(tmp_path / "cache" / "launch_configs"))
    files = expected_files(docs=False)
    assert open(config).read() == files["accelerate_configs/cpu_deepspeed_zero2.yaml"]
    assert open(deepspeed).read() == files["deepspeed_configs/zero3_offload.json"]


def test_auto_picks_the_first_strategy_that_fits_the_declared_memory_and_names_what_it_rejected(capsys):
    out, command = dry_run(capsys, "--gpus", "2", "--strategy", "auto", "--gpu-memory", "1000")
    assert "--config_file accelerate_configs/cpu_ddp.yaml" in shlex.join(command)
    assert command[-2:] == ["--strategy", "ddp"]  # named to the ranks, which check they run it
    _, record, _ = auto_plan(0.005)
    assert "no strategy fits" in record
    memory, record = memory_that_picks_zero3_offload()
    assert record["strategy"] == "zero3_offload" and record["fits"]
    rejected = [row["strategy"] for row in record["rejected"]]
    assert rejected == ["DDP", "ZeRO-1", "ZeRO-2", "FSDP shard-grad-op", "ZeRO-3", "FSDP full-shard",
                        "ZeRO-2 + CPU offload"]
    assert all("usable" in row["reason"] for row in record["rejected"])
    assert record["predicted"]["total_bytes"] <= record["usable_bytes"] < min(
        row["predicted_bytes"] for row in record["rejected"])


def auto_plan(memory_gib: float):
    """A plan of the demo recipe's short run with `strategy: auto` on 2 CPU processes of `memory_gib` GiB each."""
    from finetune.errors import RecipeError

    options, overrides = split_launch_options(["--gpus", "2", "--gpu-memory", str(memory_gib), *DEMO_SHORT_RUN,
                                               "--strategy", "auto"])
    try:
        return plan_launch("recipes/demo.yaml", overrides, this_machine(options))
    except RecipeError as error:
        return None, str(error), None


def memory_that_picks_zero3_offload() -> tuple[float, dict]:
    """The GPU memory at which the plan must offload: between ZeRO-3 + CPU offload's prediction and the smallest of
    those before it, read from the planner's own candidates."""
    _, record, _ = auto_plan(1000)
    totals = {row["key"]: row["predicted_bytes"] for row in record["candidates"]}
    before = min(total for key, total in totals.items() if key != "zero3_offload")
    memory = (totals["zero3_offload"] + before) / 2 / 0.9 / 1024**3
    _, record, _ = auto_plan(memory)
    return memory, record


def test_the_launch_options_are_refused_where_they_cannot_apply(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's agent, under `accelerate launch` too
    assert main(["train", "recipes/demo.yaml", "--gpus", "2"]) == 2
    assert "under `accelerate launch` or torchrun the launcher's own options decide" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    for arguments, message in (
        (["--gpus", "0"], "`--gpus 0` must be at least 1"),
        (["--gpus", "2", "--strategy", "zero4"], "no shipped strategy `zero4`"),
        (["--gpus", "2", "--strategy", "single"], "strategy `single` runs on one GPU"),
        (["--gpus", "2", "--strategy", "zero3", "--deepspeed", "deepspeed_configs/zero2.json"], "keep one"),
        (["--gpus", "2", "--nnodes", "2"], "needs the main machine's address"),
        (["--gpus", "2", "--nnodes", "2", "--node-rank", "2", "--main-addr", "h"], "is not in 0..1"),
        (["--nnodes", "1", "--node-rank", "3"], "`--node-rank 3` is not in 0..0 (`--nnodes 1`)"),
        (["--node-rank", "-1"], "`--node-rank -1` is not in 0..0"),
        (["--gpus", "2", "--nnodes", "2", "--main-addr", "h", "--main-port", "70000"],
         "`--main-port 70000` is not a TCP port: give one in 1..65535"),
        (["--main-port", "0"], "`--main-port 0` is not a TCP port"),
    ):
        assert main(["train", "recipes/demo.yaml", *arguments, "--dry-run"]) == 2, arguments
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (arguments, err)


def test_slurms_variables_that_are_not_numbers_are_named(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "4321")
    for name in ("SLURM_NNODES", "SLURM_NODEID"):
        monkeypatch.setenv(name, "abc")
        assert main(["train", "recipes/demo.yaml", "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"{name}='abc' is not a whole number: fix or unset it" in err and len(err.strip().splitlines()) == 1
        monkeypatch.delenv(name)


def test_rendezvous_variables_no_launcher_set_are_named_and_a_launchers_are_not(monkeypatch, capsys):
    from finetune.plan.launch import launch_or_run_here

    monkeypatch.setattr("os.execve", lambda *args: pytest.fail(f"launched: {args[1]}"))
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29400")):
        monkeypatch.setenv(name, value)
    # a leftover from another job's shell: named at once, not a wait of ddp_timeout for a rank nobody starts
    stray = r"WORLD_SIZE=2 RANK=0 MASTER_ADDR=127\.0\.0\.1 MASTER_PORT=29400"
    with pytest.raises(RecipeError, match=rf"^{stray} set, but no launcher started this process .*: unset them "
                                          r"\(`unset WORLD_SIZE RANK MASTER_ADDR MASTER_PORT`\) to run here, or "
                                          r"launch with `accelerate launch`"):
        launch_or_run_here("recipes/demo.yaml", ["--max_steps", "1"])
    assert main(["train", "recipes/demo.yaml", "--max_steps", "1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    # what each launcher sets beside them: torchrun's agent (also under `accelerate launch`), accelerate's one
    # process, DeepSpeed's launcher, srun starting every task of its step
    for marker in ({"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0"}, {"ACCELERATE_MIXED_PRECISION": "no"},
                   {"CROSS_RANK": "0"}, {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}):
        with monkeypatch.context() as launched:
            for name, value in marker.items():
                launched.setenv(name, value)
            assert launch_or_run_here("recipes/demo.yaml", ["--max_steps", "1"]) == ["--max_steps", "1"], marker


def test_a_gpu_machine_launches_every_gpu_and_several_nodes_meet_through_slurms_variables(monkeypatch, capsys):
    simulate_gpus(monkeypatch, A100, count=8, memory_gib=80)
    _, command = dry_run(capsys, "--use_cpu", "false")
    assert option(command, "--num_processes") == "8"  # every GPU it sees
    assert option(command, "--config_file") == "accelerate_configs/deepspeed_zero2.yaml"
    assert main(["train", "recipes/demo.yaml", "--gpus", "9", "--dry-run"]) == 2
    assert "`--gpus 9` but this machine sees 8 GPU(s)" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_ID", "4321")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    out, command = dry_run(capsys, "--main-addr", "node-a", "--strategy", "zero3", "--use_cpu", "false")
    assert option(command, "--num_processes") == "8" and option(command, "--num_machines") == "2"
    assert option(command, "--machine_rank") == "1" and option(command, "--main_process_ip") == "node-a"
    assert option(command, "--main_process_port") == str(4321 % 10000 + 20000)  # one port per job
    assert option(command, "--deepspeed_multinode_launcher") == "standard"
    assert "4 × NVIDIA A100-SXM4-80GB on each of 2 nodes (this is node 1)" in out


def test_one_gpu_asked_of_a_machine_with_eight_runs_anew_seeing_only_one(monkeypatch, capsys):
    """`--gpus 1` on an 8-GPU node: one process with no launcher would see all 8, which preflight refuses
    (nn.DataParallel); the run starts anew (same pid, its plan) with CUDA_VISIBLE_DEVICES naming one of them."""
    from finetune.recipe.preflight import check_one_process_per_gpu

    simulate_gpus(monkeypatch, A100, count=8, memory_gib=80)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RecipeError, match="8 GPUs are visible to one process"):  # what running here would meet
        check_one_process_per_gpu({"use_cpu": False})
    out, command = dry_run(capsys, "--gpus", "1", "--strategy", "single", "--use_cpu", "false")
    assert command[:4] == ["CUDA_VISIBLE_DEVICES=0", "finetune", "train", "recipes/demo.yaml"]
    assert "plan: one process here on GPU 0, one of the 8 this machine shows" in out
    became = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: became.append((path, argv, env)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2,3")  # a scheduler's order: its first is taken
    assert main(["train", "recipes/demo.yaml", "--gpus", "1", "--strategy", "single", "--use_cpu", "false",
                 "--max_steps", "1"]) == 0
    ((path, argv, env),) = became
    assert argv[1:] == ["-m", "finetune", "train", "recipes/demo.yaml", "--strategy", "single", "--use_cpu",
                        "false", "--max_steps", "1"] and path == argv[0]
    assert env["CUDA_VISIBLE_DEVICES"] == "4"
    plan = json.loads(env[LAUNCH_PLAN_ENV])
    assert plan["launcher_pid"] == os.getpid() and plan["processes"] == 1  # the run it becomes trusts it
    assert plan["launch"].startswith("CUDA_VISIBLE_DEVICES=4 finetune train recipes/demo.yaml")
    capsys.readouterr()
    # A machine showing one GPU runs here, as before.
    simulate_gpus(monkeypatch, A100, count=1, memory_gib=80)
    _, command = dry_run(capsys, "--gpus", "1", "--strategy", "single", "--use_cpu", "false")
    assert command == ["none,", "one", "process", "runs", "here"]


def test_a_strategy_named_on_the_command_line_must_be_what_a_typed_launch_runs(monkeypatch, capsys):
    from finetune.errors import RecipeError

    with pytest.raises(RecipeError, match="no shipped strategy `zero5`"):  # one process here checks the name too
        parse_recipe("recipes/demo.yaml", ["--strategy", "zero5", "--max_steps", "1"])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "deepspeed_configs/zero2.json")
    with pytest.raises(RecipeError, match="asks for deepspeed_zero3, but this launch runs deepspeed_zero2"):
        parse_recipe("recipes/demo.yaml", ["--strategy", "zero3", "--max_steps", "1"])
    capsys.readouterr()
    # The recipe file's own strategy (demo.yaml: zero2) gives way to the typed launch's config, said once.
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "deepspeed_configs/zero3.json")
    assert parse_recipe("recipes/demo.yaml", ["--max_steps", "1"]).strategy.zero_stage == 3
    out = capsys.readouterr().out
    assert out.count("warning: `strategy: zero2` asks for deepspeed_zero2, but this launch runs deepspeed_zero3") == 1


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """The demo's short run launched by `finetune train --gpus 2 --strategy auto` itself, with the GPU memory at which
    the plan must offload."""
    cache = tmp_path_factory.mktemp("cache")
    memory, _ = memory_that_picks_zero3_offload()
    output_dir = tmp_path_factory.mktemp("self_auto")
    command = finetune_command("train", "recipes/demo.yaml", "--gpus", "2", "--output_dir", str(output_dir),
                               *DEMO_SHORT_RUN, "--strategy", "auto", "--gpu-memory", f"{memory:.6f}")
    return output_dir, run(command, env={"FINETUNE_CACHE": str(cache)}), cache


def run_record(output_dir) -> dict:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {"effective": json.loads((output_dir / "effective_config.json").read_text()),
            "losses": [entry["loss"] for entry in state["log_history"] if "loss" in entry],
            "summary": json.loads((output_dir / "eval_results.json").read_text())}


def check_planned_run(output_dir, output: str, strategy: str) -> dict:
    """A self-launched run: its plan recorded and printed as the launch a user could type, and the memory every rank
    held against it (the model states it predicted, to the alignment slack)."""
    record = run_record(output_dir)
    plan = record["effective"]["plan"]
    assert plan["strategy"] == strategy and plan["processes"] == 2
    assert plan["launch"].startswith("accelerate launch --config_file accelerate_configs/cpu_deepspeed_zero2.yaml")
    assert f"--deepspeed_config_file deepspeed_configs/{strategy}.json" in plan["launch"]
    assert f"launch: {plan['launch']}" in output
    assert record["effective"]["values"]["world_size"]["value"] == 2
    check = record["summary"]["memory_against_plan"]
    assert check["against"] == "the launch plan" and check["what"] == "model states"
    assert [rank["rank"] for rank in check["ranks"]] == [0, 1] and check["over"] == []
    assert all(rank["ratio"] == pytest.approx(1.0, abs=0.02) for rank in check["ranks"])
    return record


@pytest.mark.distributed
def test_a_named_strategy_launches_its_shipped_config_for_real(deepspeed_runs):
    """`finetune train --gpus 2 --strategy zero3` (the shared ZeRO-3 run every ZeRO-3 test reads): the engine runs
    stage 3 with partitioned parameters (the strategy check stops otherwise)."""
    run = deepspeed_runs["zero3"]
    record = check_planned_run(run["output_dir"], run["output"], "zero3")
    assert record["effective"]["plan"]["chosen_by"] == "named by the command line"
    assert record["effective"]["strategy"]["running"]["zero_stage"] == 3


@pytest.mark.distributed
def test_the_known_library_warnings_are_not_in_a_runs_log(deepspeed_runs, lora_runs):
    """DeepSpeed ZeRO-3's collectives warned several times a step (torch's renamed all_gather / reduce_scatter), and
    DDP searched every LoRA step for unused parameters and warned on each rank that it found none."""
    zero3 = deepspeed_runs["zero3"]["output"]
    assert "FutureWarning" not in zero3 and "reduce_scatter_tensor" not in zero3
    lora_ddp = lora_runs["ddp"]
    log = lora_ddp.with_name(f"{lora_ddp.name}.log").read_text()
    assert "find_unused_parameters" not in log and "FutureWarning" not in log
    assert "{'loss': " in log  # the log of the training itself


@pytest.mark.distributed
def test_a_self_launch_runs_as_the_same_launch_typed_by_hand(auto_run, deepspeed_runs):
    """`--strategy auto` chose ZeRO-3 + CPU offload; the same run typed as `accelerate launch` with that config
    writes the same strategy and the same losses."""
    output_dir, result, cache = auto_run
    assert_succeeded(result)
    assert not error_lines(result.output)
    mine, theirs = check_planned_run(output_dir, result.output, "zero3_offload"), deepspeed_runs["zero3_offload"]
    for side in ("requested", "running"):
        assert {key: value for key, value in mine["effective"]["strategy"][side].items() if key != "source"} == {
            key: value for key, value in theirs["effective"]["strategy"][side].items() if key != "source"}
    assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6) and len(mine["losses"]) == 3
    plan = mine["effective"]["plan"]
    assert plan["chosen_by"].startswith("auto") and len(plan["rejected"]) == 7
    assert not (cache / "plan_calibration.json").exists()  # CPU processes calibrate nothing

def test_a_model_the_estimator_cannot_read_launches_a_named_strategy_unplanned_but_not_auto(tmp_path, capsys):
    from finetune import presets

    model = tmp_path / "mystery"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mystery"}')
    assert main(["train", "recipes/demo.yaml", "--gpus", "2", "--model_name_or_path", str(model), "--dry-run"]) == 2
    assert "has no tokenizer this machine can load" in capsys.readouterr().err  # one line, no traceback
    presets.build_tokenizer().save_pretrained(model)
    out, command = dry_run(capsys, "--gpus", "2", "--model_name_or_path", str(model))
    assert "warning: no plan for this launch (cannot read the config of" in out
    assert option(command, "--deepspeed_config_file") == "deepspeed_configs/zero2.json"
    assert main(["train", "recipes/demo.yaml", "--gpus", "2", "--strategy", "auto", "--model_name_or_path",
                 str(model), "--dry-run"]) == 2
    assert "`strategy: auto` needs a plan, and none could be made" in capsys.readouterr().err


def test_without_gpus_and_without_gpus_asked_for_the_recipe_runs_here_in_one_process(monkeypatch, capsys):
    from finetune.plan.launch import launch_or_run_here

    monkeypatch.setattr("os.execve", lambda *args: pytest.fail(f"launched: {args[1]}"))
    assert launch_or_run_here("recipes/demo.yaml", ["--max_steps", "1"]) == ["--max_steps", "1"]
    assert LAUNCH_PLAN_ENV not in os.environ  # nothing planned for one process here
    # its dry run says the same, by the same decision: no launch of the recipe's ZeRO-2 on one CPU process
    out, command = dry_run(capsys)
    assert command == ["none,", "one", "process", "runs", "here"]
    assert out.startswith("plan: one process here, without a launcher and unplanned") and "ZeRO-2" not in out
    assert main(["train", "recipes/demo.yaml", "--max_stesp", "1", "--dry-run"]) == 2  # its keys are still checked
    assert "unknown option `--max_stesp` (did you mean `max_steps`?)" in capsys.readouterr().err


def test_a_launch_plan_left_in_the_environment_is_ignored_with_a_warning(monkeypatch, capsys):
    from finetune.launch.self_launch import launch_plan, under_a_launcher
    from finetune.plan.launch import launch_or_run_here

    stale = {"strategy": "zero3", "label": "ZeRO-3", "launcher_pid": 1}  # its launcher was another process
    monkeypatch.setenv(LAUNCH_PLAN_ENV, json.dumps(stale))
    assert launch_plan() is None and not under_a_launcher()
    monkeypatch.setattr("os.execve", lambda *args: pytest.fail(f"launched: {args[1]}"))
    assert launch_or_run_here("recipes/demo.yaml", ["--max_steps", "1"]) == ["--max_steps", "1"]  # runs here
    assert LAUNCH_PLAN_ENV not in os.environ
    assert capsys.readouterr().out.startswith(f"warning: ignoring {LAUNCH_PLAN_ENV} from the environment: no "
                                              "self-launch of this run wrote it")
    for launcher in (os.getpid(), os.getppid()):  # one process planned here; a rank of the launcher it became
        plan = {**stale, "launcher_pid": launcher}
        assert launch_plan({LAUNCH_PLAN_ENV: json.dumps(plan)}) == plan


@pytest.mark.distributed
def test_two_nodes_on_loopback_meet_and_train_from_the_same_command(tmp_path):
    """`finetune train` on each of 2 "nodes" (one CPU process each, on loopback) with its rank: they meet, then each
    becomes Accelerate's launcher for its machine; one run of world size 2 under the recipe's ZeRO-2."""
    from finetune.launch.commands import free_port

    port = free_port()
    nodes = [subprocess.Popen(finetune_command(
        "train", "recipes/demo.yaml", "--nnodes", "2", "--node-rank", str(rank), "--main-addr", "127.0.0.1",
        "--main-port", str(port), "--gpus", "1", *DEMO_SHORT_RUN, "--save_strategy", "no", "--output_dir",
        str(tmp_path / f"node{rank}")), cwd=PROJECT_ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "FINETUNE_CACHE": str(tmp_path / "cache")})
        for rank in (0, 1)]
    logs = [node.communicate(timeout=400)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-4000:] + logs[1][-4000:]
    for rank, log in enumerate(logs):
        assert "launch: all 2 nodes arrived" in log
        assert f"--num_machines 2 --machine_rank {rank} --main_process_ip 127.0.0.1" in log
    effective = json.loads((tmp_path / "node0" / "effective_config.json").read_text())
    assert effective["values"]["world_size"]["value"] == 2 and effective["strategy"]["running"]["zero_stage"] == 2
    assert effective["plan"]["nodes"] == 2 and effective["plan"]["processes"] == 2


@pytest.mark.parametrize(("axis", "config", "program"), [
    (["--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "2"], "cpu_ddp.yaml", "finetune"),
    (["--tensor_parallel_size", "2"], "cpu_ddp.yaml", "finetune.testing.parallelism_on_cpu"),
    (["--sequence_parallel_size", "2", "--strategy", "zero3"], "cpu_deepspeed_zero2.yaml", "finetune"),
])
def test_a_recipe_naming_a_parallelism_axis_launches_as_that_axis_runs(capsys, axis, config, program):
    out, command = dry_run(capsys, "--gpus", "2", *axis)
    assert option(command, "--config_file").endswith(config) and option(command, "-m") == program
    assert command[-len(axis):] == axis
    if "--pipeline_parallel_size" in axis:  # planned as the loop runs it, its fullest stage against the machine
        assert "plan: PP 2 (1F1B) (the recipe's pipeline_parallel_size) on 2 CPU process(es)" in out
        assert "fits" in out.split("plan: PP 2", 1)[1].splitlines()[0]


def test_a_pipeline_self_launch_plans_each_stage_and_the_nodes_host_ram_at_load(monkeypatch):
    """The self-launch of a recipe naming `pipeline_parallel_size` plans it (before: launched "not planned"): the
    fullest stage's memory on this machine's GPUs, and the host RAM a node takes to load its stages, each rank reading
    its own, which `--host-memory` can then refuse."""
    from finetune.launch.devices import KNOWN_GPUS
    from finetune.launch.self_launch import Machine
    from finetune.plan.launch import plan_launch

    simulate_gpus(monkeypatch, A100, count=2, memory_gib=80)
    a100 = KNOWN_GPUS["a100"]
    machine = Machine(processes_per_node=2, gpu=a100, memory_gib=80, memory_source="the GPU", host_memory_gib=64)
    launch, record, _ = plan_launch("recipes/demo.yaml", ["--pipeline_parallel_size", "2",
                                                          "--gradient_accumulation_steps", "2"], machine)
    assert record["label"] == "PP 2 (1F1B)" and record["fits"] and record["strategy"] == "pipeline"
    # two stages on one node: the node loads both, each rank its own (rank 0 the embedding, rank 1 the head)
    assert record["host_load_bytes_per_node"] == sum(record["predicted"]["host_load_bytes"].values())
    low = Machine(processes_per_node=2, gpu=a100, memory_gib=80, memory_source="the GPU", host_memory_gib=1e-4)
    _, starved, _ = plan_launch("recipes/demo.yaml", ["--pipeline_parallel_size", "2",
                                                      "--gradient_accumulation_steps", "2"], low)
    assert not starved["fits"] and starved["shortfall"] == "host load"


def a100_node(monkeypatch, count: int):
    """A node of `count` simulated 80 GiB A100s with 64 GiB of host RAM, as the self-launch reads it."""
    from finetune.launch.devices import KNOWN_GPUS
    from finetune.launch.self_launch import Machine

    simulate_gpus(monkeypatch, A100, count=count, memory_gib=80)
    return Machine(processes_per_node=count, gpu=KNOWN_GPUS["a100"], memory_gib=80, memory_source="the GPU",
                   host_memory_gib=64)


def test_a_pipeline_self_launch_on_more_gpus_than_stages_runs_replicas(monkeypatch):
    """4 GPUs and `pipeline_parallel_size: 2`: two replicas of the pipeline, data parallel, planned as such (each rank
    its stage as in one pipeline); 3 GPUs cannot be split into pipelines of 2 and are refused before the launch."""
    from finetune.plan.launch import plan_launch

    pipeline = ["--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "2"]
    _, record, _ = plan_launch("recipes/demo.yaml", pipeline, a100_node(monkeypatch, 4))
    assert record["label"] == "PP 2 × DP 2 (1F1B)" and record["processes"] == 4 and record["fits"]
    with pytest.raises(RecipeError, match=r"this launch has 3 process\(es\): launch a multiple of 2"):
        plan_launch("recipes/demo.yaml", pipeline, a100_node(monkeypatch, 3))


def test_a_pipeline_self_launch_with_tensor_parallel_stages_plans_the_3d_split(monkeypatch, tmp_path):
    """8 GPUs, `pipeline_parallel_size: 2` and `tensor_parallel_size: 2` on a hub-shaped checkpoint: 2 replicas of a
    pipeline whose stages are split over 2 GPUs each, planned as the loop runs it (the row's TP terms); 6 GPUs cannot
    be split into groups of 2 × 2 and are refused before the launch, naming both sizes."""
    from hub_fixtures import save_hub_model

    from finetune.plan.launch import plan_launch

    hub = save_hub_model(tmp_path / "hub")
    recipe = ["--model_name_or_path", str(hub), "--pipeline_parallel_size", "2", "--tensor_parallel_size", "2",
              "--gradient_accumulation_steps", "2"]
    _, record, _ = plan_launch("recipes/demo.yaml", recipe, a100_node(monkeypatch, 8))
    assert record["label"] == "PP 2 × TP 2 × DP 2 (1F1B)" and record["processes"] == 8 and record["fits"]
    with pytest.raises(RecipeError, match=r"split over `tensor_parallel_size: 2`, but this launch has 6 process\(es\): "
                                          r"launch a multiple of 4 \(each 2 × 2 = 4 processes one replica"):
        plan_launch("recipes/demo.yaml", recipe, a100_node(monkeypatch, 6))
