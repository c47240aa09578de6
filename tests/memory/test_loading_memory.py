"""Host RAM while the model loads, per rank, on 2 CPU processes with a checkpoint large enough to see it: a
Qwen2-shaped model at hidden 2048 (130M parameters, 263 MB of bf16 safetensors). Under ZeRO-3 (`zero.Init`) and FSDP2
(ranks ≠ 0 built on the meta device) only global rank 0 reads the checkpoint; under pipeline parallelism each rank
reads only its stage's tensors; each rank's growth is what the estimator's `host_load_bytes_of_rank` predicts; every
rank then trains the checkpoint's weights, not empty ones."""

import json

import pytest
import torch
from hub_fixtures import save_hub_model
from safetensors.torch import load_file
from support import CPU_LAUNCHES, FSDP_ON_CPU, assert_succeeded, launch_demo

from finetune import outputs
from finetune.train.axes.pipeline.loop import FINAL_INDEX

pytestmark = pytest.mark.distributed
MiB = 1024**2
WIDTHS = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 3, "num_attention_heads": 16,
          "num_key_value_heads": 4}
# lr 1e-30: Adam moves each weight by about 1e-30, so the saved weights are the ones every rank started from.
RUN = ["--max_steps", "1", "--per_device_train_batch_size", "1", "--max_seq_length", "64", "--bf16", "true",
       "--learning_rate", "1e-30", "--warmup_steps", "0", "--generation_eval_samples", "0", "--max_eval_samples", "2"]
# glibc keeps freed blocks below its mmap threshold in the heap, and the threshold grows to 32 MiB as large blocks
# are freed. On a CPU-only run the ZeRO-3 partitions and the modules gathered to fill them (GPU memory on a GPU) go
# through the host's allocator, and resident memory would show what it keeps (+146 MiB a rank, measured) rather than
# what is held. A fixed threshold returns large blocks when they are freed.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# Python objects, the allocator and DeepSpeed's bookkeeping while loading (measured: 3 to 49 MiB).
SLACK = 64 * MiB


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return save_hub_model(tmp_path_factory.mktemp("wide"), "chatml", **WIDTHS)


def launched(launch, wide_model, output_dir, *extra):
    assert_succeeded(launch_demo(launch, output_dir, "--model_name_or_path", str(wide_model), *RUN, *extra,
                                 env=ALLOCATOR))
    return output_dir


@pytest.fixture(scope="module")
def runs(wide_model, tmp_path_factory):
    """ZeRO-3 (bf16: DeepSpeed's half dtype) and FSDP2 full shard (fp32 masters, bf16 compute) on the wide model."""
    return {"zero3": launched(CPU_LAUNCHES["zero3"], wide_model, tmp_path_factory.mktemp("zero3")),
            "fsdp": launched(FSDP_ON_CPU, wide_model, tmp_path_factory.mktemp("fsdp"))}


