"""`finetune train RECIPE.yaml` launching itself: which strategy, planned how, launched with which files.

The strategy is the one the command line or the recipe names (`strategy: zero3`, a row of the shipped table), the
recipe's own DeepSpeed JSON (`deepspeed:`), or `auto`: the first in the decision tree that the planner finds fits
this recipe, its data's real lengths and the micro-batch it will run, on these GPUs (or on the CPU processes standing
in for them, with the memory `--gpu-memory` declares). The plan (the choice, the strategies rejected before it and
why, the bytes predicted per rank) travels to every rank (`LAUNCH_PLAN_ENV`) into `effective_config.json`, and at
the end of the run `memory_against_plan` holds what was measured against it.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from finetune.errors import RecipeError
from finetune.launch.commands import Launch, accelerate_launch_command, as_typed
from finetune.launch.grace import grace_for_launch
from finetune.launch.self_launch import (
    LAUNCH_PLAN_ENV,
    Machine,
    check_no_stray_rendezvous,
    drop_a_stray_launch_plan,
    first_visible_gpu,
    launch_requested,
    replace_with,
    run_here_on_one_gpu,
    split_launch_options,
    this_machine,
    under_a_launcher,
)
from finetune.launch.strategies import SHIPPED_BY_NAME, shipped
from finetune.memory.callback import STATE_KEYS
from finetune.plan.decision_tree import HEADROOM, decision_path, make_plan, planned_total, usable_bytes, why_not

# A run may exceed its prediction by what the plan leaves free of the usable memory before it says so: the headroom
# `finetune plan` keeps (10% of the GPU) over the 90% a prediction may fill.
MARGIN = 1 / HEADROOM - 1


def launch_or_run_here(recipe: str, overrides: list[str], given=None) -> list[str] | None:
    """Launches the recipe when no launcher started this process and there is something to launch (GPUs, `--gpus`,
    several nodes): this process becomes Accelerate's launcher and never returns. Returns None after `--dry-run`, or
    the overrides (without the launch options) to run here: under a launcher, or as one process on a machine without
    GPUs and without `--gpus`. `given`: launch options parsed before the recipe."""
    options, overrides = split_launch_options(overrides, given)
    check_no_stray_rendezvous()  # a leftover WORLD_SIZE would wait ddp_timeout for ranks nobody starts
    drop_a_stray_launch_plan()
    if under_a_launcher():
        if launch_requested(options):
            raise RecipeError("`--gpus`, `--gpu-memory`, `--nnodes`, ... are for `finetune train` started without a "
                              "launcher; under `accelerate launch` or torchrun the launcher's own options decide.")
        return overrides
    machine = this_machine(options)
    if machine.cpu and options.gpus is None and machine.nodes == 1:  # one process, here: the dry run says so too
        if options.dry_run:
            from finetune.recipe.parse import read_recipe

            read_recipe(recipe, overrides, auto_precision="fp32")  # the recipe's keys, checked as the run reads them
            print("plan: one process here, without a launcher and unplanned (no GPU on this machine and no `--gpus "
                  "N`, which launches N CPU processes)")
            print("launch: none, one process runs here")
            return None
        return overrides
    launch, plan, overrides = plan_launch(recipe, overrides, machine)
    if launch is None and machine.visible_gpus > 1:
        # one process on a machine with several GPUs: it would see them all (preflight refuses nn.DataParallel), so it
        # runs anew seeing one, as accelerate_configs/single_gpu.yaml's `gpu_ids: "0"` pins it under a launcher
        gpu = first_visible_gpu()
        plan["launch"] = as_typed(["finetune", "train", recipe, *overrides], {"CUDA_VISIBLE_DEVICES": gpu})
        print_launch_plan(plan)
        print(f"plan: one process here on GPU {gpu}, one of the {machine.visible_gpus} this machine shows (set "
              "CUDA_VISIBLE_DEVICES to choose another)")
        print(f"launch: {plan['launch']}", flush=True)
        if options.dry_run:
            return None
        run_here_on_one_gpu([sys.executable, "-m", "finetune", "train", recipe, *overrides],
                            json.dumps({**plan, "launcher_pid": os.getpid()}), gpu)
        return None  # not reached: the run has replaced this process
    if launch is None:  # one process needs no launcher: it runs here, with its plan
        plan["launch"] = shlex.join(["finetune", "train", recipe, *overrides])
        print_launch_plan(plan)
        print("launch: none, one process runs here")
        if options.dry_run:
            return None
        os.environ[LAUNCH_PLAN_ENV] = json.dumps({**plan, "launcher_pid": os.getpid()})
        return overrides
    command = launch_command(launch, machine, recipe, overrides)
    environment = plan["launcher_environment"]
    plan["launch"] = as_typed(command, environment)
    print_launch_plan(plan)
    if options.dry_run:
        print(f"launch: {plan['launch']}")
        return None
    # the launcher keeps this process's pid (`os.execve`): its ranks trust a plan naming their parent
    replace_with(command, json.dumps({**plan, "launcher_pid": os.getpid()}), machine, options.rendezvous_timeout,
                 environment)
    return None  # not reached: the launcher has replaced this process


def plan_launch(recipe: str, overrides: list[str], machine: Machine) -> tuple[Launch | None, dict, list[str]]:
    """The strategy to launch (None: one process, run here), its plan record, and the overrides to launch with
    (naming the strategy `auto` chose, so every rank checks it runs that one)."""
    from finetune.launch.devices import training_precision_here
    from finetune.recipe.parse import read_recipe

    precision = training_precision_here() if machine.gpu is not None else "fp32"  # what `bf16: auto` runs as here
    sections = read_recipe(recipe, overrides, auto_precision=precision)
    training = sections.training_inputs
    launch, record, overrides = _plan_launch(recipe, overrides, machine, sections)
    # a run that saves on preemption gets the time to (finetune.launch.grace)
    record["launcher_environment"] = grace_for_launch(training.get("save_on_preemption"))
    return launch, record, overrides


def _plan_launch(recipe: str, overrides: list[str], machine: Machine, sections) -> tuple[Launch | None, dict,
                                                                                           list[str]]:
    from finetune.memory.shapes import model_shape
    from finetune.plan.calibration import calibration_for
    from finetune.plan.from_recipe import request_from_recipe
    from finetune.recipe.batch_plan import plan_from_recipe

    training = sections.training_inputs
    named = training.get("strategy") if training.get("strategy") != "auto" else None
    axis = _recipe_axis(sections)
    for own in sections.axes:  # each axis plans its own launch (a pipeline: each stage's memory), or checks it
        planned = own.plan_launch(recipe, overrides, machine, sections)
        if planned is not None:
            return _axis_launch(axis, machine), planned, without_option(overrides, "--strategy")
    if axis is not None and not (_keeps_a_named_engine(axis) and (named or training.get("deepspeed"))):
        # the recipe names an axis: its launch follows from it (SP under a named DeepSpeed strategy keeps that one)
        return _axis_launch(axis, machine), {
            "strategy": axis, "chosen_by": "the recipe's parallelism axes; not planned",
            "plan_error": "the recipe names the parallelism axes itself", "device": machine.describe(),
            "processes": machine.processes, "nodes": machine.nodes}, without_option(overrides, "--strategy")
    if training.get("deepspeed"):
        if named is not None:
            raise RecipeError(f"the recipe names `strategy: {named}` and a DeepSpeed config (`deepspeed: "
                              f"{training['deepspeed']}`), which would win in Trainer: keep one.")
        launch, how = Launch(_deepspeed_launch_config(machine), str(training["deepspeed"])), \
            f"the recipe's DeepSpeed config ({training['deepspeed']})"
    elif named is not None:
        shipped(named)  # an unknown name stops here, with the choices
        launch, how = _launch_of(named, machine), f"named by the {sections.sources.get('strategy', 'recipe')}"
    micro = plan_from_recipe(training, sections.data.max_seq_length, machine.processes).micro_batch_size
    sections.method.check_training_keys({**training, "per_device_train_batch_size": micro}, sections.sources)
    # the recipe and its data read as the run reads them: their errors stop here
    request, _ = request_from_recipe(recipe, machine.processes, machine.memory_gib, machine.gpu, overrides=overrides,
                                     sections=sections, host_memory_gib=machine.host_memory_gib,
                                     nodes=machine.nodes, cpu_processes=machine.cpu,
                                     calibrations=calibration_for(machine.gpu and machine.gpu.name))
    chosen_by_auto = named is None and not training.get("deepspeed")
    try:
        model_shape(request.model)
    except RecipeError as error:  # a model the estimator cannot read: a named strategy still launches, unplanned
        if chosen_by_auto:
            raise RecipeError(f"`strategy: auto` needs a plan, and none could be made: {error} Name a strategy "
                              "(`--strategy zero2`, ...) to launch without one.") from None
        return launch, {"strategy": named, "chosen_by": "named; not planned", "plan_error": str(error),
                        "device": machine.describe(), "processes": machine.processes, "nodes": machine.nodes}, overrides
    plan = make_plan(replace(request, micro_batch_size=micro))
    rejected = []
    if not chosen_by_auto:
        # the table's row when the name is among the tree's candidates here, else the plan's "yours" row for it
        chosen = next((row for row in plan["strategies"] if named and row["key"] == named), plan["your_strategy"])
    elif plan.get("axis_choice") is not None:  # no data-parallel strategy fits without offload: an axis does
        choice = plan["axis_choice"]
        chosen, how = next(row for row in plan["axes"] if row["name"] == choice["name"]), f"auto: {choice['because']}"
        named = None
        rejected = [{"strategy": row["name"], "key": row["key"], "reason": why_not(row, plan),
                     "predicted_bytes": planned_total(row)} for row in plan["strategies"]]
        launch = _axis_launch(choice["key"], machine)
        overrides = [*without_option(overrides, "--strategy"),
                     *(token for pair in choice["overrides"] for token in pair.split())]
    else:
        if plan["recommended"] is None:
            raise RecipeError(f"`strategy: auto`: no strategy fits {machine.describe()} at {machine.memory_gib:g} GiB "
                              f"each ({machine.memory_source}): " + "; ".join(decision_path(plan)) + ".")
        index = next(i for i, row in enumerate(plan["strategies"]) if row["name"] == plan["recommended"])
        chosen, named, how = plan["strategies"][index], plan["strategies"][index]["key"], \
            "auto: the first in the decision tree that fits"
        rejected = [{"strategy": row["name"], "key": row["key"], "reason": why_not(row, plan),
                     "predicted_bytes": planned_total(row)} for row in plan["strategies"][:index]]
        launch = _launch_of(named, machine)
        overrides = [*without_option(overrides, "--strategy"), "--strategy", named]  # every rank checks it runs it
    record = {
        "strategy": named or chosen["estimate"].setup.strategy,
        "label": chosen["name"].removeprefix("yours: "),
        "chosen_by": how,
        "device": machine.describe(),
        "processes": machine.processes,
        "nodes": machine.nodes,
        "memory_per_gpu_gib": machine.memory_gib,
        "memory_source": machine.memory_source,
        "usable_bytes": int(usable_bytes(machine.memory_gib, plan["device_context_bytes"])),
        "margin": MARGIN,
        "micro_batch_size": micro,
        "fits": chosen["fits"],
        "shortfall": chosen["shortfall"],
        "rejected": rejected,
        "candidates": [{"strategy": row["name"], "key": row["key"], "fits": row["fits"],
                        "predicted_bytes": planned_total(row)} for row in plan["strategies"]],
        "predicted": predicted_per_rank(chosen, machine),
    }
    return launch, record, overrides


def without_option(tokens: list[str], option: str) -> list[str]:
    """`tokens` without `option` and its value (`--key value` or `--key=value`)."""
    kept, skip = [], False
    for token in tokens:
        if skip:
            skip = False
        elif token == option:
            skip = True
        elif not token.startswith(f"{option}="):
            kept.append(token)
    return kept


def predicted_per_rank(row: dict, machine: Machine) -> dict:
    """The chosen strategy's prediction, the same on every rank but for host RAM at load (rank 0 reads the checkpoint
    alone under ZeRO-3 and FSDP2): per GPU, offloaded, model states in all, and the calibration added."""
    estimate = row["estimate"]
    record = estimate.to_dict()
    per_gpu, offloaded = record["per_gpu"], record["offloaded_per_rank"]
    return {
        **per_gpu,
        "offloaded_per_rank": offloaded,
        "model_states_bytes": sum(per_gpu[key] + offloaded.get(key, 0) for key in STATE_KEYS),
        "calibration_bytes": row["overhead_bytes"],
        "calibrated_by": row["calibrated_by"],
        "host_load_bytes": {"rank 0": estimate.host_load_bytes_of_rank(0, device_is_host=machine.cpu),
                            "other ranks": estimate.host_load_bytes_of_rank(1, device_is_host=machine.cpu)},
    }


def _recipe_axis(sections) -> str | None:
    """The parallelism axis a recipe names that decides its launch (`Axis.launched_as`: finetune.axes), the one that
    runs the steps first, if any."""
    from finetune.axes import runner_of

    launching = [axis for axis in sections.axes if axis.launched_as]
    chosen = runner_of(sections.axes) or next(iter(launching), None)
    return chosen.name if chosen is not None else None


def _keeps_a_named_engine(axis: str) -> bool:
    from finetune.axes import axis_class

    return axis_class(axis).keeps_a_named_engine


def _axis_launch(axis: str, machine: Machine) -> Launch:
    """How an axis launches with its sizes given as recipe keys: as the shipped strategy it names (`Axis.launched_as`:
    plain processes for a pipeline, one a stage, and for tensor parallelism; DeepSpeed ZeRO-3 for sequence
    parallelism), on CPU processes under its CPU twin's program where it has one (`Axis.cpu_program`)."""
    from finetune.axes import axis_class

    chosen = axis_class(axis)
    launch = _launch_of(chosen.launched_as, machine)
    return launch._replace(program=chosen.cpu_program) if machine.cpu and chosen.cpu_program else launch


