"""The block the daemon logs once it is ready: its version, the device, each model loaded
at start with its memory (weights, KV cache), the models it loads on demand, and the
URLs to use. One log record, so the journal and a terminal show the same lines.

``startup_facts`` reads them from the server's state; ``startup_summary`` only formats,
so it is tested on facts made up in the test."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import __version__
from ..units import human_bytes

if TYPE_CHECKING:
    from .state import ServerState

log = logging.getLogger(__name__)

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # reached on loopback from this host
_DEFAULT_URL = "http://127.0.0.1:8000"  # where `localserve top` looks unless told
_SHOWN_ON_DEMAND = 5  # names listed of the models loaded on demand
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8", "int8": "int8"}


@dataclass(frozen=True)
class ModelFacts:
    name: str
    architecture: str
    format: str  # gguf, gptq, awq, safetensors
    quantization: str  # its main type (GGUF: the largest share), or the stored dtype
    weights_bytes: int  # on the device
    host_weights_bytes: int  # experts kept in host memory (cpu_moe)
    kv_tokens: int  # the device pool
    kv_bytes: int
    kv_dtype: str
    max_num_seqs: int
    max_model_len: int  # tokens one sequence may hold (prompt and output)
    cpu_kv_tokens: int = 0  # the host tier swapped-out sequences go to
    cpu_kv_bytes: int = 0
    embeds: bool = False


@dataclass(frozen=True)
class StartupFacts:
    host: str  # as given to --host
    port: int
    device: str  # cpu, cuda:0
    device_name: str  # the CPU's model or the GPU's name
    threads: int | None = None  # CPU threads (cpu only)
    cpu_kernels: str | None = None  # the CPU kernel build chosen (avx512_vnni, avx2), None: torch references
    models: list[ModelFacts] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # preloads that did not load
    on_demand: list[str] = field(default_factory=list)  # served names not loaded yet
    ollama_port: int | None = None
    api_key: bool = False
    version: str = __version__


def base_url(host: str, port: int) -> str:
    """The URL a client on this host uses for a listener on ``host``:``port``."""
    host = _WILDCARDS.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def kv_line(model: ModelFacts) -> str:
    """The KV pool in words: its size, and that it is shared, by how many sequences of
    what length at most."""
    dtype = _DTYPES.get(model.kv_dtype, model.kv_dtype)
    line = (f"KV cache: {model.kv_tokens:,} tokens ({human_bytes(model.kv_bytes)} {dtype}) shared by up to "
            f"{model.max_num_seqs:,} sequences of at most {model.max_model_len:,} tokens")
    if model.cpu_kv_tokens:
        line += (f"; {model.cpu_kv_tokens:,} more ({human_bytes(model.cpu_kv_bytes)}) in host memory "
                 "for sequences swapped out")
    return line


def startup_summary(facts: StartupFacts) -> str:
    """The block, as lines of ``label  text`` under a heading."""
    rows: list[tuple[str, str]] = []
    device = f"{facts.device}: {facts.device_name}" if facts.device_name else facts.device
    if facts.device.startswith("cpu"):
        if facts.threads:
            device += f", {facts.threads} thread{'s' * (facts.threads != 1)}"
        device += f", CPU kernels {facts.cpu_kernels}" if facts.cpu_kernels else ", torch reference kernels"
    rows.append(("device", device))
    for model in facts.models:
        weights = f"weights {human_bytes(model.weights_bytes)}"
        if model.host_weights_bytes:
            weights += f" (+ {human_bytes(model.host_weights_bytes)} of experts in host memory)"
        kind = ", embeddings" if model.embeds else ""
        rows.append(("model", f"{model.name}: {model.architecture}, {model.format} {model.quantization}{kind}, "
                              f"{weights}"))
        rows.append(("", kv_line(model)))
    for name in facts.failed:
        rows.append(("model", f"{name}: not loaded (the error is above)"))
    if not facts.models and not facts.failed:
        rows.append(("model", "none loaded yet"))
    if facts.on_demand:
        shown = ", ".join(facts.on_demand[:_SHOWN_ON_DEMAND])
        more = len(facts.on_demand) - _SHOWN_ON_DEMAND
        count = len(facts.on_demand)
        rows.append(("on demand", f"{count} model{'s' * (count != 1)}, loaded on first request: {shown}"
                                  + (f" and {more} more (localserve list)" if more > 0 else "")))
    url = base_url(facts.host, facts.port)
    rows.append(("OpenAI", f"{url}/v1"))
    ollama = url if facts.ollama_port is None else f"{url} and {base_url(facts.host, facts.ollama_port)}"
    rows.append(("Ollama", ollama))
    rows.append(("dashboard", "localserve top" if url == _DEFAULT_URL else f"localserve top --url {url}"))
    if facts.api_key:
        rows.append(("API key", "required: send Authorization: Bearer KEY (/health is open)"))
    if facts.host in _WILDCARDS:
        rows.append(("listening", f"on every address of this host ({facts.host or '*'}), port {facts.port}"))
    width = max(len(label) for label, _ in rows)
    lines = [f"localserve {facts.version} is ready"]
    lines += [f"  {label:<{width}}  {text}".rstrip() for label, text in rows]
    return "\n".join(lines)


def startup_facts(state: ServerState, host: str, port: int, ollama_port: int | None = None) -> StartupFacts:
    """What the summary says, read from a started server's state (the listener's
    ``host``/``port``, as bound)."""
    config = state.config
    manager = state.manager
    loaded = dict(manager.loaded)
    models = [_model_facts(name, model) for name, model in loaded.items()]
    loaded_names = set(loaded)
    failed = []
    for name in config.preload:
        canonical = manager.catalog.canonical(name) or name
        if canonical not in loaded_names and name not in loaded_names:
            failed.append(name)
    try:
        served = manager.catalog.names()
    except Exception:  # an unreadable registry: the summary goes out without the list
        served = []
    on_demand = [name for name in served if name not in loaded_names and name not in failed]
    threads = kernels = None
    if state.device.startswith("cpu"):
        threads = config.engine.cpu_threads()
        if config.engine_processes:  # named by an engine process: the daemon imports no kernels
            kernels = next((model.engine.cpu_kernels for model in loaded.values()), None)
        elif not config.engine.disable_cpu_kernels:
            from ..kernels import cpu_library

            kernels = cpu_library.variant()
    return StartupFacts(host=host, port=port, device=state.device, device_name=state.device_name, threads=threads,
                        cpu_kernels=kernels, models=models, failed=failed, on_demand=on_demand,
                        ollama_port=ollama_port, api_key=bool(config.api_key))


def _model_facts(name: str, model: object) -> ModelFacts:
    from .engine_process.remote import EngineFacts

    engine = model.engine.engine  # type: ignore[attr-defined]
    memory = model.engine.memory  # type: ignore[attr-defined]
    description = model.description()  # type: ignore[attr-defined]
    block_size = engine.config.block_size
    if isinstance(engine, EngineFacts):  # in an engine process: the figures it sent
        kv_tokens, cpu_kv_tokens, kv_dtype = engine.kv_tokens, engine.cpu_kv_tokens, engine.kv_dtype
    else:
        kv_tokens, cpu_kv_tokens = engine.kv.device.num_blocks * block_size, engine.kv.cpu.num_blocks * block_size
        kv_dtype = str(engine.kv_dtype).removeprefix("torch.")
    return ModelFacts(
        name=name, architecture=engine.spec.architecture, format=description["format"],
        quantization=description["quantization"].split(",")[0], weights_bytes=int(memory.get("weights_bytes", 0)),
        host_weights_bytes=int(memory.get("host_weights_bytes", 0)),
        kv_tokens=kv_tokens, kv_bytes=int(memory.get("kv_cache_bytes", 0)),
        kv_dtype=kv_dtype, max_num_seqs=engine.config.max_num_seqs,
        max_model_len=engine.max_model_len, cpu_kv_tokens=cpu_kv_tokens,
        cpu_kv_bytes=int(memory.get("cpu_kv_cache_bytes", 0)), embeds=engine.spec.pooling is not None)


def log_startup_summary(state: ServerState, host: str, port: int, ollama_port: int | None = None) -> None:
    """Log the block at INFO; a failure to gather it is a warning, never the daemon's end."""
    try:
        summary = startup_summary(startup_facts(state, host, port, ollama_port))
    except Exception as exc:
        log.warning("could not write the start-up summary: %s", exc)
        return
    # No highlighter: rich would colour digits inside names and versions ("llama3.2:1b").
    log.info("%s", summary, extra={"highlighter": None})
