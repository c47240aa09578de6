"""Tokens/s, MFU and peak memory against the planner's prediction for plain Trainer, TRL's SFTTrainer and finetune's
paths at real widths on one GPU: one command, under 10 minutes on one H100 or H200, for the day one is lent.

    python benchmarks/gpu_speed.py                            # writes results/gpu-speed-<device>.json
    python benchmarks/gpu_speed.py --cpu --results-dir DIR    # the same code on the tiny model, 12 steps

Models are random-init, built on the GPU and saved in bf16 with the tiny preset's tokenizer, so nothing is
downloaded or uploaded: Llama-3.2-1B's shape (all 16 layers) and Llama-3-8B's width (hidden 4,096, 32 query and 8
key-value heads, vocabulary 128,256) with 4 decoder layers. The data is the bench's echo task with lengths uniform
over the upper half of the sequence (2,048 tokens): a padded micro-batch is mostly real tokens, as the plan assumes
when it predicts at `max_seq_length`, and packing still has room to fill. Micro-batch 4, 30 steps, bf16.

Rows, one process each (`finetune.bench.harness`), a row on every model before the next row:
- plain_trainer: plain Trainer, padded (finetune.bench.plain_trainer: the bf16 checkpoint trained as loaded);
- trl_sft: TRL's SFTTrainer, padded, with its fused LM head (finetune.bench.trl_sft);
- finetune: `finetune train` defaults on one GPU (fp32 master weights under bf16 autocast, TRL's fused LM head);
- full_logits: the same with `fused_lm_head: false` (the model's own loss over the full logits);
- packing: the same with `packing: true`;
- liger: the same with `use_liger_kernel: true` (skipped without CUDA or without liger-kernel);
- compile: the same with `torch_compile: true` (skipped without CUDA); last, as its compilation starts slowest.
A row gets at most ROW_TIMEOUT seconds and never more than the budget (BUDGET_SECONDS, model building included) has
left; one that cannot start in time is recorded as skipped, with the reason.

The JSON, `gpu-speed-<device>.json` (the device as `finetune bench` names it), is rewritten after every row:
    "date", "device", "device_name", "command", "wall_seconds",
    "peak_tflops": the dense bf16 peak MFU divides by (finetune.launch.devices; null on a CPU or an unknown GPU),
    "versions": {"torch", "transformers", "trl", "accelerate", "liger-kernel"} (null: not installed),
    "settings": {"max_seq_length", "micro_batch", "steps", "bf16", "examples"},
    "models": {NAME: {"shape": {"num_parameters", "hidden_size", "num_layers", "vocab_size"}, "rows": {ROW: {...}}}}
Every row has "what" and "status" ("ran", "failed" or "skipped"), and "reason" unless it ran. A row that ran has:
    "tokens_per_second": non-pad tokens over Trainer's `train_runtime`, the whole run (warm-up and compilation
        included), read as `finetune bench` reads every row;
    "steady_tokens_per_second", "tflops_per_device", "mfu": the last logged window (steps 21-30; 2-10 on CPU),
        timed by finetune's throughput callback in every row, the baselines too; "mfu" is null without a known peak;
    "train_loss", "wall_seconds" (the process, start-up included);
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_kind": `torch.cuda.max_memory_allocated` and
        `max_memory_reserved` ("cuda_max_allocated"), or the process's peak resident set on a CPU ("cpu_max_rss",
        reserved null), as the memory report records them (its reserved peak is read since the last step's reset of
        the peaks; nothing here empties the allocator's cache, so the pool only grew before it);
    "predicted_peak_bytes", "predicted_parts" (the estimate's `per_gpu` bytes), "prediction": "memory_report" (the
        run's own, finetune rows) or "estimate" (`finetune.memory.estimate.estimate` for a baseline: this script's
        Setup), and "plan_assumes": what that prediction counts, and what it does not model;
    "allocated_over_predicted", "reserved_over_predicted": measured over predicted, null unless measured on CUDA.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune import outputs  # noqa: E402
from finetune.bench.harness import Settings, Variant, device_label, last_window, run_once  # noqa: E402
from finetune.errors import ChildTimedOut  # noqa: E402
from finetune.memory.estimate import MethodTerms, Setup, estimate  # noqa: E402
from finetune.memory.shapes import model_shape, resolve_config  # noqa: E402

BUDGET_SECONDS = 570  # 10 minutes, less the interpreter's start and the summary
ROW_TIMEOUT = 150  # seconds a row may take
ROW_TIMEOUTS = {"compile": 300}  # its first graphs compile for minutes
LEAST_TIME_FOR_A_ROW = 45  # a process's start-up alone takes 20-30 s on a GPU machine
# A model: (a known shape, the decoder layers kept: None for all).
MODES = {
    "gpu": {"models": {"llama-3.2-1b": ("llama-3.2-1b", None), "llama-3-8b-width-4-layers": ("llama-3-8b", 4)},
            "max_seq_length": 2048, "micro_batch": 4, "steps": 30, "examples": 480},
    "cpu": {"models": {"tiny": ("tiny", None)}, "max_seq_length": 128, "micro_batch": 4, "steps": 12, "examples": 192},
}
# The recipe's `strategy: zero2` would launch DeepSpeed even for one GPU: every finetune row runs one plain process,
# as the baselines do.
ONE_PROCESS = ["--strategy", "single"]
ROWS = [
    Variant("plain_trainer", "plain Hugging Face Trainer, padded batches", plain=True),
    Variant("trl_sft", "TRL SFTTrainer, padded batches (its fused LM head)", peer=True),
    Variant("finetune", "finetune train defaults (TRL's fused LM head)", extra=ONE_PROCESS),
    Variant("full_logits", "finetune train, the loss over the full logits",
            extra=[*ONE_PROCESS, "--fused_lm_head", "false"]),
    Variant("packing", "finetune train, packed rows", extra=[*ONE_PROCESS, "--packing", "true"]),
    Variant("liger", "finetune train, Liger kernels", extra=[*ONE_PROCESS, "--use_liger_kernel", "true"],
            needs_cuda="Liger kernels are Triton (CUDA)"),
    Variant("compile", "finetune train, torch.compile", extra=[*ONE_PROCESS, "--torch_compile", "true"],
            needs_cuda="the row times GPU kernels (on a CPU inductor spends minutes compiling C++)"),
]
NOT_PLANNED = {"liger": "Liger's kernels are not modelled: the prediction is the run without them",
               "compile": "torch.compile is not modelled: the prediction is the eager run's"}


def build_model(shape: str, layers: int | None, directory: Path, device: str) -> str:
    """`tiny`, or a random-init model of a known shape (its first `layers` decoder layers when given) built on
    `device` in bf16 and saved with the tiny tokenizer, as `finetune.bench.harness.random_init_model_dir` saves one
    built on the host with every layer."""
    if shape == "tiny":
        return shape
    import torch
    from transformers import AutoModelForCausalLM

    from finetune import presets

    config = resolve_config(shape)
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    presets.build_tokenizer().save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the rows' processes get the GPU
    return str(directory)


def filled_rows_file(path: Path, examples: int, max_seq_length: int, seed: int = 0) -> Path:
    """The bench's echo task (`finetune.bench.harness.long_tailed_file`) with lengths uniform over the upper half of
    the sequence, a few tokens short of it for the chat template (the tiny tokenizer has a token a letter)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    with path.open("w") as out:
        for length in rng.integers(max_seq_length // 2, max_seq_length - 16, size=examples):
            text = "".join(rng.choice(letters, size=int(length) // 2))
            out.write(json.dumps({"instruction": "echo", "input": text, "output": text}) + "\n")
    return path


def baseline_setup(variant: Variant, settings: Settings) -> Setup:
    """The planner's question for a baseline: one process, the checkpoint's weights trained as loaded (bf16 as this
    script saves them, so AdamW's states are bf16 too; the tiny preset is built in fp32), the full logits held unless
    TRL's fused LM head scores the tokens."""
    return Setup(strategy="single", precision="bf16" if settings.bf16 else "fp32",
                 pure_bf16=settings.model != "tiny", micro_batch_size=settings.micro_batch,
                 sequence_length=settings.max_seq_length,
                 method=MethodTerms(logits_held=False, fused_head=True) if variant.peer else MethodTerms())


def assumptions(setup: dict, row: str) -> str:
    """What a prediction counts, from its Setup (`estimate(...).to_dict()["setup"]`), and what it leaves out."""
    if setup["pure_bf16"]:
        weights = "pure bf16 (weights, gradients and AdamW states)"
    elif setup["precision"] == "fp32":
        weights = "fp32"
    else:
        weights = f"{setup['precision']} autocast over fp32 weights, gradients and AdamW states"
    method = setup["method"]
    head = "TRL's fused LM head (no logits held)" if method["fused_head"] else \
        "the full logits held" if method["logits_held"] else "no logits held"
    said = [weights, head, f"{setup['micro_batch_size']} x {setup['sequence_length']} tokens",
            f"{setup['attention']} attention"]
    return "; ".join([*said, *([NOT_PLANNED[row]] if row in NOT_PLANNED else [])])


def read_row(variant: Variant, settings: Settings, output_dir: Path) -> dict:
    """A finished run's last logged throughput window, its peaks, and the planner's prediction for it: the run's own
    memory report where it wrote one, else `estimate` for the baseline's Setup."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    window = last_window(history)
    memory = outputs.read_record(output_dir, outputs.MEMORY_REPORT, missing=None)
    if memory is not None:
        rank = memory["ranks"][0]  # one process
        measured, predicted, source = rank["measured"] or {}, (rank["predicted"] or {}).get("estimate"), \
            "memory_report"
    else:
        measured = outputs.read_record(output_dir, outputs.PEAK_MEMORY, missing={})
        predicted = estimate(model_shape(settings.model), baseline_setup(variant, settings)).to_dict()
        source = "estimate"
    row = {"steady_tokens_per_second": window.get("throughput/tokens_per_second"),
           "tflops_per_device": window.get("throughput/tflops_per_device"), "mfu": window.get("throughput/mfu"),
           "peak_allocated_bytes": measured.get("peak_bytes"),
           "peak_reserved_bytes": measured.get("peak_reserved_bytes"), "peak_kind": measured.get("peak_kind"),
           "predicted_peak_bytes": None, "predicted_parts": None,
           "prediction": source, "plan_assumes": None, "allocated_over_predicted": None,
           "reserved_over_predicted": None}
    if predicted is not None:
        parts = predicted["per_gpu"]
        row.update(predicted_peak_bytes=parts["total_bytes"], predicted_parts=parts,
                   plan_assumes=assumptions(predicted["setup"], variant.name))
        if row["peak_kind"] == "cuda_max_allocated":
            row["allocated_over_predicted"] = row["peak_allocated_bytes"] / parts["total_bytes"]
            row["reserved_over_predicted"] = row["peak_reserved_bytes"] / parts["total_bytes"]
    return row


def skip_reason(variant: Variant, cuda: bool, seconds_left: float) -> str | None:
    if variant.needs_cuda and not cuda:
        return f"{variant.needs_cuda}; no CUDA here"
    if variant.name == "liger" and importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed here"
    if seconds_left < LEAST_TIME_FOR_A_ROW:
        return f"not run: {seconds_left:.0f} s of the {BUDGET_SECONDS} s budget left"
    return None


def run_row(variant: Variant, settings: Settings, output_dir: Path, timeout: float) -> dict:
    """One row's run and what it measured, or why it failed; its folder is removed once read (`finetune train` saves
    the model it trained, gigabytes a row at these widths)."""
    try:
        result = run_once(variant, settings, output_dir, timeout=timeout)
    except ChildTimedOut:
        return {"status": "failed", "reason": f"timed out after {timeout:.0f} s"}
    if "failed" in result:
        return {"status": "failed", "reason": result["failed"]}
    row = {"status": "ran", "tokens_per_second": result["tokens_per_second"], "train_loss": result["train_loss"],
           "wall_seconds": result["wall_seconds"], **read_row(variant, settings, output_dir)}
    shutil.rmtree(output_dir, ignore_errors=True)
    return row


def models_to_run(mode: dict, scratch: Path, cuda: bool) -> dict[str, Settings]:
    """Each model of the mode built and saved, with the data and settings its rows train on."""
    train_file = filled_rows_file(scratch / "train.jsonl", mode["examples"], mode["max_seq_length"])
    models = {}
    for name, (shape, layers) in mode["models"].items():
        print(f"building {name}", flush=True)
        model = build_model(shape, layers, scratch / name, "cuda" if cuda else "cpu")
        models[name] = Settings(model=model, train_file=train_file, max_seq_length=mode["max_seq_length"],
                                micro_batch=mode["micro_batch"], steps=mode["steps"], bf16=cuda, cuda=cuda)
    return models


def shape_record(model: str) -> dict:
    shape = model_shape(model)
    return {"num_parameters": shape.num_parameters, "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
            "vocab_size": shape.vocab_size}


def versions() -> dict:
    found = {}
    for package in ("torch", "transformers", "trl", "accelerate", "liger-kernel"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def print_summary(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    GiB = 1024**3
    table = Table(title=f"gpu_speed on {record['device']}")
    for column in ("model", "row", "tokens/s", "steady tokens/s", "MFU", "peak allocated", "reserved", "predicted",
                   "allocated / predicted"):
        table.add_column(column, justify="left" if column in ("model", "row") else "right")
    for model, entry in record["models"].items():
        for name, row in entry["rows"].items():
            if row["status"] != "ran":
                table.add_row(model, name, f"{row['status']}: {row['reason']}"[:60], "", "", "", "", "", "")
                continue
            number = lambda value, form: "–" if value is None else form.format(value)  # noqa: E731
            table.add_row(model, name, number(row["tokens_per_second"], "{:,.0f}"),
                          number(row["steady_tokens_per_second"], "{:,.0f}"), number(row["mfu"], "{:.1%}"),
                          number(row["peak_allocated_bytes"] and row["peak_allocated_bytes"] / GiB, "{:.2f} GiB"),
                          number(row["peak_reserved_bytes"] and row["peak_reserved_bytes"] / GiB, "{:.2f} GiB"),
                          number(row["predicted_peak_bytes"] and row["predicted_peak_bytes"] / GiB, "{:.2f} GiB"),
                          number(row["allocated_over_predicted"], "{:.2f}"))
    Console(width=160).print(table)


def offline_environment(cuda: bool) -> None:
    """What the rows' processes inherit: the checkout as working folder (they name recipes/demo.yaml), no hub (a lent
    GPU has no internet; everything is built here), and no GPU for a CPU run."""
    os.chdir(ROOT)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def new_record(args, cuda: bool, mode: dict) -> dict:
    import torch

    from finetune.train.throughput import peak_tflops_of

    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    command = ["python benchmarks/gpu_speed.py", *(["--cpu"] if args.cpu else []),
               *(["--rows", *args.rows] if args.rows else [])]  # the results folder is this machine's: left out
    settings = {key: mode[key] for key in ("max_seq_length", "micro_batch", "steps", "examples")}
    return {"date": date.today().isoformat(), "device": device_label(cuda), "device_name": device_name,
            "peak_tflops": peak_tflops_of(device_name), "command": " ".join(command), "versions": versions(),
            "wall_seconds": None, "settings": {**settings, "bf16": cuda}, "models": {}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the tiny model on CPU processes, 12 steps (a test's run)")
    parser.add_argument("--rows", nargs="+", choices=[row.name for row in ROWS], metavar="ROW",
                        help=f"run only these ({', '.join(row.name for row in ROWS)})")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print("gpu_speed: no CUDA GPU visible; `--cpu` runs the same rows on the tiny model.", file=sys.stderr)
        return 2
    started = time.monotonic()
    mode = MODES["gpu" if cuda else "cpu"]
    record = new_record(args, cuda, mode)
    path = args.results_dir.resolve() / f"gpu-speed-{record['device']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    offline_environment(cuda)

    def save() -> None:
        record["wall_seconds"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(record, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="finetune-gpu-speed-") as scratch:
        scratch = Path(scratch)
        os.environ["FINETUNE_CACHE"] = str(scratch / "cache")  # plan calibrations: never the user's store
        models = models_to_run(mode, scratch, cuda)
        record["models"] = {name: {"shape": shape_record(settings.model), "rows": {}}
                            for name, settings in models.items()}
        for variant in [row for row in ROWS if not args.rows or row.name in args.rows]:
            for name, settings in models.items():
                left = started + BUDGET_SECONDS - time.monotonic()
                reason = skip_reason(variant, cuda, left)
                if reason is None:
                    print(f"running {variant.name} on {name}: {variant.what}", flush=True)
                    timeout = min(ROW_TIMEOUTS.get(variant.name, ROW_TIMEOUT), left)
                    row = run_row(variant, settings, scratch / name / variant.name, timeout)
                    print(f"  {row['status']}: " + (row.get("reason") or f"{row['tokens_per_second']:,.0f} tokens/s"),
                          flush=True)
                else:
                    row = {"status": "skipped", "reason": reason}
                if "reason" in row:  # a failure's line may name the scratch folder, gone once this ends
                    row["reason"] = row["reason"].replace(str(scratch), "<scratch>")
                record["models"][name]["rows"][variant.name] = {"what": variant.what, **row}
                save()
    save()
    print_summary(record)
    print(f"wrote {path}")
    failed = [f"{model}/{name}" for model, entry in record["models"].items() for name, row in entry["rows"].items()
              if row["status"] == "failed"]
    print("every row that could run ran" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
