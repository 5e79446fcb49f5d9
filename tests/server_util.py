"""A real localserve HTTP server in a background thread, for tests that need sockets
(the openai SDK, disconnects, concurrency)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import uvicorn

from localserve.engine.config import EngineConfig
from localserve.server.app import create_app
from localserve.server.config import ServerConfig
from localserve.server.serve import listener_config

from .conftest import STORIES_HF

# A plain template, so the real trained stories model can chat.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``condition`` came true within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def stories_with_template(root: Path, template: str = CHAT_TEMPLATE, name: str = "stories") -> Path:
    """stories260K-hf copied from tests/data (1.2 MB; a folder of links out of itself is
    refused by pull) with a chat template added."""
    folder = root / name
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(STORIES_HF / name, folder / name)
    config = json.loads((STORIES_HF / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def small_engine_config(**overrides: object) -> EngineConfig:
    return EngineConfig(**{"kv_cache_memory": 64 << 20, "max_num_seqs": 64, **overrides})  # type: ignore[arg-type]


class RunningServer:
    def __init__(self, config: ServerConfig, **app_options: object) -> None:
        self.app = create_app(config, **app_options)  # type: ignore[arg-type]
        self.state = self.app.state.localserve
        # The listener settings `localserve serve` uses (slow clients cut off, connections capped).
        self.server = uvicorn.Server(listener_config(self.app, config, port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self.server.server_state.connections)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True) -> None:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and (self.state.ready or not wait_ready)):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextmanager
def running_server(config: ServerConfig, wait_ready: bool = True, **app_options: object) -> Iterator[RunningServer]:
    server = RunningServer(config, **app_options)
    server.start(wait_ready)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def stories_client(root: Path, template: str = CHAT_TEMPLATE, **config_fields: object) -> Iterator[openai.OpenAI]:
    """The openai SDK (strict response validation) against a server of stories260K with
    ``template`` as its chat template; ``config_fields``: further ServerConfig fields."""
    path = stories_with_template(root, template)
    config = ServerConfig(models={"stories": path}, preload=["stories"], engine=small_engine_config(), device="cpu",
                          **config_fields)  # type: ignore[arg-type]
    with running_server(config) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", _strict_response_validation=True,
                            max_retries=0)
