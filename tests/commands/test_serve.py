"""`finetune serve`: the demo run behind `transformers serve` answers the real `openai` client on loopback, streaming
and not, as `finetune chat` answers (the training chat template and stops), and stops cleanly on SIGTERM, removing
the model folder it wrote; bad input stops before anything is written."""

import json
import signal
import socket
import subprocess
import time
import urllib.request

import pytest
from support import PROJECT_ROOT, finetune_command, free_port

from finetune.cli import main
from finetune.commands.serve import server_command
from finetune.train.evaluation import stop_token_ids
from finetune.train.trained_model import load_with_tokenizer

PROMPTS = ["reverse\n\nabcdef", "sort\n\ndcba"]


def wait_for_models(port: int, server, timeout: float = 240) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server ended early ({server.returncode}): {server.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
                return json.loads(response.read())["data"]
        except OSError:
            time.sleep(1)
    raise AssertionError("the server did not answer in time")


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
    assert main(["serve", str(tmp_path), "--export-dir", str(tmp_path / "taken"), "--port", str(free_port())]) == 2
    assert "is not empty" in capsys.readouterr().err
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        assert main(["serve", str(tmp_path), "--port", str(holder.getsockname()[1])]) == 2
    assert "give another --port" in capsys.readouterr().err
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
        "serve", "demo", "--host", "127.0.0.1", "--port", "8000"]

