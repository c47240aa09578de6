"""Group Relative Policy Optimization (`method: grpo`): online reinforcement learning with verifiable rewards, through
TRL's `GRPOTrainer`, on the toolkit's rails.

Each step the policy writes `num_generations` completions of each prompt (sampled at `temperature`, up to
`max_completion_length` new tokens); the rewards (`reward_funcs`: the built-in verifiable ones, a user's function, a
trained reward model; finetune.train.methods.grpo.rewards) score them; each completion's advantage is its reward
against its group's mean (scaled by the group's spread, `scale_rewards`), and the policy's likelihood of each is
pushed by it, clipped as PPO does (`epsilon`), with a KL penalty to a frozen reference copy when `beta` > 0.

What it holds beyond supervised fine-tuning (the memory estimate's `MethodTerms`): the KV cache and next-token logits
of every completion a rank generates in one round, a frozen reference model when `beta` > 0, and each reward model.
The held-out measure is each task's greedy exact match (as SFT reports it) and TRL's mean reward on the eval prompts.

This module holds the method's keys and config and is read with the recipe; its trainer (`trainer.py`) is imported
only when a run builds it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field

from finetune.errors import RecipeError
from finetune.memory.estimate import MethodTerms
from finetune.recipe.aliases import TrlKey
from finetune.recipe.args import trl_config
from finetune.recipe.methods import Method
from finetune.train.methods.grpo.rewards import BUILT_IN, check_reward_names

GRPO_CONFIG = "GRPOConfig"
DEFAULT_REWARD_TIMEOUT = 300.0  # seconds: a round's scoring, generous for a local function, short of a hung run


@functools.cache
def trl_grpo_loss_types() -> tuple[str, ...]:
    """The installed TRL's GRPO losses, from the help of `GRPOConfig.loss_type` ("Supported values are 'grpo',
    ..."), which its trainer's dispatch mirrors."""
    import re

    from trl.trainer.grpo_config import GRPOConfig

    help_text = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    return tuple(re.findall(r"'(\w+)'", help_text.split("Supported values are", 1)[-1].split(". ", 1)[0]))


