"""Checkpoints that resume safely: a checkpoint counts as complete only once every rank has finished saving it.

Trainer writes a checkpoint's files in place, so a run killed mid-save leaves a folder that looks like a
checkpoint. After each save, all ranks meet and rank 0 writes `finetune_complete.json` into the folder (with the
recipe and the layout it was trained with); only then are older checkpoints rotated out. `resume_from_checkpoint:
auto` takes the newest folder that has the marker and holds every file a resume needs, whole
(`finetune.checkpoints.untrusted_files`), and names each newer one it skips, with the file at fault.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from accelerate import PartialState
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from finetune import outputs
from finetune.axes import AXES, axis_class
from finetune.checkpoints.untrusted_files import (  # noqa: F401 (check_checkpoint_files: resume and export call it from here)
    CHECKPOINT_NAME,
    UnsafeCheckpointFile,
    check_checkpoint_files,
    deepspeed_tag_problem,
    file_damage,
    files_loaders_open,
)
from finetune.errors import RecipeError, launched_rank
from finetune.launch.strategies import STRATEGIES, Strategy, loaded_sharded, prepared_strategy
from finetune.memory.ledger import optimizer_chain
from finetune.outputs import CHECKPOINT_COMPLETE as COMPLETE_MARKER

# Keys whose change between a run and its resumption is expected, not worth a warning.
RESUME_KEYS_IGNORED = {"resume_from_checkpoint", "output_dir", "save_on_preemption", "model_load_timeout"}


PLANNED = "set by the batch plan for the launch"


def recipe_values(recipe) -> dict[str, str]:
    """The value of every key the user set (recipe file or command line), as text; values the batch plan derived
    for the launch (micro-batch and accumulation fit to the process count) are marked PLANNED."""
    values = {}
    for section in recipe.sections:
        for key in recipe.sources:
            if hasattr(section, key) and key not in RESUME_KEYS_IGNORED:
                values[key] = PLANNED if key in recipe.planned_keys else str(getattr(section, key))
    return values


def checkpoint_layout(trainer) -> dict:
    """How the state in a checkpoint is laid out: ranks, strategy (ddp for one process too: both hold the whole state),
    ZeRO stage (None without DeepSpeed), FSDP sharding, sequences a step (the trainer's global batch). Read
    from what Accelerate prepares (valid before the model is wrapped, when a resume is checked; the strategy check
    stops a run whose engine differs)."""
    args = trainer.args
    running = loaded_sharded(trainer.model) or prepared_strategy(trainer.accelerator.state, args.world_size)
    layout = {"world_size": args.world_size, "strategy": "ddp" if running.kind == "single" else running.kind,
              "zero_stage": running.zero_stage, "sequences_per_step": trainer.global_batch_size}
    if running.kind == "fsdp":
        layout["fsdp_sharding"] = running.fsdp_sharding
    if running.axis is not None:  # an axis in the engine's place (the model loaded tensor-parallel): its sizes
        layout.update(running.axis.record(running))
    if running.kind == "deepspeed":
        zero = trainer.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        layout["round_robin_gradients"] = zero.get("round_robin_gradients") is True
    return layout


def mark_complete(folder: Path, step: int, layout: dict, recipe_values: dict[str, str],
                  train_data: str | None = None) -> None:
    """Called once every rank has saved `folder` (on rank 0, or on each node's first process with
    `save_on_each_node`): records the step, the layout, the recipe and the training data's fingerprint in it.
    Trainer itself rotates on rank 0 as soon as rank 0 has saved, before the other ranks finish, and counts
    half-written folders, so a crash in a save could leave no complete checkpoint at all."""
    marker = {"step": step, **layout, "recipe": recipe_values, "train_data": train_data}
    outputs.write_record(folder, COMPLETE_MARKER, marker)  # atomic: a killed save leaves no half-written marker


def name_deepspeed_tag_on_this_node(folder: Path) -> None:
    """DeepSpeed writes `latest` (the tag its loader reads) on global rank 0 only, though with `save_on_each_node` every
    node holds its own ranks' states: the other nodes' first processes name the tag too, or they cannot resume."""
    tags = sorted(path.name for path in folder.glob("global_step*") if path.is_dir())
    if len(tags) == 1 and not (folder / "latest").is_file():
        outputs.write_text(folder, "latest", tags[0])


def rotate_complete_checkpoints(output_dir, save_total_limit: int | None, best: str | None = None) -> list[Path]:
    """Deletes all but the `save_total_limit` newest complete checkpoints, never the best one; incomplete folders
    are neither counted nor touched. Returns the deleted folders."""
    if not save_total_limit or save_total_limit <= 0:
        return []
    complete = [folder for folder in checkpoints_newest_first(output_dir) if is_complete(folder)]
    best_folder = Path(best).resolve() if best else None
    deleted = [folder for folder in complete[save_total_limit:] if folder.resolve() != best_folder]
    for folder in deleted:
        shutil.rmtree(folder, ignore_errors=True)
    return deleted


def read_marker(checkpoint: str | Path) -> dict:
    """What `mark_complete` recorded in `checkpoint`; empty for a checkpoint this toolkit did not write, or whose
    marker is damaged (`is_complete` tells them apart)."""
    marker = Path(checkpoint) / COMPLETE_MARKER
    try:
        record = json.loads(marker.read_text()) if marker.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return {}
    return record if isinstance(record, dict) else {}


def is_complete(checkpoint: str | Path) -> bool:
    """Every rank saved `checkpoint`: its marker exists and reads as one (a truncated or foreign file does not)."""
    return "step" in read_marker(checkpoint)


def why_incomplete(checkpoint: str | Path, rank: int | None = None) -> str:
    """How a skipped checkpoint is named to the user: its save was interrupted, or a file it needs is missing or
    damaged (which, and why)."""
    marker = Path(checkpoint) / COMPLETE_MARKER
    if marker.is_file() and not is_complete(checkpoint):
        return f"its marker {marker} is damaged (not the record a finished save writes)"
    if not marker.is_file():
        return "incomplete (its save was interrupted)"
    try:
        damage = resume_damage(checkpoint, rank)
    except UnsafeCheckpointFile as error:
        return str(error)
    return f"damaged: {damage}" if damage else "complete"


def recipe_changes(checkpoint: Path, now: dict[str, str]) -> list[str]:
    """`key: then → now` for every recipe key that differs from the one the checkpoint was trained with."""
    saved = read_marker(checkpoint)
    if not saved:
        return []
    then = saved.get("recipe", {})
    changed = [key for key in sorted(set(then) | set(now))
               if then.get(key) != now.get(key) and PLANNED not in (then.get(key), now.get(key))]
    return [f"{key}: {then.get(key, 'default')} → {now.get(key, 'default')}" for key in changed]


def saved_chat_template(checkpoint: str | Path) -> str | None:
    """The chat template saved with a checkpoint's tokenizer: `chat_template.jinja` (Transformers' file), else the
    `chat_template` of its tokenizer_config.json; None where it saved none."""
    folder = Path(checkpoint)
    try:
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text(encoding="utf-8")
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def check_same_data(checkpoint: str | Path, train_data: str, ignore_data_skip: bool,
                    chat_template: str | None = None) -> str | None:
    """Trainer resumes by skipping the batches the checkpoint's run had consumed: on other data that would skip rows
    never trained on. Refuses changed training data, unless `ignore_data_skip` says to start the new data from its
    first row (returned as the line to print). None when the data is unchanged or the checkpoint recorded none.
    Where the tokenizer's `chat_template` differs from the one saved with the checkpoint, the rows changed because
    the template did, and the line says so (the data files may be the same)."""
    then = read_marker(checkpoint).get("train_data")
    if then is None or then == train_data:
        return None
    saved = saved_chat_template(checkpoint) if chat_template is not None else None
    if saved is not None and saved != chat_template:
        saved_file = Path(checkpoint, "chat_template.jinja")
        if not saved_file.is_file():
            saved_file = f"the `chat_template` of {checkpoint}/tokenizer_config.json"
        if not ignore_data_skip:
            raise RecipeError(
                f"the chat template differs from the one {checkpoint} was trained with, so the tokenized training "
                f"rows changed ({then} → {train_data}): resuming would skip batches of rows never trained on. Resume "
                f"with the template it was saved with (`chat_template`: {saved_file}), set `ignore_data_skip: true` "
                "to continue with the new template from the first row, or start afresh in another output_dir.")
        return (f"the chat template changed since {checkpoint} ({then} → {train_data}): continuing with the rows it "
                "renders from their first row (ignore_data_skip)")
    if not ignore_data_skip:
        raise RecipeError(
            f"the training data differs from the data {checkpoint} was trained on ({then} → {train_data}): resuming "
            "would skip the first batches of the new data as if they had been trained on. Set `ignore_data_skip: "
            "true` to continue the step count and schedule with the new data from its first row, or start afresh "
            "in another output_dir.")
    return (f"the training data changed since {checkpoint} ({then} → {train_data}): continuing with the new data "
            "from its first row (ignore_data_skip)")


def continue_schedule_at_this_runs_rate(scheduler, learning_rate: float) -> str | None:
    """A resumed scheduler keeps the base learning rate it was saved with (LambdaLR's `base_lrs`), and the optimizer
    the rate of the saved schedule, so a changed `learning_rate` or warmup would never apply. The schedule's shape
    (type, warmup, total steps) is rebuilt from this run's arguments anyway (Transformers' schedules are
    `functools.partial`s, which LambdaLR does not save); this puts this run's rate under it and sets the rate of the
    next step from it. Returns a line naming what changed, if anything."""
    import torch

    while not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and hasattr(scheduler, "scheduler"):
        scheduler = scheduler.scheduler  # Accelerate's and DeepSpeed's wrappers
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return None  # DeepSpeed-config schedulers compute each rate from the config (plateau: refused earlier)
    saved_base, saved_rate = max(scheduler.base_lrs), max(scheduler.get_last_lr())
    scheduler.base_lrs = [base * learning_rate / saved_base for base in scheduler.base_lrs]  # groups keep ratios
    rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, base, rate in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, rates):
        group["initial_lr"], group["lr"] = base, rate
    scheduler._last_lr = rates
    if saved_base == learning_rate and saved_rate == max(rates):
        return None
    return (f"learning rate from step {scheduler.last_epoch + 1}: {max(rates):.6g} by this run's schedule "
            f"(learning_rate {learning_rate:g}); the checkpoint's schedule had {saved_rate:.6g} (learning_rate "
            f"{saved_base:g})")


def checkpoint_step(folder: Path) -> int:
    return int(CHECKPOINT_NAME.match(folder.name).group(1))


def checkpoints_newest_first(output_dir: str | Path) -> list[Path]:
    folders = [p for p in Path(output_dir).iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)]
    return sorted(folders, key=checkpoint_step, reverse=True)


def newest_complete_checkpoint(output_dir: str | Path, whole: bool = False) -> tuple[Path | None, list[Path]]:
    """The newest complete checkpoint in `output_dir` (or None) and the newer ones skipped; with `whole`, one whose
    every file a resume reads is there and reads (`resumable`), as a resume takes it."""
    if not os.path.isdir(output_dir):
        return None, []
    skipped = []
    for folder in checkpoints_newest_first(output_dir):
        if resumable(folder, launched_rank()) if whole else is_complete(folder):
            return folder, skipped
        skipped.append(folder)
    return None, skipped


def agree_on_newest_complete(output_dir: str | Path, world_size: int) -> tuple[Path | None, list[Path]]:
    """`newest_complete_checkpoint`, agreed by every rank: each reads its own node's `output_dir` (with
    `save_on_each_node` the nodes need not share a disk) and all resume from the newest step complete on every node,
    naming the newer ones some nodes skip. Nodes that share no complete step stop, all of them, with the steps each
    has: one starting fresh while another resumes would train different models and hang at the first collective."""
    if world_size == 1:
        return newest_complete_checkpoint(output_dir, whole=True)
    import socket

    from accelerate.utils import gather_object

    folders = checkpoints_newest_first(output_dir) if os.path.isdir(output_dir) else []
    rank = launched_rank()  # its own files: with save_on_each_node a node's folder holds its ranks' alone
    here = {"host": socket.gethostname(), "folder": str(Path(output_dir).resolve()),
            "steps": [checkpoint_step(folder) for folder in folders if resumable(folder, rank)]}
    views = gather_object([here])
    common = set.intersection(*(set(view["steps"]) for view in views))
    if not common and any(view["steps"] for view in views):
        have = "; ".join(f"rank {rank} ({view['host']}, {view['folder']}): "
                         f"{', '.join(f'checkpoint-{step}' for step in view['steps']) or 'none'}"
                         for rank, view in enumerate(views))
        raise RecipeError(f"`resume_from_checkpoint: auto`: no checkpoint is complete on every node ({have}). Copy one "
                          "checkpoint folder to every node's output_dir, or start afresh with "
                          "`resume_from_checkpoint: false` in a new output_dir.")
    if not common:
        return None, []
    step = max(common)
    skipped = [folder for folder in folders if checkpoint_step(folder) > step and not resumable(folder, rank)]
    newer = [f"rank {rank} ({view['host']}, {view['folder']})" for rank, view in enumerate(views)
             if max(view["steps"]) > step]
    if newer and PartialState().is_main_process:
        print(f"warning: resuming every node from checkpoint-{step}, the newest complete on all of them; newer ones "
              f"are complete only on {'; '.join(newer)}")
    return Path(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}"), skipped


def check_explicit_checkpoint(path: str) -> None:
    """An explicit `resume_from_checkpoint` must be a checkpoint Trainer finished writing."""
    folder = Path(path)
    if not folder.is_dir():
        raise RecipeError(f"`resume_from_checkpoint: {path}` is not a checkpoint directory; give one, or auto.")
    if not (folder / "trainer_state.json").is_file() and not (folder / COMPLETE_MARKER).is_file():
        raise RecipeError(f"`resume_from_checkpoint: {path}` is incomplete (no trainer_state.json): its save was "
                          "interrupted. Resume from an earlier checkpoint, or use auto to pick the newest complete "
                          "one.")
    damage = resume_damage(folder, launched_rank())  # an unsafe file raises here, by name
    if damage is not None:
        raise RecipeError(f"`resume_from_checkpoint: {path}` is damaged: {damage}. Resume from another checkpoint, or "
                          "use auto to pick the newest whole one.")


def layout_strategy(layout: dict) -> Strategy:
    """The strategy a checkpoint layout records (markers written before FSDP was recorded: from the ZeRO stage); an
    axis in the engine's place with the layout its marker records (`Axis.recorded_layout`)."""
    kind = layout.get("strategy") or ("ddp" if layout.get("zero_stage") is None else "deepspeed")
    axis = axis_class(kind).recorded_layout(layout) if kind in AXES else None
    return Strategy(kind, zero_stage=layout.get("zero_stage"), fsdp_sharding=layout.get("fsdp_sharding"), axis=axis)


