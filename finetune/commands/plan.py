"""`finetune plan --model M --gpus N --gpu-memory GiB` (or `--gpu t4`): predicted memory per strategy, the
recommendation, the batch plan and the launch command. `--recipe R.yaml` plans the user's own recipe and data;
`--calibrate OUTPUT_DIR` compares a finished run's measured memory with the prediction. `--json` for machines."""

from __future__ import annotations

import json

from finetune.launch.devices import KNOWN_GPUS
from finetune.memory.estimate import OPTIMIZER_STATE_BYTES, PRECISIONS, GiB
from finetune.plan.decision_tree import CUDA_CONTEXT_BYTES, DEFAULT_GLOBAL_BATCH_SIZE, HEADROOM
from finetune.recipe.batch_plan import DEFAULT_LR_SCALING, LR_SCALING_RULES
from finetune.recipe.methods import DEFAULT_METHOD, METHODS

# Options that describe the model and run: a recipe gives them itself (`--recipe`), so they are refused beside it.
RECIPE_GIVES = {"model": "model_name_or_path", "precision": "bf16/fp16", "optimizer": "optim", "lora_rank": "lora_r",
                "lora_dropout": "lora_dropout", "qlora": "use_qlora", "seq_len": "max_seq_length",
                "gradient_checkpointing": "gradient_checkpointing", "method": "method",
                "num_generations": "num_generations", "completion_length": "max_completion_length",
                "ds3_gather_for_generation": "ds3_gather_for_generation"}
BATCH_OPTIONS = ("global_batch_size", "max_micro_batch_size", "learning_rate", "base_batch_size", "lr_scaling")


