"""FSDP2 on 2 CPU processes through the real Trainer + Accelerate path (Accelerate's one refusal of FSDP on CPU lifted
by `finetune.testing.fsdp_on_cpu`): parameters really sharded, the ledger equal to the prediction (and to `finetune
plan`'s),
bf16 mixed precision, weights `from_pretrained` loads at the end, `finetune export` of a sharded checkpoint, resume with
the same losses on 2 ranks and on 1, a DDP run refusing an FSDP checkpoint, per-node weights on 2 nodes, and LoRA under
shard-grad-op."""

import json
import math
import shutil
import subprocess

import pytest
import torch
from support import (
    FSDP_ON_CPU,
    FSDP_SHARD_GRAD_OP_ON_CPU,
    LORA_DEMO_RUN,
    PROJECT_ROOT,
    assert_succeeded,
    error_lines,
    free_port,
    gathered_weights_peaks,
    launch_demo,
    measuring_gathers,
)

from finetune import outputs, presets
from finetune.checkpoints.complete import COMPLETE_MARKER
from finetune.checkpoints.export import export
from finetune.memory import model_shape
from finetune.memory.estimate import Setup, fsdp_gathered_weights_bytes
from finetune.plan.decision_tree import PlanRequest, make_plan

pytestmark = pytest.mark.distributed
RUN = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "1",
       "--warmup_steps", "2"]
# FSDP2 splits each parameter's dim 0 into equal shards and pads the last one: a rank holds up to a row per tensor
# more or less than Ψ/N (the tiny model: 256 bytes of parameters).
PADDING = 1024


def losses(output_dir) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Full shard, fp32."""
    output_dir = tmp_path_factory.mktemp("fsdp") / "whole"
    launch, env = measuring_gathers(FSDP_ON_CPU, output_dir.parent / "gathers")
    assert_succeeded(launch_demo(launch, output_dir, *RUN, env=env))
    return output_dir


@pytest.fixture(scope="module")
def shard_grad_op_bf16_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("fsdp") / "shard_grad_op_bf16"
    launch, env = measuring_gathers(FSDP_SHARD_GRAD_OP_ON_CPU, output_dir.parent / "gathers")
    assert_succeeded(launch_demo(launch, output_dir, *RUN, "--bf16", "true", env=env))
    return output_dir


def test_fsdp2_trains_with_parameters_really_sharded(fsdp_run):
    effective = outputs.read_record(fsdp_run, outputs.EFFECTIVE_CONFIG)
    running = effective["strategy"]["running"]
    assert (running["strategy"], running["fsdp_sharding"], running["fsdp_version"]) == ("fsdp", "full_shard", 2)
    full = 4 * presets.build_model(presets.build_tokenizer(), seed=0).num_parameters()  # fp32 bytes
    held = [entry["params_bytes"] for entry in effective["ranks"]]
    assert len(held) == 2 and all(abs(bytes_ - full / 2) <= PADDING for bytes_ in held), (held, full)
    logged = losses(fsdp_run)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(loss) for loss in logged.values())
    assert logged[6] < logged[1]


def ledger_matches_prediction(output_dir, strategy: str) -> list[dict]:
    """Measured parameters, gradients and optimizer states per rank equal the prediction, up to FSDP2's padding."""
    ranks = outputs.read_record(output_dir, outputs.MEMORY_REPORT)["ranks"]
    assert [record["strategy"] for record in ranks] == [strategy] * 2
    for record in ranks:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            measured, predicted = record["measured"][key], record["predicted"][key]
            assert abs(measured - predicted) <= PADDING, (record["rank"], key, measured, predicted)
    return ranks