def describe_layout(layout: dict) -> str:
    """`DeepSpeed ZeRO-2 on 4 rank(s)`; an axis's own loop named by its kind, with the `*_parallel_size` sizes its
    marker records."""
    strategy = layout_strategy(layout)
    sizes = [f"{key} {value}" for key, value in layout.items() if key.endswith("_parallel_size")]
    recorded = f" ({', '.join(sizes)})" if strategy.kind not in STRATEGIES and sizes else ""
    return f"{strategy.describe()}{recorded} on {layout['world_size']} rank(s)"


def resume_needs_universal(checkpoint: Path, now: dict) -> bool:
    """Whether this run can continue from `checkpoint` as saved (False: the same layout; DDP, whose every rank holds
    the whole state; FSDP, whose distributed checkpoint PyTorch reshards to any world size), only through DeepSpeed's
    universal format (True: a ZeRO-1/2/3 checkpoint saved with another world size, same stage), or not at all
    (RecipeError: another global batch, strategy or ZeRO stage)."""
    saved = read_marker(checkpoint)
    if "sequences_per_step" not in saved:  # not written by this toolkit: nothing to compare
        return False
    if saved["sequences_per_step"] != now["sequences_per_step"]:
        raise RecipeError(
            f"{checkpoint} was trained with {saved['sequences_per_step']} sequences a step and this run takes "
            f"{now['sequences_per_step']}: Trainer would resume at another place in the data. Set "
            f"`global_batch_size: {saved['sequences_per_step']}` so micro-batch and accumulation fit this launch.")
    export_hint = (f"Resume under {describe_layout(saved)}, or start afresh from its weights: `finetune export "
                   f"{checkpoint} WEIGHTS_DIR` then `model_name_or_path: WEIGHTS_DIR` (optimizer state starts over).")
    if layout_strategy(saved).kind != layout_strategy(now).kind:  # each keeps its optimizer states its own way
        raise RecipeError(f"{checkpoint} was saved by {describe_layout(saved)} and this run is {describe_layout(now)}: "
                          f"the optimizer states of the two do not convert. {export_hint}")
    if saved["world_size"] == now["world_size"] and saved["zero_stage"] == now["zero_stage"]:
        return False
    if layout_strategy(saved).kind in ("ddp", "fsdp"):
        return False  # every DDP rank holds the whole state; PyTorch's distributed checkpoint reshards FSDP's
    if saved["zero_stage"] != now["zero_stage"]:  # DeepSpeed's universal loader reads only its own stage's layout
        raise RecipeError(f"{checkpoint} was saved by {describe_layout(saved)} and this run is {describe_layout(now)}: "
                          f"the optimizer states of the two do not convert. {export_hint}")
    refusal = _not_universal(checkpoint, saved)
    if refusal:
        raise RecipeError(f"{refusal} It cannot move from {saved['world_size']} to {now['world_size']} rank(s). "
                          f"{export_hint}")
    return True


