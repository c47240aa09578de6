"""Tokenization with completion-only labels, the over-long and answer-less policies, and the data summary.

Conversations: each assistant turn is rendered with the tokenizer's own chat template (tools passed as
`apply_chat_template(..., tools=...)`), and its learned tokens start where the conversation rendered up to the turn
stops agreeing with the prompt rendered with `add_generation_prompt`: not at the generation prompt's length, which
is wrong for templates whose generation prompt is not a prefix of the rendered turn (reasoning templates open the
answer with `<think>`; tokens the prompt supplies at inference are not the model's to learn). They end at the last
special token of the turn (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, EOS), so the model learns to stop
(`turn_end_ids`: what generation stops at). A conversation is rendered and tokenized once and each turn found in
that text (`_spans_from_one_render`, linear in the turns), which gives those same spans; a template whose turns it
cannot find that way is rendered turn by turn. Each span is verified (it holds the answer, or the tool calls, and ends
with that token) and a template it cannot align is refused by name instead of trained on shifted labels. Tool
results, the tool list and user turns are not learned. Prompt/completion pairs learn the completion and EOS; plain
text learns every token. `finetune labels` shows what is learned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import Dataset, concatenate_datasets
from jinja2.exceptions import TemplateError

from finetune import presets
from finetune.data.formats import CONVERSATION_FORMATS, detect_format, to_messages, to_tools, tool_name
from finetune.errors import RecipeError

IGNORE_INDEX = -100
TOOLS_FIX = ("use a model whose chat template supports tools (Qwen2.5, Llama-3.1, Mistral v0.3 and later, ...), or "
             "`tokenizer_name_or_path` naming a tokenizer whose template does")


def template_name(tokenizer) -> str:
    """How errors name the template at fault: by the tokenizer's `name_or_path`."""
    name = f"`{tokenizer.name_or_path}`" if tokenizer.name_or_path else f"this {type(tokenizer).__name__}"
    default = " (the default template given to tokenizers without one)" if (
        tokenizer.chat_template == presets.CHAT_TEMPLATE) else ""
    return f"the chat template of {name}{default}"


def _render(tokenizer, messages, tools=None, add_generation_prompt=False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except (TemplateError, TypeError) as error:
        hint = ""
        if uses_tools(messages, tools):
            hint = f" (the conversation has tool calls or results, which it may not support: {TOOLS_FIX})"
        raise RecipeError(f"{template_name(tokenizer)} cannot render the conversation: {error}{hint}.") from None


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether a conversation lists tools, calls one or carries a result."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def _token_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # templates write BOS themselves


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _special_ids(tokenizer) -> set[int]:
    """Ids that can close a turn: the special tokens (EOS, `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...)."""
    added = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)


def encode_conversation(messages: list[dict], tokenizer, tools: list[dict] | None = None
                        ) -> tuple[list[int], list[int]]:
    """`(input_ids, labels)` of a whole conversation, every assistant turn labelled (its answer or tool calls and
    the token that ends it)."""
    text = _render(tokenizer, messages, tools)
    missing = [tool_name(tool) for tool in tools or [] if tool_name(tool) not in text]
    if missing:
        raise RecipeError(f"{template_name(tokenizer)} does not render the `tools` list (`{missing[0]}` is missing "
                          f"from the rendered conversation): it has no tool support; {TOOLS_FIX}.")
    special_ids = _special_ids(tokenizer)
    input_ids, spans = _spans_from_one_render(messages, text, tokenizer, tools, special_ids)
    if spans is None:  # turn by turn: each assistant turn rendered as the last, and its generation prompt
        input_ids, spans = _token_ids(tokenizer, text), []
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                spans.append(_assistant_span(messages, index, tokenizer, tools, input_ids, special_ids))
        if None in spans:  # an earlier turn renders differently once the conversation goes on (Qwen3's <think>)
            found = _spans_in_whole_render(messages, text, tokenizer)
            spans = [span if span is not None else found[turn] for turn, span in enumerate(spans)]
    labels = [IGNORE_INDEX] * len(input_ids)
    answers = [message for message in messages if message["role"] == "assistant"]
    for (start, end), message in zip(spans, answers):
        if message["content"].strip() or message.get("tool_calls"):  # an empty answer teaches only to stop: not learned
            labels[start:end] = input_ids[start:end]
    return input_ids, labels


