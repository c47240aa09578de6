"""`finetune plan --model M --gpus N --gpu-memory GiB` (or `--gpu t4`): predicted memory per strategy, the
recommendation, the batch plan and the launch command. `--json` prints the same for machines."""

from __future__ import annotations

import json

from finetune.devices import KNOWN_GPUS
from finetune.memory.estimate import OPTIMIZER_STATE_BYTES, PRECISIONS, GiB


def plan_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="predict memory per strategy and recommend one before spending GPU hours",
        description="Predict memory per GPU for every shipped strategy, recommend the first that fits "
        "(DDP → ZeRO-1 → ZeRO-2 → ZeRO-3/FSDP → offload), and print the batch plan and launch command.",
    )
    parser.add_argument("--model", required=True,
                        help="tiny, a known shape (llama-3-8b, llama-3-70b, qwen2.5-0.5b, qwen2.5-7b, mistral-7b), "
                             "a local model directory or config.json, or a hub id (fetches config.json only)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs (processes) in all")
    parser.add_argument("--gpu-memory", type=float,
                        help="memory per GPU in GiB (e.g. 24, 80); default: that of --gpu or of the visible GPU")
    parser.add_argument("--gpu", help=f"the GPU model planned for ({', '.join(KNOWN_GPUS)}): sets the precision "
                                      "(bf16 needs compute capability 8.0) and the default --gpu-memory; default: "
                                      "the visible GPU")
    parser.add_argument("--compute-capability", metavar="MAJOR.MINOR",
                        help="instead of --gpu: the GPU's compute capability (7.5 for a T4: no bf16)")
    parser.add_argument("--host-memory", type=float, help="CPU RAM per node in GiB, checked for CPU offload")
    parser.add_argument("--precision", choices=("auto", *PRECISIONS), default="auto",
                        help="fp32, or bf16/fp16 mixed; auto (default): bf16 where the GPU has it, else fp16")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), default="adamw")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on every linear layer (0: full)")
    parser.add_argument("--qlora", action="store_true", help="4-bit NF4 base weights (with --lora-rank)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--global-batch-size", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--max-micro-batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, help="LR at --base-batch-size (default 2e-5; LoRA 2e-4)")
    parser.add_argument("--base-batch-size", type=int, help="batch the learning rate was tuned at")
    parser.add_argument("--lr-scaling", choices=("none", "linear", "sqrt"), default="sqrt")
    parser.add_argument("--recipe", default="RECIPE.yaml", help="recipe path to put in the launch command")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the --gpus are spread over (default 1)")
    parser.add_argument("--inter-node-gbps", type=float, default=100.0,
                        help="network bandwidth of one node in Gb/s, for the cross-node traffic (default 100)")
    parser.add_argument("--tflops-per-gpu", type=float, default=400.0,
                        help="achieved TFLOP/s per GPU, for the step's compute time (default 400: ~40%% MFU, H100)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=plan_command)


def plan_command(args) -> int:
    from finetune.devices import gpu_named
    from finetune.errors import RecipeError
    from finetune.plan import PlanRequest, make_plan

    if args.gpu is not None and args.compute_capability is not None:
        raise RecipeError("give `--gpu` or `--compute-capability`, not both.")
    gpu = gpu_named(args.gpu, args.compute_capability)
    gpu_memory = args.gpu_memory if args.gpu_memory is not None else gpu and gpu.memory_gib
    if gpu_memory is None:
        raise RecipeError("`--gpu-memory` (GiB per GPU) is needed: no GPU is visible and `--gpu` names none.")
    request = PlanRequest(
        model=args.model, gpus=args.gpus, gpu_memory_gib=gpu_memory, host_memory_gib=args.host_memory,
        precision=args.precision, gpu=gpu, optimizer=args.optimizer, lora_rank=args.lora_rank, qlora=args.qlora,
        sequence_length=args.seq_len, gradient_checkpointing=args.gradient_checkpointing,
        global_batch_size=args.global_batch_size, max_micro_batch_size=args.max_micro_batch_size,
        learning_rate=args.learning_rate, base_batch_size=args.base_batch_size, lr_scaling=args.lr_scaling,
        recipe=args.recipe, nodes=args.nodes, inter_node_gbps=args.inter_node_gbps,
        tflops_per_gpu=args.tflops_per_gpu,
    )
    plan = make_plan(request)
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        print_plan(plan)
    return 0


def plan_to_json(plan: dict) -> dict:
    rows = [{"name": row["name"], "config": row["config"], "fits": row["fits"], **row["estimate"].to_dict()}
            for row in plan["strategies"]]
    return {**plan, "strategies": rows}


def _gib(value: int) -> str:
    return f"{value / GiB:,.1f}"


def print_plan(plan: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=130)
    table = Table(title=f"{plan['model']}: {plan['num_parameters'] / 1e9:.2f}B parameters "
                        f"({plan['trainable_parameters'] / 1e9:.3g}B trained) on {plan['gpus']} × "
                        f"{plan['gpu_memory_gib']:g} GiB{' ' + plan['gpu'] if plan['gpu'] else ''}, "
                        f"{plan['precision']} — GiB per GPU")
    for column in ("strategy", "params", "grads", "optimizer", "activations", "buffers", "total / GPU",
                   "offloaded / node", "fits"):
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for row in plan["strategies"]:
        result = row["estimate"]
        style = "bold green" if row["name"] == plan["recommended"] else None
        table.add_row(
            row["name"], _gib(result.params_bytes), _gib(result.grads_bytes), _gib(result.optimizer_bytes),
            _gib(result.activations_bytes), _gib(result.temporary_bytes), _gib(result.total_bytes),
            _gib(result.host_bytes_per_node) if result.offloaded else "–",
            "yes" if row["fits"] else "no", style=style,
        )
    console.print(table)
    if plan["recommended"] is None:
        console.print("[bold red]No data-parallel strategy fits[/]: more or larger GPUs, LoRA/QLoRA "
                      "(--lora-rank, --qlora), gradient checkpointing or a shorter --seq-len.")
    else:
        misses = ", ".join(row["name"] for row in plan["strategies"] if not row["fits"]
                           and plan["strategies"].index(row) < _index(plan, plan["recommended"]))
        console.print(f"Recommended: [bold green]{plan['recommended']}[/] — the first in the decision tree that "
                      f"fits under 90% of {plan['gpu_memory_gib']:g} GiB"
                      + (f" ({misses} do not fit)." if misses else "."))
        batch = plan["batch_plan"]
        console.print(
            f"Batch plan: {batch['micro_batch_size']} × {plan['gpus']} GPUs × {batch['gradient_accumulation_steps']} "
            f"accumulation = {batch['global_batch_size']} sequences per step; learning rate "
            f"{batch['learning_rate']:.3g} ({batch['lr_scaling']} from {batch['base_learning_rate']:.3g} at batch "
            f"{batch['base_batch_size']}).")
        console.print("Launch:", plan["launch_command"], soft_wrap=True, highlight=False)
    three_d = plan["parallel_3d"]
    if three_d:
        console.print(
            f"On paper, without offload: tensor parallel {three_d['tensor_parallel']} × pipeline parallel "
            f"{three_d['pipeline_parallel']} would need {_gib(three_d['total_bytes'])} GiB per GPU (pipeline bubble "
            f"{three_d['pipeline_bubble_fraction']:.0%}); that needs a 3D-parallel engine such as Megatron-LM.")
    if plan["inter_node"]:
        print_inter_node(console, plan["inter_node"])
    console.print("Estimates: model states as DeepSpeed/Trainer allocate them; activations per Korthikanti et al. "
                  "2022; buffers = communication buckets and gathered layers. See docs/memory.md.")


def _index(plan: dict, name: str) -> int:
    return next(i for i, row in enumerate(plan["strategies"]) if row["name"] == name)


def print_inter_node(console, traffic: dict) -> None:
    from rich.table import Table

    table = Table(title=f"Across {traffic['nodes']} nodes × {traffic['gpus_per_node']} GPUs at "
                        f"{traffic['inter_node_gbps']:g} Gb/s per node — per optimizer step")
    for column in ("strategy", "GB through each node's link", "network s", "compute s", "hidden by compute"):
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for row in traffic["strategies"]:
        table.add_row(row["name"], f"{row['bytes_per_node'] / 1e9:,.1f}", f"{row['seconds']:,.2f}",
                      f"{traffic['compute_seconds']:,.2f}", "yes" if row["hidden"] else "no")
    console.print(table)
    from finetune.strategies import SHIPPED_BY_NAME

    by_name = {row["name"]: row for row in traffic["strategies"]}
    zero3, zeropp, hybrid = (by_name[SHIPPED_BY_NAME[name].label]
                             for name in ("zero3", "zero3_zeropp", "fsdp_hybrid_shard"))
    if zero3["hidden"]:
        console.print("Cross-node traffic hides behind compute even for ZeRO-3 / FSDP full shard: ZeRO++ and hybrid "
                      "sharding would not pay off here.")
    else:
        console.print(f"ZeRO-3 / FSDP full shard would wait on the network ({zero3['seconds']:.2f} s "
                      f"vs {traffic['compute_seconds']:.2f} s of compute): ZeRO++ "
                      f"({zeropp['seconds']:.2f} s, {zeropp['config']}) or FSDP hybrid shard "
                      f"({hybrid['seconds']:.2f} s, {hybrid['config']}) pay off where the model fits their memory.",
                      soft_wrap=True)
