"""`finetune chat OUTPUT_DIR|CHECKPOINT [--prompt TEXT]`: talk to a fine-tuned model, one prompt or a conversation
read from stdin (what `llamafactory-cli chat` and torchtune's generate recipe do).

The model and tokenizer are loaded as `finetune export` loads them (`load_with_tokenizer`: full weights, ZeRO or FSDP
shards consolidated, a LoRA adapter on its base, merged or not). Each prompt is given as the run was trained: rendered
with the tokenizer's chat template and `add_generation_prompt` as training and evaluation render it, or, for a run
whose data summary says it learned plain text only (prompt/completion pairs, text), as plain text, each turn on its
own. The answer stops at any token that ended an answer in training (the template's end of turn as well as EOS:
`finetune.train.evaluation.stop_token_ids`), so it never holds a turn the model goes on to invent, and streams to
stdout token by token (Transformers' `TextStreamer`); notes go to stderr, so stdout holds the answers alone.
"""

from __future__ import annotations

import contextlib
import sys

COMMANDS_HELP = "/reset clears the conversation, /exit or Ctrl-D ends it; end a line with \\ to go on on the next"


def chat_command_parser(subparsers) -> None:
    from finetune.commands.model_source import add_model_source_arguments

    parser = subparsers.add_parser(
        "chat", help="talk to a trained model: one prompt, or a conversation on stdin",
        description="Load a run's output_dir or one of its checkpoint-N folders (full weights, DeepSpeed ZeRO or FSDP "
        "shards, a LoRA adapter on its base) and answer with the tokenizer's chat template, greedily unless "
        f"--temperature or --top-p asks to sample (a run trained on prompt/completion or text data gets its prompts as "
        f"plain text, each on its own). Without --prompt, turns are read from stdin: {COMMANDS_HELP}.",
    )
    add_model_source_arguments(parser, merge_lora_help="merge the LoRA adapter into its base before generating "
                               "(default: generate through peft)", seed_help="seed that built the `tiny` base "
                               "(default: the one the run recorded), and of sampling (default 0)")
    parser.add_argument("--prompt", help="answer this one user turn and exit (default: read turns from stdin)")
    parser.add_argument("--image", action="append", metavar="PATH",
                        help="an image shown with the first prompt (a vision-language model's run; repeat for more)")
    parser.add_argument("--system", help="a system turn that opens the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest answer in tokens (default 256)")
    parser.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy decoding)")
    parser.add_argument("--top-p", type=float, help="sample from the most likely tokens holding this probability "
                        "(nucleus sampling; default: greedy decoding)")
    parser.add_argument("--show-prompt", action="store_true",
                        help="print each prompt to stderr as the model gets it: rendered by the chat template, history "
                        "included, or plain text for a run trained on prompt/completion or text data")
    parser.set_defaults(func=chat_command)


def generation_settings(max_new_tokens: int, temperature: float | None, top_p: float | None) -> dict:
    """`generate` keyword arguments: greedy decoding unless a temperature or a top-p asks to sample (the other then
    left at 1, neutral); what is not named here comes from the model's generation config (EOS, top_k)."""
    from finetune.errors import RecipeError

    if max_new_tokens < 1:
        raise RecipeError(f"--max-new-tokens {max_new_tokens}: give 1 or more.")
    if temperature is not None and temperature <= 0:
        raise RecipeError(f"--temperature {temperature}: give a value above 0, or leave it out for greedy decoding.")
    if top_p is not None and not 0 < top_p <= 1:
        raise RecipeError(f"--top-p {top_p}: give a value in (0, 1], or leave it out for greedy decoding.")
    if temperature is None and top_p is None:
        # None, not the model's own sampling values, which greedy decoding would ignore with a warning
        return {"max_new_tokens": max_new_tokens, "do_sample": False, "temperature": None, "top_p": None,
                "top_k": None}
    return {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": temperature or 1.0,
            "top_p": top_p or 1.0}