def _not_universal(checkpoint: Path, saved: dict) -> str | None:
    """Why DeepSpeed's universal conversion cannot take this ZeRO checkpoint (None: it can)."""
    if saved.get("zero_stage") == 0:
        return (f"{checkpoint} was saved by {describe_layout(saved)}: DeepSpeed's universal checkpoints cover "
                "ZeRO-1/2/3 only.")
    if saved.get("round_robin_gradients"):
        return (f"{checkpoint} was saved with `round_robin_gradients: true`, whose partitions DeepSpeed's universal "
                "conversion maps to the wrong parameters.")
    return None


def convert_to_universal(checkpoint: Path, workers: int = 1) -> Path:
    """DeepSpeed's `ds_to_universal`: per-parameter fp32 weights and optimizer states that the same ZeRO stage loads
    on any world size, with `workers` processes extracting the ranks' shards and merging them. Written beside the
    original as `<tag>_universal` and named in `latest_universal`, last: a conversion already made (`finetune
    universal` before a relaunch) is used as it is."""
    from deepspeed.checkpoint import ds_to_universal

    tag = (checkpoint / "latest").read_text().strip()
    universal = checkpoint / f"{tag}_universal"
    if (checkpoint / "latest_universal").is_file():
        return universal
    shutil.rmtree(universal, ignore_errors=True)  # left by an interrupted conversion
    ds_to_universal.main(argparse.Namespace(
        input_folder=str(checkpoint / tag), output_folder=str(universal), num_extract_workers=workers,
        num_merge_workers=workers, keep_temp_folder=False, strict=True, inject_missing_state=True))
    (checkpoint / "latest_universal").write_text(universal.name)
    return universal