# The generation prompt each chat template appends (`<|im_start|>assistant\n`), as last read off a conversation
# (with tools or without: a tokenizer may keep a template for each).
_GENERATION_PROMPTS: dict[tuple[str, bool], str] = {}


def _spans_from_one_render(messages, text: str, tokenizer, tools, special_ids
                           ) -> tuple[list[int] | None, list[tuple[int, int]] | None]:
    """`(input_ids, spans)` of a conversation from its one rendering, tokenized once: linear in its turns, where
    rendering and tokenizing each assistant turn as the last costs the square of them. The template's generation
    prompt and the text closing an assistant turn are read off the last assistant turn (the conversation rendered up
    to it with the generation prompt, a prefix of the whole, which ends with the generation prompt the template
    appended to an earlier conversation or, read afresh, to this one without it); every assistant turn is then found
    in the text after the previous one: the generation prompt, the answer right after it, the closing text right after
    the answer (or after the tool calls, which must all be there), mapped to tokens through the tokenizer's character
    offsets. Each turn's learned tokens are then those the turn-by-turn rendering learns: from where the generation
    prompt ends to the special token that closes the turn. `(None, None)` wherever any of it does not hold (a slow
    tokenizer, no generation prompt, a turn rendered otherwise): the caller renders turn by turn."""
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns or not tokenizer.is_fast:
        return None, None
    last = turns[-1]
    prompt = _render(tokenizer, messages[:last], tools, add_generation_prompt=True)
    template = (str(tokenizer.chat_template), bool(tools))
    header = _GENERATION_PROMPTS.get(template)
    if header is None or not prompt.endswith(header):
        before = _render(tokenizer, messages[:last], tools)
        header = prompt[len(before):]
        if not (header.strip() and prompt.startswith(before)):
            return None, None
        _GENERATION_PROMPTS[template] = header
    upto = text if last + 1 == len(messages) else _render(tokenizer, messages[: last + 1], tools)
    if not (text.startswith(prompt) and text.startswith(upto)):
        return None, None
    encoded = tokenizer(text, add_special_tokens=False)
    input_ids, token_at = encoded["input_ids"], encoded.char_to_token  # the token holding a character, or None
    first, closing = token_at(len(prompt)), token_at(len(upto) - 1)
    if first is None or closing is None:
        return None, None
    closing = next((i for i in range(closing, first - 1, -1) if input_ids[i] in special_ids), None)
    if closing is None:
        return None, None
    span = encoded.token_to_chars(closing)
    closer = text[span.start:span.end]  # `<|im_end|>`, `<|eot_id|>`, ...
    spans, cursor = [], 0
    for index in turns:
        message = messages[index]
        found = text.find(header, cursor)
        if found < 0:
            return None, None
        start_char = found + len(header)
        content = message["content"].strip()
        if content and not text.startswith(content, start_char):
            return None, None
        after = start_char + len(content)
        closed = text.find(closer, after)
        between = text[after:closed]
        calls = [call["function"]["name"] for call in message.get("tool_calls") or []]
        if closed < 0 or (between.strip() if not calls else header in between or
                          not all(name in between for name in calls)):
            return None, None
        cursor = closed + len(closer)
        start, end = token_at(start_char), token_at(cursor - 1)  # from the token reaching past the prompt...
        if start is None or end is None or index == last and start_char != len(prompt) \
                or input_ids[end] not in special_ids:
            return None, None
        spans.append((start, end + 1))  # ...to the closing token, kept
    return input_ids, spans


# A two-turn conversation whose assistant turns show the tokens a template closes them with.
TURN_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye"}]


def turn_end_ids(tokenizer) -> list[int]:
    """The tokens that close an assistant turn in the tokenizer's chat template (`<|im_end|>`, `<|eot_id|>`,
    `<end_of_turn>`, EOS, ...): the last learned token of each turn of a probe conversation, found exactly as
    training labels it, so generation stops where the model learned to. A base model's EOS (`<|endoftext|>`) is
    often not among them."""
    input_ids, labels = encode_conversation(TURN_PROBE, tokenizer)
    return sorted({input_ids[i] for i, label in enumerate(labels)
                   if label != IGNORE_INDEX and (i + 1 == len(labels) or labels[i + 1] == IGNORE_INDEX)})


