"""`finetune serve OUTPUT_DIR|CHECKPOINT`: an OpenAI-compatible API for a trained model, by delegation (what
`llamafactory-cli api` and `swift deploy` give): `transformers serve`, or `vllm serve` where vLLM and CUDA are there.

Either server reads a plain model folder: safetensors weights, its tokenizer with the chat template training used,
and a generation config stopping at every token that ended an answer in training
(`finetune.train.evaluation.stop_token_ids`), so a client's answers end where `finetune chat`'s do. A full
fine-tune's output folder is one already, and is served in place (`in_place_refusal`): nothing is loaded or copied
first, which at 70B would be 141 GB through host RAM and a disk. Anything else (checkpoint shards, a LoRA adapter,
stops the folder lacks) is loaded as `finetune chat` loads it and written once, in a folder beside the run (on the
run's disk, not in TMPDIR, often small or held in RAM), or in `--export-dir`. The server is a child process: Ctrl-C
or SIGTERM stops it (killed after `SHUTDOWN_GRACE_SECONDS` if a request keeps it busy) and removes a folder written
for this serve alone.

`transformers serve` answers one request at a time on one inference thread and gives `generate` the client's
`max_tokens` as `max_new_tokens`, which overrides any `max_length` (transformers' `_prepare_generated_length`):
nothing it reads stops a generation at the model's context. So it runs here as `python -m finetune.commands.serve`,
its sequential generation manager capping every request at what the context has room for (`capped_at_context`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"
ENGINES = ("auto", "transformers", "vllm")
# How long a stopped server may take to finish the request it is answering before it is killed (uvicorn waits for
# open connections without limit, and transformers serve cannot be told otherwise).
SHUTDOWN_GRACE_SECONDS = 10
# What stops a serve: Ctrl-C, a `kill`, and the terminal or SSH session closing (SIGHUP, which would otherwise end the
# process without removing its copy of the model).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def serve_command_parser(subparsers) -> None:
    from finetune.commands.model_source import add_model_source_arguments

    parser = subparsers.add_parser(
        "serve", help="serve a trained model behind an OpenAI-compatible API (transformers serve, or vLLM)",
        description="Write the model of a run's output_dir or checkpoint-N folder (full weights, ZeRO or FSDP shards, "
        "a LoRA adapter merged into its base) as a plain model folder with the chat template training used and its "
        "stop tokens, and serve it with `transformers serve` (or `vllm serve` with --engine vllm, or auto where vLLM "
        "and CUDA are installed): /v1/chat/completions, streaming or not, under --model-name. Loopback only unless "
        "--host says otherwise; Ctrl-C stops it.",
    )
    add_model_source_arguments(parser)
    parser.add_argument("--host", default=LOOPBACK, help=f"address to listen on (default {LOOPBACK}: this machine "
                        "only; the API has no authentication)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--model-name", help="the name clients give as `model` (default: the folder's name)")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="auto: vLLM where it and CUDA are installed, else transformers serve")
    parser.add_argument("--export-dir", help="write the served model folder here and keep it (default: a temporary "
                        "folder, removed when the server stops)")
    parser.set_defaults(func=serve_command)


def check_name(name: str) -> str:
    from finetune.errors import RecipeError

    if not name or any(mark in name for mark in (":", "@", "\\")) or name.startswith(("/", ".")) or ".." in name:
        raise RecipeError(f"--model-name {name!r}: give a name of letters, digits, '-', '_', '.' and '/' (no ':', "
                          "'@', or leading '/' or '.'): the servers read ':' and '@' as a file and a revision.")
    return name


def check_port_free(host: str, port: int) -> None:
    import socket

    from finetune.errors import RecipeError

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, port))
    except OSError as error:
        raise RecipeError(f"cannot listen on {host}:{port} ({error.strerror or error}): give another --port, or "
                          "stop what holds it.") from None


def pick_engine(engine: str) -> str:
    """vLLM when asked, or under `auto` where it is installed and CUDA is there; else transformers serve."""
    import importlib.util

    import torch

    from finetune.errors import RecipeError

    has_vllm = importlib.util.find_spec("vllm") is not None
    if engine == "vllm" and not (has_vllm and torch.cuda.is_available()):
        raise RecipeError("--engine vllm needs vLLM and a CUDA GPU here: pip install vllm on a GPU machine, or use "
                          "--engine transformers.")
    if engine == "auto":
        engine = "vllm" if has_vllm and torch.cuda.is_available() else "transformers"
    if engine == "transformers" and importlib.util.find_spec("fastapi") is None:
        raise RecipeError("transformers serve needs its serving extras: pip install 'finetune-kit[serve]' (or "
                          "'transformers[serving]').")
    return engine


def write_served_model(source: str, folder: Path, base_model: str | None, seed: int | None) -> bool:
    """The model of `source` as a plain folder a server loads: weights (an adapter merged), the tokenizer with its
    chat template, stops in the generation config. True when the run learned plain text (no template to chat in)."""
    import contextlib

    from finetune.checkpoints.export import weights_bytes, writing_export
    from finetune.models.vision import processor_of
    from finetune.train.evaluation import record_stop_tokens
    from finetune.train.trained_model import load_with_tokenizer, plain_text_format

    plain_text = plain_text_format(source) is not None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's consolidation prints
        model, tokenizer = load_with_tokenizer(source, base_model=base_model, seed=seed)
    if hasattr(model, "peft_config"):  # a LoRA run: the servers read plain weights
        model = model.merge_and_unload()
    record_stop_tokens(model, tokenizer, plain_text)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with writing_export(folder, weights_bytes(model), "the served model"):
        model.save_pretrained(folder, safe_serialization=True)
        (processor_of(tokenizer) or tokenizer).save_pretrained(folder)  # a vision-language model's processor whole
    return plain_text


def in_place_refusal(source: Path) -> str | None:
    """Why `source` cannot be served as it is (None: it can): it must be a finished plain model folder, its weights in
    safetensors, its tokenizer (with the chat template, unless the run learned plain text) beside them, and its
    generation config stopping at every token `write_served_model` would record. Checked as `finetune chat` checks
    what it loads: a run still training, or a file that could run code, stops here."""
    import json

    from transformers import AutoTokenizer, GenerationConfig

    from finetune.checkpoints.complete import check_checkpoint_files
    from finetune.checkpoints.export import check_finished
    from finetune.train.evaluation import stop_token_ids
    from finetune.train.trained_model import plain_text_format

    if not source.is_dir():
        return "it is not a folder"
    if (source / "adapter_config.json").is_file():
        return "it holds a LoRA adapter, merged into its base for the server"
    if not ((source / "model.safetensors").is_file() or (source / "model.safetensors.index.json").is_file()):
        return "its weights are not one plain safetensors model (checkpoint shards are consolidated first)"
    if not (source / "tokenizer_config.json").is_file():
        return "its tokenizer is not beside the weights"
    if not (source / "generation_config.json").is_file():
        return "it has no generation config to stop the answers"
    check_finished(source)
    check_checkpoint_files(source, skip_checkpoints=True)
    plain_text = plain_text_format(str(source)) is not None
    tokenizer = AutoTokenizer.from_pretrained(source)
    if not plain_text and tokenizer.chat_template is None:
        return "its tokenizer has no chat template"
    generation_config = GenerationConfig.from_pretrained(source)
    saved = generation_config.eos_token_id
    saved = set(saved if isinstance(saved, list) else [saved])
    if saved != set(stop_token_ids(tokenizer, generation_config, chat_template=not plain_text)):
        return "its generation config does not stop at every token that ended an answer in training"
    if not json.loads((source / "config.json").read_text()).get("model_type"):
        return "its config.json names no model type"
    return None


def workspace_beside(source: Path) -> Path:
    """A new folder for a served copy, beside the run on its disk (the run's disk holds a model; TMPDIR is often
    small or in RAM), else in TMPDIR where the run's parent cannot be written."""
    parent = source.resolve().parent
    try:
        return Path(tempfile.mkdtemp(prefix=".finetune-serve-", dir=parent))
    except OSError:
        return Path(tempfile.mkdtemp(prefix="finetune-serve-"))