def convertible_to_universal(checkpoint: Path) -> None:
    """Refuses, saying why, a folder DeepSpeed's universal conversion cannot take: not a complete checkpoint, not a
    ZeRO-1/2/3 one, or one saved with round-robin gradients."""
    if not is_complete(checkpoint):
        raise RecipeError(f"{checkpoint} is not a complete checkpoint: {why_incomplete(checkpoint)}")
    saved = read_marker(checkpoint)
    if layout_strategy(saved).kind != "deepspeed" or not (checkpoint / "latest").is_file():
        raise RecipeError(f"{checkpoint} was saved by {describe_layout(saved)}: only DeepSpeed ZeRO checkpoints need "
                          "the universal format (DDP's hold the whole state; FSDP's reshard to any world size).")
    refusal = _not_universal(checkpoint, saved)
    if refusal:
        raise RecipeError(refusal)


class SeparateOptimizerStepsCallback(TrainerCallback):
    """DeepSpeed's ZeRO-3 universal loader gives every parameter group the same `step` tensor, which Adam then
    advances once per group, so bias correction drifts (measured: loss 0.2% off two steps later). Each group gets
    its own copy before the first step."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        import torch

        seen = set()
        for param_state in optimizer_chain(optimizer)[-1].state.values():
            step = param_state.get("step")
            if torch.is_tensor(step):
                if id(step) in seen:
                    param_state["step"] = step.clone()
                seen.add(id(param_state["step"]))


def prepare_resume(trainer, checkpoint: str) -> None:
    """Stops before training if this launch cannot continue from `checkpoint`; converts a DeepSpeed checkpoint saved
    with another world size to DeepSpeed's universal format and has the engine load that."""
    now, accelerator, saved = checkpoint_layout(trainer), trainer.accelerator, read_marker(checkpoint)
    if not resume_needs_universal(Path(checkpoint), now):
        if now["strategy"] == "fsdp" and saved.get("world_size", now["world_size"]) != now["world_size"] \
                and accelerator.is_main_process:
            print(f"{checkpoint} was saved by {describe_layout(saved)}; continuing on {describe_layout(now)} through "
                  "PyTorch's distributed checkpoint resharding")
        return
    already = (Path(checkpoint) / "latest_universal").is_file()
    if not already:
        converted_outside_the_process_group(Path(checkpoint), accelerator.is_main_process)
    accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    trainer.add_callback(SeparateOptimizerStepsCallback())
    if accelerator.is_main_process:
        made = "converted before this launch (finetune universal)" if already else "converted now"
        print(f"{checkpoint} was saved by {describe_layout(saved)}; continuing on {describe_layout(now)} through "
              f"DeepSpeed's universal checkpoint format ({made})")


