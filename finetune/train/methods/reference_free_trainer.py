"""The toolkit's guarantees for TRL's reference-free pair trainers (`ReferenceFreePairTrainer`, mixed into the CPO and
ORPO trainers), and how a run builds one (`reference_free_trainer`).

TRL's CPOTrainer and ORPOTrainer tokenize every pair when they are built (`tokenize_row`) and fit it to `max_length` by
cutting the answers only: a pair whose prompt alone is longer keeps its whole prompt and no answer token. Here they
are tokenized whole and then cut as the other pair methods' pairs are (TRL's newer trainers drop a pair whose prompt
fills `max_length` and keep the first `max_length` tokens of each longer sequence), under the recipe's length
policies, counted in the data summary (finetune.data.pairs.apply_pair_length_policies)."""

from __future__ import annotations

import sys

from finetune.checkpoints.complete import recipe_values
from finetune.data.pairs import SOURCE_COLUMN, apply_pair_length_policies
from finetune.models.loading import hold_trainable_parameters, trainable_dtype
from finetune.models.lora import lora_config
from finetune.train.methods.trl_trainers import trl_refusals
from finetune.train.trainer import (
    FULL_LOGITS_ASKED,
    LIGER_LOSS,
    FinetuneTrainerMixin,
    keep_the_fused_head_under_liger,
    liger_loss_asked,
)

# A tokenized pair's sequences, as TRL's tokenize_row writes them: prompt + answer, whole
SEQUENCES = ("chosen", "rejected")
SEQUENCE_COLUMNS = tuple(f"{sequence}_{part}" for sequence in SEQUENCES
                         for part in ("input_ids", "attention_mask", "labels"))


def reference_free_trainer(trainer_class, trainer_name: str, recipe, model, tokenizer, data, callbacks):
    """The trainer, TRL applying the adapters under LoRA; the pairs it tokenizes go through the length policies,
    completing the data summary."""
    args = recipe.training
    peft_config = lora_config(model, recipe.lora) if recipe.lora.use_lora else None
    with trl_refusals(trainer_name):
        trainer = trainer_class(model=model, args=args, train_dataset=data.train, eval_dataset=data.eval,
                                processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config,
                                recipe_values=recipe_values(recipe), train_data=data.summary["train_fingerprint"],
                                data_args=recipe.data, summary=data.summary)
    # fp32 master weights under mixed precision, whatever dtype the checkpoint was stored in
    hold_trainable_parameters(trainer.model, trainable_dtype(recipe.strategy, args.mixed_precision, args.pure_bf16))
    return trainer