def plan_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="predict memory per strategy and recommend one before spending GPU hours",
        description="Predict memory per GPU for every shipped strategy, recommend the first that fits "
        "(DDP → ZeRO-1 → ZeRO-2 → ZeRO-3/FSDP → offload), and print the batch plan and launch command.",
    )
    parser.add_argument("--model",
                        help="(without --recipe) tiny, a known shape (llama-2-7b, llama-3-8b, llama-3-70b, "
                             "qwen2.5-0.5b, qwen2.5-7b, mistral-7b), a local model directory or config.json, or a hub "
                             "id (fetches config.json only)")
    parser.add_argument("--gpus", type=int, help="GPUs (processes) in all")
    parser.add_argument("--gpu-memory", type=float,
                        help="memory per GPU in GiB (e.g. 24, 80); default: that of --gpu or of the visible GPU")
    parser.add_argument("--gpu", help=f"the GPU model planned for ({', '.join(KNOWN_GPUS)}): sets the precision "
                                      "(bf16 needs compute capability 8.0) and the default --gpu-memory; default: "
                                      "the visible GPU")
    parser.add_argument("--compute-capability", metavar="MAJOR.MINOR",
                        help="instead of --gpu: the GPU's compute capability (7.5 for a T4: no bf16)")
    parser.add_argument("--host-memory", type=float,
                        help="CPU RAM per node in GiB: checked for CPU offload and for loading the model (every rank "
                             "loads it whole before sharding unless ZeRO-3 init)")
    model = parser.add_argument_group("model and run (without --recipe; a recipe gives these itself)")
    model.add_argument("--precision", choices=("auto", *PRECISIONS),
                       help="fp32, or bf16/fp16 mixed; auto (default): bf16 where the GPU has it, else fp16")
    model.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), help="default adamw")
    model.add_argument("--lora-rank", type=int, help="LoRA rank on every linear layer (default 0: full)")
    model.add_argument("--lora-dropout", type=float,
                       help="dropout on the adapters' input (default 0.05, as in a recipe): each adapter then keeps "
                            "its own copy of its input and a mask for the backward")
    model.add_argument("--qlora", action="store_true", help="4-bit NF4 base weights (with --lora-rank)")
    model.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048)")
    model.add_argument("--gradient-checkpointing", action="store_true")
    model.add_argument("--method", choices=tuple(METHODS),
                       help="the training method: a preference method adds its frozen reference model and two "
                            "sequences per pair, grpo its generation round (default sft)")
    model.add_argument("--num-generations", type=int,
                       help="grpo: the group size asked for (default 8, TRL's): planned on the recommended strategy "
                            "beside the other sizes; one that does not fit stops the plan, naming the term")
    model.add_argument("--completion-length", type=int,
                       help="grpo: new tokens a completion may have (default 256, TRL's); --seq-len bounds the prompt "
                            "and completion together")
    model.add_argument("--ds3-gather-for-generation", choices=("true", "false"),
                       help="grpo under ZeRO-3: gather the whole policy onto every GPU for each generation round "
                            "(default true, TRL's; counted in the plan), or gather layer by layer per token (false)")
    batch = parser.add_argument_group("batch and learning rate (with --recipe: override the recipe's)")
    batch.add_argument("--global-batch-size", type=int,
                       help="sequences per optimizer step; must split over --gpus (default "
                            f"{DEFAULT_GLOBAL_BATCH_SIZE}, rounded up to a multiple of --gpus)")
    batch.add_argument("--max-micro-batch-size", type=int, help="largest micro-batch tried (default 64)")
    batch.add_argument("--learning-rate", type=float, help="LR at --base-batch-size (default 2e-5; LoRA 2e-4)")
    batch.add_argument("--base-batch-size", type=int, help="batch the learning rate was tuned at")
    batch.add_argument("--lr-scaling", choices=LR_SCALING_RULES,
                       help=f"as the recipe key `lr_scaling` (default {DEFAULT_LR_SCALING})")
    parser.add_argument("--recipe", metavar="RECIPE.yaml",
                        help="plan this recipe: its model, precision, LoRA/QLoRA, strategy (`deepspeed` key), "
                             "batch and learning-rate keys, max_seq_length, and its data's token lengths after "
                             "truncation and packing")
    parser.add_argument("--config", metavar="ACCELERATE.yaml",
                        help="the Accelerate config (or DeepSpeed JSON) the recipe is launched with: its strategy is "
                             "checked beside the recommendation (a recipe's `deepspeed` key wins, as in Trainer)")
    parser.add_argument("--calibrate", metavar="OUTPUT_DIR",
                        help="compare a finished run's memory_report.json with the prediction per part and rank")
    parser.add_argument("--save-calibration", action="store_true",
                        help="with --calibrate on a GPU run: store the overhead measured beyond the prediction for "
                             "that GPU (--gpu or the visible one); later plans for it add it")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the --gpus are spread over (default 1)")
    parser.add_argument("--inter-node-gbps", type=float, default=100.0,
                        help="network bandwidth of one node in Gb/s, for the cross-node traffic (default 100)")
    parser.add_argument("--tflops-per-gpu", type=float, default=400.0,
                        help="achieved TFLOP/s per GPU, for the step's compute time (default 400: ~40%% MFU, H100)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=plan_command)


def plan_command(args) -> int:
    from finetune.errors import RecipeError
    from finetune.launch.devices import gpu_named
    from finetune.plan.generation import refuse_group_size

    if args.gpu is not None and args.compute_capability is not None:
        raise RecipeError("give `--gpu` or `--compute-capability`, not both.")
    if args.save_calibration and args.calibrate is None:
        raise RecipeError("`--save-calibration` stores what `--calibrate OUTPUT_DIR` measured: give that too.")
    gpu = gpu_named(args.gpu, args.compute_capability)
    if args.calibrate is not None:
        return calibrate_command(args, gpu)
    if args.recipe is None and args.model is None:
        raise RecipeError("`finetune plan` needs `--model M` or `--recipe RECIPE.yaml` (and `--gpus N`).")
    if args.recipe is not None:
        clashes = [name for name in RECIPE_GIVES if getattr(args, name) not in (None, False)]
        if clashes:
            options = ", ".join(f"`--{name.replace('_', '-')}`" for name in clashes)
            keys = ", ".join(f"`{RECIPE_GIVES[name]}`" for name in clashes)
            raise RecipeError(f"{options} with `--recipe {args.recipe}`: the recipe gives these ({keys}); "
                              "change them in the recipe.")
    if args.gpus is None:
        raise RecipeError("`--gpus N` (GPUs in all) is needed to plan.")
    gpu_memory = args.gpu_memory if args.gpu_memory is not None else gpu and gpu.memory_gib
    if gpu_memory is None:
        raise RecipeError("`--gpu-memory` (GiB per GPU) is needed: no GPU is visible and `--gpu` names none.")
    plan = make_plan_for(args, gpu, gpu_memory)
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        print_plan(plan)
    refuse_group_size(plan)
    return 0


def make_plan_for(args, gpu, gpu_memory: float) -> dict:
    from finetune.errors import RecipeError
    from finetune.plan.calibration import calibration_for
    from finetune.plan.decision_tree import PlanRequest, make_plan
    from finetune.recipe.methods import method_class

    hardware = dict(host_memory_gib=args.host_memory, nodes=args.nodes, inter_node_gbps=args.inter_node_gbps,
                    tflops_per_gpu=args.tflops_per_gpu, calibrations=calibration_for(gpu and gpu.name))
    batch = {name: getattr(args, name) for name in BATCH_OPTIONS}
    if args.recipe is not None:
        from finetune.plan.from_recipe import request_from_recipe

        request, data_summary = request_from_recipe(args.recipe, args.gpus, gpu_memory, gpu, config=args.config,
                                                    batch_options=batch, **hardware)
        return {**make_plan(request), "recipe": args.recipe, "data": data_summary}
    your_strategy = your_config = None
    if args.config is not None:
        from finetune.launch.strategies import read_config_file

        your_strategy, your_config = read_config_file(args.config)[0], args.config
    request = PlanRequest(
        model=args.model, gpus=args.gpus, gpu_memory_gib=gpu_memory, gpu=gpu, precision=args.precision or "auto",
        optimizer=args.optimizer or "adamw", lora_rank=args.lora_rank or 0, qlora=args.qlora,
        lora_dropout=0.05 if args.lora_dropout is None else args.lora_dropout,
        sequence_length=args.seq_len or 2048, gradient_checkpointing=args.gradient_checkpointing,
        global_batch_size=batch["global_batch_size"], max_micro_batch_size=batch["max_micro_batch_size"] or 64,
        learning_rate=batch["learning_rate"], base_batch_size=batch["base_batch_size"],
        lr_scaling=batch["lr_scaling"], your_strategy=your_strategy, your_config=your_config,
        method=args.method or DEFAULT_METHOD, num_generations=args.num_generations,
        completion_length=args.completion_length, gather_for_generation=None if args.ds3_gather_for_generation is None
        else args.ds3_gather_for_generation == "true", **hardware,
    )
    if (args.num_generations or args.completion_length or args.ds3_gather_for_generation) and \
            not method_class(request.method).memory.generates:
        raise RecipeError(f"`--num-generations`, `--completion-length` and `--ds3-gather-for-generation` plan an "
                          f"online RL method's generation (`--method grpo`); `--method {request.method}` generates "
                          "nothing.")
    return make_plan(request)


def calibrate_command(args, gpu) -> int:
    from finetune.plan.calibration import compare, save_overhead

    comparison = compare(args.calibrate)
    saved = None
    if args.save_calibration:
        if gpu is None:
            from finetune.errors import RecipeError

            raise RecipeError("`--save-calibration` needs the GPU the run measured: `--gpu NAME` (no GPU is visible).")
        saved = save_overhead(gpu.name, comparison)
    if args.json:
        print(json.dumps({**comparison, "saved_to": saved and str(saved)}, indent=2))
    else:
        print_calibration(comparison, gpu, saved)
    return 0


def print_calibration(comparison: dict, gpu, saved) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if Console().is_terminal else 130)
    table = Table(title=f"{comparison['output_dir']}: {comparison['strategy']} on {comparison['world_size']} "
                        "rank(s) — predicted vs measured, MiB")
    for column in ("rank", "part", "predicted", "measured", "measured / predicted"):
        table.add_column(column, justify="left" if column == "part" else "right", no_wrap=True)
    for rank in comparison["ranks"]:
        for part in rank["parts"]:
            label = part["part"] + (f" ({rank['peak_kind']})" if part["part"] == "peak" else "")
            table.add_row(str(rank["rank"]), label, _mib(part["predicted"]), _mib(part["measured"]),
                          "–" if part["ratio"] is None else f"{part['ratio']:.3f}")
    console.print(table)
    overhead = comparison["overhead_bytes"]
    if overhead is None:
        console.print("Measured on CPU: the peak is the process's resident memory (Python, libraries, data), which the "
                      "estimator does not model; only a GPU run's peak calibrates plans.")
    else:
        from finetune.plan.calibration import calibration_key

        share = comparison["overhead_share"]
        key = calibration_key(comparison["strategy"], comparison["method"], comparison["num_parameters"])
        measured = (f"Overhead beyond the prediction: {_mib(overhead)} MiB (peak allocated − predicted total), "
                    f"{share:+.1%} of the predicted peak")
        if saved is not None:
            console.print(f"{measured}; stored for {gpu.name} in {saved}, for {key}: later plans of that class on it "
                          f"add {max(0.0, share):.1%} of their predicted peak (the largest its runs measured).")
        else:
            console.print(f"{measured}. Add --save-calibration (and --gpu NAME) to fold it into later plans of {key} "
                          "on that GPU.")


