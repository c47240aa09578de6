"""`finetune serve`: the demo run behind `transformers serve` answers the real `openai` client on loopback, streaming
and not, as `finetune chat` answers (the training chat template and stops), and stops cleanly on SIGTERM, removing
the model folder it wrote; a request is capped at the context, and a stop mid-answer is bounded; bad input (an
export folder inside the run) and a full disk stop in one line, leaving nothing written."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from support import PROJECT_ROOT, finetune_command, free_port, wait_for_models

from finetune import presets
from finetune.cli import main
from finetune.commands.serve import SHUTDOWN_GRACE_SECONDS, run_server, server_command, serving_split
from finetune.train.evaluation import stop_token_ids
from finetune.train.trained_model import load_with_tokenizer

PROMPTS = ["reverse\n\nabcdef", "sort\n\ndcba"]


def test_the_demo_run_answers_the_openai_client_as_chat_does(trained_demo, tmp_path, capsys):
    from openai import OpenAI

    port = free_port()
    served = tmp_path / "served"
    server = subprocess.Popen(
        finetune_command("serve", str(trained_demo), "--port", str(port), "--model-name", "demo/reverse",
                         "--export-dir", str(served)),
        cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert [model["id"] for model in wait_for_models(port, server)] == ["demo/reverse"]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            answer = client.chat.completions.create(model="demo/reverse", messages=messages, max_tokens=8,
                                                    temperature=0)
            streamed = client.chat.completions.create(model="demo/reverse", messages=messages, max_tokens=8,
                                                      temperature=0, stream=True)
            pieces = [chunk.choices[0].delta.content for chunk in streamed
                      if chunk.choices and chunk.choices[0].delta.content]
            assert main(["chat", str(trained_demo), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
            chatted = capsys.readouterr().out.strip()
            assert answer.choices[0].message.content == "".join(pieces) == chatted
            assert answer.choices[0].finish_reason == "stop"  # at the template's end of turn, before 8 tokens
        assert client.chat.completions.create(
            model="demo/reverse", messages=[{"role": "user", "content": "reverse\n\nabcdef"}],
            max_tokens=8, temperature=0).choices[0].message.content == "fedcba"  # the demo learned to reverse
    finally:
        server.send_signal(signal.SIGTERM)
        _, errors = server.communicate(timeout=60)
    assert server.returncode == 0, errors
    assert "Traceback" not in errors and "server stopped" in errors
    assert f"at http://127.0.0.1:{port}/v1" in errors  # loopback unless --host says otherwise
    template = (served / "chat_template.jinja").read_text()
    assert template == (trained_demo / "chat_template.jinja").read_text()  # the template training used
    stops = json.loads((served / "generation_config.json").read_text())["eos_token_id"]
    model, tokenizer = load_with_tokenizer(trained_demo)
    assert (stops if isinstance(stops, list) else [stops]) == stop_token_ids(tokenizer, model.generation_config)


def test_serve_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0 and "--model-name" in capsys.readouterr().out
    cases = {
        ("--model-name", "my:model"): "--model-name 'my:model'",
        ("--port", "70000"): "--port 70000: give a port between 1 and 65535",
        ("--engine", "vllm", "--port", str(free_port())): "--engine vllm needs vLLM and a CUDA GPU",
    }
    for extra, message in cases.items():
        assert main(["serve", str(tmp_path), *extra]) == 2
        assert message in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    (tmp_path / "run").mkdir()
    assert main(["serve", str(tmp_path / "run"), "--export-dir", str(tmp_path / "taken"), "--port",
                 str(free_port())]) == 2
    assert "is not empty" in capsys.readouterr().err
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        assert main(["serve", str(tmp_path), "--port", str(holder.getsockname()[1])]) == 2
    assert "give another --port" in capsys.readouterr().err
    for source, inside in ((tmp_path, tmp_path / "checkpoint-99"), (tmp_path / "checkpoint-5", tmp_path / "served")):
        source.mkdir(exist_ok=True)
        assert main(["serve", str(source), "--export-dir", str(inside), "--port", str(free_port())]) == 2
        assert "is inside the" in capsys.readouterr().err and not inside.exists()
    assert main(["serve", str(tmp_path), "--port", str(free_port())]) == 2  # no model there
    assert "holds no model" in capsys.readouterr().err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_vllm_is_given_the_served_folder_under_the_clients_name():
    """Where vLLM and CUDA are installed (`--engine auto` picks it there), the same folder goes to `vllm serve`, its
    stops read from the generation config; not run here (no vLLM on CPU): its command line is held to vLLM's
    flags."""
    assert server_command("vllm", "demo/reverse", "127.0.0.1", 8000) == [
        "vllm", "serve", "demo/reverse", "--served-model-name", "demo/reverse", "--host", "127.0.0.1", "--port",
        "8000", "--generation-config", "auto"]
    assert server_command("transformers", "demo", "127.0.0.1", 8000)[1:] == [
        "-m", "finetune.commands.serve", "demo", "--host", "127.0.0.1", "--port", "8000"]
    # On a node of 8 GPUs a 70B (64 heads, 8 KV heads: 141 GB in bf16, more than any one GPU) is sharded over all 8.
    llama_70b = {"num_attention_heads": 64, "num_key_value_heads": 8}
    assert serving_split(llama_70b, 8) == 8 and serving_split(llama_70b, 1) == 1
    assert server_command("vllm", "m", "127.0.0.1", 8000, serving_split(llama_70b, 8))[-2:] == [
        "--tensor-parallel-size", "8"]
    # vLLM's rule: heads divisible by the GPUs, KV heads divisible by them or dividing them.
    assert serving_split({"num_attention_heads": 14, "num_key_value_heads": 2}, 8) == 2  # not 7
    assert serving_split({"num_attention_heads": 40, "num_key_value_heads": 8}, 6) == 4  # not 5
    assert serving_split({"text_config": llama_70b}, 4) == 4  # a vision-language model's text config


# The untrained model's context: short, so that an answer capped at it is quick on a busy CPU.
UNTRAINED_CONTEXT = 64


@pytest.fixture(scope="module")
def untrained_tiny(tmp_path_factory):
    """The `tiny` model untrained, with a context of 64 tokens: it never writes its end token, so only a cap ends its
    answers."""
    folder = tmp_path_factory.mktemp("untrained_tiny")
    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer, seed=0)
    model.config.max_position_embeddings = UNTRAINED_CONTEXT
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_plain_run_folder_is_served_in_place_and_one_lacking_its_stops_is_copied_beside_it(trained_demo, tmp_path,
                                                                                              monkeypatch, capsys):
    """The demo's output folder already is what a server reads (safetensors, the tokenizer with the training
    template, the stops in its generation config): it is served as it is, nothing loaded or copied (at 70B, 141 GB
    through host RAM and a disk). A folder whose generation config lost a stop is loaded and written once, beside
    it on its disk (not in TMPDIR), with the stops training recorded, and removed when the server stops."""
    import shutil

    from finetune.commands import serve

    seen = []

    def server(command, folder):  # the server not started: what it would load, while the workspace exists
        link = folder / command[command.index("-m") + 2]
        seen.append({"folder": folder, "target": link.resolve(), "workspace": sorted(p.name for p in folder.iterdir()),
                     "stops": json.loads((link / "generation_config.json").read_text())["eos_token_id"]})
        return 0

    monkeypatch.setattr(serve, "run_server", server)
    monkeypatch.setattr(serve, "pick_engine", lambda engine: "transformers")
    assert main(["serve", str(trained_demo), "--port", str(free_port()), "--model-name", "demo"]) == 0
    assert seen[0]["target"] == trained_demo.resolve() and seen[0]["workspace"] == ["demo"]
    assert f"serving {trained_demo} in place: a plain model folder with its stops (nothing copied)" in \
        capsys.readouterr().err
    trained = seen[0]["stops"]

    lost = tmp_path / "run"
    shutil.copytree(trained_demo, lost, ignore=shutil.ignore_patterns("checkpoint-*"))
    config = json.loads((lost / "generation_config.json").read_text())
    del config["eos_token_id"]  # saved without its stops
    (lost / "generation_config.json").write_text(json.dumps(config))
    assert main(["serve", str(lost), "--port", str(free_port()), "--model-name", "demo"]) == 0
    err = capsys.readouterr().err
    assert "is not served in place (its generation config does not stop at every token" in err
    copy = seen[1]
    assert copy["folder"].parent == tmp_path and copy["folder"].name.startswith(".finetune-serve-")  # beside the run
    assert copy["target"] == copy["folder"] / "model" and copy["stops"] == trained  # the stops training recorded
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]  # the copy went with the server


def test_vllm_on_a_node_of_eight_gpus_is_started_over_the_gpus_the_model_splits_across(untrained_tiny, monkeypatch,
                                                                                         capsys):
    """`finetune serve` as it runs where vLLM and 8 GPUs are (simulated: the engine chosen, the GPU count, the server
    not started): the tiny model's 4 heads split over 4 of them."""
    import torch

    from finetune.commands import serve

    started = []
    monkeypatch.setattr(serve, "pick_engine", lambda engine: "vllm")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(serve, "run_server", lambda command, folder: started.append(command) or 0)
    assert main(["serve", str(untrained_tiny), "--port", str(free_port())]) == 0
    ((command,),) = [started]
    assert command[:3] == ["vllm", "serve", untrained_tiny.name] and command[-2:] == ["--tensor-parallel-size", "4"]
    assert "with vllm on 4 GPUs (tensor parallel)" in capsys.readouterr().err