# How often the other ranks look for the main process's conversion, and how often they say they are waiting.
CONVERSION_POLL_SECONDS, CONVERSION_NOTE_SECONDS = 2.0, 60.0


def converted_outside_the_process_group(checkpoint: Path, is_main: bool) -> None:
    """The main process converts `checkpoint` in a child process (`finetune universal`, several workers: none forked
    from a rank holding a CUDA context) while the other ranks wait for its `latest_universal`, written last, outside
    any collective: a conversion longer than `ddp_timeout` (hours for a 70B) times nothing out. If the main process
    fails, its launcher stops the others."""
    import subprocess
    import sys
    import time

    if is_main:
        command = [sys.executable, "-m", "finetune", "universal", str(checkpoint), "--workers",
                   str(conversion_workers())]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            raise RecipeError(f"converting {checkpoint} to DeepSpeed's universal format failed:\n"
                              f"{result.stdout[-3000:]}")
        return
    started = noted = time.monotonic()
    while not (checkpoint / "latest_universal").is_file():
        time.sleep(CONVERSION_POLL_SECONDS)
        if time.monotonic() - noted >= CONVERSION_NOTE_SECONDS and PartialState().is_local_main_process:
            noted = time.monotonic()
            print(f"waiting for the main process to convert {checkpoint} to the universal format "
                  f"({noted - started:.0f} s)", flush=True)