def _spans_in_whole_render(messages, text: str, tokenizer) -> list[tuple[int, int]]:
    """Assistant spans found in the rendered conversation itself, for the turns a template renders one way while they
    are the last and another once the conversation goes on (Qwen3 writes an empty `<think></think>` before the latest
    answers only; the latest turn renders as itself and is found by rendering). Every message's text is looked up in
    order, and an assistant span runs from its answer's first character to the special token that closes it, mapped
    to tokens through the tokenizer's character offsets. Tool calls, which a template writes in a form of its own,
    cannot be found this way and are refused."""
    unfindable = RecipeError(
        f"{template_name(tokenizer)} does not render a conversation as a prefix of its continuation, and the answers "
        "cannot be found in the rendered text, so assistant tokens cannot be located; use a template that renders "
        "earlier turns as it rendered them (`chat_template` in tokenizer_config.json).")
    if not tokenizer.is_fast or any(m.get("tool_calls") for m in messages):
        raise unfindable
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    closers = [token for token in tokenizer.all_special_tokens + [t.content for t in
               tokenizer.added_tokens_decoder.values() if t.special] if token]
    spans, cursor = [], 0
    for message in messages:
        content = message["content"].strip()
        found = text.find(content, cursor) if content else -1
        if found < 0:
            if message["role"] == "assistant" and content:
                raise unfindable
            if message["role"] == "assistant":
                spans.append((0, 0))  # an empty answer: not learned (encode_conversation)
            continue  # a template may fold a system prompt elsewhere, or drop it
        cursor = found + len(content)
        if message["role"] != "assistant":
            continue
        closes = [(position, token) for token in closers if (position := text.find(token, cursor)) >= 0]
        if not closes:
            raise unfindable
        position, token = min(closes)
        start_char, cursor = found, position + len(token)
        start = next(i for i, (_, end) in enumerate(offsets) if end > start_char)
        end = max(i for i, (begin, _) in enumerate(offsets) if begin < cursor) + 1
        spans.append((start, end))
    return spans


def _assistant_span(messages, index, tokenizer, tools, input_ids, special_ids) -> tuple[int, int] | None:
    """`[start, end)` of assistant turn `index`'s learned tokens in `input_ids`, verified; None where the turn
    rendered as the last differs from the same turn inside the whole conversation."""
    upto = _token_ids(tokenizer, _render(tokenizer, messages[: index + 1], tools))
    if upto != input_ids[: len(upto)]:
        return None
    prompt = _render(tokenizer, messages[:index], tools, add_generation_prompt=True)
    prompt_ids = _token_ids(tokenizer, prompt)
    start = next((i for i, (a, b) in enumerate(zip(prompt_ids, upto)) if a != b), min(len(prompt_ids), len(upto)))
    end = next((i + 1 for i in range(len(upto) - 1, start - 1, -1) if upto[i] in special_ids), None)
    turn = f"assistant turn {sum(m['role'] == 'assistant' for m in messages[:index]) + 1}"
    if end is None:
        raise RecipeError(
            f"{template_name(tokenizer)} ends {turn} ({_decode(tokenizer, upto[start:])!r:.120}) without a special "
            "token such as EOS, so the model would never learn to stop; use a template that closes each assistant "
            "turn with `{{ eos_token }}` or an end-of-turn token (`chat_template` in tokenizer_config.json)."
        )
    _check_learned(messages[index], _decode(tokenizer, upto[start : end - 1]), prompt, tokenizer, turn)
    return start, end


def _collapsed(text: str) -> str:
    return " ".join(text.split())  # templates trim or re-space an answer's edges (Llama-3, Gemma `| trim`)


