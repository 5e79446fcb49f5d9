"""Per-model defaults, as Ollama's Modelfile gives them: the format (parsed and written
back), the registry's made models (sharing their base's blobs), and the daemon applying
them under each request's own fields, through the official ollama and openai clients."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from click.testing import CliRunner

from localserve.cli.main import main
from localserve.errors import LocalserveError
from localserve.registry import Registry
from localserve.registry.builtin import DEMO
from localserve.registry.create import create_model
from localserve.registry.modelfile import Modelfile, parse_modelfile, render_modelfile
from localserve.registry.settings import ModelSettings
from localserve.server.config import ServerConfig
from localserve.server.generation import sampling_params
from localserve.server.protocol import ChatCompletionRequest

from .conftest import DATA
from .server_util import CHAT_TEMPLATE, RunningServer, running_server, small_engine_config, stories_with_template

STORIES_GGUF = DATA / "models" / "stories260K.gguf"

FULL = '''# a comment line
FROM ./stories.gguf
parameter temperature 0.25
PARAMETER top_k 7
PARAMETER num_predict 12
PARAMETER stop "<|end|>"
PARAMETER stop """say "when" now"""
PARAMETER num_thread 4
SYSTEM """You tell
short stories."""
TEMPLATE {{ bos_token }}{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}|{% endfor %}
MESSAGE user Tell me about the sea.
MESSAGE assistant "The sea is \\"big\\"."
LICENSE """MIT License

Permission is hereby granted."""
'''


# -- the format -------------------------------------------------------------------------

def test_every_instruction_is_read() -> None:
    made = parse_modelfile(FULL)
    assert made.base == "./stories.gguf"
    assert made.settings.parameters == {"temperature": 0.25, "top_k": 7, "num_predict": 12,
                                        "stop": ["<|end|>", 'say "when" now']}  # num_thread: Ollama's runner's
    assert made.settings.system == "You tell\nshort stories."
    assert made.settings.template == "{{ bos_token }}{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}|{% endfor %}"
    assert made.settings.messages == ({"role": "user", "content": "Tell me about the sea."},
                                      {"role": "assistant", "content": 'The sea is "big".'})
    assert made.licenses == ["MIT License\n\nPermission is hereby granted."]


@pytest.mark.parametrize("value", ['plain', 'ends with a quote"', 'holds """ three', "line\nbreak", " spaced ", ""])
def test_what_show_writes_reads_back_the_same(value: str) -> None:
    settings = ModelSettings.checked({"stop": [value or "x"], "seed": 3}, system=value, template=value,
                                     messages=[{"role": "user", "content": value}])
    text = render_modelfile("demo", settings, [value], "a title")
    assert parse_modelfile(text) == Modelfile("demo", settings, [value])


@pytest.mark.parametrize(("text", "error"), [
    ("PARAMETER temperature 1", "no FROM line"),
    ("FROM a\nFROM b", "line 2: a second FROM"),
    ("FROM a\n\nPARAMETER warmth 1", "line 3: unknown parameter 'warmth'"),
    ("FROM a\nPARAMETER top_k many", "line 2: top_k takes an integer"),
    ("FROM a\nPARAMETER temperature 9", "line 2: temperature 9.0 is out of range"),
    ("FROM a\nPARAMETER top_p 0", "line 2: top_p 0.0 is out of range"),
    ("FROM a\nSYSTEM \"\"\"never closed", "line 2: the SYSTEM opened with \"\"\" is never closed"),
    ("FROM a\nSYSTEM \"open", "line 2: the SYSTEM opens a quote"),
    ("FROM a\nSYSTEM \"x\" more", "line 2: text after the SYSTEM's closing quote"),
    ("FROM a\nMESSAGE tool hello", "line 2: MESSAGE 'tool'"),
    ("FROM a\nADAPTER ./lora.gguf", "line 2: ADAPTER (LoRA adapters) is not supported"),
    ("FROM a\nQUANTIZE q4", "line 2: unknown instruction 'QUANTIZE'"),
    ("FROM a\n42", "line 2: expected an instruction"),
])
def test_a_wrong_modelfile_names_its_line(text: str, error: str) -> None:
    with pytest.raises(LocalserveError, match=None) as raised:
        parse_modelfile(text)
    assert error in str(raised.value)