def test_a_huge_max_tokens_is_capped_at_the_context_and_sigterm_mid_answer_stops_and_cleans_up(
        untrained_tiny, tmp_path):
    """`max_tokens` of a million (and the client's own generation config without an end token) ends at the model's
    context instead of holding the one inference thread; SIGTERM while it is answered stops the server in bounded
    time and removes the temporary copy."""
    port, temporary = free_port(), tmp_path / "tmp"
    temporary.mkdir()
    server = subprocess.Popen(finetune_command("serve", str(untrained_tiny), "--port", str(port)), cwd=PROJECT_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(temporary)})
    answers, asking = [], None
    try:
        wait_for_models(port, server)
        assert [path.name for path in temporary.iterdir() if path.name.startswith("finetune-serve-")]
        body = {"model": untrained_tiny.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6,
                "generation_config": json.dumps({"max_new_tokens": 10**6, "eos_token_id": None, "do_sample": False})}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        asking = threading.Thread(target=lambda: answers.append(json.loads(
            urllib.request.urlopen(request, timeout=120).read())))
        asking.start()
        lines = iter(server.stderr.readline, "")
        assert any("[Request received]" in line for line in lines)  # being answered
    finally:
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        _, errors = server.communicate(timeout=60)
    if asking is not None:
        asking.join(timeout=60)
    assert time.monotonic() - started < SHUTDOWN_GRACE_SECONDS + 15
    assert server.returncode == 0 and "Traceback" not in errors and "server stopped" in errors
    (answer,) = answers  # answered before the server stopped, at the context
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == UNTRAINED_CONTEXT
    assert answer["choices"][0]["finish_reason"] == "length"
    assert not [path.name for path in temporary.iterdir() if path.name.startswith("finetune-serve-")]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["kill", "terminal closed"])