def _mib(value) -> str:
    return "–" if value is None else f"{value / 1024**2:,.1f}"


def _row_to_json(row: dict | None) -> dict | None:
    if row is None:
        return None
    return {**{key: value for key, value in row.items() if key != "estimate"}, **row["estimate"].to_dict()}


def plan_to_json(plan: dict) -> dict:
    recommended = plan["recommended_estimate"]
    return {**plan, "strategies": [_row_to_json(row) for row in plan["strategies"]],
            "axes": [_row_to_json(row) for row in plan.get("axes", [])],
            "your_strategy": _row_to_json(plan["your_strategy"]),
            "recommended_estimate": recommended and recommended.to_dict(),
            "group_sizes": plan.get("group_sizes") and {
                **plan["group_sizes"], "rows": [{**row, "estimate": row["estimate"].to_dict()}
                                                for row in plan["group_sizes"]["rows"]]}}


def _gib(value: int) -> str:
    return f"{value / GiB:,.1f}"


def print_plan(plan: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=170)
    rows = ([plan["your_strategy"]] if plan["your_strategy"] else []) + plan["strategies"]
    unit_name, unit = ("GiB", GiB) if max(row["estimate"].total_bytes for row in rows) >= GiB else ("MiB", 1024**2)

    def size(value: int) -> str:
        return f"{value / unit:,.1f}"

    table = Table(title=f"{plan['model']}: {plan['num_parameters'] / 1e9:.2f}B parameters "
                        f"({plan['trainable_parameters'] / 1e9:.3g}B trained) on {plan['gpus']} × "
                        f"{plan['gpu_memory_gib']:g} GiB{' ' + plan['gpu'] if plan['gpu'] else ''}, "
                        f"{plan['precision']} — {unit_name} per GPU")
    reference = rows[0]["estimate"].setup.method.reference_model
    for column in ("strategy", "micro", "params", "grads", "optimizer", *(("reference",) if reference else ()),
                   "activations", "buffers", "total / GPU", "offloaded / node", "host RAM at load / node", "fits"):
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    yours = plan["your_strategy"]
    for row in rows:
        result = row["estimate"]
        style = "bold green" if row["name"] == plan["recommended"] else "bold" if row is yours else None
        table.add_row(
            # Gradients at their peak (between accumulation micro-steps under ZeRO-1), as the total counts them.
            row["name"], str(row.get("micro_batch_size", result.setup.micro_batch_size)),
            size(result.params_bytes), size(result.grads_peak_bytes),
            size(result.optimizer_bytes), *((size(result.reference_bytes),) if reference else ()),
            size(result.activations_bytes), size(result.temporary_bytes), size(result.total_bytes),
            size(result.host_bytes_per_node) if result.offloaded else "–", size(result.host_load_bytes_per_node),
            "yes" if row["fits"] else f"no ({row['shortfall']})", style=style,
        )
    console.print(table)
    if plan.get("gathered_policy"):
        console.print(f"Note: {plan['gathered_policy']}", soft_wrap=True, highlight=False)
    if plan.get("group_sizes"):
        print_group_sizes(console, plan["group_sizes"], size, unit_name)
    if plan.get("data") is not None:
        print_data_lengths(console, plan)
    if (plan.get("data") or {}).get("router_aux_loss_coef") is not None:  # finetune.models.experts
        console.print(f"Experts: the load-balancing loss is added at router_aux_loss_coef "
                      f"{plan['data']['router_aux_loss_coef']:g} (0 turns it off).", highlight=False)
    for line in calibration_lines(plan):
        console.print(line, soft_wrap=True, highlight=False)
    console.print(f"Fits: a total within {HEADROOM:.0%} of the GPU less {_gib(CUDA_CONTEXT_BYTES)} GiB for the CUDA "
                  "context, which no term predicts; the rest covers fragmentation and what the model leaves out "
                  "(docs/memory.md). Each row is at the micro-batch in its `micro` column: the smallest, to say "
                  "whether the strategy fits at all; the recommended one at the batch plan's.")
    if yours:
        micro = yours["micro_batch_size"]
        console.print(f"Yours ({yours['config']}) at micro-batch {micro}: "
                      + ("fits." if yours["fits"] else f"does not fit ({yours['shortfall']})."))
    if plan["global_batch_note"]:
        console.print(f"Note: {plan['global_batch_note']}.")
    if plan.get("axes"):
        print_axes(console, plan, size, unit_name)
    choice = plan.get("axis_choice")
    if choice is not None:
        console.print(f"Recommended: [bold green]{choice['name']}[/] — chosen because {choice['because']}.",
                      soft_wrap=True)
        console.print("Launch:", choice["launch_command"], soft_wrap=True, highlight=False)
    elif plan["recommended"] is None:
        console.print("[bold red]No data-parallel strategy fits[/]: more or larger GPUs, LoRA/QLoRA "
                      "(--lora-rank, --qlora), gradient checkpointing or a shorter --seq-len.")
        if any(row["shortfall"] == "host load" for row in plan["strategies"]):
            console.print("Some fit on the GPUs but not in host RAM while the model loads: more RAM per node, or "
                          "fewer ranks per node where every rank loads the whole model (ZeRO-3 and FSDP load it on "
                          "one rank).")
    else:
        misses = ", ".join(row["name"] for row in plan["strategies"] if not row["fits"]
                           and plan["strategies"].index(row) < _index(plan, plan["recommended"]))
        console.print(f"Recommended: [bold green]{plan['recommended']}[/] — the first in the decision tree that "
                      f"fits under {HEADROOM:.0%} of {plan['gpu_memory_gib']:g} GiB less the CUDA context"
                      + (f" ({misses} do not fit)." if misses else "."))
        batch = plan["batch_plan"]
        console.print(
            f"Batch plan: {batch['micro_batch_size']} × {plan['gpus']} GPUs × {batch['gradient_accumulation_steps']} "
            f"accumulation = {batch['global_batch_size']} sequences per step; learning rate "
            f"{batch['learning_rate']:.3g} ({batch['lr_scaling']} from {batch['base_learning_rate']:.3g} at batch "
            f"{batch['base_batch_size']}).")
        console.print("Launch:", plan["launch_command"], soft_wrap=True, highlight=False)
        if plan["launch_note"]:
            console.print(f"Note: {plan['launch_note']}.")
        buffer = plan["strategies"][_index(plan, plan["recommended"])].get("nvme_param_buffer_size")
        if buffer is not None:
            console.print(f"NVMe: `offload_param.buffer_size` must hold the largest parameter partition, {buffer:,} "
                          "elements (`finetune train` sizes \"auto\" so; give other launchers this number).")
    if plan["inter_node"]:
        print_inter_node(console, plan["inter_node"])
    console.print("Estimates: model states as DeepSpeed/Trainer allocate them; activations tensor by tensor as "
                  "autograd saves them (measured at real widths); buffers = communication buckets and gathered "
                  "layers. See docs/memory.md.")