def test_settings_merge_and_lead_the_conversation() -> None:
    base = ModelSettings.checked({"temperature": 0.5, "num_predict": 9}, system="base", messages=[
        {"role": "user", "content": "hi"}])
    made = ModelSettings.checked({"temperature": 0.1}).over(base)
    assert made.parameters == {"temperature": 0.1, "num_predict": 9} and made.system == "base"
    assert made.request_fields() == {"temperature": 0.1, "max_tokens": 9}
    assert ModelSettings.checked({"num_predict": -1}).request_fields() == {}  # until the context's end
    asked = [{"role": "user", "content": "q"}]
    assert made.conversation(asked) == [{"role": "system", "content": "base"}, {"role": "user", "content": "hi"},
                                        *asked]
    own = [{"role": "system", "content": "mine"}, *asked]
    assert made.conversation(own) == [{"role": "user", "content": "hi"}, *own]  # the request's system wins


def test_request_fields_win_over_the_model_and_the_model_over_the_api() -> None:
    defaults = {"temperature": 0.8, "top_k": 40, **ModelSettings.checked(
        {"temperature": 0.0, "num_predict": 50, "stop": ["END"], "seed": 5}).request_fields()}
    bare = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    params = sampling_params(bare, prompt_len=10, max_model_len=1000, defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens, params.stop, params.seed) == (0.0, 40, 50, ["END"], 5)
    assert sampling_params(bare, prompt_len=980, max_model_len=1000, defaults=defaults).max_tokens == 20  # what is left
    asked = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                  "temperature": 0.7, "max_tokens": 3, "stop": "S", "top_k": 0})
    params = sampling_params(asked, prompt_len=10, max_model_len=1000, defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens, params.stop) == (0.7, 0, 3, ["S"])


# -- the registry -----------------------------------------------------------------------

def test_a_model_made_from_a_registry_model_shares_its_blobs(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "home")
    demo = registry.get("demo")
    made = create_model(registry, "teller", parse_modelfile("FROM demo\nPARAMETER temperature 0.3\nSYSTEM Be brief."))
    assert {f.digest for f in made.files if f.role != "settings"} == {f.digest for f in demo.files if f.role != "settings"}
    # the demo's own num_predict is kept, under the new parameter
    assert registry.settings(registry.get("teller")) == ModelSettings.checked(
        {"num_predict": 200, "temperature": 0.3}, system="Be brief.")
    assert made.source == "created from demo" and made.architecture == demo.architecture
    registry.remove("teller")
    assert registry.blobs.has(demo.files[0].digest)  # the demo's blobs stay


def test_a_model_made_from_a_file_beside_the_modelfile(tmp_path: Path) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    shutil.copyfile(STORIES_GGUF, folder / "stories.gguf")
    registry = Registry(tmp_path / "home")
    made = create_model(registry, "full", parse_modelfile(FULL), folder)
    settings = registry.settings(made)
    assert settings.system == "You tell\nshort stories." and len(settings.messages) == 2
    assert made.license == "MIT License"
    license_file = next(f for f in made.files if f.role == "license")
    assert registry.blobs.path(license_file.digest).read_text() == "MIT License\n\nPermission is hereby granted."
    assert [f.role for f in made.files].count("license") == 1


