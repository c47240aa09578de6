"""The group size of an online RL method (GRPO's `num_generations`), planned: what each size costs per GPU on the
recommended strategy, which fit, and, for one that does not, the term that overflows.

TRL generates a round of completions at once: `per_device_train_batch_size` × processes × `steps_per_generation`
(an optimizer step's micro-batches by default), which must hold whole groups. A group larger than a round raises
the micro-batch until one fits: the training forward's activations and the round's KV cache grow with it. A group
that divides the round costs nothing more; it leaves fewer prompts a round.
"""

from __future__ import annotations

from dataclasses import replace

from finetune.errors import RecipeError
from finetune.memory.estimate import GiB, MemoryEstimate, estimate, generated_at_once

GROUP_SIZES = (2, 4, 8, 16, 32, 64)
DEFAULT_GROUP_SIZE = 8  # TRL's `num_generations`


def overflowing_term(result: MemoryEstimate) -> str:
    """The largest part of a GPU's prediction, as a user would name it."""
    terms = {
        "the generation round's KV cache and logits": result.generation_bytes,
        ("the training forward's activations" + (" and logits" if result.setup.method.logits_held else "")):
            result.activations_bytes + result.temporary_bytes,
        "the model states (weights, gradients, optimizer)": result.model_states_bytes,
        "the frozen reference model": result.reference_bytes,
        "the reward models": result.reward_models_bytes,
    }
    name = max(terms, key=terms.get)
    return f"{name} ({terms[name] / GiB:.1f} GiB of {result.total_bytes / GiB:.1f} GiB)"


def group_sizes(request, shape, candidate, batch: dict, overhead_bytes: int) -> dict:
    """Each group size on `candidate` at the batch plan's micro-batch and accumulation: the micro-batch a round of
    whole groups needs, the prompts a round then holds, the per-GPU estimate and whether it fits; the size asked
    for (`request.num_generations`, else TRL's 8), and the one recommended: that size where it fits, else the
    largest smaller one that does."""
    from finetune.plan.decision_tree import _setup, shortfall

    micro, accumulation = batch["micro_batch_size"], batch["gradient_accumulation_steps"]
    asked = request.num_generations or DEFAULT_GROUP_SIZE
    rows = []
    for group in sorted({*GROUP_SIZES, asked}):
        factor = request.gpus * accumulation  # a round: micro-batch × processes × steps a round
        size = next(size for size in range(micro, micro + group + 1) if size * factor % group == 0)
        setup = replace(_setup(request, candidate.options, size), gradient_accumulation_steps=accumulation)
        result = estimate(shape, setup)
        reason = shortfall(request, result, overhead_bytes)
        rows.append({"num_generations": group, "micro_batch_size": size, "prompts_per_round": size * factor // group,
                     "completions_per_gpu": generated_at_once(setup), "estimate": result, "fits": reason is None,
                     "overflow": None if reason is None else overflowing_term(result)})
    fitting = [row["num_generations"] for row in rows if row["fits"] and row["num_generations"] <= asked]
    return {"strategy": candidate.name, "asked": asked, "recommended": max(fitting) if fitting else None,
            "rows": rows}


def refuse_group_size(plan: dict) -> None:
    """A group size asked for that does not fit stops the plan, naming the term that overflows and the size that
    fits."""
    groups = plan.get("group_sizes")
    if not groups:
        return
    asked = next(row for row in groups["rows"] if row["num_generations"] == groups["asked"])
    if asked["fits"]:
        return
    instead = (f"`num_generations: {groups['recommended']}` fits" if groups["recommended"]
               else "no group size fits: use more GPUs, a shorter `max_seq_length`, or a smaller model")
    raise RecipeError(f"`num_generations: {groups['asked']}` does not fit under {groups['strategy']}: a round needs "
                      f"a micro-batch of {asked['micro_batch_size']} ({asked['completions_per_gpu']} completions a "
                      f"GPU), and {asked['overflow']} overflows the GPU; {instead}.")