def _deepspeed_launch_config(machine: Machine) -> str:
    return SHIPPED_BY_NAME["zero2"].launch(cpu=machine.cpu).config_file


def _launch_of(key: str, machine: Machine) -> Launch | None:
    """The shipped launch of a strategy on this machine, its DeepSpeed JSON named explicitly (None: one process, no
    launcher)."""
    row = SHIPPED_BY_NAME[key]
    if key == "single":
        from finetune.memory.estimate import Setup

        Setup(strategy="single", num_gpus=machine.processes).check()  # one process: the estimator's own rule
        return None
    launch = row.launch(cpu=machine.cpu)
    if row.deepspeed_file is not None and launch.deepspeed_json is None:
        launch = launch._replace(deepspeed_json=row.deepspeed_file)
    return launch


def shipped_file(relative: str) -> str:
    """A config as the launch names it. A shipped one: the file in the working directory when it is the generator's
    own (a checkout, or a folder `finetune configs write` wrote), else the generator's text written once under the
    user's cache directory, so that a self-launch works from any folder. Any other file (a recipe's own DeepSpeed
    JSON): as given."""
    from finetune import outputs
    from finetune.generated_files import expected_files

    text = expected_files(docs=False).get(relative)
    if text is None:
        return relative
    here = Path(relative)
    if here.is_file() and here.read_text() == text:
        return relative
    import hashlib

    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = outputs.user_cache_dir() / "launch_configs" / digest
    path = folder / Path(relative).name
    if not path.is_file() or path.read_text() != text:
        outputs.write_text(folder, path.name, text)
    return str(path)