@pytest.mark.parametrize(("modelfile", "error"), [
    ("FROM ./missing.gguf", "FROM ./missing.gguf: no such file or folder"),
    ("FROM nobody-has-this", "'nobody-has-this:latest' is not in the registry"),
    ("FROM demo\nTEMPLATE {{ .Prompt }}", "Ollama's Go templates"),
    ("FROM demo\nTEMPLATE {% for m in messages %}", "TEMPLATE:"),
])
def test_a_model_that_cannot_be_made_leaves_the_registry_as_it_was(tmp_path: Path, modelfile: str,
                                                                     error: str) -> None:
    registry = Registry(tmp_path / "home")
    blobs = sorted(p.name for p in registry.blobs.root.iterdir())
    with pytest.raises(LocalserveError) as raised:
        create_model(registry, "broken", parse_modelfile(modelfile), tmp_path)
    assert error in str(raised.value)
    assert [str(r.name) for r in registry.list()] == ["demo:latest"]
    assert sorted(p.name for p in registry.blobs.root.iterdir()) == blobs


def test_an_older_registrys_demo_gets_its_defaults_but_a_users_demo_is_kept(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "home")
    record = registry.get("demo")
    record.files = [f for f in record.files if f.role != "settings"]  # as registries before settings held it
    registry.add(record)
    assert Registry(tmp_path / "home").settings(registry.get("demo")) == DEMO.settings
    create_model(registry, "demo", parse_modelfile("FROM demo\nPARAMETER num_predict 7"))
    reopened = Registry(tmp_path / "home")
    assert reopened.settings(reopened.get("demo")).parameters == {"num_predict": 7}


def test_broken_stored_settings_are_a_clear_error(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "home")
    record = create_model(registry, "teller", parse_modelfile("FROM demo\nPARAMETER seed 1"))
    stored = next(f for f in record.files if f.role == "settings")
    path = registry.blobs.path(stored.digest)
    path.chmod(0o644)
    path.write_bytes(b'{"parameters": {"temperature": "hot"}}')
    with pytest.raises(LocalserveError, match="teller:latest's settings: temperature takes a number"):
        registry.settings(registry.get("teller"))


# -- the daemon -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("modelfile")
    registry = Registry(root / "registry")
    create_model(registry, "stories", Modelfile(str(stories_with_template(root, CHAT_TEMPLATE))))
    config = ServerConfig(registry_home=root / "registry", engine=small_engine_config(), device="cpu")
    with running_server(config) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


def rendered(server: RunningServer, model: str, messages: list[dict[str, str]]) -> str:
    """The prompt the daemon renders for ``messages`` (its /tokenize, then /detokenize)."""
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": model, "messages": messages}, timeout=60).json()
    return httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": tokens["tokens"]},
                      timeout=60).json()["prompt"]


