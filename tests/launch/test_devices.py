"""The one "does this GPU do bf16?" answer, on simulated GPUs: what plan, train, QLoRA and the notebooks ask."""

import pytest
from gpu_simulation import A100, T4, simulate_gpus

from finetune.launch.devices import KNOWN_GPUS, gpu_named, training_precision_here, visible_gpu


@pytest.mark.parametrize("gpu, precision", [(T4, "fp16"), (A100, "bf16"), (("Tesla V100", (7, 0)), "fp16"),
                                            (("NVIDIA H100", (9, 0)), "bf16")])
def test_the_visible_gpu_decides_the_training_precision(monkeypatch, gpu, precision):
    simulate_gpus(monkeypatch, gpu, memory_gib=16)
    seen = visible_gpu()
    assert (seen.name, seen.compute_capability, seen.memory_gib) == (gpu[0], gpu[1], 16)
    assert seen.supports_bf16 == (precision == "bf16") and training_precision_here() == precision


def test_without_a_gpu_notebooks_train_in_fp32(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert visible_gpu() is None and training_precision_here() == "fp32"


def test_named_gpus_agree_with_their_compute_capability():
    assert [name for name, gpu in KNOWN_GPUS.items() if not gpu.supports_bf16] == ["t4", "v100"]
    assert gpu_named(compute_capability="7.5").half_precision == "fp16"
    assert gpu_named("H100").half_precision == "bf16"


def test_a_deepspeed_run_on_cpu_does_not_compile_deepspeeds_inference_collective(monkeypatch):
    import importlib

    from finetune.launch.devices import without_deepspeeds_cpu_inference_collective

    def build_shm_op():  # stands in for DeepSpeed's: a run in this process may already have replaced it
        return "compiled"

    backend = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.setattr(backend, "build_shm_op", build_shm_op)  # restored after the test
    assert not without_deepspeeds_cpu_inference_collective(uses_deepspeed=False)
    assert backend.build_shm_op is build_shm_op  # a run without DeepSpeed leaves DeepSpeed alone
    assert without_deepspeeds_cpu_inference_collective(uses_deepspeed=True)
    assert backend.build_shm_op() is None  # nothing compiled; the backend's inference all-reduce uses gloo's
