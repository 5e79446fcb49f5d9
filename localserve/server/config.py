"""What the daemon is told to do (``ServerConfig``): the models it serves, where it
listens, its limits and the engine options its models load with. A plain dataclass that
the command line (cli.py), the application (app.py) and the model manager read, kept
apart from them so that none has to import another to name it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engine.config import EngineConfig

DEFAULT_KEEP_ALIVE_S = 300.0


@dataclass
class ServerConfig:
    models: dict[str, Path] = field(default_factory=dict)  # name -> checkpoint path
    registry_home: Path | None = None  # the registry whose models are served too (None: only `models`)
    preload: list[str] = field(default_factory=list)  # names loaded at start-up
    engine: EngineConfig = field(default_factory=EngineConfig)
    device: str | None = None
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    ollama_port: int | None = None  # a second listener, where Ollama's clients look by default (11434)
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = 32 << 20
    keep_alive: float = DEFAULT_KEEP_ALIVE_S  # seconds; math.inf keeps forever
    max_loaded_models: int = 3
    max_queued_requests: int = 256  # per model, beyond the running batch
    drain_timeout: float = 30.0  # seconds SIGTERM waits for running requests
    tool_parser: str = "auto"  # how replies' tool calls are read: from the chat template, a format, or "none"
    reasoning_parser: str = "auto"  # <think> blocks: "auto" (from the template), "think" or "none"