def _check_learned(message: dict, learned: str, prompt: str, tokenizer, turn: str) -> None:
    """The span learns the answer: all of it, or all but an opening the generation prompt itself writes (a
    reasoning template's `<think>`); and every tool call, by its function name. A span shifted into the answer
    (labels counted from a generation prompt longer than the shared header) leaves out words no prompt writes."""
    content, learned = _collapsed(message["content"]), _collapsed(learned)
    supplied = content[: len(content) - len(learned)].strip() if learned and content.endswith(learned) else None
    if content not in learned and not (supplied is not None and _collapsed(prompt).endswith(supplied)):
        raise RecipeError(
            f"{template_name(tokenizer)}: the tokens found for {turn} ({learned!r:.120}) do not hold its answer "
            f"({content!r:.120}); the template renders the turn in a way its generation prompt does not line up "
            "with, and training on shifted labels is refused; use a template whose generation prompt opens the "
            "rendered assistant turn (`chat_template` in tokenizer_config.json, or `tokenizer_name_or_path`)."
        )
    for call in message.get("tool_calls") or []:
        if call["function"]["name"] not in learned:
            raise RecipeError(
                f"{template_name(tokenizer)} does not render tool calls (the call to `{call['function']['name']}` "
                f"in {turn} is missing from the rendered turn {learned!r:.120}); {TOOLS_FIX}."
            )


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _text(value, what: str) -> str:
    """A text field; numbers (as CSV and Parquet readers type "7") are their text, anything else is an error."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise RecipeError(f"{what} has no text ({value!r}).")


def encode_example(example: dict, dataset_format: str, tokenizer) -> tuple[list[int], list[int]]:
    """`(input_ids, labels)` of one example, before truncation."""
    if dataset_format in CONVERSATION_FORMATS:
        messages = [{**m, "content": _text(m["content"], f"a {m['role']} turn")}
                    for m in to_messages(example, dataset_format)]
        return encode_conversation(messages, tokenizer, tools=to_tools(example))
    if dataset_format == "prompt_completion":
        prompt_ids = tokenizer(_text(example["prompt"], "`prompt`"))["input_ids"]
        completion = _text(example["completion"], "`completion`")
        completion_ids = _with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer)
        return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    if dataset_format == "text":
        input_ids = _with_eos(tokenizer(_text(example["text"], "`text`"))["input_ids"], tokenizer)
        return input_ids, list(input_ids)
    raise RecipeError(f"unknown dataset format `{dataset_format}`.")


def encode_messages(messages: list[dict], tokenizer, max_seq_length: int,
                    tools: list[dict] | None = None) -> dict[str, list[int]]:
    """`input_ids`, `attention_mask` and `labels` for one conversation, truncated to `max_seq_length`."""
    input_ids, labels = encode_conversation(messages, tokenizer, tools)
    input_ids, labels = input_ids[:max_seq_length], labels[:max_seq_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def splits_overlong(data_args) -> bool:
    """Whether packing cuts an over-long example into row-long pieces (`packing_strategy: bfd_split`) instead of
    `overlong_policy` truncating, dropping or refusing it."""
    return bool(getattr(data_args, "packing", False)) and getattr(data_args, "packing_strategy", "bfd") == "bfd_split"


def apply_length_policies(input_ids: list[int], labels: list[int], data_args, where: str
                          ) -> tuple[list[int], list[int], str]:
    """The example as training sees it under `overlong_policy` and `unlabeled_policy`: `(input_ids, labels,
    drop)`, `drop` the reason it is left out (`overlong`, `no_answer_tokens`) or empty; `where` names it in errors."""
    max_length, length, drop = data_args.max_seq_length, len(input_ids), ""
    if length > max_length and not splits_overlong(data_args):
        if data_args.overlong_policy == "error":
            raise RecipeError(f"{where} has {length} tokens, more than `max_seq_length: {max_length}` "
                              f"(`overlong_policy: error`; or truncate, drop).")
        drop = "overlong" if data_args.overlong_policy == "drop" else ""
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    if not drop and all(label == IGNORE_INDEX for label in labels):
        if data_args.unlabeled_policy == "error":
            raise RecipeError(f"{where} has no answer token left after truncation to `max_seq_length: {max_length}` "
                              f"(`unlabeled_policy: error`; or drop).")
        drop = "no_answer_tokens"  # its loss would be 0/0
    return input_ids, labels, drop


@dataclass
class PreparedData:
    train: Dataset
    eval: Dataset | None
    # Raw eval conversations for generation: prompt messages, reference answer and task name.
    generation_examples: list[dict]
    # Per split: rows, tokens, labelled tokens, length percentiles, truncated and dropped rows (data_summary.json).
    summary: dict


class Encoder:
    """One raw example (and its index) → its tokens, labels, length before the policies and why it is dropped (or
    ""): what `datasets.map` runs over a split, or over a stream as it is read."""

    def __init__(self, name: str, tokenizer, data_args, dataset_format: str):
        self.name, self.tokenizer, self.data_args, self.dataset_format = name, tokenizer, data_args, dataset_format

    def __call__(self, example: dict, index: int) -> dict:
        where = f"{self.name} example {index + 1}"
        try:
            input_ids, labels = encode_example(example, self.dataset_format, self.tokenizer)
        except RecipeError as error:
            raise RecipeError(f"{where}: {error}") from None
        length = len(input_ids)
        input_ids, labels, drop = apply_length_policies(input_ids, labels, self.data_args, where)
        return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels,
                "original_length": length, "drop": drop,
                "labelled": sum(label != IGNORE_INDEX for label in labels)}


# The columns `Encoder` adds that training does not read.
ENCODER_RECORDS = ["original_length", "drop", "labelled"]


def column(dataset: Dataset, name: str) -> np.ndarray:
    """One column as a numpy array, read through Arrow: `dataset[name]` is a lazy column that numpy would walk row by
    row in Python (minutes for a million rows)."""
    return dataset.with_format("arrow")[name].to_numpy(zero_copy_only=False)


def token_counts(dataset: Dataset, name: str = "input_ids") -> np.ndarray:
    """The length of each row's token list, counted by Arrow."""
    import pyarrow.compute

    return pyarrow.compute.list_value_length(dataset.with_format("arrow")[name]).to_numpy(zero_copy_only=False)