@pytest.fixture(scope="module")
def pipeline_run(wide_model, tmp_path_factory):
    """Two stages (layers 0-1 with the embedding; layer 2 with the norm and the head), fp32 masters, bf16 compute."""
    return launched(CPU_LAUNCHES["ddp"], wide_model, tmp_path_factory.mktemp("pipeline"),
                    "--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "2")


def checkpoint_bytes(model_dir) -> int:
    return (model_dir / "model.safetensors").stat().st_size


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_only_global_rank_0_reads_the_checkpoint_and_each_rank_takes_the_predicted_host_ram(runs, wide_model, name):
    ranks = outputs.read_record(runs[name], outputs.MEMORY_REPORT)["ranks"]
    loaded = {record["rank"]: record["measured"]["host_load_bytes"] for record in ranks}
    predicted = {record["rank"]: record["predicted"]["host_load_bytes"] for record in ranks}
    for rank in (0, 1):
        assert abs(loaded[rank] - predicted[rank]) <= SLACK, (name, rank, loaded, predicted)
    whole = checkpoint_bytes(wide_model)
    assert loaded[0] - loaded[1] >= 0.9 * whole  # rank 0 alone holds the whole checkpoint...
    # ...rank 1 its ZeRO-3 partition in bf16 (half the model: on a GPU it lies there), under FSDP2 nothing until
    # Accelerate fills its shards from rank 0.
    assert loaded[1] <= {"zero3": whole / 2, "fsdp": 0}[name] + SLACK, (name, loaded)


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_every_rank_trains_the_checkpoints_weights(runs, wide_model, name):
    """The shards rank 1 trained came from rank 0: with an update of ~1e-30 the saved model is the checkpoint (empty
    or zeroed shards would differ by the weights' own size, ~0.02)."""
    start, saved = load_file(wide_model / "model.safetensors"), load_file(runs[name] / "model.safetensors")
    assert sorted(saved) == sorted(start)
    assert max((saved[key].float() - start[key].float()).abs().max().item() for key in start) < 1e-20
    losses = [entry["loss"] for entry in json.loads((runs[name] / "trainer_state.json").read_text())["log_history"]
              if "loss" in entry]
    assert len(losses) == 1 and 4 < losses[0] < 8  # about ln(vocabulary) for a random model


def test_zero3_on_a_bf16_checkpoint_keeps_deepspeeds_fp32_masters_equal_to_the_prediction(runs, wide_model):
    """DeepSpeed keeps its own fp32 master partition (nothing is cast by finetune); the hub-like model (GQA, untied
    head, bf16 safetensors) partitions and is predicted like the tiny default."""
    weights = load_file(wide_model / "model.safetensors")
    parameters = sum(tensor.numel() for tensor in weights.values())
    # Trainer's no-weight-decay group (norms and biases) is stepped after the first group's fp32 gradients are freed:
    # the step holds the larger group's copy (tests/memory/test_memory_distributed.py: NO_DECAY_FP32).
    no_decay_fp32_shard = 4 * sum(tensor.numel() for name, tensor in weights.items()
                                  if "norm" in name or "bias" in name) // 2
    effective = outputs.read_record(runs["zero3"], outputs.EFFECTIVE_CONFIG)["values"]
    assert effective["trainable_weights"]["value"] == "fp32 (DeepSpeed's master copy)"
    for record in outputs.read_record(runs["zero3"], outputs.MEMORY_REPORT)["ranks"]:
        assert record["strategy"].startswith("deepspeed_zero3")
        assert abs(record["measured"]["optimizer_bytes"] - (4 + 8) * parameters / 2) <= 1024  # fp32 master + Adam
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert abs(record["measured"][key] - record["predicted"][key]) <= 1024 + (
                no_decay_fp32_shard if key == "grads_bytes" else 0), (record["rank"], key)


def test_each_pipeline_rank_reads_only_its_stage_as_predicted(pipeline_run, wide_model):
    """Each rank builds the model on the meta device and reads its stage's tensors, cast to fp32 one at a time: its
    host RAM is its stage in fp32 (plus one tensor as stored), as `host_load_bytes_of_rank` plans it, not the whole
    model loaded and upcast on every rank (6 bytes a parameter: 0.78 GB here, 3.4 TB a node for a 70B cut 8 ways)."""
    ranks = outputs.read_record(pipeline_run, outputs.MEMORY_REPORT)["ranks"]
    parameters = sum(tensor.numel() for tensor in load_file(wide_model / "model.safetensors").values())
    for record in ranks:
        loaded, predicted = record["measured"]["host_load_bytes"], record["predicted"]["host_load_bytes"]
        stage = record["measured"]["params_bytes"]  # the stage's fp32 masters, as held in training
        assert abs(loaded - predicted) <= max(SLACK, 0.1 * predicted), (record["rank"], loaded, predicted)
        assert stage <= predicted <= stage + 4 * 2 * WIDTHS["hidden_size"] * WIDTHS["intermediate_size"]
        assert loaded < 0.6 * 6 * parameters, (record["rank"], loaded)  # the whole model, upcast, is not loaded


def test_the_pipelines_final_model_is_one_shard_a_stage_in_the_checkpoints_dtype(pipeline_run, wide_model):
    """Each rank writes its stage as one bf16 shard (the checkpoint's dtype, `save_dtype: auto`), rank 0 the index:
    the checkpoint's own weights came back (lr 1e-30), so each stage was filled from the file, by its names."""
    from transformers import AutoModelForCausalLM

    index = json.loads((pipeline_run / FINAL_INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    start = load_file(wide_model / "model.safetensors")
    saved = {}
    for shard in sorted(set(index["weight_map"].values())):
        saved.update(load_file(pipeline_run / shard))
    assert sorted(saved) == sorted(start) == sorted(index["weight_map"])
    assert all(saved[name].dtype == start[name].dtype for name in start)
    assert max((saved[name].float() - start[name].float()).abs().max().item() for name in start) < 1e-20
    assert json.loads((pipeline_run / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(pipeline_run, dtype="auto")
    assert model.dtype == torch.bfloat16
    loaded = model.state_dict()
    assert max((loaded[name].float() - start[name].float()).abs().max().item() for name in start) < 1e-20


def test_the_load_probe_counts_its_own_span_not_the_process_earlier_peak():
    """A process that was larger before the span (its imports' buffers freed, its pages reclaimed under memory
    pressure) must not charge that to the span: the probe reads the kernel's high-water mark reset at its start, and
    the process's lifetime peak is still what `peak_resident_bytes` reports."""
    import gc
    import mmap

    from finetune.memory.ledger import HostLoadProbe, peak_resident_bytes

    def touched(size: int) -> mmap.mmap:
        """Fresh anonymous pages, made resident one by one: whatever the allocator holds from earlier tests in this
        worker, they add `size` to the resident set."""
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        return block

    gc.collect()  # an earlier test's garbage freed now, not inside the span (the set would shrink under it)
    touched(256 * MiB).close()  # the process larger before the span, then returned to the system
    lifetime = peak_resident_bytes()
    probe = HostLoadProbe()
    held = touched(64 * MiB)
    assert 60 * MiB <= probe.stop() <= 80 * MiB  # the span's 64 MiB, not the 256 MiB before it
    assert peak_resident_bytes() >= lifetime and len(held) == 64 * MiB