def launch_command(launch: Launch, machine: Machine, recipe: str, overrides: list[str]) -> list[str]:
    """Accelerate's launcher with the strategy's shipped config, its DeepSpeed JSON named explicitly (so the launch
    does not depend on a path written inside the YAML), every process of every node, then `finetune train`."""
    options = ["--num_machines", str(machine.nodes)]
    if machine.nodes > 1:
        options += ["--machine_rank", str(machine.node_rank), "--main_process_ip", machine.main_addr]
        if launch.deepspeed_json is not None:  # torchrun on each node, not DeepSpeed's pdsh
            options += ["--deepspeed_multinode_launcher", "standard"]
    return accelerate_launch_command(
        shipped_file(launch.config_file), "train", recipe, *overrides, num_processes=machine.processes,
        deepspeed_json=launch.deepspeed_json and shipped_file(launch.deepspeed_json), program=launch.program,
        options=tuple(options), main_process_port=machine.main_port)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 1024**3:,.2f} GiB"


def print_launch_plan(plan: dict) -> None:
    if plan.get("chosen_by", "").startswith("the recipe's parallelism axes"):
        print(f"plan: {plan['strategy']}, as the recipe's parallelism axes say, on {plan['device']}; not planned here "
              "(`finetune plan` prints the axes' memory).")
        return
    if "plan_error" in plan:
        print(f"warning: no plan for this launch ({plan['plan_error']}); launching the named strategy "
              f"{plan['strategy']} on {plan['device']} without one.")
        return
    predicted = plan["predicted"]
    total = predicted["total_bytes"] + predicted["calibration_bytes"]
    verdict = "fits" if plan["fits"] else f"does NOT fit ({plan['shortfall']})"
    print(f"plan: {plan['label']} ({plan['chosen_by']}) on {plan['device']}, {plan['memory_per_gpu_gib']:.3g} GiB each "
          f"({plan['memory_source']}): predicted {_gib(total)} per GPU against {_gib(plan['usable_bytes'])} usable, "
          f"{verdict}")
    for row in plan["rejected"]:
        print(f"plan: rejected {row['strategy']}: {row['reason']}")
    if not plan["fits"]:
        print(f"warning: the plan predicts {plan['label']} does not fit here ({plan['shortfall']}); launching it "
              "because it was named. `--strategy auto` picks one that fits.")


