"""Ollama's API through the official ``ollama`` Python client (its pydantic types check
every answer's shape), offline against a real daemon serving the stories260K model: the
model routes (list, show, ps, pull of a local folder, copy, delete, version) and errors in
Ollama's shape. Facts are checked against the checkpoint's own files."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest
from safetensors import safe_open

from localserve.server.config import ServerConfig

from .conftest import STORIES_HF
from .server_util import CHAT_TEMPLATE, RunningServer, running_server, small_engine_config, stories_with_template
from .test_reasoning import THINKING_TEMPLATE

# Llama 3.1's way of calling (a bare JSON object, or one after <|python_tag|>), in short: a
# story model's 512-token context cannot hold the real template.
LLAMA_STYLE = (
    "{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}- call one as "
    "{\"name\": ..., \"parameters\": {...}} or <|python_tag|>{...}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m.get('tool_calls') %}"
    "{{ m['tool_calls'][0]['function']['arguments'] | tojson }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)



@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("ollama")
    models = {"stories": stories_with_template(root, CHAT_TEMPLATE),
              "tooly": stories_with_template(root, LLAMA_STYLE, name="tooly"),
              "thinker": stories_with_template(root, THINKING_TEMPLATE, name="thinker")}
    config = ServerConfig(models=models,
                          registry_home=root / "registry", engine=small_engine_config(), device="cpu")
    with running_server(config) as running:
        yield running
        for name in models:
            httpx.post(f"{running.url}/api/localserve/unload", json={"model": name}, timeout=60)


@pytest.fixture
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


def parameter_count() -> int:
    with safe_open(STORIES_HF / "model.safetensors", "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())


def test_list_and_show_describe_the_checkpoint(client: ollama.Client) -> None:
    config = json.loads((STORIES_HF / "config.json").read_text())
    [stories] = [m for m in client.list().models if m.model == "stories"]
    assert stories.details.format == "safetensors" and stories.details.family == "llama"
    assert len(stories.digest) == 64 and stories.size == (STORIES_HF / "model.safetensors").stat().st_size
    shown = client.show("stories")
    assert shown.template == CHAT_TEMPLATE and shown.capabilities == ["completion"]
    assert shown.modelinfo["llama.context_length"] == config["max_position_embeddings"]
    assert shown.modelinfo["llama.block_count"] == config["num_hidden_layers"]
    assert shown.modelinfo["llama.embedding_length"] == config["hidden_size"]
    assert shown.modelinfo["general.parameter_count"] == parameter_count()


def test_pull_a_local_folder_copy_and_delete(client: ollama.Client, server: RunningServer, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    folder = stories_with_template(tmp_path, CHAT_TEMPLATE, name="tiny-stories")
    monkeypatch.setattr(server.state.config, "allow_pull_from", [tmp_path])  # serve --allow-pull-from
    events = list(client.pull(str(folder), stream=True))
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    names = {m.model for m in client.list().models}
    assert "tiny-stories:latest" in names
    assert client.show("tiny-stories").modelinfo["general.architecture"] == "llama"
    assert client.copy("tiny-stories", "copied:v1").status == "success"
    assert {"tiny-stories:latest", "copied:v1"} <= {m.model for m in client.list().models}
    assert client.delete("copied:v1").status == "success"
    assert client.delete("tiny-stories").status == "success"
    assert not {"tiny-stories:latest", "copied:v1"} & {m.model for m in client.list().models}
    assert client.pull(str(folder), stream=False).status == "success"  # one answer when not streamed
    client.delete("tiny-stories")


def test_errors_in_ollamas_shape(client: ollama.Client, server: RunningServer) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error
    answer = httpx.post(f"{server.url}/api/show", json={"model": "no-such-model"})
    assert set(answer.json()) == {"error"}
    with pytest.raises(ollama.ResponseError, match="not a registry model"):
        client.copy("stories", "elsewhere")  # a --model path is not the registry's to copy
    with pytest.raises(ollama.ResponseError, match="not a source this server pulls from"):
        list(client.pull("/no/such/folder", stream=True))


def test_ps_and_version(client: ollama.Client, server: RunningServer) -> None:
    httpx.post(f"{server.url}/api/localserve/load", json={"model": "stories"}, timeout=60).raise_for_status()
    [running] = client.ps().models
    assert running.model == running.name == "stories" and running.context_length > 0 and running.size > 0
    assert running.size_vram == 0  # all of it in host memory on a CPU
    assert running.details.family == "llama"
    [raw] = httpx.get(f"{server.url}/api/ps").json()["models"]
    assert raw["requests_in_flight"] == 0 and raw["memory"]["weights_bytes"] > 0  # localserve's fields beside
    version = httpx.get(f"{server.url}/api/version").json()
    assert version["version"].count(".") == 2 and version["localserve"]
    assert httpx.head(f"{server.url}/").status_code == 200


# -- chat and generate -------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Once upon a time"}]


def openai_reply(server: RunningServer, **fields: object) -> dict:
    body = {"model": "stories", "messages": MESSAGES, "temperature": 0, "max_tokens": 12, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]


def test_chat_whole_and_streamed_equal_the_openai_endpoint(client: ollama.Client, server: RunningServer) -> None:
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat("stories", messages=MESSAGES, options=options, stream=False)
    expected = openai_reply(server)["message"]["content"]
    assert whole.message.content == expected and whole.message.role == "assistant"
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12
    assert whole.prompt_eval_count == len(httpx.post(f"{server.url}/tokenize", json={
        "model": "stories", "messages": MESSAGES}).json()["tokens"])
    assert whole.total_duration >= whole.eval_duration > 0 and whole.prompt_eval_duration > 0
    parts = list(client.chat("stories", messages=MESSAGES, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == expected and len(parts) > 3
    stopped = client.chat("stories", messages=MESSAGES, options={**options, "stop": [expected[5:9]]}, stream=False)
    assert stopped.message.content == expected[:5] and stopped.done_reason == "stop"


def test_chat_follows_options_and_seeds(client: ollama.Client) -> None:
    sampled = [client.chat("stories", messages=MESSAGES, options={"seed": 7, "num_predict": 10}).message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # Ollama's default temperature 0.8, the same seed
    other = client.chat("stories", messages=MESSAGES, options={"seed": 8, "num_predict": 10}).message.content
    assert other != sampled[0]


def test_structured_output_by_format(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    reply = client.chat("stories", messages=MESSAGES, format=schema, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(reply.message.content), schema)
    # "json": any object (a story model never ends one; what it wrote is held to JSON)
    as_json = client.generate("stories", prompt="Once upon a time", format="json",
                              options={"temperature": 0, "num_predict": 6})
    assert as_json.response.startswith('{"') and as_json.done_reason == "length"


def test_generate_templated_raw_and_context(client: ollama.Client, server: RunningServer) -> None:
    options = {"temperature": 0, "num_predict": 8}
    templated = client.generate("stories", prompt="Once upon a time", options=options)
    assert templated.response == openai_reply(server, max_tokens=8)["message"]["content"]
    assert len(templated.context) == templated.prompt_eval_count + templated.eval_count
    raw = client.generate("stories", prompt="Once upon a time", raw=True, options=options)
    completion = httpx.post(f"{server.url}/v1/completions", json={
        "model": "stories", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 8}, timeout=60).json()
    assert raw.response == completion["choices"][0]["text"] and raw.context is None
    # The context given back carries the conversation on: the next prompt follows it.
    follow = client.generate("stories", prompt="The end.", context=templated.context, options=options)
    assert follow.prompt_eval_count > len(templated.context)
    parts = list(client.generate("stories", prompt="Once upon a time", options=options, stream=True))
    assert "".join(p.response for p in parts) == templated.response and parts[-1].context == templated.context


def test_load_and_unload_by_empty_requests(client: ollama.Client) -> None:
    assert client.generate("stories").done_reason == "load"
    assert "stories" in [m.model for m in client.ps().models]
    assert client.chat("stories", messages=[], keep_alive=0).done_reason == "unload"
    assert "stories" not in [m.model for m in client.ps().models]
    # load_duration: the time to load, when the request had to wait for one.
    cold = client.chat("stories", messages=MESSAGES, options={"num_predict": 2})
    warm = client.chat("stories", messages=MESSAGES, options={"num_predict": 2})
    assert cold.load_duration > 0 and warm.load_duration == 0 and cold.total_duration > cold.load_duration


def test_refusals_are_ollama_errors(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError, match="suffix"):
        client.generate("stories", prompt="def f(", suffix="    return x")
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat("nope", messages=MESSAGES)
    assert unknown.value.status_code == 404
    with pytest.raises(ollama.ResponseError, match="role"):
        client.chat("stories", messages=[{"role": "wizard", "content": "hi"}])


def test_langchain_chat_ollama(server: RunningServer) -> None:
    from langchain_ollama import ChatOllama

    chat = ChatOllama(model="stories", base_url=server.url, temperature=0, num_predict=12)
    answer = chat.invoke("Once upon a time")
    assert answer.content == openai_reply(server)["message"]["content"]
    assert "".join(chunk.content for chunk in chat.stream("Once upon a time")) == answer.content


TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                              "parameters": {"type": "object", "properties": {
                                                  "zone": {"type": "string", "enum": ["CET", "UTC"]}},
                                                  "required": ["zone"], "additionalProperties": False}}}
# Held to Llama's call format by a schema, the reply is read back as a call.
CALL = {"type": "object", "properties": {"name": {"const": "get_time"},
                                         "parameters": TIME_TOOL["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False}


def test_tool_calls_whole_streamed_and_sent_back(client: ollama.Client, server: RunningServer) -> None:
    ask = dict(model="tooly", messages=MESSAGES, tools=[TIME_TOOL], format=CALL, options={"temperature": 0})
    reply = client.chat(**ask)
    [call] = reply.message.tool_calls
    assert call.function.name == "get_time" and reply.message.content == "" and reply.done_reason == "stop"
    jsonschema.validate(dict(call.function.arguments), TIME_TOOL["function"]["parameters"])
    parts = list(client.chat(**ask, stream=True))
    assert parts[-1].message.tool_calls == reply.message.tool_calls and not any(p.message.tool_calls for p in parts[:-1])
    # The call and its result sent back: the arguments reach the template as an object.
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_time", "arguments": dict(call.function.arguments)}}]},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"}]
    follow = client.chat("tooly", messages=history, tools=[TIME_TOOL], options={"temperature": 0, "num_predict": 4})
    openai_history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_time",
                                                     "arguments": json.dumps(dict(call.function.arguments))}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "1"}]
    usage = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tooly", "messages": openai_history, "tools": [TIME_TOOL], "max_tokens": 1}).json()["usage"]
    assert follow.prompt_eval_count == usage["prompt_tokens"]  # rendered as the OpenAI endpoint renders it


def test_thinking(client: ollama.Client, server: RunningServer) -> None:
    """The template opens a think block the story model never closes: all of it is
    thinking, as the OpenAI endpoint reads it too; think: false closes it in the prompt."""
    reply = client.chat("thinker", messages=MESSAGES, options={"temperature": 0, "num_predict": 12})
    served = openai_reply(server, model="thinker")["message"]
    assert reply.message.thinking == served["reasoning_content"] and reply.message.content == served["content"] == ""
    parts = list(client.chat("thinker", messages=MESSAGES, options={"temperature": 0, "num_predict": 12}, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking
    plain = client.chat("thinker", messages=MESSAGES, think=False, options={"temperature": 0, "num_predict": 12})
    assert plain.message.thinking is None and plain.message.content


def test_serve_listens_on_ollamas_port_too(tmp_path: Path) -> None:
    """`serve --ollama-port`: a second listener for clients that only know Ollama's address."""
    import os
    import subprocess
    import sys

    from .test_service import free_port, wait_healthy

    port, ollama_port = free_port(), free_port()
    env = {**os.environ, "LOCALSERVE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "localserve.cli", "serve", "--port", str(port), "--ollama-port",
                                str(ollama_port), "--device", "cpu", "--kv-cache-memory", "64MiB"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        client = ollama.Client(host=f"http://127.0.0.1:{ollama_port}", timeout=60)
        assert "demo:latest" in {m.model for m in client.list().models}
        reply = client.generate("demo", prompt="Once upon a time", raw=True, options={"temperature": 0, "num_predict": 4})
        same = httpx.post(f"http://127.0.0.1:{port}/api/generate", timeout=60, json={
            "model": "demo", "prompt": "Once upon a time", "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 4}}).json()
        assert reply.response == same["response"] and reply.eval_count == 4
    finally:
        process.terminate()
        process.wait(timeout=60)