def test_the_ollama_client_creates_a_model_whose_defaults_every_api_applies(client: ollama.Client,
                                                                           server: RunningServer) -> None:
    client.create(model="brief", from_="stories", parameters={"num_predict": 5, "temperature": 0},
                  system="Be brief.", messages=[{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "Hello"}])
    shown = client.show("brief")
    assert shown.parameters.splitlines() == [f"{'num_predict':<30} 5", f"{'temperature':<30} 0.0"]
    assert parse_modelfile(shown.modelfile).settings == ModelSettings.checked(
        {"num_predict": 5, "temperature": 0.0}, system="Be brief.",
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    # Ollama's routes: the model's num_predict, unless the request's options say otherwise
    answer = client.generate(model="brief", prompt="Once upon a time")
    assert (answer.eval_count, answer.done_reason) == (5, "length")
    assert client.generate(model="brief", prompt="Once upon a time", options={"num_predict": 2}).eval_count == 2
    # temperature 0 from the model, not Ollama's 0.8: the same reply every time
    replies = {client.chat(model="brief", messages=[{"role": "user", "content": "A cat"}]).message.content
               for _ in range(3)}
    assert len(replies) == 1
    # OpenAI's route applies them too
    openai_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    completion = openai_client.chat.completions.create(model="brief", messages=[{"role": "user", "content": "A cat"}])
    assert completion.usage.completion_tokens == 5 and completion.choices[0].finish_reason == "length"
    # the system prompt and opening turns lead, unless the request has its own system prompt
    assert rendered(server, "brief", [{"role": "user", "content": "A cat"}]).endswith(
        "system: Be brief.\nuser: Hi\nassistant: Hello\nuser: A cat\nassistant:")
    assert rendered(server, "brief", [{"role": "system", "content": "Mine."}, {"role": "user", "content": "A cat"}]
                    ).endswith("user: Hi\nassistant: Hello\nsystem: Mine.\nuser: A cat\nassistant:")


def test_a_template_and_a_context_of_the_models_own(client: ollama.Client, server: RunningServer) -> None:
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    client.create(model="short", from_="stories", template=template, parameters={"num_ctx": 64})
    assert client.show("short").template == template
    assert rendered(server, "short", [{"role": "user", "content": "A cat"}]).endswith("[user] A cat ")
    client.generate(model="short", prompt="x", options={"num_predict": 1})
    assert next(m for m in client.ps().models if m.model == "short:latest").context_length == 64


def test_older_clients_send_a_whole_modelfile(server: RunningServer) -> None:
    lines = httpx.post(f"{server.url}/api/create", json={
        "model": "old", "modelfile": "FROM stories\nPARAMETER num_predict 3\nPARAMETER stop \"the\""}, timeout=60)
    assert [line["status"] for line in map(__import__("json").loads, lines.text.splitlines())][-1] == "success"
    shown = httpx.post(f"{server.url}/api/show", json={"model": "old"}, timeout=60).json()
    assert shown["settings"]["parameters"] == {"num_predict": 3, "stop": ["the"]}


@pytest.mark.parametrize(("body", "error"), [
    ({"model": "x", "from": "stories", "files": {"a.gguf": "sha256:00"}}, "uploaded files"),
    ({"model": "x", "from": "stories", "parameters": {"warmth": 1}}, "unknown parameter 'warmth'"),
    ({"model": "x", "modelfile": "FROM stories\nSYSTEM \"\"\"open"}, "never closed"),
    ({"model": "x"}, "from: name the model"),
    ({"model": "x", "from": "nobody-has-this"}, "not in the registry"),
])
def test_a_bad_create_is_a_clear_error_and_nothing_is_made(client: ollama.Client, body: dict, error: str,
                                                           server: RunningServer) -> None:
    answer = httpx.post(f"{server.url}/api/create", json={**body, "stream": False}, timeout=60)
    assert answer.status_code in (400, 404) and error in answer.json()["error"]
    assert "x:latest" not in [m.model for m in client.list().models]


# -- the command line -------------------------------------------------------------------

def test_create_show_and_run_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOCALSERVE_URL", "http://127.0.0.1:9")  # no daemon: run in-process
    (tmp_path / "Modelfile").write_text("FROM demo\nPARAMETER num_predict 8\nSYSTEM Once upon a time")
    runner = CliRunner()
    made = runner.invoke(main, ["create", "teller", "-f", str(tmp_path / "Modelfile")])
    assert made.exit_code == 0, made.output
    shown = runner.invoke(main, ["show", "teller", "--modelfile"])
    assert parse_modelfile(shown.output).settings.parameters == {"num_predict": 8}
    assert runner.invoke(main, ["show", "teller", "--parameters"]).output == f"{'num_predict':<30} 8\n"
    ran = runner.invoke(main, ["run", "teller", "Lily"])
    assert ran.exit_code == 0, ran.output
    assert "[stopped at the length limit" in ran.stderr
    assert runner.invoke(main, ["create", "bad", "-f", str(tmp_path / "none")]).exit_code != 0


def test_the_readme_quick_start_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`localserve run demo "Once upon a time"` stops at the demo's num_predict and says why."""
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOCALSERVE_URL", "http://127.0.0.1:9")
    ran = CliRunner().invoke(main, ["run", "demo", "Once upon a time"])
    assert ran.exit_code == 0, ran.output
    from localserve.formats import open_checkpoint

    tokenizer = open_checkpoint(STORIES_GGUF).tokenizer()
    assert tokenizer is not None
    assert 190 <= len(tokenizer.encode(ran.stdout.strip(), add_special_tokens=False)) <= 210  # 200 tokens, re-encoded
    assert "[stopped at the length limit" in ran.stderr