def test_fsdp_ledger_equals_the_prediction_and_the_plan_per_rank(fsdp_run, shard_grad_op_bf16_run):
    for output_dir, name, precision in ((fsdp_run, "full-shard", "fp32"),
                                        (shard_grad_op_bf16_run, "shard-grad-op", "bf16")):
        ranks = ledger_matches_prediction(output_dir, f"fsdp_{name.replace('-', '_')}")
        plan = make_plan(PlanRequest(model="tiny", gpus=2, gpu_memory_gib=1, precision=precision))
        planned = next(row for row in plan["strategies"] if row["name"] == f"FSDP {name}")["estimate"]
        for record in ranks:  # `finetune plan`'s numbers for the same model, GPUs and precision
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                assert abs(record["measured"][key] - getattr(planned, key)) <= PADDING, (name, record["rank"], key)


def test_fsdp2_gathers_the_weights_the_plan_counts(fsdp_run, shard_grad_op_bf16_run):
    """The weights FSDP2 held gathered at once on each rank over a step (unsharded parameters and all-gather buffers,
    finetune.testing.fsdp_gathers) are what the plan counts, up to FSDP2's row padding: on the tied tiny model, full
    shard keeps the tail (norm, embedding and head) the whole step beside two blocks, in the fp32 masters' dtype;
    SHARD_GRAD_OP keeps the whole model and a block's buffer, in bf16. The plan's temporary term holds them."""
    shape = model_shape("tiny")
    block, tail = shape.layer_parameters, shape.num_parameters - shape.num_layers * shape.layer_parameters
    for output_dir, sharding, precision, by_hand in (
            (fsdp_run, "full_shard", "fp32", 4 * (tail + 2 * block)),
            (shard_grad_op_bf16_run, "shard_grad_op", "bf16", 2 * (shape.num_parameters + block))):
        planned = fsdp_gathered_weights_bytes(shape, Setup(strategy="fsdp", num_gpus=2, fsdp_sharding=sharding,
                                                           precision=precision))
        measured = gathered_weights_peaks(output_dir.parent / "gathers")
        assert planned == by_hand
        assert len(measured) == 2 and all(0 <= bytes_ - planned <= PADDING for bytes_ in measured), (measured, planned)
        for record in outputs.read_record(output_dir, outputs.MEMORY_REPORT)["ranks"]:
            assert record["predicted"]["estimate"]["per_gpu"]["temporary_bytes"] >= planned


def test_bf16_under_fsdp2_computes_in_bf16_and_keeps_fp32_states_and_loss(fsdp_run, shard_grad_op_bf16_run):
    """FSDP2's mixed precision casts the gathered parameters for compute and keeps fp32 shards (Adam's master
    weights); the loss and the gradient reduction stay fp32 (finetune's policy; Accelerate's casts both to bf16)."""
    fp32, bf16 = losses(fsdp_run), losses(shard_grad_op_bf16_run)
    assert sorted(bf16) == [1, 2, 3, 4, 5, 6]
    assert all(bf16[step] != fp32[step] for step in bf16)  # computed in bf16: not the fp32 run's numbers...
    assert bf16 == pytest.approx(fp32, abs=2e-2)  # ...but the same training
    in_bf16 = [torch.tensor(loss).bfloat16().item() == loss for loss in bf16.values()]
    assert not all(in_bf16)  # the logged loss was not cast to bf16
    effective = outputs.read_record(shard_grad_op_bf16_run, outputs.EFFECTIVE_CONFIG)
    assert effective["values"]["precision"]["value"] == "bf16"
    full = 4 * presets.build_model(presets.build_tokenizer(), seed=0).num_parameters()
    assert all(abs(entry["params_bytes"] - full / 2) <= PADDING for entry in effective["ranks"])  # fp32 shards


def test_fsdp_run_ends_with_loadable_weights_and_its_checkpoint_exports(fsdp_run, tmp_path):
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(fsdp_run)  # consolidated at the end of training
    exported = AutoModelForCausalLM.from_pretrained(export(fsdp_run / "checkpoint-6", tmp_path / "exported"))
    start = presets.build_model(presets.build_tokenizer(), seed=0)
    tokens = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = final(tokens).logits
        assert torch.equal(exported(tokens).logits, logits)  # the step-6 shards are the final weights
        assert not torch.allclose(start(tokens).logits, logits)  # and they trained
    assert (tmp_path / "exported" / "tokenizer.json").is_file()