class ReferenceFreePairTrainer(FinetuneTrainerMixin):
    """The toolkit's checkpoints, resume, rotation and saving (`FinetuneTrainerMixin`) for TRL's CPOTrainer and
    ORPOTrainer. With `data_args` and the data's `summary`, the pairs they tokenize are cut and counted under the
    recipe's length policies (`cut_to_max_length`)."""

    def __init__(self, *args, data_args=None, summary: dict | None = None, **kwargs):
        self.data_args, self.data_summary = data_args, summary
        train, evaluation = kwargs.get("train_dataset"), kwargs.get("eval_dataset")
        super().__init__(*args, **kwargs)
        self.full_logits_reason = self._full_logits_reason()
        if self.full_logits_reason is None:  # after TRL applied any adapters: the head is looked up on each call
            from trl.trainer.utils import add_fused_lm_head

            keep_the_fused_head_under_liger(self.args)

            add_fused_lm_head(self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model,
                              outputs=("log_probs", "mean_logits"))
        if data_args is None:
            return
        self.train_dataset = cut_to_max_length(train, self.train_dataset, data_args, "train", summary)
        if evaluation is not None:
            self.eval_dataset = cut_to_max_length(evaluation, self.eval_dataset, data_args, "eval", summary)

    def _full_logits_reason(self) -> str | None:
        """Why the pairs are scored from the full logits (TRL's `concatenated_forward`) rather than the fused head."""
        if not self.args.fused_lm_head:
            return FULL_LOGITS_ASKED
        if liger_loss_asked(self.args):
            return LIGER_LOSS
        if self.is_encoder_decoder:
            return "an encoder-decoder model (the fused head scores a decoder-only model's shifted labels)"
        if self.aux_loss_enabled:
            return "the router's auxiliary loss, which TRL reads from the model's own forward"
        return None

    def concatenated_forward(self, model, batch):
        """TRL's chosen and rejected log-probabilities, NLL term and mean logits from one forward, the tokens scored
        through TRL's fused LM head: the (pairs × 2, sequence, vocabulary) logits and their log-softmax are never
        built. The same values as TRL's path over the full logits, but for the logged `logits/chosen` and
        `logits/rejected`, here the mean over the scored positions (TRL's: over every position, prompt and padding
        included)."""
        if self.full_logits_reason is not None:
            return super().concatenated_forward(model, batch)
        concatenated = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=self.padding(),
                                                device=self.accelerator.device)
        chosen = batch["chosen_labels"].shape[0]
        answers = concatenated["concatenated_labels"]
        scored = self.nll_labels(concatenated)  # the answers, or more (ORPO's NLL reads the prompt too)
        outputs = model(concatenated["concatenated_input_ids"], attention_mask=concatenated[
            "concatenated_attention_mask"], use_cache=False, labels=scored, fused_lm_head=True)
        log_probs = outputs.log_probs
        in_answer = (answers[:, 1:] != -100).to(log_probs.dtype)
        logps = (log_probs * in_answer).sum(-1)
        if self.average_log_prob:
            logps = logps / in_answer.sum(-1)
        in_nll = outputs.label_mask[:chosen]
        nll = -(log_probs[:chosen] * in_nll).sum() / in_nll.sum()
        mean_logits = [outputs.mean_logits[part][outputs.label_mask[part]] for part in (slice(None, chosen),
                                                                                       slice(chosen, None))]
        return logps[:chosen], logps[chosen:], *mean_logits, self.nll_term(nll)

    def padding(self) -> int:
        """The id TRL's `concatenated_forward` pads the concatenated sequences with."""
        return self.pad_token_id

    def nll_labels(self, concatenated: dict):
        """The labels the NLL term is taken over: the answers (CPO); ORPO's override takes every attended token."""
        return concatenated["concatenated_labels"]

    @property
    def average_log_prob(self) -> bool:
        """Whether an answer's log-probability is its per-token mean (TRL's `get_batch_logps(average_log_prob=...)`)."""
        raise NotImplementedError

    def nll_term(self, nll):
        """The NLL term as the trainer's loss adds it."""
        return nll

    def tokenize_row(self, feature, model=None):
        """TRL's tokenized pair, its answers not cut to `max_length` where the length policies cut it afterwards."""
        if self.data_args is None:
            return super().tokenize_row(feature, model)
        limit, self.max_length = self.max_length, sys.maxsize
        try:
            return super().tokenize_row(feature, model)
        finally:
            self.max_length = limit

    def _track_num_input_tokens(self, inputs) -> None:
        """A pair's tokens are its chosen and rejected sequences' (`chosen_input_ids`, ...): Trainer looks for
        `input_ids` and would warn at every step and count none. Counted as `FinetuneTrainerMixin` counts them."""
        mode = self.args.include_num_input_tokens_seen
        if mode == "no":
            return
        if mode == "all":
            tokens = sum(inputs[f"{sequence}_input_ids"].numel() for sequence in SEQUENCES)
        else:
            tokens = sum(inputs[f"{sequence}_attention_mask"].sum() for sequence in SEQUENCES)
        self._tokens_not_summed = getattr(self, "_tokens_not_summed", 0) + tokens

    def _send_telemetry(self):
        """No usage pings: nothing leaves the machine unless the user asks (`report_to`)."""

    def create_model_card(self, *args, **kwargs):
        """TRL writes a README.md model card into every checkpoint; the run's own records say what was trained."""


def prompt_tokens(labels: list[int]) -> int:
    """The tokens before the answer: TRL labels the prompt's -100."""
    return next((position for position, label in enumerate(labels) if label != -100), len(labels))


def cut_to_max_length(pairs, tokenized, data_args, split: str, summary: dict):
    """The whole tokenized pairs as the other pair methods' are cut: a pair whose prompt fills `max_seq_length` has no
    answer token left (dropped, or refused, as `unlabeled_policy` and `overlong_policy` say), a longer one is
    truncated keeping its start, dropped or refused (`overlong_policy`), each counted per source."""
    max_length = data_args.max_seq_length
    answered = tokenized.filter(lambda row: max(prompt_tokens(row[f"{sequence}_labels"])
                                                for sequence in SEQUENCES) < max_length)
    kept = apply_pair_length_policies(pairs, answered, data_args, split, summary, prompt=None,
                                      answers=tuple(f"{sequence}_input_ids" for sequence in SEQUENCES))
    if SOURCE_COLUMN in kept.column_names:
        kept = kept.remove_columns(SOURCE_COLUMN)
    return kept.map(lambda row: {column: row[column][:max_length] for column in SEQUENCE_COLUMNS})
