"""A trained model as its run left it, for what comes after training (`finetune chat`, `eval`, `serve`, `export
--gguf`): the weights as `finetune export` loads them, the tokenizer with the chat template training used, and whether
the run learned its prompts as plain text.

`load_with_tokenizer` reads any run folder, checkpoint-N (ZeRO or FSDP shards consolidated) or LoRA run; the records
(`data_summary.json`) are found beside the model, in its run's folder, or in the run an export came from."""

from __future__ import annotations

import json
from pathlib import Path


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """The conversation as the model sees it: the chat template with the generation prompt, as `generate_answers`
    (finetune.train.evaluation) renders eval prompts and training renders the turns before each answer."""
    from jinja2.exceptions import TemplateError

    from finetune.data.tokenize import template_name
    from finetune.errors import RecipeError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (TemplateError, TypeError) as error:
        fix = " (leave out --system: it may not take a system turn)" if messages[0]["role"] == "system" else ""
        raise RecipeError(f"{template_name(tokenizer)} cannot render the conversation: {error}{fix}.") from None


def run_folders(checkpoint: str) -> list[Path]:
    """Where the records of the run a model comes from may be: its folder, the run's when it is a checkpoint-N, and
    for a `finetune export`, the same of the folder it was exported from."""
    from finetune import outputs
    from finetune.checkpoints.complete import CHECKPOINT_NAME
    from finetune.checkpoints.export import EXPORT_RECORD

    source = Path(checkpoint)
    export = outputs.read_record(source, EXPORT_RECORD, missing=None)
    exported_from = [Path(export["source"])] if isinstance(export, dict) and export.get("source") else []
    return [folder for model in (source, *exported_from)
            for folder in ((model, model.parent) if CHECKPOINT_NAME.match(model.name) else (model,))]


def plain_text_format(checkpoint: str, system: str | None = None) -> str | None:
    """The data format(s) a run learned when none was a conversation (`prompt_completion`, `text`: trained without a
    chat template, finetune.data.tokenize.encode_example), read from its data_summary.json (`run_folders`); None for
    a run that learned a template's turns, and for a model without that record (a hub model), which get the
    template. A system turn is refused for plain-text runs: they have none."""
    from finetune import outputs
    from finetune.data.summary import trained_as_plain_text
    from finetune.errors import RecipeError

    for folder in run_folders(checkpoint):
        summary = outputs.read_record(folder, outputs.DATA_SUMMARY, missing=None)
        if summary is None:
            continue
        if not trained_as_plain_text(summary):
            return None
        formats = {source.get("format") for source in summary["sources"]}
        trained_on = " and ".join(sorted(formats))
        if system:
            raise RecipeError(f"--system: {checkpoint} was trained on {trained_on} data, without a chat template, so "
                              "it knows no system turn; leave out --system and write the instructions in the prompt.")
        return trained_on
    return None


def check_generates(model, source: Path) -> None:
    """Refuses a scorer (a reward model or classifier, `...ForSequenceClassification`, what `method: reward` trains):
    it has a head that scores a text, no language-model head to write one, and no generation config."""
    from finetune.errors import RecipeError

    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        raise RecipeError(f"{source} is a reward model ({name}, a reward model or classifier): it scores text, it does "
                          f"not generate, so it cannot chat, be evaluated on answers or be served. Use it to score a "
                          f"GRPO run's completions (`reward_funcs: [{source}]`), or `finetune export` it as "
                          "safetensors.")


def load_with_tokenizer(source: str | Path, merge_lora: bool = False, base_model: str | None = None,
                        seed: int | None = None):
    """`(model, tokenizer)` for `source` in memory (what `finetune chat` talks to): the model as `load_for_export`
    loads it (an adapter not merged stays a peft model), and the tokenizer saved beside it, else its base's
    (`base_model`, or the one the adapter names), through `models.load_tokenizer` as training loaded it: a tokenizer
    without a chat template gets the default one training gave it."""
    from finetune.checkpoints.export import beside, load_for_export
    from finetune.errors import RecipeError
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.args import ModelArguments

    source = Path(source)
    model, _ = load_for_export(source, merge_lora, base_model, seed)
    check_generates(model, source)
    saved, adapter = beside(source, "tokenizer_config.json"), beside(source, "adapter_config.json")
    name = str(saved.parent) if saved is not None else base_model or (
        adapter is not None and json.loads(adapter.read_text()).get("base_model_name_or_path"))
    if not name:
        raise RecipeError(f"{source} has no tokenizer (no tokenizer_config.json there, nor in {source.parent}): copy "
                          "the tokenizer files of the model it was trained from next to the weights.")
    return model, load_tokenizer(ModelArguments(model_name_or_path=name))
