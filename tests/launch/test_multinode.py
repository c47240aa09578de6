"""Beyond one machine: the launch scripts, the nodes' pre-flight rendezvous, and 2 simulated nodes (1 process each)
training the tiny model under DeepSpeed ZeRO-2, on loopback and across two network namespaces."""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import DEMO_SHORT_RUN, PROJECT_ROOT, free_port

from finetune.checkpoints.complete import checkpoint_step, checkpoints_newest_first, is_complete
from finetune.errors import RecipeError
from finetune.launch.rendezvous import meet
from finetune.outputs import RUN_LOCK

# The launcher tier (two nodes over loopback, the launch scripts and SLURM: the real launchers):
# launches are real processes, not forked (tests/support.py).
pytestmark = pytest.mark.launcher

SCRIPTS = PROJECT_ROOT / "scripts"
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
CPU_CONFIG = "accelerate_configs/cpu_deepspeed_zero2.yaml"


def script(*args, env=None, timeout=60, **kwargs):
    return subprocess.run([str(a) for a in args], cwd=PROJECT_ROOT, env={**ENV, **(env or {})}, text=True,
                          capture_output=True, timeout=timeout, **kwargs)


def dry_run(*args, env=None):
    result = script(*args, env={"FINETUNE_DRY_RUN": "1", **(env or {})})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


# --- the scripts, rendered without running anything -------------------------------------------------------------