def test_fsdp_resume_logs_the_uninterrupted_losses_on_2_ranks_and_on_1(fsdp_run, tmp_path):
    marker = json.loads((fsdp_run / "checkpoint-3" / COMPLETE_MARKER).read_text())
    assert (marker["strategy"], marker["fsdp_sharding"], marker["world_size"]) == ("fsdp", "full_shard", 2)
    expected = losses(fsdp_run)
    for processes in (2, 1):
        resumed = tmp_path / f"resumed-{processes}"
        resumed.mkdir()
        shutil.copytree(fsdp_run / "checkpoint-3", resumed / "checkpoint-3")
        # One process keeps the 32 sequences a step with 2 accumulation steps.
        batch = ["--global_batch_size", str(marker["sequences_per_step"])] if processes == 1 else []
        result = launch_demo(FSDP_ON_CPU, resumed, *RUN, "--resume_from_checkpoint", "auto", *batch,
                             num_processes=processes)
        assert_succeeded(result)
        got = losses(resumed)
        assert sorted(got) == [1, 2, 3, 4, 5, 6]
        for step in (4, 5, 6):
            assert got[step] == pytest.approx(expected[step], abs=1e-4), (processes, step, expected, got)
    assert (f"{resumed / 'checkpoint-3'} was saved by FSDP full_shard on 2 rank(s); continuing on FSDP full_shard on "
            "1 rank(s) through PyTorch's distributed checkpoint resharding") in result.output


def test_a_ddp_run_refuses_an_fsdp_checkpoint_with_what_to_do(fsdp_run, tmp_path):
    ddp = tmp_path / "ddp"
    ddp.mkdir()
    shutil.copytree(fsdp_run / "checkpoint-3", ddp / "checkpoint-3")
    result = launch_demo("accelerate_configs/cpu_ddp.yaml", ddp, *RUN, "--resume_from_checkpoint", "auto")
    assert result.returncode != 0
    assert len(error_lines(result.output)) == 1
    assert ("was saved by FSDP full_shard on 2 rank(s) and this run is DDP or one process on 2 rank(s): the "
            "optimizer states of the two do not convert") in result.output
    assert "finetune export" in result.output
    assert "[rank0]: Traceback" not in result.output and "[rank1]: Traceback" not in result.output