def memory_against_plan(records: list[dict], plan: dict | None) -> dict | None:
    """Each rank's measured memory against the plan that came with the run (else the run's own prediction). On a
    GPU: peak allocated against the predicted total (with any calibration); on CPU processes, whose peak RSS is not
    predicted: the model states held at the first step (parameters, gradients, optimizer states, offloaded ones
    included) against their prediction. `over`: the ranks above the prediction by more than `MARGIN`."""
    ranks = []
    what = None
    plan = plan if plan and plan.get("predicted") else None  # an unplanned launch: the run's own prediction
    for record in records:
        measured, own = record.get("measured") or {}, record.get("predicted") or {}
        if not measured:
            continue
        if str(measured.get("peak_kind", "")).startswith("cuda"):
            what, got = "peak allocated", measured.get("peak_bytes")
            want = (plan["predicted"]["total_bytes"] + plan["predicted"]["calibration_bytes"]) if plan \
                else own.get("peak_bytes")
        else:
            what, got = "model states", sum(measured.get(key, 0) for key in STATE_KEYS)
            want = plan["predicted"]["model_states_bytes"] if plan else sum(own.get(key, 0) for key in STATE_KEYS)
        if got and want:
            ranks.append({"rank": record["rank"], "measured_bytes": int(got), "predicted_bytes": int(want),
                          "ratio": got / want})
    if not ranks:
        return None
    return {"against": "the launch plan" if plan else "the run's own prediction", "what": what, "margin": MARGIN,
            "ranks": ranks, "worst_ratio": max(rank["ratio"] for rank in ranks),
            "over": [rank for rank in ranks if rank["ratio"] > 1 + MARGIN]}


def over_plan_warnings(check: dict | None) -> list[str]:
    if not check:
        return []
    return [f"rank {rank['rank']} held {rank['measured_bytes'] / 1024**2:,.1f} MiB ({check['what']}), "
            f"{rank['ratio'] - 1:.0%} above {check['against']}'s {rank['predicted_bytes'] / 1024**2:,.1f} MiB, "
            f"beyond its {check['margin']:.0%} margin (`finetune plan --calibrate OUTPUT_DIR` compares part by part)."
            for rank in check["over"]]