def print_axes(console, plan: dict, size, unit_name: str) -> None:
    """The parallelism axes' rows (finetune.plan.decision_tree.axis_rows): memory per GPU and what each costs."""
    from rich.table import Table

    table = Table(title=f"Parallelism axes on {plan['gpus']} GPUs — {unit_name} per GPU (the fullest rank)")
    for column in ("axis", "params", "grads", "optimizer", "activations", "buffers", "total / GPU", "costs", "fits"):
        table.add_column(column, justify="left" if column in ("axis", "costs") else "right", no_wrap=column != "costs")
    for row in plan["axes"]:
        result = row["estimate"]
        style = "bold green" if row["name"] == plan["recommended"] else None
        table.add_row(row["name"], size(result.params_bytes), size(result.grads_peak_bytes),
                      size(result.optimizer_bytes), size(result.activations_bytes), size(result.temporary_bytes),
                      size(result.total_bytes), row["cost"], "yes" if row["fits"] else f"no ({row['shortfall']})",
                      style=style)
    console.print(table)
    three_d = plan.get("parallel_3d")
    if three_d and three_d["name"] != plan["recommended"]:  # the recommended one's launch is printed below
        row = next(row for row in plan["axes"] if row["name"] == three_d["name"])
        console.print(f"{three_d['name']}: PP {three_d['pipeline_parallel']} × TP {three_d['tensor_parallel']} × DP "
                      f"{three_d['data_parallel']} = {plan['gpus']} GPUs, {three_d['micro_batches']} micro-batches a "
                      f"replica, bubble {three_d['bubble_fraction']:.1%}; chosen only when nothing simpler fits"
                      + ("" if row["fits"] else f", and it does not fit ({row['shortfall']})")
                      + f". Launch: {row['launch_command']}", soft_wrap=True, highlight=False)


