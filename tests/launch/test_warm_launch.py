"""A launch forked from the warm process (finetune.testing.warm_launch, how the suite runs most launches) gives each
rank what `accelerate launch` gives it and trains the same: the same run, launched for real and forked, writes the
same rank environments, losses, memory ledger and effective config. A rank environment missing one variable Accelerate
sets is a difference this test reports."""

import json

import pytest
from support import CPU_LAUNCHES, assert_succeeded, launch_demo

from finetune.testing.subprocesses import child_environment

# Each launch has its own port, rendezvous id and reply files, and this test its own record folders and phase.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "RECORD_ENVIRONMENT",
              "PYTEST_CURRENT_TEST"}
# What a process measures of itself: a forked rank shares the warm process's pages, so its resident set differs.
PROCESS_MEASURES = {"peak_bytes", "host_load_bytes"}
RECORDING = ("tests/record_environment.py",)


def launched(root, real: bool, without: tuple[str, ...] = ()):
    import support

    output_dir, environments = root / "run", root / "environments"
    environments.mkdir(parents=True)
    env = {"RECORD_ENVIRONMENT": str(environments)}
    # What the launch starts from (this process's environment changes as other tests import libraries): the ranks'
    # environments are compared as what each launch set or changed.
    (environments / "parent.json").write_text(json.dumps(child_environment(env)))
    if real:
        result = launch_demo(CPU_LAUNCHES["zero2"], output_dir, program=RECORDING, env=env, real=True)
    else:
        command = CPU_LAUNCHES["zero2"]._replace(program=RECORDING).command(
            "train", "recipes/demo.yaml", "--output_dir", str(output_dir), *support.DEMO_SHORT_RUN)
        result = support.warm_launcher().run(command, env=env, cwd=support.PROJECT_ROOT, without=without)
        assert result.forked
    assert_succeeded(result)
    return output_dir, environments


def differences(first, second) -> list[str]:
    """What two runs of the same command wrote differently, as `file: key` lines."""
    (first_dir, first_env), (second_dir, second_env) = first, second
    found = []
    def set_by_the_launch(folder, rank: int) -> dict:
        parent, environment = (json.loads((folder / name).read_text()) for name in ("parent.json", f"rank-{rank}.json"))
        return {key: environment.get(key) for key in set(parent) | set(environment)
                if environment.get(key) != parent.get(key)}

    for rank in (0, 1):
        one, other = set_by_the_launch(first_env, rank), set_by_the_launch(second_env, rank)
        found += [f"rank {rank} environment: {key}" for key in sorted(set(one) | set(other))
                  if key not in PER_LAUNCH and one.get(key) != other.get(key)]

    def losses(folder):
        return [entry["loss"] for entry in json.loads((folder / "trainer_state.json").read_text())["log_history"]
                if "loss" in entry]

    if losses(first_dir) != losses(second_dir):
        found.append(f"losses: {losses(first_dir)} != {losses(second_dir)}")

    def ledger(folder):
        ranks = json.loads((folder / "memory_report.json").read_text())["ranks"]
        return [{**rank, "measured": {key: value for key, value in rank["measured"].items()
                                      if key not in PROCESS_MEASURES}} for rank in ranks]

    if ledger(first_dir) != ledger(second_dir):
        found.append("memory_report.json: the ledger")
    effective = [json.loads((folder / "effective_config.json").read_text()) for folder in (first_dir, second_dir)]
    found += [f"effective_config.json: {key}" for key in sorted(set(effective[0]) | set(effective[1]))
              if effective[0].get(key) != effective[1].get(key)]
    return found


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    return launched(tmp_path_factory.mktemp("real"), real=True)


@pytest.mark.distributed
@pytest.mark.launcher
def test_a_forked_launch_gives_each_rank_the_real_launchs_environment_and_trains_the_same(real_run, tmp_path):
    forked = launched(tmp_path, real=False)
    assert differences(real_run, forked) == []
    environment = json.loads((real_run[1] / "rank-1.json").read_text())
    assert environment["ACCELERATE_USE_DEEPSPEED"] == "true" and environment["LOCAL_RANK"] == "1"


@pytest.mark.distributed
@pytest.mark.launcher
def test_a_forked_rank_missing_a_variable_accelerate_sets_is_a_difference(real_run, tmp_path):
    # `zero3_init_flag: false` is DeepSpeed's default too, so the run trains the same without it: only the rank
    # environments show it.
    planted = launched(tmp_path, real=False, without=("ACCELERATE_DEEPSPEED_ZERO3_INIT",))
    assert differences(real_run, planted) == ["rank 0 environment: ACCELERATE_DEEPSPEED_ZERO3_INIT",
                                              "rank 1 environment: ACCELERATE_DEEPSPEED_ZERO3_INIT"]
