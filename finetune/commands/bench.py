"""`finetune bench`: the plain Trainer baseline and the toolkit's variants (defaults, packing, fused kernels,
DDP, every ZeRO stage and FSDP) side by side on one model, data and sequence length, and with `--peers` TRL's
SFTTrainer (padded and packed) on the same settings; prints useful tokens/s with ratios to the baseline and to TRL,
1 → N process scaling and the callbacks' overhead, and writes benchmarks/results/<device>.json."""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

GiB = 1024**3
# CPU mode finishes in a few minutes on 2 cores; GPU mode is a random-init Llama-3.2-1B shape at 2048 in bf16.
MODES = {
    "cpu": {"model": "tiny", "max_seq_length": 256, "micro_batch": 16, "steps": 30, "examples": 2000},
    "gpu": {"model": "llama-3.2-1b", "max_seq_length": 2048, "micro_batch": 4, "steps": 40, "examples": 4000},
}


def bench_command_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="compare the toolkit's variants and strategies with plain Trainer",
                                   description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="CPU mode (the default without CUDA)")
    mode.add_argument("--gpu", action="store_true", help="GPU mode (the default with CUDA)")
    parser.add_argument("--variants", nargs="+", help="run only these (default: all but the peers)")
    parser.add_argument("--peers", action="store_true", help="also run TRL's SFTTrainer (padded and packed) on the "
                        "same model, data and settings, beside finetune and plain Trainer")
    parser.add_argument("--processes", type=int, default=2, help="processes for the strategy variants")
    parser.add_argument("--model", help="tiny, or a known shape built with random weights (e.g. llama-3.2-1b)")
    parser.add_argument("--steps", type=int, help="optimizer steps per variant")
    parser.add_argument("--max-seq-length", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--repeats", type=int, help="runs of every variant (default: 3 for the baseline and the "
                        "callback-overhead pair, 1 for the rest); the median is kept")
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.set_defaults(func=bench_command)


def bench_command(args) -> int:
    import torch

    from finetune.bench.harness import (
        Settings,
        device_label,
        long_tailed_file,
        random_init_model_dir,
        run_variants,
        variants,
    )
    from finetune.errors import RecipeError

    cuda = torch.cuda.is_available() and not args.cpu
    if args.gpu and not torch.cuda.is_available():
        raise RecipeError("--gpu needs CUDA and none is visible; run with --cpu.")
    defaults = MODES["gpu" if cuda else "cpu"]
    chosen = chosen_variants(variants(args.processes), args.variants, args.peers)
    for variant in chosen if args.repeats else []:
        variant.repeats = args.repeats
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as scratch:
        scratch = Path(scratch)
        max_seq_length = args.max_seq_length or defaults["max_seq_length"]
        settings = Settings(
            model=random_init_model_dir(args.model or defaults["model"], scratch / "model"),
            train_file=long_tailed_file(scratch / "train.jsonl", defaults["examples"], max_seq_length),
            max_seq_length=max_seq_length, micro_batch=args.micro_batch or defaults["micro_batch"],
            steps=args.steps or defaults["steps"], bf16=cuda, cuda=cuda)
        rows = run_variants(chosen, settings, scratch, report=lambda line: print(line, flush=True))
    record = {"date": datetime.date.today().isoformat(), "device": device_label(cuda),
              "command": " ".join(["finetune bench", *sys.argv[2:]]),
              "settings": {"model": args.model or defaults["model"], "max_seq_length": settings.max_seq_length,
                           "micro_batch": settings.micro_batch, "steps": settings.steps, "bf16": settings.bf16},
              "variants": rows, **comparisons(rows, args.processes)}
    print_table(record)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{record['device']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def chosen_variants(every: list, names: list[str] | None, peers: bool) -> list:
    """The variants named (in the bench's order), else every one, TRL's SFTTrainer rows only with `--peers`."""
    from finetune.errors import RecipeError

    known = [variant.name for variant in every]
    unknown = sorted(set(names or []) - set(known))
    if unknown:
        raise RecipeError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(known)}.")
    if names:
        return [variant for variant in every if variant.name in names]
    return [variant for variant in every if peers or not variant.peer]


def rate(rows: dict, name: str) -> float | None:
    return rows.get(name, {}).get("tokens_per_second")


def comparisons(rows: dict, processes: int) -> dict:
    """Ratios to the baseline, 1 → N process scaling of the defaults under DDP, and the callbacks' cost."""
    baseline = rate(rows, "plain_trainer")
    for row in rows.values():
        row["vs_baseline"] = row["tokens_per_second"] / baseline if baseline and "tokens_per_second" in row else None
    result = {}
    one, many = rate(rows, "finetune"), rate(rows, "ddp")
    if one and many:
        result["scaling"] = {"processes": processes, "speedup": many / one, "efficiency": many / one / processes}
    with_callbacks, without = rate(rows, "finetune"), rate(rows, "finetune_no_callbacks")
    if with_callbacks and without:
        result["callback_overhead"] = without / with_callbacks - 1  # extra time per token the callbacks cost
    peers = {ours: (theirs, rate(rows, ours), rate(rows, theirs))
             for ours, theirs in (("finetune", "trl_sft"), ("packing", "trl_sft_packed"))}
    versus = {f"{ours}_vs_{theirs}": mine / peer for ours, (theirs, mine, peer) in peers.items() if mine and peer}
    if versus:
        result["vs_trl"] = versus  # finetune's tokens/s over TRL's SFTTrainer's, padded and packed
    fused, full = rows.get("finetune", {}), rows.get("finetune_full_logits", {})
    if rate(rows, "finetune") and rate(rows, "finetune_full_logits"):
        result["fused_head"] = {"tokens_per_second": fused["tokens_per_second"] / full["tokens_per_second"],
                                "peak_bytes": fused["peak_bytes"] / full["peak_bytes"]
                                if fused["peak_bytes"] and full["peak_bytes"] else None}
    compiled, eager = rows.get("compile", {}), rows.get("packing", {})
    if compiled.get("steady_tokens_per_second") and eager.get("steady_tokens_per_second"):
        # after the first step, which compiles; end to end, Trainer's runtime with the compile in it
        result["compile"] = {"vs_eager": compiled["steady_tokens_per_second"] / eager["steady_tokens_per_second"],
                             "end_to_end_vs_eager": compiled["tokens_per_second"] / eager["tokens_per_second"],
                             **{key: compiled.get("compile", {}).get(key)
                                for key in ("compile_seconds", "graphs", "graph_breaks", "graph_break_reasons")}}
    return result


def print_table(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"finetune bench on {record['device']} ({record['settings']['model']}, "
                        f"sequence {record['settings']['max_seq_length']})")
    for column in ("variant", "useful tokens/s", "× baseline", "peak memory", "train loss", "MFU"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, row in record["variants"].items():
        if "tokens_per_second" not in row:
            table.add_row(name, row.get("skipped") or f"failed: {row.get('failed')}", "", "", "", "")
            continue
        table.add_row(name, f"{row['tokens_per_second']:,.0f}",
                      f"{row['vs_baseline']:.2f}" if row["vs_baseline"] else "–",
                      f"{row['peak_bytes'] / GiB:.2f} GiB" if row["peak_bytes"] else "–",
                      f"{row['train_loss']:.3f}", f"{row['mfu']:.1%}" if row["mfu"] else "–")
    console = Console(width=120)
    console.print(table)
    if "scaling" in record:
        scaling = record["scaling"]
        console.print(f"scaling 1 → {scaling['processes']} processes (DDP, same micro-batch each): "
                      f"{scaling['speedup']:.2f}× speedup, {scaling['efficiency']:.0%} efficiency")
    for pair, ratio in record.get("vs_trl", {}).items():
        ours, theirs = pair.split("_vs_")
        console.print(f"{ours} against TRL's SFTTrainer ({theirs}), same model, data and settings: {ratio:.2f}× "
                      "the tokens/s")
    if "fused_head" in record:
        fused = record["fused_head"]
        peak = f", {fused['peak_bytes']:.2f}× the peak memory" if fused["peak_bytes"] else ""
        console.print(f"fused LM head against the full logits (finetune vs finetune_full_logits): "
                      f"{fused['tokens_per_second']:.2f}× the tokens/s{peak}")
    if "compile" in record:
        compiled = record["compile"]
        console.print(f"torch.compile against eager (compile vs packing, after the first step): "
                      f"{compiled['vs_eager']:.2f}× the tokens/s ({compiled['end_to_end_vs_eager']:.2f}× end to end "
                      f"with {compiled['compile_seconds']} s compiling; {compiled['graphs']} graph(s), "
                      f"{compiled['graph_breaks']} graph break(s))")
    if "callback_overhead" in record:
        runs = record["variants"]["finetune"]["repeats"] + record["variants"]["finetune_no_callbacks"]["repeats"]
        console.print(f"toolkit callbacks: {record['callback_overhead']:+.1%} time per token (finetune vs "
                      f"finetune_no_callbacks; their runs spread {min(runs):,.0f}–{max(runs):,.0f} tokens/s, so a "
                      "few percent is within noise: benchmarks/callback_overhead.py times the callbacks directly)")