@dataclass
class GRPOArguments:
    """GRPO's own keys (`method: grpo`), under TRL's names."""

    reward_funcs: list[str] = field(
        default_factory=lambda: ["exact_match"],
        metadata={"help": f"GRPO: the rewards, summed (weighted by `reward_weights`): {', '.join(BUILT_IN)} (built-in, "
                          "against the rows' answer), a reward model's directory (`method: reward`'s output), or a "
                          "Python function `package.module:function` (TRL's reward function signature; its module "
                          "is code, like a script: `plan` and `--dry-run` only read its source, the run imports it)."},
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "GRPO: a weight per reward in `reward_funcs` (default: 1 each)."},
    )
    reward_timeout: float = field(
        default=DEFAULT_REWARD_TIMEOUT,
        metadata={"help": "GRPO: seconds a reward function of yours may take to score one generation round's "
                          "completions; past it the run stops naming the function (a hung scorer would hang the "
                          "run). Raise it for a slow scorer (a remote judge)."},
    )
    num_generations: int = field(
        default=8,
        metadata={"help": "GRPO: completions sampled per prompt, the group each is compared with (TRL's "
                          "`num_generations`); it must divide the completions of a generation round."},
    )
    max_completion_length: int = field(
        default=256, metadata={"help": "GRPO: new tokens a completion may have; the prompt gets the rest of "
                                       "`max_seq_length`."},
    )
    temperature: float = field(default=1.0, metadata={"help": "GRPO: sampling temperature of the completions."})
    beta: float = field(
        default=0.0,
        metadata={"help": "GRPO: weight of the KL penalty to the starting model (TRL's `beta`; 0, TRL's default, "
                          "loads no reference copy)."},
    )
    grpo_loss_type: str = field(
        default="dapo", metadata={"help": "GRPO: TRL's `loss_type`, how token losses are averaged (dapo, grpo, "
                                          "dr_grpo, ...; a name the installed TRL lacks is refused with its list)."},
    )
    scale_rewards: str = field(
        default="group", metadata={"help": "GRPO: advantages divided by the group's reward spread (group), the "
                                           "batch's (batch), or not (none)."},
    )
    num_iterations: int = field(default=1, metadata={"help": "GRPO: optimizer passes over each generated batch."})
    epsilon: float = field(default=0.2, metadata={"help": "GRPO: the clipping range of the probability ratio."})
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "GRPO: micro-batches each generation round feeds (default: an optimizer "
                                        "step's, `gradient_accumulation_steps`)."},
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "GRPO under DeepSpeed ZeRO-3: gather the whole policy onto every GPU for each generation "
                          "round (TRL's key and default; the plan counts it: 131 GiB a GPU for a 70B in bf16). "
                          "`false` gathers each layer again for every generated token instead: no such peak, but "
                          "slow. No effect under other strategies."},
    )

    def __post_init__(self):
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [self.reward_funcs]
        if isinstance(self.reward_weights, (int, float)):
            self.reward_weights = [float(self.reward_weights)]
        if self.num_generations < 2:
            raise RecipeError(f"`num_generations: {self.num_generations}`: GRPO compares each completion with the "
                              "others of its prompt's group; give at least 2.")
        if self.max_completion_length < 1:
            raise RecipeError(f"`max_completion_length` must be at least 1, got {self.max_completion_length}.")
        if self.temperature <= 0:
            raise RecipeError(f"`temperature: {self.temperature}`: GRPO samples its completions; give a positive "
                              "temperature (1.0 is TRL's default).")
        if not 0 < self.reward_timeout < float("inf"):
            raise RecipeError(f"`reward_timeout: {self.reward_timeout}` must be a positive number of seconds (default "
                              f"{DEFAULT_REWARD_TIMEOUT:g}).")
        if self.beta < 0:
            raise RecipeError(f"`beta` must be ≥ 0, got {self.beta}.")
        if self.grpo_loss_type not in trl_grpo_loss_types():
            raise RecipeError(f"`grpo_loss_type: {self.grpo_loss_type}` is not one of "
                              f"{', '.join(trl_grpo_loss_types())}.")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise RecipeError(f"`scale_rewards: {self.scale_rewards}` is not one of group, batch, none.")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise RecipeError(f"`reward_weights` gives {len(self.reward_weights)} weight(s) for "
                              f"{len(self.reward_funcs)} reward(s) in `reward_funcs`: give one per reward.")
        check_reward_names(self.reward_funcs)


# TRL's GRPOConfig and the recipe's training arguments in one dataclass, as GRPOTrainer reads them
finetune_grpo_config, __getattr__ = trl_config("trl.trainer.grpo_config:GRPOConfig", "FinetuneGRPOConfig", __name__,
                                               "The recipe's training arguments and TRL's GRPO keys.")


def reward_model_parameters(names: list[str]) -> int:
    """Parameters of the reward models among `names` (directories), read from their safetensors headers."""
    from finetune.models.loading import local_safetensors, safetensors_entries
    from finetune.train.methods.grpo.rewards import is_reward_model

    return sum(math.prod(shape) for name in names if is_reward_model(name)
               for _, _, _, shape in safetensors_entries(local_safetensors(name)))


