"""The paths only a GPU runs, in one command, for the day one is lent (CPU twins of each are in tests/):

    python benchmarks/gpu_check.py            # every visible GPU; QLoRA rows need `pip install 'finetune-kit[qlora]'`

- FSDP2 full shard in bf16 over NCCL: trains, ledger = prediction per rank (tests/launch/test_fsdp.py: over gloo);
- QLoRA on one GPU in bf16, and in fp16 as on a T4 (`torch_dtype: float16`, `fp16: true`);
- QLoRA under FSDP2 full shard and under ZeRO-3: the 4-bit weights stored in bf16 and sharded
  (tests/models/test_qlora.py checks the loading options and refusals without CUDA);
- a checkpoint stored in bf16 (as hub models are) trained under bf16 mixed precision on one GPU and under DDP over
  NCCL: trainable weights held in fp32 (tests/models/test_precision.py runs both on CPU);
- packing under flash attention 2 with 4 packed rows per micro-batch, flattened into one row (needs `flash-attn`;
  tests/data/test_attention_packing.py checks Transformers' own varlen detection without CUDA);
- DPO from the bf16 checkpoint in bf16: the frozen reference beside the fp32 masters on CUDA (tests/train/test_dpo.py
  and tests/memory/test_loading_memory.py run it on CPU); its loss need not fall in 20 steps from an untrained model;
- GRPO in bf16 with fp32 masters: the generation round's KV cache, fp32 keys beside bf16 values under autocast,
  measured against the plan's bytes (`kv_cache_gap_bytes`; tests/train/test_grpo.py checks the dtypes on CPU).
  Its loss need not fall in 20 steps: the row passes when it runs;
- the tiny vision-language model under bf16 autocast: LoRA under ZeRO-2 and full fine-tuning under FSDP2 over NCCL,
  its frozen tower beside the trained projector and ledger = prediction per rank (tests/train/test_vision_train.py and
  tests/train/test_vision_engines.py run both strategies' CPU twins, and a bf16 checkpoint under autocast).

Each row: the exit status, first and last logged loss, and the largest gap between measured and predicted model-state
bytes on any rank. On one GPU the FSDP and ZeRO-3 rows run one process and say "not sharded: one process". Results
go to benchmarks/results/gpu-check-<device>.json.

Speed at real width is benchmarks/gpu_speed.py: tokens/s, MFU and measured against predicted peak memory for plain
Trainer, TRL's SFTTrainer and finetune's paths at a 1B and an 8B-width model, in 10 minutes.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune import outputs  # noqa: E402
from finetune.launch.strategies import SHIPPED_BY_NAME  # noqa: E402
from finetune.testing.subprocesses import run  # noqa: E402

SHORT = ["--max_steps", "20", "--logging_steps", "5", "--save_strategy", "no", "--eval_on_start", "false",
         "--generation_eval_samples", "0"]
QLORA = ["--use_qlora", "true", "--lora_r", "8", "--learning_rate", "1e-3"]
# The tiny Qwen2-VL on its drawn shapes (recipes/vision.yaml's model and data), its tower frozen
VISION = ["--model_name_or_path", "tiny-vl", "--dataset", "synthetic-shapes", "--per_device_train_batch_size", "8",
          "--learning_rate", "3e-3"]
CHECKS = {
    "fsdp_full_shard_bf16": ("fsdp_full_shard", ["--bf16", "true"]),
    "qlora_single_bf16": ("single", [*QLORA, "--bf16", "true"]),
    "qlora_single_fp16_t4": ("single", [*QLORA, "--torch_dtype", "float16", "--fp16", "true"]),
    "qlora_fsdp_full_shard_bf16": ("fsdp_full_shard", [*QLORA, "--torch_dtype", "bfloat16", "--bf16", "true"]),
    "qlora_zero3_bf16": ("zero3", [*QLORA, "--torch_dtype", "bfloat16", "--bf16", "true"]),
    "bf16_checkpoint_single": ("single", ["--model_name_or_path", "{bf16_checkpoint}", "--bf16", "true"]),
    "bf16_checkpoint_ddp": ("ddp", ["--model_name_or_path", "{bf16_checkpoint}", "--bf16", "true"]),
    "packing_flash_attention_2": ("single", ["--packing", "true", "--attn_implementation", "flash_attention_2",
                                             "--per_device_train_batch_size", "4", "--bf16", "true"]),
    "dpo_bf16_checkpoint_single": ("single", ["--model_name_or_path", "{bf16_checkpoint}", "--method", "dpo",
                                              "--per_device_train_batch_size", "8", "--learning_rate", "1e-3",
                                              "--bf16", "true"]),
    "grpo_single_bf16": ("single", ["--method", "grpo", "--dataset_config", "add", "--reward_funcs", "exact_match",
                                    "--num_generations", "8", "--max_completion_length", "8",
                                    "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "40",
                                    "--max_eval_samples", "40", "--bf16", "true"]),
    "vision_lora_zero2_bf16": ("zero2", [*VISION, "--use_lora", "true", "--bf16", "true"]),
    "vision_fsdp_full_shard_bf16": ("fsdp_full_shard", [*VISION, "--bf16", "true"]),
}
# From the untrained tiny model, 20 steps of DPO (pairs it cannot yet tell apart) or GRPO (rewards near 0) move the
# loss by noise: those rows pass when they run and their ledger and KV cache match the plan.
LOSS_NEED_NOT_FALL = {"dpo_bf16_checkpoint_single", "grpo_single_bf16"}


def save_bf16_checkpoint(directory: Path) -> str:
    """The tiny default saved as hub checkpoints are: bf16 safetensors with its tokenizer."""
    from finetune import presets

    tokenizer = presets.build_tokenizer()
    presets.build_model(tokenizer, dtype=torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def sharding_note(strategy: str, gpus: int) -> str | None:
    """What a row cannot prove: on one GPU a sharding strategy runs one process, so nothing is split."""
    if gpus == 1 and SHIPPED_BY_NAME[strategy].kind in ("ddp", "deepspeed", "fsdp"):
        return "not sharded: one process (one GPU visible); the row shows the path runs, not that it shards"
    return None


# A rank's own failure: the toolkit's one-line refusal, or the exception line that ends a traceback; the launchers'
# closing lines (CalledProcessError, ChildFailedError) only repeat that a child failed.
_CAUSE = re.compile(r"^(\[rank\d+\]:\s*)?(finetune: error:|[A-Za-z_.]*(Error|Exception)\b)")
_LAUNCHER = ("CalledProcessError", "ChildFailedError")


def root_cause(output: str) -> str:
    """The line that says why a launched run failed (its rank's exception, not the launcher's), shortened."""
    lines = output.splitlines()
    causes = [line for line in lines if _CAUSE.match(line.strip()) and not any(word in line for word in _LAUNCHER)]
    return (causes or lines or ["no output"])[-1].strip()[:400]


def check(name: str, strategy: str, extra: list[str], scratch: Path) -> dict:
    gpus = 1 if strategy == "single" else torch.cuda.device_count()
    output_dir = scratch / name
    # The shipped configs launch in bf16; an fp16 row says so to the launcher too (the recipe check refuses a
    # launcher and a recipe that disagree on the precision).
    options = ("--mixed_precision", "fp16") if "--fp16" in extra else ()
    command = SHIPPED_BY_NAME[strategy].launch(cpu=False).command(
        "train", "recipes/demo.yaml", "--output_dir", str(output_dir), *SHORT, *extra, num_processes=gpus,
        options=options)
    result = run(command, timeout=1800, cwd=ROOT)
    row: dict = {"strategy": strategy, "gpus": gpus, "returncode": result.returncode}
    if note := sharding_note(strategy, gpus):
        row["note"] = note
    if result.returncode != 0:
        return {**row, "error": root_cause(result.output)}
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    row.update(first_loss=losses[0], last_loss=losses[-1])
    effective = outputs.read_record(output_dir, outputs.EFFECTIVE_CONFIG, missing=None)
    if effective is not None:
        row["trainable_weights"] = effective["values"]["trainable_weights"]["value"]
    memory = outputs.read_record(output_dir, outputs.MEMORY_REPORT, missing=None)
    if memory is not None:
        row["max_state_gap_bytes"] = max(
            abs(rank["measured"][key] - rank["predicted"][key]) for rank in memory["ranks"]
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"))
        row["peak_bytes"] = max(rank["measured"]["peak_bytes"] for rank in memory["ranks"])
        caches = [(rank["measured"]["generation_cache"], rank["predicted"].get("kv_cache_bytes_per_token"))
                  for rank in memory["ranks"] if rank["measured"].get("generation_cache")]
        if caches:  # the largest KV cache a round held against the plan's bytes a token for the same tokens
            row["kv_cache_gap_bytes"] = max(
                abs(cache["bytes"] - cache["sequences"] * cache["tokens"] * per_token) for cache, per_token in caches
                if per_token)
    return row


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), metavar="CHECK",
                        help="run these rows alone and update them in the device's results file")
    only = parser.parse_args().only
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible; the CPU twins of these paths run in `make test`.", file=sys.stderr)
        return 2
    device = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    path = ROOT / "benchmarks" / "results" / f"gpu-check-{device}.json"
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        bf16_checkpoint = save_bf16_checkpoint(Path(scratch) / "bf16_checkpoint")
        for name, (strategy, extra) in CHECKS.items():
            if only and name not in only:
                continue
            print(f"running {name}", flush=True)
            extra = [value.format(bf16_checkpoint=bf16_checkpoint) for value in extra]
            rows[name] = {**check(name, strategy, extra, Path(scratch)), "date": date.today().isoformat()}
            print(f"  {rows[name]}", flush=True)
    earlier = json.loads(path.read_text())["checks"] if only and path.is_file() else {}
    record = {"device": device, "gpus": torch.cuda.device_count(), "command": "python benchmarks/gpu_check.py",
              "checks": {**earlier, **rows}}
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    failed = [name for name, row in rows.items() if row["returncode"] != 0 or row.get("kv_cache_gap_bytes")
              or (name not in LOSS_NEED_NOT_FALL and row["last_loss"] >= row["first_loss"])]
    for name, row in rows.items():
        if "note" in row:
            print(f"{name}: {row['note']}")
    print("all checks passed" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