def test_slurm_template_starts_one_launcher_per_node_with_its_rank(tmp_path):
    """The sbatch script under a fake `srun` (which runs its command once per node, as SLURM does with
    --ntasks-per-node=1) and a fake `scontrol`: the commands each of the 2 nodes would run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'while [[ $1 == --* ]]; do echo "srun option $1"; shift; done\n'
        'for node in $(seq 0 $((SLURM_NNODES - 1))); do echo "== node $node"; SLURM_NODEID=$node "$@" || exit; done\n')
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2 $3" = "show hostnames gpu-[07-08]" ] '
                                      '&& printf "gpu-07\\ngpu-08\\n"\n')
    for fake in bin_dir.iterdir():
        fake.chmod(0o755)
    slurm = {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_JOB_ID": "123456",
             "SLURM_GPUS_ON_NODE": "2", "SLURM_SUBMIT_DIR": str(PROJECT_ROOT), "FINETUNE_DRY_RUN": "1",
             "INTERFACE": "ib0", "PATH": f"{bin_dir}:{ENV['PATH']}"}
    result = script("bash", SCRIPTS / "slurm/finetune.sbatch", "recipes/demo.yaml", "--max_steps", "100", env=slurm)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "srun option --kill-on-bad-exit=1" in lines
    nodes = "\n".join(lines).split("== node ")[1:]
    assert len(nodes) == 2
    port = 123456 % 10000 + 20000
    for rank, text in enumerate(nodes):
        env, rendezvous, launch = text.splitlines()[1:4]
        # the launcher's grace between SIGTERM and SIGKILL: the preemption save's time (finetune.launch.grace)
        assert env == "env NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 TORCH_ELASTIC_SHUTDOWN_TIMEOUT=110"
        assert rendezvous == (f"finetune rendezvous --nnodes 2 --node-rank {rank} --main-addr gpu-07 "
                              f"--main-port {port} --timeout 300")
        assert launch == (
            "accelerate launch --config_file accelerate_configs/multinode_deepspeed_zero2.yaml --num_machines 2 "
            f"--machine_rank {rank} --main_process_ip gpu-07 --main_process_port {port} --num_processes 4 "
            "--rdzv_conf timeout=300 -m finetune train recipes/demo.yaml --ddp_timeout 1800 --max_steps 100")


def test_multinode_script_says_which_value_is_missing():
    result = script(SCRIPTS / "launch_multinode.sh", "--node-rank", "0", "--main-addr", "10.0.0.1", "recipes/demo.yaml")
    assert result.returncode == 2 and "--nnodes is not set" in result.stderr
    result = script(SCRIPTS / "launch_multinode.sh", "--nodes", "2", "recipes/demo.yaml")
    assert result.returncode == 2 and "unknown option --nodes" in result.stderr


def test_single_node_and_deepspeed_launcher_scripts_render_their_commands(tmp_path):
    assert dry_run(SCRIPTS / "launch.sh", "--config", "accelerate_configs/cpu_ddp.yaml", "--processes", "2",
                   "recipes/demo.yaml", "--max_steps", "5") == [
        "accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 2 -m finetune train "
        "recipes/demo.yaml --max_steps 5"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=2\nnode-b slots=2\n")
    assert dry_run(SCRIPTS / "launch_deepspeed.sh", "--hostfile", hostfile, "recipes/demo.yaml") == [
        f"deepspeed --hostfile {hostfile} --master_addr node-a --master_port 29500 --no_local_rank --module finetune "
        "train recipes/demo.yaml --deepspeed deepspeed_configs/zero2.json"]
    result = script(SCRIPTS / "launch_deepspeed.sh", "recipes/demo.yaml")
    assert result.returncode == 2 and "--hostfile FILE is required" in result.stderr


# --- the pre-flight rendezvous, in process ---------------------------------------------------------------------


def test_main_node_names_the_nodes_that_did_not_arrive():
    started = time.monotonic()
    with pytest.raises(RecipeError, match=r"node\(s\) 1, 2 of 3 did not arrive at 127\.0\.0\.1:\d+ within 1 s"):
        meet("127.0.0.1", free_port(), num_nodes=3, node_rank=0, timeout=1)
    assert time.monotonic() - started < 10


def test_a_node_without_its_main_node_says_so():
    with pytest.raises(RecipeError, match=r"node 1 could not reach the main node \(machine rank 0\) at 127\.0\.0\.1"):
        meet("127.0.0.1", free_port(), num_nodes=2, node_rank=1, timeout=1)
    with pytest.raises(RecipeError, match="node rank 2 is not in 0..1"):
        meet("127.0.0.1", free_port(), num_nodes=2, node_rank=2, timeout=1)


def test_the_main_nodes_port_and_address_are_checked_before_any_store_and_c10ds_stack_is_kept_aside(capfd):
    for port in (0, 70000):  # Accelerate's OverflowError, c10d's TypeError
        with pytest.raises(RecipeError, match=f"`--main-port {port}` is not a TCP port: give one in 1..65535"):
            meet("127.0.0.1", port, num_nodes=2, node_rank=1, timeout=1)
    for address in ("", "no such host!"):  # c10d retried these until the timeout
        with pytest.raises(RecipeError, match=f"`--main-addr {address!r}` is not an address this machine can resolve"):
            meet(address, free_port(), num_nodes=2, node_rank=1, timeout=30)
    capfd.readouterr()
    with pytest.raises(RecipeError, match=r"^node 1 could not reach the main node .* \(c10d's log: \S+\)$") as refused:
        meet("127.0.0.1", free_port(), num_nodes=2, node_rank=1, timeout=1)
    assert "c10d" not in capfd.readouterr().err  # its retries and C++ stacks went to the log the error names
    log = Path(str(refused.value).rsplit("c10d's log: ", 1)[1].rstrip(")"))
    assert "Exception raised from" in log.read_text()
    log.unlink()


def test_the_main_node_says_whether_it_could_not_listen_or_not_reach_its_own_address():
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RecipeError, match=f"node 0 cannot listen on port {port} .*address already in use"):
            meet("127.0.0.1", port, num_nodes=2, node_rank=0, timeout=2)
    # listening, but the address given is not this machine's: not "cannot listen" (TEST-NET-1, never routed)
    with pytest.raises(RecipeError, match=r"node 0 listens on port \d+ but could not reach itself at 192\.0\.2\.1"):
        meet("192.0.2.1", free_port(), num_nodes=2, node_rank=0, timeout=1)


# --- real runs: 2 nodes × 1 process ----------------------------------------------------------------------------


def node_command(rank: int, main_addr: str, port: int, output_dir: Path, *extra: str, prefix=(), train=()):
    """One node's launch; `extra` are the script's options, `train` the recipe overrides."""
    return [*prefix, str(SCRIPTS / "launch_multinode.sh"), "--config", CPU_CONFIG, "--nnodes", "2", "--node-rank",
            str(rank), "--main-addr", main_addr, "--main-port", str(port), "--gpus-per-node", "1",
            "--rendezvous-timeout", "120", *extra, "recipes/demo.yaml", *DEMO_SHORT_RUN,
            "--save_on_each_node", "true", "--output_dir", str(output_dir / f"node{rank}"), *train]


def run_two_nodes(commands, succeed: bool = True) -> list[str]:
    nodes = [subprocess.Popen(command, cwd=PROJECT_ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for command in commands]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
    for rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert (node.returncode == 0) == succeed, f"node {rank} exited {node.returncode}:\n{output[-6000:]}"
    return outputs


def assert_identical_weights(output_dir: Path) -> None:
    """Each node saved the model it ended with (`save_on_each_node`): the same tensors, trained (not the start)."""
    first, second = (load_file(output_dir / f"node{rank}" / "model.safetensors") for rank in (0, 1))
    assert first.keys() == second.keys() and len(first) > 10
    assert all(torch.equal(first[name], second[name]) for name in first)
    from finetune import presets

    start = presets.build_model(presets.build_tokenizer()).state_dict()
    assert any(not torch.equal(first[name].float(), start[name].float()) for name in first if name in start)


def complete_steps(output_dir: Path) -> list[int]:
    return sorted(checkpoint_step(folder) for folder in checkpoints_newest_first(output_dir) if is_complete(folder))


@pytest.mark.distributed
def test_two_nodes_on_loopback_train_rotate_and_resume_each_on_its_own_disk(tmp_path):
    """`save_on_each_node` with a folder per node (no shared disk): each node marks and rotates its own checkpoints,
    `auto` resumes both from the newest step complete on both, and nodes sharing no complete step both stop."""
    saving = ["--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "2"]
    outputs = run_two_nodes(two_node_commands(tmp_path, *saving))
    assert all("rendezvous: all 2 nodes arrived" in output for output in outputs)
    assert_identical_weights(tmp_path)
    summary = (tmp_path / "node0" / "eval_results.json").read_text()
    assert '"world_size": 2' in summary and '"deepspeed_zero_stage": 2' in summary
    assert [complete_steps(tmp_path / f"node{rank}") for rank in (0, 1)] == [[2, 3], [2, 3]]  # 1 rotated on both

    # Node 1 lost its newest marker (killed before writing it): both resume from checkpoint-2, the newest on both.
    (tmp_path / "node1" / "checkpoint-3" / "finetune_complete.json").unlink()
    outputs = run_two_nodes(two_node_commands(tmp_path, *saving, "--max_steps", "4", "--resume_from_checkpoint",
                                              "auto"))
    assert "warning: resuming every node from checkpoint-2, the newest complete on all of them; newer ones are " \
           "complete only on rank 0" in outputs[0]
    assert_identical_weights(tmp_path)
    for rank in (0, 1):
        state = json.loads((tmp_path / f"node{rank}" / "checkpoint-4" / "trainer_state.json").read_text())
        assert state["global_step"] == 4 and complete_steps(tmp_path / f"node{rank}") == [3, 4]

    # Node 1's disk was replaced: no step is complete on both, so both stop (neither starts fresh nor hangs).
    shutil.rmtree(tmp_path / "node1")
    outputs = run_two_nodes(two_node_commands(tmp_path, *saving, "--max_steps", "6", "--resume_from_checkpoint",
                                              "auto"), succeed=False)
    for output in outputs:
        assert "no checkpoint is complete on every node (rank 0 (" in output and "checkpoint-4, checkpoint-3" in output
        assert "rank 1 (" in output and "node1): none" in output


def two_node_commands(output_dir: Path, *train: str) -> list[list[str]]:
    port = free_port()
    return [node_command(rank, "127.0.0.1", port, output_dir, train=train) for rank in (0, 1)]


@pytest.mark.distributed
def test_a_pipeline_across_nodes_with_a_folder_per_node_stops_before_loading(tmp_path):
    """Every stage writes into one output_dir: two nodes that each see only their own folder (node-local disks)
    both stop at the start, naming which ranks see which, before the model loads or anything is written."""
    port = free_port()
    commands = [[str(SCRIPTS / "launch_multinode.sh"), "--config", "accelerate_configs/cpu_ddp.yaml", "--nnodes", "2",
                 "--node-rank", str(rank), "--main-addr", "127.0.0.1", "--main-port", str(port), "--gpus-per-node",
                 "1", "--rendezvous-timeout", "120", "recipes/demo.yaml", *DEMO_SHORT_RUN, "--pipeline_parallel_size",
                 "2", "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / f"node{rank}")]
                for rank in (0, 1)]
    outputs = run_two_nodes(commands, succeed=False)
    for output in outputs:
        assert "pipeline parallelism writes every stage into one output_dir, but the ranks do not share it" in output
        assert "rank 0 on" in output and "sees rank(s) 0;" in output and "sees rank(s) 1." in output
    for rank in (0, 1):  # the check's own files are gone, and nothing but the run lock was written
        assert {path.name for path in (tmp_path / f"node{rank}").iterdir()} <= {RUN_LOCK}


@pytest.mark.distributed
def test_a_node_that_never_starts_is_named_within_the_timeout(tmp_path):
    started = time.monotonic()
    command = node_command(0, "127.0.0.1", free_port(), tmp_path)
    command[command.index("--rendezvous-timeout") + 1] = "10"
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=ENV, text=True, capture_output=True, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "node(s) 1 of 2 did not arrive" in result.stderr and "within 10 s" in result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 10 + 45  # the timeout plus interpreter start-up, not the launcher's 600 s
    assert not (tmp_path / "node0").exists()  # nothing was launched


def network_namespaces_available() -> str | None:
    """None when this machine lets the test make network namespaces and a veth pair, else the reason it cannot."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"ftprobe{uuid.uuid4().hex[:6]}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair (10.77.N.1 and .2), each with only that link and loopback."""
    reason = network_namespaces_available()
    if reason:
        pytest.skip(f"two virtual hosts need network namespaces: {reason}")
    tag = uuid.uuid4().hex[:6]
    hosts = [f"ft{tag}a", f"ft{tag}b"]
    links = [f"ve{tag}a", f"ve{tag}b"]
    subnet = f"10.77.{int(tag[:2], 16)}"
    commands = [["ip", "netns", "add", hosts[0]], ["ip", "netns", "add", hosts[1]],
                ["ip", "link", "add", links[0], "netns", hosts[0], "type", "veth", "peer", "name", links[1], "netns",
                 hosts[1]]]
    for index, (host, link) in enumerate(zip(hosts, links)):
        commands += [["ip", "-n", host, "addr", "add", f"{subnet}.{index + 1}/24", "dev", link],
                     ["ip", "-n", host, "link", "set", link, "up"], ["ip", "-n", host, "link", "set", "lo", "up"]]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, text=True)
        yield [(host, link, f"{subnet}.{index + 1}") for index, (host, link) in enumerate(zip(hosts, links))]
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "delete", host], capture_output=True)


@pytest.mark.distributed
def test_two_nodes_across_a_virtual_network_end_with_identical_weights(two_hosts, tmp_path):
    (host0, link0, main_addr), (host1, link1, _) = two_hosts
    port = free_port()
    outputs = run_two_nodes([
        node_command(rank, main_addr, port, tmp_path, "--interface", link, prefix=("ip", "netns", "exec", host))
        for rank, (host, link) in enumerate([(host0, link0), (host1, link1)])
    ])
    assert all(f"rendezvous: all 2 nodes arrived at {main_addr}" in output for output in outputs)
    assert_identical_weights(tmp_path)


def test_save_on_each_node_is_refused_under_zero3_before_any_process_group(monkeypatch):
    """Under ZeRO-3 only global rank 0 gets the gathered weights: refused while parsing, from the launcher's JSON."""
    from finetune.recipe.parse import parse_recipe

    monkeypatch.chdir(PROJECT_ROOT)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "deepspeed_configs/zero3.json")
    with pytest.raises(RecipeError, match=r"`save_on_each_node: true` with ZeRO-3.*shared by the nodes"):
        parse_recipe("recipes/demo.yaml", ["--save_on_each_node", "true"])