class Conversation:
    """The turns so far (after an optional system turn), answered one user turn at a time by `model`, the answer
    streamed to stdout as it is generated. A run trained on plain text (`plain_text_format`) gets each prompt as
    plain text and on its own, as it learned: a history would be text it never saw."""

    def __init__(self, model, tokenizer, generation: dict, system: str | None = None, show_prompt: bool = False,
                 plain_text_format: str | None = None, images: list | None = None):
        from finetune.models.vision import processor_of
        from finetune.train.evaluation import stop_token_ids

        self.model, self.tokenizer, self.generation = model, tokenizer, generation
        self.processor = processor_of(tokenizer)  # a vision-language model's (finetune.models.vision)
        self.images = list(images or [])  # shown with the first user turn
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.opening)
        self.show_prompt = show_prompt
        self.plain_text = plain_text_format is not None
        self.stop_ids = stop_token_ids(tokenizer, model.generation_config, chat_template=not self.plain_text)

    def reset(self) -> None:
        self.messages = list(self.opening)

    def encode(self, messages: list[dict]) -> tuple[str, dict]:
        """`(prompt as the model sees it, input tensors)`, tokenized as training tokenized it (finetune.data.tokenize):
        a rendered template writes BOS itself, a plain-text prompt gets the special tokens the tokenizer adds."""
        if self.plain_text:
            inputs = self.tokenizer(messages[-1]["content"], return_tensors="pt")
            return self.tokenizer.decode(inputs["input_ids"][0], clean_up_tokenization_spaces=False), inputs
        from finetune.train.trained_model import render_prompt

        if self.processor is not None:  # the processor renders the image parts and expands them into image tokens
            prompt = render_prompt(self.processor, messages)
            return prompt, self.processor(text=[prompt], images=self.images or None, return_tensors="pt",
                                          add_special_tokens=False)
        prompt = render_prompt(self.tokenizer, messages)
        return prompt, self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)

    def ask(self, text: str) -> str:
        import torch
        from transformers import TextStreamer

        from finetune.train.evaluation import until_stop

        turn = {"role": "user", "content": text}
        if self.processor is not None:  # content as parts; the images in the conversation's first user turn
            first = not any(message["role"] == "user" for message in self.messages)
            shown = [{"type": "image"}] * len(self.images) if first else []
            turn["content"] = [*shown, {"type": "text", "text": text}]
        messages = [*self.messages, turn]
        prompt, inputs = self.encode(messages)
        if self.show_prompt:
            print(f"[prompt] {prompt!r}", file=sys.stderr, flush=True)
        inputs = inputs.to(self.model.device)
        streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.no_grad():
            output = self.model.generate(**inputs, **self.generation, streamer=streamer, eos_token_id=self.stop_ids,
                                         pad_token_id=self.tokenizer.pad_token_id)
        answer = self.tokenizer.decode(until_stop(output[0, inputs["input_ids"].shape[1]:].tolist(), self.stop_ids),
                                       skip_special_tokens=True)
        if not self.plain_text:
            self.messages = [*messages, {"role": "assistant", "content": answer}]
        return answer


def chat_images(paths: list[str] | None, tokenizer, checkpoint: str) -> list:
    """The `--image` files as RGB images (each unreadable one refused by name), for a vision-language model only."""
    from finetune.data.vision.data import read_image
    from finetune.errors import RecipeError
    from finetune.models.vision import processor_of

    if not paths:
        return []
    if processor_of(tokenizer) is None:
        raise RecipeError(f"--image: {checkpoint} is a text model (no processor was saved with it): it cannot read "
                          "images.")
    try:
        return [read_image(path) for path in paths]
    except RecipeError as error:
        raise RecipeError(f"--image: {error}") from None


def read_turn(stream, on_terminal: bool) -> str | None:
    """The next user turn from `stream` (a `>>> ` prompt on a terminal), lines ending in `\\` joined to the next;
    None at the end of input."""
    lines: list[str] = []
    while True:
        if on_terminal:
            try:
                line = input("... " if lines else ">>> ")
            except EOFError:
                line = None
        else:
            line = stream.readline() or None
        if line is None:
            return "\n".join(lines) if lines else None
        line = line.rstrip("\r\n")
        if not line.endswith("\\"):
            return "\n".join([*lines, line])
        lines.append(line[:-1])


def converse(conversation: Conversation, stream, on_terminal: bool) -> None:
    """Answers turns from `stream` until `/exit` or the end of input; `/reset` starts the conversation over."""
    if on_terminal:
        print(f"chatting: {COMMANDS_HELP}.", file=sys.stderr)
    while (text := read_turn(stream, on_terminal)) is not None:
        command = text.strip()
        if command == "/exit":
            return
        if command == "/reset":
            conversation.reset()
            print("(conversation cleared)", file=sys.stderr, flush=True)
        elif command:
            conversation.ask(text)


def chat_command(args) -> int:
    import torch
    from transformers import set_seed

    from finetune.train.trained_model import load_with_tokenizer, plain_text_format

    generation = generation_settings(args.max_new_tokens, args.temperature, args.top_p)
    trained_on = plain_text_format(args.checkpoint, args.system)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's consolidation prints: stdout is for the answers
        model, tokenizer = load_with_tokenizer(args.checkpoint, args.merge_lora, args.base_model, args.seed)
    model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    adapter = " with its LoRA adapter" if hasattr(model, "peft_config") else ""
    print(f"loaded {args.checkpoint}{adapter} ({model.dtype}, {model.device})", file=sys.stderr, flush=True)
    if trained_on:
        print(f"trained on {trained_on} data: each prompt goes in as plain text, without a chat template, as in "
              "training, and each turn is answered on its own", file=sys.stderr, flush=True)
    set_seed(0 if args.seed is None else args.seed)  # None: the base's seed is read from the run
    conversation = Conversation(model, tokenizer, generation, args.system, args.show_prompt, trained_on,
                                images=chat_images(args.image, tokenizer, args.checkpoint))
    if args.prompt is not None:
        conversation.ask(args.prompt)
        return 0
    try:
        converse(conversation, sys.stdin, sys.stdin.isatty())
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0