def test_two_nodes_under_fsdp_each_save_the_whole_trained_model(tmp_path):
    """`save_on_each_node` on 2 nodes × 1 process (loopback), each with its own output directory: the node without
    global rank 0 gathers and writes the same full weights."""
    from safetensors.torch import load_file

    port = free_port()
    commands = [FSDP_ON_CPU.command(
        "train", "recipes/demo.yaml", "--max_steps", "3", "--logging_steps", "1", "--eval_on_start", "false",
        "--generation_eval_samples", "0", "--save_strategy", "no", "--save_on_each_node", "true",
        "--output_dir", str(tmp_path / f"node{rank}"), num_processes=2) for rank in (0, 1)]
    for rank, command in enumerate(commands):  # the same rendezvous for both, machine rank by node
        at = command.index("--main_process_port")
        command[at:at + 2] = ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                              "--main_process_port", str(port)]
    nodes = [subprocess.Popen(command, cwd=PROJECT_ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for command in commands]
    logs = [node.communicate(timeout=400)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    first, second = (load_file(tmp_path / f"node{rank}" / "model.safetensors") for rank in (0, 1))
    assert first.keys() == second.keys() and len(first) > 10
    assert all(torch.equal(first[name], second[name]) for name in first)
    start = presets.build_model(presets.build_tokenizer(), seed=0).state_dict()
    assert all(first[name].shape == start[name].shape for name in first)  # whole tensors, not shards
    assert any(not torch.equal(first[name], start[name]) for name in first)  # trained


def test_lora_under_fsdp_shard_grad_op_trains_adapters_only_saves_them_whole_and_exports(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    output_dir = tmp_path / "lora"
    run = [*LORA_DEMO_RUN, "--max_steps", "6", "--logging_steps", "3", "--save_strategy", "steps", "--save_steps", "6"]
    assert_succeeded(launch_demo(FSDP_SHARD_GRAD_OP_ON_CPU, output_dir, *run))
    running = outputs.read_record(output_dir, outputs.EFFECTIVE_CONFIG)["strategy"]["running"]
    assert (running["strategy"], running["fsdp_sharding"]) == ("fsdp", "shard_grad_op")
    ledger_matches_prediction(output_dir, "fsdp_shard_grad_op")
    summary = outputs.read_record(output_dir, outputs.EVAL_RESULTS)
    assert summary["frozen_weights_unchanged"] is True  # checked on every rank
    adapter = load_file(output_dir / "adapter_model.safetensors")
    model = presets.build_model(presets.build_tokenizer(), seed=0)
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
              and name.startswith("model.layers")]
    assert len(adapter) == 2 * len(linear)  # lora_A and lora_B of every linear layer of the blocks
    assert all(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_B" in name)  # they trained

    # The step-6 checkpoint's shards hold the adapters: exported as an adapter and merged, the same model.
    base = presets.build_model(presets.build_tokenizer(), seed=0)
    tokens = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(tokens).logits
        final = PeftModel.from_pretrained(base, output_dir)(tokens).logits
        adapter_dir = export(output_dir / "checkpoint-6", tmp_path / "adapter")
        assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
        exported = PeftModel.from_pretrained(presets.build_model(presets.build_tokenizer(), seed=0), adapter_dir)
        merged = AutoModelForCausalLM.from_pretrained(export(output_dir / "checkpoint-6", tmp_path / "merged",
                                                             merge_lora=True))
        assert torch.equal(exported(tokens).logits, final)
        assert torch.allclose(merged(tokens).logits, final, atol=1e-4)
        assert not torch.allclose(final, base_logits, atol=1e-3)  # the adapters changed the model


# Global rank 0 reads the checkpoint FAULT_SLOW_LOAD_SECONDS late (a slow disk, a first download). Put first on
# PYTHONPATH, it delays `from_pretrained` in that rank alone.
SLOW_RANK_ZERO_LOAD = """
import os
import sys
import time

if os.environ.get("RANK") == "0" and os.environ.get("FAULT_SLOW_LOAD_SECONDS"):
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        print(f"rank 0: reading the checkpoint {os.environ['FAULT_SLOW_LOAD_SECONDS']} s late", file=sys.stderr,
              flush=True)
        time.sleep(float(os.environ["FAULT_SLOW_LOAD_SECONDS"]))
        return original(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
"""


def test_the_other_ranks_wait_for_rank_0_to_read_the_checkpoint_past_ddp_timeout(tmp_path):
    """FSDP2 with rank-0 loading, as shipped: rank 0 reads a hub checkpoint 45 s late, past `ddp_timeout: 20`. The
    other rank, which built the model empty at once, waits for it within `model_load_timeout`, not `ddp_timeout`
    (which would end the run in the data's first collective), and the run trains. The checkpoint's config.json
    records no dtype and the run trains LoRA: the other rank builds its frozen base in the dtype rank 0 loads (the
    weights' own, bf16, read from the safetensors header; before, fp32 from the missing config entry), so rank 0's
    weights fit its shards."""
    from hub_fixtures import save_hub_model

    hub = save_hub_model(tmp_path / "hub")
    config = json.loads((hub / "config.json").read_text())
    assert config.pop("dtype", None) or config.pop("torch_dtype", None)
    (hub / "config.json").write_text(json.dumps(config))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_RANK_ZERO_LOAD)
    env = {"PYTHONPATH": str(site), "FAULT_SLOW_LOAD_SECONDS": "45"}
    output_dir = tmp_path / "run"
    result = launch_demo(FSDP_ON_CPU, output_dir, "--model_name_or_path", str(hub), "--ddp_timeout", "20",
                         "--max_steps", "2", "--logging_steps", "1", "--eval_on_start", "false", "--use_lora", "true",
                         "--generation_eval_samples", "0", "--max_eval_samples", "2", env=env)
    assert "rank 0: reading the checkpoint 45 s late" in result.output  # the delay happened
    assert_succeeded(result)
    assert len(losses(output_dir)) == 2


def test_a_model_built_empty_takes_the_dtypes_rank_0_loads(tmp_path):
    """What a rank other than 0 builds on the meta device has rank 0's dtype tensor by tensor: the weights' own dtype
    where config.json records none, and the modules Transformers keeps in fp32 in fp32; a difference left anyway is
    named by `check_same_parameters_on_every_rank` before any broadcast."""
    from types import SimpleNamespace

    from hub_fixtures import save_hub_model
    from transformers import AutoModelForCausalLM

    from finetune.models.loading import keep_in_fp32, load_model, weights_dtype

    hub = save_hub_model(tmp_path)
    config = json.loads((hub / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (hub / "config.json").write_text(json.dumps(config))
    assert weights_dtype(str(hub)) == torch.bfloat16
    model_args = SimpleNamespace(model_name_or_path=str(hub), torch_dtype="auto", attn_implementation=None,
                                 trust_remote_code=False)
    empty = load_model(model_args, None, shapes_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(hub, dtype="auto")
    assert {name: p.dtype for name, p in empty.named_parameters()} == \
        {name: p.dtype for name, p in loaded.named_parameters()}
    empty._keep_in_fp32_modules_strict = {"norm"}  # as a model that declares fp32 norms does
    assert keep_in_fp32(empty, torch.bfloat16) == 2 * config["num_hidden_layers"] + 1
    assert all(p.dtype == (torch.float32 if "norm" in name else torch.bfloat16) for name, p in empty.named_parameters())


def test_under_fsdp2_the_frozen_reference_is_read_by_rank_0_alone_and_broadcast(tmp_path):
    """Full DPO under FSDP2's rank-0 loading: the reference goes the policy's way. Rank 0 builds (or reads) it, the
    other ranks build its shapes, and Accelerate's FSDP2 preparation broadcasts rank 0's weights into every rank's
    shards (TRL's own preparation shards it with no broadcast, so a rank built empty would keep garbage). Rank 1
    reads none of it (before: its whole copy; 8 × 141 GB a node at 70B), and the first step's loss is DPO's ln 2
    only if every rank's reference holds the policy's weights."""
    output_dir = tmp_path / "dpo"
    assert_succeeded(launch_demo(FSDP_ON_CPU, output_dir, "--method", "dpo", "--max_steps", "1", "--logging_steps",
                                 "1", "--eval_on_start", "false", "--generation_eval_samples", "0",
                                 "--max_eval_samples", "8", "--per_device_eval_batch_size", "8"))
    ranks = {record["rank"]: record for record in outputs.read_record(output_dir, outputs.MEMORY_REPORT)["ranks"]}
    read = {rank: record["measured"]["reference_read_bytes"] for rank, record in ranks.items()}
    whole = 4 * model_shape("tiny").num_parameters  # the tiny model, built in fp32 from its seed on rank 0
    assert read == {0: whole, 1: 0}, read
    assert ranks[1]["predicted"]["host_load_bytes"] == 0 < ranks[0]["predicted"]["host_load_bytes"]
    assert losses(output_dir)[1] == pytest.approx(0.6931, abs=1e-3)  # -log sigmoid(0) on every rank