def test_save_on_each_node_is_refused_under_fsdp1_before_any_process_group(monkeypatch):
    """FSDP1 gathers the full state dict on global rank 0 only (FSDP2 is gathered on every node:
    tests/launch/test_fsdp.py)."""
    from finetune.recipe.parse import parse_recipe

    monkeypatch.chdir(PROJECT_ROOT)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(RecipeError, match=r"`save_on_each_node: true` with FSDP1.*`fsdp_version: 2`"):
        parse_recipe("recipes/demo.yaml", ["--save_on_each_node", "true"])
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert parse_recipe("recipes/demo.yaml", ["--save_on_each_node", "true"]).training.save_on_each_node is True


def test_hybrid_shard_takes_its_sizes_from_the_launch_not_from_the_file():
    """The shipped file is written for 2 nodes × 2 GPUs; on 2 nodes × 8 the script passes replicate 2 × shard 8."""
    hybrid = dry_run(SCRIPTS / "launch_multinode.sh", "--config", "accelerate_configs/multinode_fsdp_hybrid_shard.yaml",
                     "--nnodes", "2", "--node-rank", "1", "--main-addr", "10.0.0.1", "--gpus-per-node", "8",
                     "recipes/demo.yaml")[-1]
    assert "parallelism_config_dp_replicate_size: 2" in (PROJECT_ROOT / "accelerate_configs" /
                                                          "multinode_fsdp_hybrid_shard.yaml").read_text()
    assert ("--num_processes 16 --parallelism_config_dp_replicate_size 2 --parallelism_config_dp_shard_size 8 "
            "--rdzv_conf timeout=300 -m finetune train recipes/demo.yaml") in hybrid
    zero2 = dry_run(SCRIPTS / "launch_multinode.sh", "--nnodes", "2", "--node-rank", "0", "--main-addr", "10.0.0.1",
                    "--gpus-per-node", "8", "recipes/demo.yaml")[-1]
    assert "--num_processes 16 --rdzv_conf" in zero2 and "parallelism_config" not in zero2