def serving_split(config: dict, gpus: int) -> int:
    """The GPUs vLLM shards the model over: the most of the `gpus` visible that divide its attention heads, and
    that its key-value heads divide or are divided by (vLLM's own rule for splitting them, replicating KV heads
    where there are fewer than GPUs). One GPU holds a model up to about 30B in bf16; a 70B needs several, and
    `vllm serve` alone takes one."""
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    return max(n for n in range(1, max(gpus, 1) + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0))


def server_command(engine: str, name: str, host: str, port: int, tensor_parallel: int = 1) -> list[str]:
    """The server's command line, run in the folder that holds the model under `name` (transformers serve pins a
    model by the path it loads it from, and answers only to that name; it spreads a model over the GPUs it sees with
    `device_map="auto"`, vLLM over `tensor_parallel` of them)."""
    if engine == "vllm":
        return ["vllm", "serve", name, "--served-model-name", name, "--host", host, "--port", str(port),
                "--generation-config", "auto", *(["--tensor-parallel-size", str(tensor_parallel)]
                                                 if tensor_parallel > 1 else [])]
    return [sys.executable, "-m", "finetune.commands.serve", name, "--host", host, "--port", str(port)]


def capped_at_context(model, inputs: dict, generation_config):
    """`generation_config` with `max_new_tokens` no more than the model's context has room for after the prompt (at
    least one token), whatever the client asked (`max_tokens`, or a `generation_config` of its own)."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context:
        room = max(context - inputs["input_ids"].shape[-1], 1)
        if generation_config.max_new_tokens is None or generation_config.max_new_tokens > room:
            generation_config.max_new_tokens = room
    return generation_config


def serve_image_only_processors() -> None:
    """A vision-language model's processor loaded as training loaded it
    (finetune.models.vision.processors.load_processor): `transformers serve` builds it with AutoProcessor, which for
    Qwen2-VL's family needs torchvision for its video half even to read images; where torchvision is missing its
    image-only form serves image content parts the same."""
    from transformers.cli.serving import model_manager

    from finetune.models.vision.processors import load_processor

    original = model_manager.ModelManager._load_processor

    def load(self, model_id_and_revision: str, gguf_file: str | None = None):
        model_id, _ = model_manager.split_revision(model_id_and_revision)
        if gguf_file is None and (Path(model_id) / "processor_config.json").is_file():
            return load_processor(model_id)
        return original(self, model_id_and_revision, gguf_file)

    model_manager.ModelManager._load_processor = load


def parse_answers_only_in_their_family_template(utils) -> None:
    """`transformers serve` parses an answer (its reasoning, tool calls) by a template it picks by model type
    (Qwen2-VL's: ChatML, the answer after `<|im_start|>assistant`) when the tokenizer names none. A model trained on
    another chat template (a recipe's `chat_template`, the tiny models') never writes that anchor, and the parser
    then returns the prompt with the answer. The family's template is used only where the chat template renders its
    anchor; otherwise the answer is served as decoded."""
    chosen = utils.get_response_template

    def response_template(processor, model):
        template = chosen(processor, model)
        tokenizer = getattr(processor, "tokenizer", processor)
        rendered = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None) or ""
        anchor = (template or {}).get("start_anchor")
        if anchor and getattr(tokenizer, "response_template", None) is None and anchor.strip() not in rendered:
            return None
        return template

    utils.get_response_template = response_template


def serve_within_context(argv: list[str]) -> None:
    """`transformers serve ARGV`, its sequential generation manager (one per model, built by
    `GenerationState.get_manager`) capping each request at the context (`capped_at_context`)."""
    from transformers.cli import transformers as transformers_cli
    from transformers.cli.serving import utils

    class ContextBoundGenerateManager(utils.GenerateManager):
        def generate_streaming(self, model, processor, inputs, gen_config, *args, **kwargs):
            return super().generate_streaming(model, processor, inputs, capped_at_context(model, inputs, gen_config),
                                              *args, **kwargs)

        async def generate_non_streaming(self, model, processor, inputs, gen_config, *args, **kwargs):
            return await super().generate_non_streaming(model, processor, inputs,
                                                        capped_at_context(model, inputs, gen_config), *args, **kwargs)

    utils.GenerateManager = ContextBoundGenerateManager
    serve_image_only_processors()
    parse_answers_only_in_their_family_template(utils)
    sys.argv = ["transformers", "serve", *argv]
    transformers_cli.main()


def serve_command(args) -> int:
    from finetune.errors import RecipeError

    source = Path(args.checkpoint)
    name = check_name(args.model_name or source.resolve().name)
    if not 0 < args.port < 65536:
        raise RecipeError(f"--port {args.port}: give a port between 1 and 65535.")
    check_port_free(args.host, args.port)  # before the model is written: a taken port would end the server only then
    engine = pick_engine(args.engine)
    if args.export_dir is not None:
        check_export_dir(source, Path(args.export_dir))
    # SIGTERM or SIGHUP while the model is written ends here as SystemExit (SIGINT as KeyboardInterrupt), through the
    # `finally` that removes the workspace
    previous = {signum: signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))
                for signum in (signal.SIGTERM, signal.SIGHUP)}
    refusal = "--export-dir asks for a copy" if args.export_dir else in_place_refusal(source)
    # in place, the workspace holds only the name the server loads; a copy is written beside the run
    workspace = Path(tempfile.mkdtemp(prefix="finetune-serve-")) if refusal is None else workspace_beside(source)
    try:
        if refusal is None:
            from finetune.train.trained_model import plain_text_format

            folder, plain_text = source.resolve(), plain_text_format(str(source)) is not None
            print(f"serving {source} in place: a plain model folder with its stops (nothing copied)", file=sys.stderr)
        else:
            folder = Path(args.export_dir).resolve() if args.export_dir else workspace / "model"
            print(f"writing the served model to {folder}: {source} is not served in place ({refusal})",
                  file=sys.stderr)
            plain_text = write_served_model(str(source), folder, args.base_model, args.seed)
        link = workspace / name  # the name clients give, as the path the server loads
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(folder, target_is_directory=True)
        if args.host not in (LOOPBACK, "localhost", "::1"):
            print(f"warning: listening on {args.host}: anyone who can reach this port can use the model (no "
                  "authentication).", file=sys.stderr)
        if plain_text:
            print(f"note: {source} learned plain text, without a chat template: ask /v1/completions with the prompt "
                  "as it was trained; chat completions wrap it in a template it never saw.", file=sys.stderr)
        tensor_parallel = 1
        if engine == "vllm":
            import json

            import torch

            tensor_parallel = serving_split(json.loads((folder / "config.json").read_text()),
                                                   torch.cuda.device_count())
        on = f" on {tensor_parallel} GPUs (tensor parallel)" if tensor_parallel > 1 else ""
        print(f"serving {source} as `{name}` with {engine}{on} at http://{args.host}:{args.port}/v1 (Ctrl-C stops "
              "it)", file=sys.stderr, flush=True)
        return run_server(server_command(engine, name, args.host, args.port, tensor_parallel), workspace)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check_export_dir(source: Path, export_dir: Path) -> None:
    """--export-dir under `finetune export`'s destination rules (not the run served, inside it or around it, nor
    another run), and new or empty: the served folder is written whole, over nothing."""
    from finetune.checkpoints.export import check_destination
    from finetune.errors import RecipeError

    check_destination(source, export_dir, force=False, outside_the_run=True)
    if export_dir.exists() and any(export_dir.iterdir()):
        raise RecipeError(f"--export-dir {export_dir} is not empty: give a new or empty folder.")


def run_server(command: list[str], folder: Path, grace_seconds: float = SHUTDOWN_GRACE_SECONDS) -> int:
    """Runs the server until it ends or this process is asked to stop (`STOP_SIGNALS`), which it passes on; a
    server still busy `grace_seconds` later (a request being answered) is killed. A stop asked for is a clean end
    (0)."""
    server = subprocess.Popen(command, cwd=folder, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stopping = []

    def stop(signum, frame):
        if not stopping and server.poll() is None:
            server.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
        stopping.append(time.monotonic())

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        while True:  # in steps: a signal's handler returns into wait(), which would wait on without a deadline
            try:
                returncode = server.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0] > grace_seconds:
                    print(f"the server was still answering a request {grace_seconds:g}s after the stop: killed it",
                          file=sys.stderr, flush=True)
                    server.kill()
                    returncode = server.wait()
                    break
        if stopping:
            print("server stopped", file=sys.stderr)
            return 0
        return returncode
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if server.poll() is None:
            server.kill()
            server.wait()


if __name__ == "__main__":  # the transformers server, as `server_command` starts it
    serve_within_context(sys.argv[1:])