class GroupRelativePolicyOptimization(Method):
    name = "grpo"
    description = ("online reinforcement learning on prompts (`dataset: synthetic` gives the synthetic tasks' "
                   "prompts, their answers checked exactly): `num_generations` sampled completions a prompt, scored "
                   "by `reward_funcs`, each pushed by its reward against its group's, through TRL's GRPOTrainer")
    arguments = GRPOArguments
    trl_keys = (
        TrlKey("loss_type", GRPO_CONFIG, ours="grpo_loss_type"),
        TrlKey("use_vllm", GRPO_CONFIG, kept=(False,),
               why="completions are generated through Transformers here; vLLM generation is not wired up yet"),
        TrlKey("use_transformers_continuous_batching", GRPO_CONFIG, kept=(False,),
               why="TRL's continuous-batching generation casts the policy to bf16 in place every round "
                   "(trl/trainer/grpo_trainer.py), fp32 master weights included; completions come from `generate`"),
        TrlKey("vllm_mode", GRPO_CONFIG, ignored=True, why="no vLLM here: completions come from Transformers"),
        TrlKey("vllm_gpu_memory_utilization", GRPO_CONFIG, ignored=True,
               why="no vLLM here: completions come from Transformers"),
        TrlKey("log_completions", GRPO_CONFIG, ignored=True,
               why="the run reports the held-out exact match and sample answers instead"),
        TrlKey("num_completions_to_print", GRPO_CONFIG, ignored=True, why="completions are not printed"),
        TrlKey("max_prompt_length", f"{GRPO_CONFIG} (older TRL)", ignored=True,
               why="a prompt is never cut: one leaving no room for `max_completion_length` within `max_seq_length` "
                   "is dropped, counted (`overlong_policy`)"),
        TrlKey("reward_model_name_or_path", "TRL's GRPO script", why="name the reward model's directory in "
               "`reward_funcs`, beside the other rewards"),
    )
    # planned by name (`finetune plan --method grpo`): TRL's default completion length, no reference (beta 0)
    memory = MethodTerms(reference_model=False, sequences_per_example=1, completion_length=256, logits_held=False,
                         fused_head=True)  # TRL's fused LM head (trl/trainer/grpo_trainer.py `add_fused_lm_head`)
    preprocess_refusal = ("under `method: grpo` the data are prompts, which the policy completes while training: "
                          "there are no tokenized examples to cache")

    def terms(self) -> MethodTerms:
        settings = self.settings
        return MethodTerms(reference_model=settings.beta > 0, sequences_per_example=1,
                           completion_length=settings.max_completion_length,
                           steps_per_generation=settings.steps_per_generation,
                           reward_model_parameters=reward_model_parameters(settings.reward_funcs),
                           gathers_for_generation=settings.ds3_gather_for_generation, logits_held=False,
                           fused_head=True)

    def training_arguments(self, data_args):
        settings = self.settings
        if settings.max_completion_length >= data_args.max_seq_length:
            raise RecipeError(f"`max_completion_length: {settings.max_completion_length}` leaves no room for a prompt "
                              f"in `max_seq_length: {data_args.max_seq_length}`: raise `max_seq_length` above it.")
        return finetune_grpo_config(), {
            "num_generations": settings.num_generations, "max_completion_length": settings.max_completion_length,
            "temperature": settings.temperature, "beta": settings.beta, "loss_type": settings.grpo_loss_type,
            "scale_rewards": settings.scale_rewards, "num_iterations": settings.num_iterations,
            "epsilon": settings.epsilon, "steps_per_generation": settings.steps_per_generation,
            "ds3_gather_for_generation": settings.ds3_gather_for_generation,
            "reward_weights": settings.reward_weights, "shuffle_dataset": True, "log_completions": False,
            "remove_unused_columns": False,  # every column reaches the reward functions, as TRL means
        }

    def check_training_keys(self, training_inputs, sources) -> None:
        """A generation round holds whole groups: the completions of a round over every process (TRL's
        `generation_batch_size`: micro-batch × processes × `steps_per_generation`) and of an eval batch must divide
        into groups of `num_generations`."""
        settings = self.settings
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        micro = int(training_inputs.get("per_device_train_batch_size") or 1)
        steps = settings.steps_per_generation or int(training_inputs.get("gradient_accumulation_steps") or 1)
        round_size = micro * processes * steps
        if round_size % settings.num_generations:
            raise RecipeError(
                f"`num_generations: {settings.num_generations}` does not divide a generation round's {round_size} "
                f"completions (`per_device_train_batch_size: {micro}` × {processes} process(es) × "
                f"{steps} step(s) a round): make the round a multiple of it, e.g. `per_device_train_batch_size: "
                f"{_next_multiple(micro, settings.num_generations, processes * steps)}`, or pick a group size that "
                "divides it.")
        evaluation = int(training_inputs.get("per_device_eval_batch_size") or 8) * processes
        if training_inputs.get("eval_strategy", "no") != "no" and evaluation % settings.num_generations:
            raise RecipeError(f"`num_generations: {settings.num_generations}` does not divide an eval batch of "
                              f"{evaluation} completions (`per_device_eval_batch_size` × {processes} process(es)).")

    def check_data_keys(self, data_args) -> None:
        if data_args.packing or data_args.padding_free:
            raise RecipeError("`packing` and `padding_free` are for supervised fine-tuning; under `method: grpo` the "
                              "policy writes the completions (drop them).")
        if data_args.streaming or data_args.preprocessed_dir is not None:
            raise RecipeError("`streaming` and `preprocessed_dir` are for supervised fine-tuning; under `method: "
                              "grpo` the prompts are read whole (drop them).")

    def plan_data(self, sections):
        from finetune.data.prompts import load_prompt_data

        return None, load_prompt_data(sections.data, int(sections.training_inputs.get("seed") or 42)).summary

    def prepare_model(self, recipe, model):
        from finetune.models.loading import hold_trainable_parameters, trainable_dtype

        if recipe.lora.use_lora:
            raise RecipeError("`method: grpo` trains the whole policy here; LoRA under GRPO is not wired up yet: drop "
                              "`use_lora`.")
        args = recipe.training
        hold_trainable_parameters(model, trainable_dtype(recipe.strategy, args.mixed_precision, args.pure_bf16))
        return model

    def prepare_data(self, recipe, tokenizer, model):
        from finetune.data.prompts import load_prompt_data
        from finetune.data.summary import fingerprint

        settings = self.settings
        data = load_prompt_data(recipe.data, recipe.training.seed, tokenizer, settings.max_completion_length)
        check_answers(data.summary, settings.reward_funcs)
        data.summary["train_fingerprint"] = fingerprint(data.train)
        return data

    def callbacks(self, recipe, tokenizer, data) -> list:
        from finetune.data.prompts import exact_match_examples
        from finetune.train.evaluation import ExactMatchCallback

        examples = exact_match_examples(data.eval, recipe.data.generation_eval_samples)
        return [ExactMatchCallback(tokenizer, examples, self.settings.max_completion_length)]

    def build_trainer(self, recipe, model, tokenizer, data, callbacks):
        from finetune.train.methods.grpo.trainer import grpo_trainer

        return grpo_trainer(recipe, model, tokenizer, data, callbacks)

    def print_data_summary(self, summary: dict) -> None:
        from finetune.data.prompts import print_prompt_summary

        print_prompt_summary(summary)


def check_answers(summary: dict, reward_funcs: list[str]) -> None:
    """A reward that checks completions against the rows' answers needs every source's training rows to have one."""
    from finetune.data.prompts import ANSWER_COLUMN
    from finetune.train.methods.grpo.rewards import NEEDS_ANSWER

    needing = [name for name in reward_funcs if name in NEEDS_ANSWER]
    bare = [source["name"] for source in summary["sources"]
            if source["train"]["with_answer"] < source["train"]["prompts"]]
    if needing and bare:
        raise RecipeError(f"`reward_funcs: {needing[0]}` checks each completion against the row's answer, but "
                          f"{bare[0]} has rows without one (an `{ANSWER_COLUMN}` or `completion` column, or "
                          "conversations ending in an assistant turn): give answers, or a reward that needs none.")


def _next_multiple(micro: int, group: int, factor: int) -> int:
    """The smallest micro-batch from `micro` up whose round (micro × `factor`) holds whole groups."""
    return next(size for size in range(micro, micro + group + 1) if size * factor % group == 0)