def _tokenize_split(split: Dataset, name: str, tokenizer, data_args, dataset_format: str,
                    encode=None) -> tuple[Dataset, dict]:
    """`encode`: what `datasets.map` runs over each row (default: the text path's `Encoder`)."""
    max_length = data_args.max_seq_length
    encode = encode or Encoder(name, tokenizer, data_args, dataset_format)
    started = time.time()
    num_proc = getattr(data_args, "dataset_num_proc", None)
    num_proc = num_proc if (num_proc or 1) > 1 else None
    encoded = split.map(encode, with_indices=True, remove_columns=split.column_names, desc=f"tokenizing {name}",
                        num_proc=min(num_proc, len(split)) if num_proc else None)
    # Another rank (or an earlier run) wrote the cache file this map read: it did not tokenize again.
    from_cache = bool(encoded.cache_files) and Path(encoded.cache_files[0]["filename"]).stat().st_mtime < started
    lengths, reasons, labelled = (column(encoded, name) for name in ("original_length", "drop", "labelled"))
    is_kept = reasons == ""
    kept = encoded.filter(lambda drop: drop == "", input_columns="drop")
    images = column(encoded, "image_tokens")[is_kept] if "image_tokens" in encoded.column_names else None
    kept = kept.remove_columns([name for name in (*ENCODER_RECORDS, "image_tokens") if name in kept.column_names])
    kept_lengths = lengths[is_kept] if splits_overlong(data_args) else np.minimum(lengths[is_kept], max_length)
    summary = {
        "rows": len(split),
        "rows_kept": len(kept),
        "tokens": int(kept_lengths.sum()),
        "labelled_tokens": int(labelled[is_kept].sum()),
        "length_percentiles": {f"p{q}": int(np.percentile(lengths, q)) for q in (50, 90, 99)}
        | {"max": int(lengths.max())},
        "truncated_rows": int(((lengths > max_length) & is_kept).sum())
        if data_args.overlong_policy == "truncate" and not splits_overlong(data_args) else 0,
        **({"split_rows": int(((lengths > max_length) & is_kept).sum())} if splits_overlong(data_args) else {}),
        "dropped": {reason: int(count) for reason in ("overlong", "no_answer_tokens")
                    if (count := (reasons == reason).sum())},
        "from_cache": from_cache,
    }
    if images is not None and len(images):  # rows with images: their image tokens (finetune.data.vision.pipeline)
        summary["image_tokens"] = {"total": int(images.sum()), "max_per_row": int(images.max()),
                                   "p50": int(np.percentile(images, 50))}
    return kept, summary


