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
import ollama
import pytest
from safetensors import safe_open

from localserve.server.config import ServerConfig

from .conftest import STORIES_HF
from .server_util import CHAT_TEMPLATE, RunningServer, running_server, small_engine_config, stories_with_template

pytestmark = pytest.mark.skipif(not STORIES_HF.is_dir(), reason="../shared/models/stories260K-hf not present")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("ollama")
    config = ServerConfig(models={"stories": stories_with_template(root, CHAT_TEMPLATE)},
                          registry_home=root / "registry", engine=small_engine_config(), device="cpu")
    with running_server(config) as running:
        yield running


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


def test_pull_a_local_folder_copy_and_delete(client: ollama.Client, tmp_path: Path) -> None:
    folder = stories_with_template(tmp_path, CHAT_TEMPLATE, name="tiny-stories")
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
    with pytest.raises(ollama.ResponseError, match="neither a file or folder"):
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