def conversion_workers() -> int:
    """Processes converting a checkpoint: the machine's cores, up to 8 (each holds shards in host memory)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def rank_files(pattern: str, ranks: list[int]) -> list[str]:
    return [pattern.format(rank=rank) for rank in ranks]


def files_a_resume_needs(folder: Path, rank: int | None = None) -> list[list[str]]:
    """What Trainer reads back to resume from `folder` under the strategy its marker records (else the one its files
    show): for each need, the names (glob patterns, relative to `folder`) of which one must exist. Each rank's own
    files (RNG state, ZeRO partition) for every rank, or, given the `rank` that reads it, for that rank alone where
    the checkpoint was saved with `save_on_each_node` (each node's folder holds its own ranks' files only).
    Trainer: `_load_from_checkpoint` (weights, unless DeepSpeed or FSDP loads them), `_load_optimizer_and_scheduler`
    (optimizer.pt and scheduler.pt; DeepSpeed's engine its global_step folder; FSDP its optimizer folder),
    `_load_rng_state` (one file a rank) and `trainer_state.json`."""
    marker = read_marker(folder)
    if "strategy" in marker or "zero_stage" in marker:
        kind = layout_strategy(marker).kind
    else:
        kind = ("deepspeed" if any(folder.glob("global_step*")) else
                "fsdp" if any(folder.glob("pytorch_model_fsdp*")) else "ddp")
    world_size = marker.get("world_size", 1)
    ranks = list(range(world_size))
    if rank is not None and marker.get("recipe", {}).get("save_on_each_node") == "True" and rank < world_size:
        ranks = [rank]
    rng = [["rng_state.pth"]] if world_size == 1 else [[name] for name in rank_files("rng_state_{rank}.pth", ranks)]
    needs = [["trainer_state.json"], *rng]
    if kind == "deepspeed":
        tag = (folder / "latest").read_text(errors="replace").strip() if (folder / "latest").is_file() else "*"
        needs += [["latest"], [f"{tag}/*model_states.pt"]]
        if marker.get("zero_stage", 1):  # ZeRO-1/2/3 partition the optimizer: one file a rank
            needs += [[name] for name in rank_files(f"{tag}/*zero_pp_rank_{{rank}}_mp_rank_00_optim_states.pt",
                                                    ranks)]
    elif kind in AXES:  # an axis in the engine's place: what its run saves (a pipeline's stages, TP's slices)
        needs = axis_class(kind).files_a_resume_needs(marker, needs)
    elif kind == "fsdp":
        # Accelerate's `save_fsdp_model`/`save_fsdp_optimizer`: a distributed checkpoint folder (sharded state
        # dicts, the shipped configs) or `.bin` files (full or local state dicts)
        needs += [["pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp*.bin"], ["optimizer_0/.metadata",
                                                                                "optimizer*.bin"], ["scheduler.pt"]]
    else:
        needs += [["model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                   "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin"],
                  ["optimizer.pt", "optimizer.bin"], ["scheduler.pt"]]
    return needs


def resume_damage(folder: str | Path, rank: int | None = None) -> str | None:
    """Why a checkpoint cannot be resumed from (by `rank`, or by all: `files_a_resume_needs`), naming the file (None
    when whole): a file a resume needs is missing, or a file it opens does not read. Raises UnsafeCheckpointFile for a
    file that could run code."""
    folder = Path(folder)
    tag_problem = deepspeed_tag_problem(folder)  # first: the needs below look inside the folder `latest` names
    if tag_problem is not None:
        return tag_problem
    for names in files_a_resume_needs(folder, rank):
        if not any(any(folder.glob(name)) for name in names):
            return f"{folder / names[0]} is missing (a resume needs it: Trainer would go on without it, or stop)"
    for path in files_loaders_open(folder):
        damage = file_damage(path)
        if damage is not None:
            return f"{path} {damage}"
    return None


def resumable(folder: Path, rank: int | None = None) -> bool:
    """Complete and whole: every rank saved it and every file a resume reads is there and reads (an unsafe file
    counts as whole here, to be refused by name when it is picked)."""
    if not is_complete(folder):
        return False
    try:
        return resume_damage(folder, rank) is None
    except UnsafeCheckpointFile:
        return True
