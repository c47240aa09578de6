"""The data pipeline `finetune train`, `finetune preprocess` and `finetune plan --recipe` share: load → formats →
tokenize and mask → pack, with the fingerprint checkpoints record; or the cache `finetune preprocess` wrote, read on
every rank while its key matches."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from accelerate.utils import gather_object

from finetune.data.cache import cache_dir, load_preprocessed
from finetune.data.collate import pack_prepared, prepare_model_for_packing
from finetune.data.loading import load_raw_data
from finetune.data.summary import fingerprint
from finetune.data.tokenize import PreparedData, prepare_datasets, token_counts
from finetune.errors import RecipeError


def prepare_data(recipe, tokenizer, model) -> PreparedData:
    """Tokenized (and, if asked, packed) data and its summary: read from the cache `finetune preprocess` wrote when
    its key matches (finetune.data.cache), else tokenized here."""
    from finetune.models.vision import processor_of

    args = recipe.training
    if processor_of(tokenizer) is not None:  # before the packing preparation and the stream below
        from finetune.data.vision.pipeline import check_vision_data_options

        check_vision_data_options(recipe.data)
    if recipe.data.packing or recipe.data.padding_free:
        prepare_model_for_packing(model)
    if recipe.data.streaming:  # tokenized as it is read (finetune.data.streaming)
        from finetune.data.streaming import prepare_stream

        data = prepare_stream(recipe, tokenizer)
        check_chat_template_is_used(recipe.model, data.summary)
        return data
    data = read_preprocessed(recipe, tokenizer) or tokenize_data(recipe, tokenizer)
    check_chat_template_is_used(recipe.model, data.summary)
    # Which ranks read tokenized data (the preprocessed cache, or the `datasets` cache rank 0 wrote under
    # main_process_first) instead of tokenizing.
    from_cache = "preprocessed" in data.summary or all(source["train"]["from_cache"]
                                                       for source in data.summary["sources"])
    data.summary["train_from_cache_by_rank"] = gather_object([from_cache]) if args.world_size > 1 else [from_cache]
    return data


def check_chat_template_is_used(model_args, summary: dict) -> None:
    """A recipe's `chat_template` with prompt/completion sources is refused by name. A string prompt and completion
    are TRL's standard (not conversational) format, which TRL trains as plain text without the template, and so does
    finetune.data.tokenize; chat, eval and serve then send such a run raw prompts too (trained_as_plain_text). The
    template would be saved and recorded yet never seen by the model, whereas a recipe that names one expects its
    examples rendered through it: saying so lets the user choose `messages` data or no template."""
    from finetune.models.loading import chat_template_text

    if not getattr(model_args, "chat_template", None) or chat_template_text(model_args.chat_template) is None:
        return
    plain = [source["name"] for source in summary.get("sources", []) if source.get("format") == "prompt_completion"]
    if plain:
        raise RecipeError(f"`chat_template` is set, but {plain[0]} holds prompt/completion strings, which train as "
                          "plain text (TRL's standard format) without the template: it would be saved with the model "
                          "and never used. Write the examples as `messages` (a user and an assistant turn) to train "
                          "through the template, or drop `chat_template`.")


def tokenize_data(recipe, tokenizer) -> PreparedData:
    """The data pipeline, load → tokenize → pack, and the fingerprint checkpoints record (resumes compare it);
    `finetune preprocess` runs this same function ahead of a launch."""
    data = prepare_datasets(load_raw_data(recipe.data), tokenizer, recipe.data, recipe.training)
    if recipe.data.packing:
        data = pack_prepared(data, recipe.data.max_seq_length, recipe.data.packing_strategy)
    data.summary["train_fingerprint"] = fingerprint(data.train)
    return data


def read_preprocessed(recipe, tokenizer) -> PreparedData | None:
    """The cache `finetune preprocess` wrote, memory-mapped on every rank, when its key matches on every rank (were
    one rank to tokenize alone, under main_process_first, the others would wait for it at a barrier); rank 0 says
    which data it reads, or why it tokenizes instead."""
    args = recipe.training
    directory = cache_dir(recipe.data, args.output_dir)
    data, why_not = load_preprocessed(directory, recipe.data, tokenizer, args.seed)
    if data is None and not why_not and recipe.data.preprocessed_dir is not None:
        why_not = f"`preprocessed_dir: {directory}` holds no preprocessed data (`finetune preprocess` writes it)"
    ranks = gather_object([(data is not None, why_not)]) if args.world_size > 1 else [(data is not None, why_not)]
    reasons = [f"{f'rank {rank}: ' if args.world_size > 1 else ''}{why}" for rank, (_, why) in enumerate(ranks) if why]
    if not all(usable for usable, _ in ranks):
        data = None
    if args.process_index == 0 and data is not None:
        print(f"reading the preprocessed data in {directory} (key {data.summary['preprocessed']['key']}) on every "
              "rank: no tokenizing")
    elif args.process_index == 0 and reasons:
        print(f"warning: {reasons[0]}; tokenizing as usual (`finetune preprocess` with this recipe refreshes it)")
    return data


@dataclass(frozen=True)
class _OneProcess:
    """What `prepare_datasets` asks of `TrainingArguments`, for a planner that starts no process group."""

    seed: int

    def main_process_first(self, desc: str = ""):
        return nullcontext()


def example_lengths(sections) -> tuple[tuple[int, ...], dict]:
    """Token count of every training row after the data policies (truncation, drops) and packing, and the data
    summary `finetune train` writes (`data_summary.json`)."""
    from finetune.models.loading import load_tokenizer

    tokenizer = load_tokenizer(sections.model)
    seed = int(sections.training_inputs.get("seed") or 42)
    if sections.data.streaming:  # a stream's first rows stand for it (finetune.data.streaming)
        from finetune.data.loading import RawData, Source
        from finetune.data.streaming import sample_of

        raw = RawData([Source(sections.data.train_file or sections.data.dataset, sample_of(sections.data))])
    else:
        raw = load_raw_data(sections.data)
    data = prepare_datasets(raw, tokenizer, sections.data, _OneProcess(seed))
    if sections.data.packing:
        data = pack_prepared(data, sections.data.max_seq_length, sections.data.packing_strategy)
    return tuple(int(length) for length in token_counts(data.train)), data.summary