def generation_examples(split: Dataset, dataset_format: str, limit: int) -> list[dict]:
    """The first `limit` eval conversations cut before their last assistant turn, for exact-match generation; those
    with tools are left out (the answer is a call, and generation renders prompts without the tool list). `limit`
    counts examples, so the first N of a longer list are the N a smaller limit gives (the preprocessed cache keeps
    them all)."""
    if dataset_format not in CONVERSATION_FORMATS:
        return []
    examples = []
    for example in split:
        if len(examples) >= limit:
            break
        messages = to_messages(example, dataset_format)
        answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if answers and not uses_tools(messages, to_tools(example)):
            examples.append({"prompt": messages[: answers[-1]], "reference": messages[answers[-1]]["content"],
                             "task": example.get("task") or "all"})
    return examples


def prepare_datasets(raw, tokenizer, data_args, training_args) -> PreparedData:
    """Tokenizes each source once (rank 0 first; the other ranks then read the `datasets` cache it wrote),
    mixes the training sources by weight and concatenates their eval splits. A vision-language model's tokenizer
    carries its processor (finetune.models.vision.processor_of): its rows are read with their images and encoded by the
    processor (finetune.data.vision.pipeline)."""
    from finetune.models.vision import processor_of

    processor = processor_of(tokenizer)
    trains, evals, examples, sources = [], [], [], []
    with training_args.main_process_first(desc="tokenizing the dataset"):
        for source in raw.sources:
            dataset_format = detect_format(source.train.column_names, source.declared_format(data_args))
            encoders = _vision_encoders(processor, source, data_args) if processor is not None else {}
            train, train_summary = _tokenize_split(source.train, "train", tokenizer, data_args, dataset_format,
                                                   encoders.get("train"))
            record = {"name": source.name, "format": dataset_format, "train": train_summary, "eval": None}
            trains.append(train)
            if source.eval is not None:
                detect_format(source.eval.column_names, dataset_format)  # the eval split must have the same columns
                eval_split = source.splits(data_args.max_eval_samples)["eval"]
                evaluation, record["eval"] = _tokenize_split(eval_split, "eval", tokenizer, data_args, dataset_format,
                                                             encoders.get("eval"))
                evals.append(evaluation)
                wanted = data_args.generation_eval_samples - len(examples)
                if wanted > 0 and processor is not None:
                    from finetune.data.vision.pipeline import vision_generation_examples

                    examples += vision_generation_examples(eval_split, encoders["eval"].data_dir, wanted)
                elif wanted > 0:
                    examples += generation_examples(eval_split, dataset_format, wanted)
            sources.append(record)
    for record, train in zip(sources, trains):
        if len(train) == 0:
            raise RecipeError(f"no training example of {record['name']} is left after the data policies "
                              f"({record['train']['dropped']}); raise `max_seq_length: {data_args.max_seq_length}` "
                              f"or check the data.")
    train = raw.mixed(trains, training_args.seed)
    evaluation = (concatenate_datasets(evals) if len(evals) > 1 else evals[0]) if evals else None
    summary = {"sources": sources, "weights": raw.weights, "train_rows": len(train),
               "eval_rows": len(evaluation) if evaluation is not None else 0}
    return PreparedData(train, evaluation, examples, summary)


def _vision_encoders(processor, source, data_args) -> dict:
    """The row encoders of a source with images, by split: image paths are relative to each split's data file."""
    from finetune.data.vision.pipeline import VisionEncoder, check_vision_data_options, data_dir_of

    check_vision_data_options(data_args)
    train_dir = data_dir_of(source.name)
    eval_dir = data_dir_of(data_args.eval_file) if data_args.eval_file else train_dir
    return {"train": VisionEncoder("train", processor, data_args, train_dir),
            "eval": VisionEncoder("eval", processor, data_args, eval_dir)}