def test_a_server_busy_past_the_grace_period_is_killed(tmp_path, stop):
    ignores_sigint = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                      "print('up', flush=True); time.sleep(60)"]
    threading.Timer(1.0, os.kill, (os.getpid(), stop)).start()
    started = time.monotonic()
    assert run_server(ignores_sigint, tmp_path, grace_seconds=0.5) == 0
    assert time.monotonic() - started < 10


def test_serve_disk_full_is_one_line_and_leaves_nothing(untrained_tiny, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def full_disk(model, folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"x" * 2000)
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    kept = tmp_path / "kept"
    assert main(["serve", str(untrained_tiny), "--export-dir", str(kept), "--port", str(free_port())]) == 2
    output = capsys.readouterr().err
    assert "Traceback" not in output
    assert output.strip().splitlines()[-1].startswith(f"finetune: error: no space left on {kept}: ")
    assert "the served model needs ~" in output and "nothing partial was left there" in output
    assert not kept.exists()



def test_a_stop_while_the_model_is_written_removes_the_copy(tmp_path, monkeypatch):
    """SIGHUP (the terminal closing) as SIGTERM: the serve ends, and the folder written beside the run goes with it."""
    from finetune.commands import serve

    def stopped_while_writing(source, folder, base_model, seed):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(5)

    monkeypatch.setattr(serve, "write_served_model", stopped_while_writing)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(run), "--port", str(free_port())])
    assert exit_info.value.code == 128 + signal.SIGHUP
    assert list(tmp_path.iterdir()) == [run]  # the copy was beside the run, and went
