"""What the daemon is told to do (``ServerConfig``): the models it serves, where it
listens, its limits and the engine options its models load with. A plain dataclass that
the command line (cli.py), the application (app.py) and the model manager read, kept
apart from them so that none has to import another to name it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engine.config import EngineConfig
from ..errors import LocalserveError
from ..vision.image_fetch import ImageFetcher

DEFAULT_KEEP_ALIVE_S = 300.0
MAX_CLIENT_TIMEOUT_S = 3600.0  # waiting longer for a client's bytes defends against nothing
MAX_CONNECTIONS = 1 << 20  # Linux's default ceiling on a process's open files (fs.nr_open)


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
    # Folders whose files /api/pull and /api/create may read (none: only registries and URLs over HTTP).
    allow_pull_from: list[Path] = field(default_factory=list)
    keep_alive: float = DEFAULT_KEEP_ALIVE_S  # seconds; math.inf keeps forever
    max_loaded_models: int = 3
    max_queued_requests: int = 256  # per model, beyond the running batch
    drain_timeout: float = 30.0  # seconds SIGTERM waits for running requests
    # Slow clients (slow_clients.py): seconds to send a request's headers, seconds a body may
    # stall between chunks, and open connections at most (more are answered 503).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024
    tool_parser: str = "auto"  # how replies' tool calls are read: from the chat template, a format, or "none"
    reasoning_parser: str = "auto"  # <think> blocks: "auto" (from the template), "think" or "none"
    # Each model's engine in a process of its own (engine_process/), not on a thread of the daemon's.
    engine_processes: bool = False
    # Fetches image_url parts (and Anthropic url sources) named by http(s) URLs; None: refused
    # (--allow-image-urls, --image-url-host).
    image_fetcher: ImageFetcher | None = None

    def __post_init__(self) -> None:
        for value, option in ((self.header_timeout, "--header-timeout"), (self.body_timeout, "--body-timeout")):
            # NaN and infinity fail the comparison too.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_CLIENT_TIMEOUT_S:
                raise LocalserveError(f"{option} must be a number of seconds above 0 and at most "
                                      f"{MAX_CLIENT_TIMEOUT_S:g}, not {value!r}")
        if type(self.max_connections) is not int or not 1 <= self.max_connections <= MAX_CONNECTIONS:
            raise LocalserveError(f"--max-connections must be a whole number from 1 to {MAX_CONNECTIONS}, "
                                  f"not {self.max_connections!r}")