@pytest.mark.distributed
def test_two_nodes_of_two_train_under_hybrid_shard_with_the_launchs_sizes(tmp_path):
    """4 processes as 2 nodes × 2 on loopback, through the script, under the shipped hybrid-shard file: each rank holds
    the half of the weights its node shards (shard 2 inside the node, replicate 2 across), not a quarter."""
    from finetune import outputs, presets

    config, port = "accelerate_configs/multinode_fsdp_hybrid_shard.yaml", free_port()
    commands = [[str(SCRIPTS / "launch_multinode.sh"), "--config", config, "--nnodes", "2", "--node-rank", str(rank),
                 "--main-addr", "127.0.0.1", "--main-port", str(port), "--gpus-per-node", "2",
                 "--rendezvous-timeout", "120", "recipes/demo.yaml", *DEMO_SHORT_RUN, "--save_strategy", "no",
                 "--save_on_each_node", "true", "--output_dir", str(tmp_path / f"node{rank}")] for rank in (0, 1)]
    nodes = [subprocess.Popen(command, cwd=PROJECT_ROOT, env={**ENV, "FINETUNE_MODULE": "finetune.testing.fsdp_on_cpu"},
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for command in commands]
    logs = [node.communicate(timeout=400)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-4000:] + logs[1][-4000:]
    effective = outputs.read_record(tmp_path / "node0", outputs.EFFECTIVE_CONFIG)
    assert effective["values"]["world_size"]["value"] == 4
    assert effective["strategy"]["running"]["fsdp_sharding"] == "hybrid_shard"
    full = 4 * presets.build_model(presets.build_tokenizer(), seed=0).num_parameters()
    ranks = outputs.read_record(tmp_path / "node0", outputs.MEMORY_REPORT)["ranks"]
    assert [record["rank"] for record in ranks] == [0, 1, 2, 3]
    for record in ranks:  # half the fp32 weights a rank (up to FSDP2's padding), as planned
        assert abs(record["measured"]["params_bytes"] - full / 2) <= 0.01 * full, record
        assert abs(record["measured"]["params_bytes"] - record["predicted"]["params_bytes"]) <= 0.01 * full, record
    assert (tmp_path / "node1" / "model.safetensors").is_file()  # node 1 saved its own copy of the trained model