def calibration_lines(plan: dict) -> list[str]:
    """Which calibration each strategy's total includes: measured by a run of that strategy on this GPU, or the
    largest measured there by a run of another (nothing without one)."""
    calibrations = plan["calibrations"]
    if not calibrations:
        return []
    runs = sum(entry.get("runs", 1) for entry in calibrations.values())
    lines = [f"Calibrated on {plan['gpu']} by {runs} run(s) in {len(calibrations)} class(es) of strategy, method and "
             "model size (finetune plan --calibrate; finished `finetune train` runs add theirs); added to each total:"]
    for row in plan["strategies"]:
        if row["calibrated_by"] is None:
            continue
        entry = calibrations[row["calibrated_by"]]
        share = f"{entry['overhead_share']:.1%} of its peak"
        whose = (f"{entry['runs']} run(s) of it" if entry["strategy"] == row["strategy_label"]
                 else f"none of it: the largest of {entry['method']} at {entry['model_class']}, "
                      f"{entry['runs']} {entry['strategy']} run(s)")
        lines.append(f"  {row['name']}: +{_gib(row['overhead_bytes'])} GiB, {share} ({whose}; latest "
                     f"{entry['latest']['from']})")
    return lines


UNTOKENIZED = {"pairs": "two sequences each, tokenized by TRL when training starts",
               "examples": "tokenized by TRL when training starts",
               "prompts": "completed by the policy while training"}


