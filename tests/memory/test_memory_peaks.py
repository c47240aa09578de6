"""Where gradients peak, measured on 2 CPU ranks against the estimator: ZeRO-1 under gradient accumulation keeps the
full gradients between micro-steps, ZeRO-2 only its partition; ZeRO-3 holds one `sub_group_size` group's fp32
gradients at a time. Unit tests of the same terms (and of host RAM at load) are in test_memory.py."""

import json

import pytest

from finetune.memory import model_shape

pytestmark = pytest.mark.distributed

TINY = model_shape("tiny")
PSI = TINY.num_parameters
ALIGNMENT = 1024  # bytes: DeepSpeed pads each flat partition to an alignment boundary
SUB_GROUP_SIZE = 50_000  # elements: the tiny model's 262,912-element partition is stepped in several sub-groups


@pytest.fixture(scope="module")
def peak_runs(tmp_path_factory):
    """Three short fp32 runs: ZeRO-1 and ZeRO-2 with 2 micro-steps per optimizer step, ZeRO-3 with small
    sub-groups (a DeepSpeed JSON written here)."""
    from support import PROJECT_ROOT, assert_succeeded, launch_demo

    config = json.loads((PROJECT_ROOT / "deepspeed_configs/zero3.json").read_text())
    config["zero_optimization"]["sub_group_size"] = SUB_GROUP_SIZE
    zero3_json = tmp_path_factory.mktemp("configs") / "zero3_sub_groups.json"
    zero3_json.write_text(json.dumps(config))
    accumulate = ("--gradient_accumulation_steps", "2")
    runs = {}
    for name, deepspeed_json, extra in [("zero1_accumulate", "deepspeed_configs/zero1.json", accumulate),
                                        ("zero2_accumulate", "deepspeed_configs/zero2.json", accumulate),
                                        ("zero3_sub_groups", str(zero3_json), ())]:
        output_dir = tmp_path_factory.mktemp(name)
        assert_succeeded(launch_demo("accelerate_configs/cpu_deepspeed_zero2.yaml", output_dir, *extra,
                                     deepspeed_json=deepspeed_json))
        runs[name] = json.loads((output_dir / "memory_report.json").read_text())["ranks"]
    return runs


def test_zero1_holds_full_gradients_between_micro_steps_and_zero2_only_its_partition(peak_runs):
    for record in peak_runs["zero1_accumulate"]:
        measured, predicted = record["measured"], record["predicted"]
        # stage_1_and_2.py reduces only at the accumulation boundary: every fp32 gradient, whole, on each rank.
        assert measured["grads_between_micro_steps_bytes"] == predicted["grads_between_micro_steps_bytes"] == 4 * PSI
        assert predicted["estimate"]["setup"]["gradient_accumulation_steps"] == 2
        assert predicted["grads_peak_bytes"] == max(predicted["grads_bytes"], 4 * PSI)
        assert measured["grads_peak_bytes"] >= measured["grads_between_micro_steps_bytes"]
    for record in peak_runs["zero2_accumulate"]:
        measured, predicted = record["measured"], record["predicted"]
        # Reduce-scattered each micro-step: the rank's partition, sized by the whole tensors it touches
        # (`grads_in_partition`, the same slack as at the step: up to the embedding more on the rank it cuts).
        assert predicted["grads_between_micro_steps_bytes"] == 4 * PSI // 2
        extra = measured["grads_between_micro_steps_bytes"] - predicted["grads_between_micro_steps_bytes"]
        assert 0 <= extra <= ALIGNMENT + 4 * TINY.largest_layer_parameters
        assert measured["grads_between_micro_steps_bytes"] < 4 * PSI * 0.6  # far from ZeRO-1's full gradients
        for key in ("params_bytes", "optimizer_bytes"):  # accumulation changes nothing else
            assert measured[key] == predicted[key]


def test_zero3_holds_one_sub_group_of_fp32_gradients_at_the_step(peak_runs):
    partition = PSI // 2
    for record in peak_runs["zero3_sub_groups"]:
        measured, predicted = record["measured"], record["predicted"]
        assert predicted["estimate"]["setup"]["sub_group_size"] == SUB_GROUP_SIZE
        assert measured["grads_between_micro_steps_bytes"] == predicted["grads_between_micro_steps_bytes"] == 0
        # The fp32 part: the partition in fp32 is held one sub-group at a time, a sub-group closing on the tensor
        # that takes it past sub_group_size: between 4·sub_group_size and 4·(sub_group_size + one tensor's shard).
        fp32_held = measured["grads_bytes"] - 4 * partition
        assert 4 * SUB_GROUP_SIZE <= fp32_held <= 4 * (SUB_GROUP_SIZE + TINY.largest_layer_parameters // 2)
        assert fp32_held < 4 * partition / 3
        # Predicted: the upper end, within one tensor's fp32 shard of what was held.
        assert 0 <= predicted["grads_bytes"] - measured["grads_bytes"] <= 4 * TINY.largest_layer_parameters // 2