def print_data_lengths(console, plan: dict) -> None:
    """The recipe's data as the plan read it: rows, length percentiles, packing, and the length planned."""
    if not any("length_percentiles" in (source.get("train") or {}) for source in plan["data"]["sources"]):
        # pairs, examples and prompts TRL tokenizes (or completes) when training starts: planned at full length
        for source in plan["data"]["sources"]:
            unit = next(unit for unit in UNTOKENIZED if unit in source["train"])
            console.print(f"Data {source['name']} ({source['format']}): {source['train'][unit]:,} training {unit}, "
                          f"{UNTOKENIZED[unit]}.")
        if plan["sequence_length"] is not None:
            console.print(f"Activations planned at max_seq_length {plan['sequence_length']} tokens per sequence.")
        return
    for source in plan["data"]["sources"]:
        lengths = source["train"]["length_percentiles"]
        console.print(f"Data {source['name']}: {source['train']['rows_kept']:,} training rows, tokens per row "
                      f"p50/p90/p99/max {lengths['p50']}/{lengths['p90']}/{lengths['p99']}/{lengths['max']} before "
                      "truncation.")
        images = source["train"].get("image_tokens")
        if images:  # a vision-language model's rows: their images' tokens, as its processor expands them
            console.print(f"Images of {source['name']}: {images['total']:,} image tokens in all, up to "
                          f"{images['max_per_row']} a row (p50 {images['p50']}); the vision tower's activations are "
                          "planned at the fullest row's.")
    for split, packing in plan["data"].get("packing", {}).items():
        if split == "train":
            console.print(f"Packed: {packing['rows']:,} rows of up to {packing['row_length']} tokens, "
                          f"{packing['fill']:.1%} filled.")
    if plan["sequence_length"] is not None:
        console.print(f"Activations planned at {plan['sequence_length']} tokens per row: the longest row of a "
                      f"micro-batch of {plan['batch_plan']['micro_batch_size']} in 99% of micro-batches.")


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
    from finetune.launch.strategies import SHIPPED_BY_NAME

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


def print_group_sizes(console, groups: dict, size, unit_name: str) -> None:
    """GRPO's group sizes on the recommended strategy (finetune.plan.generation)."""
    from rich.table import Table

    table = Table(title=f"GRPO group sizes under {groups['strategy']} ({unit_name} per GPU): a generation round "
                        "holds whole groups")
    for column in ("num_generations", "micro-batch", "prompts / round", "completions / GPU", "generation",
                   "activations", "total / GPU", "fits"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in groups["rows"]:
        result = row["estimate"]
        style = "bold green" if row["num_generations"] == groups["recommended"] else None
        table.add_row(str(row["num_generations"]), str(row["micro_batch_size"]), str(row["prompts_per_round"]),
                      str(row["completions_per_gpu"]), size(result.generation_bytes),
                      size(result.activations_bytes + result.temporary_bytes), size(result.total_bytes),
                      "yes" if row["fits"] else "no", style=style)
    console.print(table)
    if groups["recommended"] is not None:
        console.print(f"Group size: [bold green]num_generations: {groups['recommended']}[/]"
                      + ("" if groups["recommended"] == groups["asked"] else
                         f" (the {groups['asked']} asked for does not fit)"), highlight=False)
