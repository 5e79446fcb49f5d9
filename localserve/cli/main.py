"""The `localserve` command."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .. import __version__
from click.core import ParameterSource

from .options import config_file_option, default_config_path, env_for_every_option, reread
from ..engine.config import KV_CACHE_DTYPES, MAX_THREADS, EngineConfig
from ..engine.speculative.config import MAX_DRAFT_TOKENS, METHODS, SpeculativeConfig
from ..errors import LocalserveError

if TYPE_CHECKING:
    from .run_backends import Backend

# Set (to anything), an unexpected error shows its traceback instead of one line.
DEBUG_ENV = "LOCALSERVE_DEBUG"
_DEFAULTS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
             for f in dataclasses.fields(EngineConfig)}


class ByteSize(click.ParamType):
    """A size in bytes: plain (``1073741824``) or with a unit (``512MiB``, ``4GiB``, ``2GB``)."""

    name = "size"
    _UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
              "t": 1 << 40, "tib": 1 << 40}

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().replace(" ", "")
        number = text.rstrip("kmgtib")
        unit = text[len(number):]
        try:
            size = float(number) * self._UNITS[unit]
        except (ValueError, KeyError):
            self.fail(f"{value!r} is not a size (e.g. 4GiB, 512MiB, 1073741824)", param, ctx)
        if size <= 0:
            self.fail(f"{value!r} must be positive", param, ctx)
        return int(size)


class LayerCount(click.ParamType):
    """A number of layers, or ``all``."""

    name = "N|all"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if value == "all":
            return value
        try:
            count = int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            count = -1
        if count < 0:
            self.fail(f"{value!r} is neither a number of layers nor 'all'", param, ctx)
        return count


class ModelPath(click.ParamType):
    """A model: a .gguf file or checkpoint folder, or a registry name (``name[:tag]``)."""

    name = "MODEL"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from ..registry import resolve_model

        try:
            return resolve_model(str(value))
        except LocalserveError as exc:
            self.fail(str(exc), param, ctx)


def engine_options(command: Callable[..., None]) -> Callable[..., None]:
    """The engine options every command that loads a model takes (``EngineConfig``
    fields, with its defaults)."""

    def option(flag: str, help: str, **kwargs: object) -> Callable[..., object]:
        field = flag.split("/")[0].removeprefix("--").replace("-", "_")
        default = _DEFAULTS[field]
        return click.option(flag, field, default=default, show_default=default is not None, help=help, **kwargs)

    options = [
        option("--max-model-len", "Longest prompt + output; default the model's context.", type=int),
        option("--max-num-seqs", "Sequences per step at most.", type=int),
        option("--max-num-batched-tokens", "Tokens per step at most (long prompts are prefilled in chunks); "
               "default 512 on the CPU, 2048 on a GPU.",
               type=int),
        option("--gpu-memory-utilization", "Share of the GPU's memory to use; the KV cache gets what the weights "
               "and activations leave.", type=float),
        option("--kv-cache-memory", "Size of the device KV cache (e.g. 4GiB); default: measured on CUDA; on "
               "the CPU room for --max-num-seqs sequences of the context, at most 25% of free memory.",
               type=ByteSize()),
        option("--kv-cache-dtype", "auto is the model's dtype (on the CPU fp32, or fp16 for a GGUF of quantized "
               "weights, as llama.cpp); fp16 and bf16 take half of fp32, int8 and fp8 about half of fp16.",
               type=click.Choice(list(KV_CACHE_DTYPES))),
        option("--cpu-offload-gb", "GiB of host memory for swapped requests and spilled prefix blocks.", type=float),
        option("--enable-prefix-caching/--no-enable-prefix-caching", "Share the KV of equal prompt prefixes."),
        option("--cpu-moe", "Keep the MoE experts of the first N layers (bare flag: all) in host memory and run "
               "them on the CPU.", type=LayerCount(), is_flag=False, flag_value="all"),
        option("--threads", "CPU threads for the model's kernels; default: the physical cores; at most the CPUs "
               "this process may use.", type=click.IntRange(1, MAX_THREADS)),
        option("--exact-cpu-matmul/--no-exact-cpu-matmul", "Keep activations in fp32 in every CPU matmul instead "
               "of rounding them to int8 for GGUF's types as llama.cpp does, and an auto KV cache in fp32 (slower)."),
        option("--disable-cuda-graphs/--no-disable-cuda-graphs", "On a GPU, run decode steps eagerly instead of "
               "replaying the CUDA graphs captured at load."),
        click.option("--speculative", "speculative", type=click.Choice(list(METHODS)), default=None,
                     help="Speculative decoding: ngram drafts the tokens that followed the sequence's last few "
                          "earlier on (prompt lookup: no draft model), draft_model runs --draft-model; each step "
                          "verifies every request's drafts. "
                          "Exact: the output is what decoding without it gives (greedy) or follows (sampling)."),
        click.option("--draft-model", "--draft", "draft_model", type=ModelPath(), default=None,
                     help="Speculative decoding with a draft model: a smaller model of the same tokenizer (registry "
                          "name, .gguf file or checkpoint folder, e.g. Llama-3.2-1B for Llama-3.1-8B) proposes each "
                          "request's next tokens, in one batch, in its own KV cache (--speculative draft_model)."),
        click.option("--num-speculative-tokens", "num_speculative_tokens",
                     type=click.IntRange(0, MAX_DRAFT_TOKENS), default=None,
                     help="Draft tokens a request verifies per step at most (with --speculative or --draft-model; "
                          "default 4); "
                          "each request drafts fewer, or none, while its drafts are seldom accepted."),
        click.option("--prepared-cache/--no-prepared-cache", "prepared_cache", default=True, show_default=True,
                     help="On the CPU, keep a GGUF model's weights in the kernels' layout under <home>/prepared "
                          "(about the model's size on disk) and map them at the next load instead of converting "
                          "the file again."),
    ]
    for add in reversed(options):
        command = add(command)  # type: ignore[assignment]
    return command


def engine_config(options: dict[str, object]) -> EngineConfig:
    """The ``EngineConfig`` from a command's ``engine_options`` (removed from ``options``)."""
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    if "prepared_cache" in options:  # a flag here, a folder in the engine
        from ..registry import default_home

        options["prepared_cache"] = str(default_home() / "prepared") if options["prepared_cache"] else None
    method, draft_tokens = options.pop("speculative", None), options.pop("num_speculative_tokens", None)
    draft_model = options.pop("draft_model", None)
    if draft_model is not None:
        if method not in (None, "draft_model"):
            raise click.UsageError(f"--draft-model goes with --speculative draft_model, not {method}")
        method = "draft_model"
    if method is not None:
        options["speculative"] = SpeculativeConfig(method=method, num_tokens=4 if draft_tokens is None else draft_tokens,
                                                   draft_model=None if draft_model is None else str(draft_model))
    elif draft_tokens is not None:
        raise click.UsageError("--num-speculative-tokens needs --speculative or --draft-model")
    return EngineConfig(**{name: options.pop(name) for name in names if name in options})  # type: ignore[arg-type]


class _Commands(click.Group):
    """Every command's failure ends as one line and exit status 1, never a traceback: a
    LocalserveError (bad input, a bad file, an unknown name) as its message, an OSError
    (no permission, a full disk, a name too long) as what the system said of which file,
    anything else as an internal error (a bug), whose traceback LOCALSERVE_DEBUG=1 shows."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except LocalserveError as exc:
            raise click.ClickException(str(exc)) from exc
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: usage errors, --help, Ctrl-C at a prompt
        except OSError as exc:
            if exc.errno == errno.EPIPE or os.environ.get(DEBUG_ENV):
                raise  # a closed pipe (`| head`) click ends quietly
            raise click.ClickException(_os_error_line(exc)) from exc
        except Exception as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            raise click.ClickException(f"internal error (a bug): {type(exc).__name__}: {_shortened(str(exc))} "
                                       f"(run again with {DEBUG_ENV}=1 to see the traceback)") from exc


def _os_error_line(exc: OSError) -> str:
    """What the system refused and of which files, e.g. ``/x/blobs/tmp-1: No space left on device``."""
    reason = exc.strerror or str(exc)
    names = [_shortened(os.fsdecode(name)) for name in (exc.filename, exc.filename2) if name is not None]
    return f"{', '.join(names)}: {reason}" if names else reason


def _shortened(text: str, limit: int = 200) -> str:
    """The first line of ``text``, cut short: a 10,000-character name would fill the terminal."""
    line = next(iter(text.strip().splitlines()), "")
    return line if len(line) <= limit else f"{line[:60]}... ({len(line):,} characters)"


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="localserve")
def main() -> None:
    """Serve quantized LLMs on one machine: paged KV cache, continuous batching."""


@main.command()
@click.argument("model")
@click.argument("prompt", required=False)
@click.option("--system", default=None, help="A system prompt.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens to generate at most; default: the model's num_predict, else until the model stops or the "
                   "context is full.")
@click.option("--temperature", type=click.FloatRange(min=0), default=None,
              help="0 is greedy; default: the model's own, else 0.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Default: the model's own, else 1.")
@click.option("--top-k", type=click.IntRange(min=0), default=None, help="0 is no limit; default: the model's own, else 0.")
@click.option("--seed", type=int, default=None)
@click.option("--raw", is_flag=True, help="Complete PROMPT as plain text, without the chat template.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="An image to send with PROMPT (or the chat's first message), for models that read images; "
                   "repeat for more. In a chat, /image PATH adds one to the next message.")
@click.option("--format", "output_format", type=click.Choice(["json"]), default=None,
              help="Answer with a JSON object (enforced token by token).")
@click.option("--schema", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Answer with JSON valid against this JSON schema file (enforced token by token).")
@click.option("--mmproj", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The vision projector file (llama.cpp's mmproj) of MODEL, a .gguf file (in-process only).")
@click.option("--device", default=None, help="cpu or cuda; default cuda when available (in-process only).")
@click.option("--dtype", default=None, help="float32, float16 or bfloat16; default picks per device (in-process only).")
@engine_options
def run(model: str, prompt: str | None, system: str | None, max_tokens: int | None, temperature: float | None,
        top_p: float | None, top_k: int | None, seed: int | None, raw: bool, images: tuple[Path, ...],
        output_format: str | None, schema: Path | None, mmproj: Path | None, device: str | None, dtype: str | None,
        **options: object) -> None:
    """Chat with MODEL (a registry name, a .gguf file or an HF checkpoint folder), or
    answer PROMPT and exit. Runs on the daemon when it is up and serves MODEL, else
    loads the model here (then the engine options apply). The model's own defaults (a
    Modelfile's parameters and system prompt) apply where no flag is given."""
    from .chat_repl import ChatSettings, chat_loop, image_data_url, messages_for, stdin_reader, user_message, write_stdout

    image_urls = [image_data_url(path) for path in images]  # checked before a model loads
    backend = _run_backend(model, device, dtype, options, mmproj)
    if image_urls and (raw or not backend.has_template):
        raise LocalserveError("images need the model's chat template to place them: drop --raw" if raw
                              else f"{model} has no chat template to place images in")
    if temperature is None:  # greedy unless the model says otherwise
        temperature = backend.settings.parameters.get("temperature", 0.0)
    settings = ChatSettings(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
                            system=system, json_schema=_read_schema(schema) if schema else None,
                            json_object=output_format == "json")
    if prompt is not None:
        if backend.has_template and not raw:
            pieces = backend.chat(messages_for([user_message(prompt, image_urls)], settings), settings)
        else:
            pieces = backend.complete(prompt, settings)
        for piece in pieces:
            write_stdout(piece)
        write_stdout("\n")
        return
    if not backend.has_template:
        click.echo(f"{model} has no chat template: each message is completed as plain text, without history.",
                   err=True)
    generate = backend.chat if backend.has_template else (lambda messages, s: backend.complete(_text(messages[-1]), s))
    chat_loop(generate, settings, stdin_reader(), write_stdout, image_urls)


def _text(message: dict[str, Any]) -> str:
    """A message completed as plain text (a model without a chat template): its text alone."""
    if isinstance(message["content"], list):
        raise LocalserveError("this model has no chat template to place images in")
    return message["content"]


def _read_schema(path: Path) -> dict[str, Any]:
    try:
        schema = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise click.BadParameter(f"{path}: not a JSON file ({exc})", param_hint="--schema") from exc
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{path}: a JSON schema is an object", param_hint="--schema")
    return schema


def _run_backend(model: str, device: str | None, dtype: str | None, options: dict[str, object],
                 mmproj: Path | None = None) -> Backend:
    """The daemon when one is reachable and serves ``model`` (a name: what the daemon
    means by it, as ``stop`` and ``ps`` do), else an engine in this process (``mmproj``:
    a .gguf model file's vision projector)."""
    from ..client import DaemonClient
    from ..engine.engine import Engine
    from ..registry import open_registry
    from ..registry.settings import ModelSettings
    from .run_backends import LocalBackend, daemon_backend

    path, settings = Path(model).expanduser(), ModelSettings()
    if mmproj is not None:
        if not path.is_file():
            raise click.BadParameter("goes with MODEL as a .gguf file", param_hint="--mmproj")
        path = served_models([str(path)], [str(mmproj)]).popitem()[1]
    if not path.exists():
        client = DaemonClient()
        if client.reachable() and (backend := daemon_backend(client, model)) is not None:
            return backend
        registry = open_registry()
        record = registry.get(model)
        path, settings = registry.path(record.name), registry.settings(record)
    config = engine_config(options)
    if settings.context_length is not None and config.max_model_len is None:  # the model's num_ctx, unless asked
        config = dataclasses.replace(config, max_model_len=settings.context_length)
    return LocalBackend(Engine(path, config, device=device, dtype=dtype), settings)


def model_source(value: str) -> tuple[str, Path]:
    """``NAME=PATH`` or ``PATH`` (named after the file or folder, without .gguf)."""
    name, sep, path = value.partition("=")
    if not sep or "/" in name or not name:
        name, path = "", value
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise click.BadParameter(f"{path}: no such file or folder", param_hint="--model")
    return name or resolved.name.removesuffix(".gguf"), resolved


def served_models(models: Sequence[str], projectors: Sequence[str]) -> dict[str, Path]:
    """``--model`` values by name, each GGUF model named by ``--mmproj [NAME=]PATH`` paired
    with its vision projector (a folder of links to both under the localserve home, which
    opens as one model: formats/mmproj.py)."""
    from ..formats.mmproj import pair_folder
    from ..registry import default_home

    sources = dict(model_source(value) for value in models)
    for value in projectors:
        name, sep, path = value.partition("=")
        if not sep or "/" in name:
            name, path = "", value
        if not name and len(sources) != 1:
            raise click.BadParameter("say which model a projector is for when several are served: --mmproj "
                                     "NAME=PATH", param_hint="--mmproj")
        name = name or next(iter(sources))
        if name not in sources:
            raise click.BadParameter(f"no --model named {name!r}", param_hint="--mmproj")
        sources[name] = pair_folder(sources[name], Path(path), default_home() / "mmproj-links")
    return sources


@main.command()
@click.option("--model", "models", multiple=True, metavar="[NAME=]PATH",
              help="A model to serve as NAME (default: the file or folder name), loaded at start-up. Repeatable "
                   "(in LOCALSERVE_MODEL: separated by spaces). SIGHUP re-reads the config file's list.")
@click.option("--mmproj", "projectors", multiple=True, metavar="[NAME=]PATH",
              help="A GGUF model's vision projector file (llama.cpp's mmproj): the images side of --model NAME "
                   "(NAME may be left out when one model is served). Repeatable.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --api-key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(min=1, max=65535))
@click.option("--ollama-port", default=None, type=click.IntRange(min=1, max=65535),
              help="Also listen on this port (Ollama's is 11434), for clients that only know Ollama's address.")
@click.option("--api-key", default=None,
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health.")
@click.option("--insecure-no-auth", is_flag=True, help="Allow a non-loopback --host without an API key.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Allow browser requests from ORIGIN (e.g. http://localhost:3000). Repeatable; default none.")
@click.option("--allow-image-urls", is_flag=True,
              help="Fetch images that requests name by http(s) URL (public hosts only; 20 MiB, 10 s each).")
@click.option("--image-url-host", "image_url_hosts", multiple=True, metavar="HOST",
              help="Fetch image URLs from HOST only, whatever address it has (implies --allow-image-urls). "
                   "Repeatable.")
@click.option("--allow-pull-from", "allow_pull_from", multiple=True, metavar="DIR",
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Let HTTP clients pull (/api/pull, /api/create FROM) local files below DIR. Repeatable; default "
                   "none: over HTTP only hf.co/ repos and https:// URLs.")
@click.option("--keep-alive", default="5m", show_default=True,
              help="How long an idle model stays loaded (300, 5m, 1h; 0 unloads at once; -1 forever).")
@click.option("--max-loaded-models", default=3, show_default=True,
              type=click.IntRange(min=1), help="Models loaded at once; the least recently used idle one makes room.")
@click.option("--max-queued-requests", default=256, show_default=True, type=click.IntRange(min=0),
              help="Requests a model queues beyond its running batch; more get 429.")
@click.option("--max-body-size", default="32MiB", show_default=True, type=ByteSize(), help="Largest request body.")
@click.option("--header-timeout", default=10.0, show_default=True, type=float,
              help="Seconds a client has to send a request's headers; past them its connection is closed (408).")
@click.option("--body-timeout", default=30.0, show_default=True, type=float,
              help="Seconds a client sending a request body may go silent; past them its connection is closed (408).")
@click.option("--max-connections", default=1024, show_default=True, type=int,
              help="Open connections at most, streams and idle keep-alive ones included; more are answered 503.")
@click.option("--drain-timeout", default=30.0, show_default=True,
              help="Seconds SIGTERM waits for running requests before exiting.")
@click.option("--tool-parser", default="auto", show_default=True,
              type=click.Choice(["auto", "none", "hermes", "llama3_json", "mistral", "deepseek", "pythonic"]),
              help="How tool calls are read from replies: auto picks the chat template's format.")
@click.option("--reasoning-parser", default="auto", show_default=True, type=click.Choice(["auto", "think", "none"]),
              help="Split <think> blocks into reasoning_content: auto does for templates that write them.")
@click.option("--device", default=None, help="cpu or cuda; default cuda when available.")
@click.option("--dtype", default=None, help="float32, float16 or bfloat16; default picks per device.")
@click.option("--engine-processes/--no-engine-processes", default=True, show_default=True,
              help="Run each model's engine in a process of its own (started at once, so torch loads beside the "
                   "daemon's start; a crash there ends one model's requests, not the daemon), or on a thread of the "
                   "daemon's.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@engine_options
@config_file_option
def serve(config: Path | None, models: tuple[str, ...], projectors: tuple[str, ...], host: str, port: int,
          ollama_port: int | None,
          api_key: str | None,
          insecure_no_auth: bool, cors_origins: tuple[str, ...], allow_image_urls: bool,
          image_url_hosts: tuple[str, ...], allow_pull_from: tuple[Path, ...], keep_alive: str,
          max_loaded_models: int,
          max_queued_requests: int, max_body_size: int, header_timeout: float, body_timeout: float,
          max_connections: int, drain_timeout: float, tool_parser: str,
          reasoning_parser: str, device: str | None, dtype: str | None, engine_processes: bool, log_level: str,
          **options: object) -> None:
    """Run the daemon: OpenAI's HTTP API (/v1), Ollama's (/api) and Anthropic's
    (/v1/messages), localserve's admin API, /health and /metrics, on one port (and
    Ollama's too with --ollama-port). Every option can also come from the
    environment (LOCALSERVE_<OPTION>) or a config file; SIGTERM drains and exits,
    SIGHUP reloads the model list. Registry models are served on request; with no
    --model, the built-in `demo` model is loaded at start."""
    if engine_processes:
        from ..server.engine_process.spawn import start_spare

        start_spare()  # importing torch from now on, beside the imports below
    from ..logs import configure_logging
    from ..server.config import ServerConfig
    from ..server.model_manager import parse_keep_alive
    from ..server.serve import serve as run_server
    from ..vision.image_fetch import ImageFetcher

    configure_logging(log_level)
    sources = served_models(models, projectors)
    try:
        keep_alive_s = parse_keep_alive(keep_alive)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--keep-alive") from exc
    from ..registry import default_home, open_registry
    from ..registry.builtin import DEMO

    open_registry(default_home())  # a home that cannot be used is one line here, not a failed start
    # With no --model, the built-in demo model is loaded at start: a fresh machine serves it.
    server_config = ServerConfig(
        models=sources, registry_home=default_home(), preload=list(sources) or [str(DEMO.name)],
        engine=engine_config(options), device=device, dtype=dtype,
        host=host, port=port, ollama_port=ollama_port, api_key=api_key or None, cors_origins=list(cors_origins),
        allow_pull_from=[folder.resolve() for folder in allow_pull_from],
        image_fetcher=ImageFetcher.allowing(image_url_hosts) if allow_image_urls or image_url_hosts else None,
        max_body_bytes=max_body_size, keep_alive=keep_alive_s, max_loaded_models=max_loaded_models,
        max_queued_requests=max_queued_requests, drain_timeout=drain_timeout, tool_parser=tool_parser,
        reasoning_parser=reasoning_parser, header_timeout=header_timeout, body_timeout=body_timeout,
        max_connections=max_connections, engine_processes=engine_processes)
    sys.exit(run_server(server_config, insecure_no_auth, log_level, _model_list_on_reload(config)))


env_for_every_option(serve)


def _model_list_on_reload(config_file: Path | None) -> Callable[[], dict[str, Path]] | None:
    """What SIGHUP serves: the config file's ``model`` list read anew, unless the
    command line or environment gave the models (those cannot change)."""
    ctx = click.get_current_context()
    if ctx.get_parameter_source("models") in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
        return None
    read_models = reread(config_file or default_config_path(), ctx.command, "models", [])
    read_projectors = reread(config_file or default_config_path(), ctx.command, "projectors", [])
    return lambda: served_models(read_models(), read_projectors())


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (for a bug report).")
@click.option("--no-bench", is_flag=True, help="Skip the GPU microbenchmarks.")
def doctor(as_json: bool, no_bench: bool) -> None:
    """What this machine has and whether localserve works on it: versions, CPU features,
    each GPU's capability and free memory; every kernel against its torch reference (on a
    GPU, compiled for it first); the demo model end to end; on a GPU, the kernels'
    microbenchmarks against their targets. Exits 1 when a check fails."""
    import json

    from ..doctor import diagnose

    report = diagnose(benchmarks=not no_bench)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for line in report.lines():
            click.echo(line)
    if report.failed:
        raise SystemExit(1)


@main.command()
@click.argument("model", type=ModelPath())
@click.option("--gpu-memory", type=ByteSize(), default=None,
              help="The GPU's memory (e.g. 24GiB); default: this machine's first GPU, or without one the CPU "
              "and this host's available memory.")
@click.option("--dtype", default=None, help="Dtype of unquantized weights; default as the engine picks on the "
              "device planned for.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@engine_options
def fit(model: str, gpu_memory: int | None, dtype: str | None, as_json: bool, **options: object) -> None:
    """Whether MODEL fits a GPU (on a host without one: this host's memory, served by the
    CPU) and how many sequences it serves at once, from the model's metadata alone (no
    weights are loaded). The context planned for is --max-model-len (default: the model's,
    on the CPU at most 8,192 tokens); --cpu-offload-gb adds the sequences the CPU tier
    can hold."""
    import json

    import torch

    from ..facts.fit import describe, plan

    if gpu_memory is None and torch.cuda.is_available():
        gpu_memory = torch.cuda.get_device_properties(0).total_memory
    result = plan(model, gpu_memory, engine_config(options), dtype)  # gpu_memory None: the CPU and host memory
    if as_json:
        click.echo(json.dumps(result.summary(), indent=2))
        return
    _echo_lines(describe(result, Path(model).name))


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
@click.option("--template", "show_template", is_flag=True, help="Print only the chat template.")
@click.option("--license", "show_license", is_flag=True, help="Print only the license (its text when the model has it).")
@click.option("--modelfile", "show_modelfile", is_flag=True,
              help="Print a Modelfile that makes the model (its own parameters, system prompt, template).")
@click.option("--parameters", "show_parameters", is_flag=True, help="Print only the model's own default parameters.")
def show(model: str, as_json: bool, show_template: bool, show_license: bool, show_modelfile: bool,
         show_parameters: bool) -> None:
    """What MODEL (a registry name, a .gguf file or an HF checkpoint folder) is: architecture,
    parameters (total, and active per token for mixture-of-experts models), context,
    quantization, size, chat template, license and files."""
    import json

    from ..facts.show import model_facts

    facts, lines = model_facts(model)
    if show_modelfile:
        click.echo(facts["modelfile"], nl=False)
    elif show_parameters:
        click.echo("\n".join(facts["parameter_lines"]) or f"{model} sets no parameters of its own")
    elif show_template:
        click.echo(facts["template"] or f"{model} has no chat template")
    elif show_license:
        click.echo(facts["license_text"] or facts["license"] or f"{model} declares no license")
    elif as_json:
        click.echo(json.dumps(facts, indent=2))
    else:
        _echo_lines(lines)


@main.command()
@click.argument("source")
@click.option("--name", default=None, help="Register as NAME[:TAG] (default: from the repo and quantization, or the "
              "file or folder name).")
@click.option("--sha256", default=None, help="The expected sha256 of a URL's file (checked before it is registered).")
@click.option("--json", "as_json", is_flag=True, help="Print the registered model as JSON.")
@click.option("--max-size", default="64GiB", show_default=True, type=ByteSize(), envvar="LOCALSERVE_MAX_DOWNLOAD_SIZE",
              help="Refuse a downloaded file larger than this.")
@click.option("--mmproj", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A local .gguf model's vision projector file (llama.cpp's mmproj), stored with it.")
def pull(source: str, name: str | None, sha256: str | None, as_json: bool, max_size: int,
         mmproj: Path | None) -> None:
    """Add a model to the registry from SOURCE:

    \b
    hf.co/OWNER/REPO[:TAG]   a Hub repo; in a GGUF repo TAG picks the quantization
                             (default Q4_K_M) or a file name, and a vision
                             projector (mmproj) there comes too
    https://.../FILE.gguf    a file by URL (resumable)
    ./model.gguf, ./folder   a local file (--mmproj: with its vision projector),
                             an HF checkpoint folder or a folder holding a GGUF
                             model and its projector (copied)

    An interrupted pull resumes where it stopped; every file is verified before
    the model is listed."""
    import json

    from ..registry import open_registry
    from ..registry.pull import progress_bar
    from ..registry.pull import pull as pull_model

    progress = progress_bar()
    try:
        record = pull_model(open_registry(), source, name, sha256, progress, max_size,
                            mmproj=str(mmproj) if mmproj else None)
    finally:
        if progress.live.is_started:
            progress.stop()
    if as_json:
        click.echo(json.dumps(record.as_dict(), indent=2))
    else:
        click.echo(f"{record.name}  {record.format}  {record.architecture}  {record.quantization.split(',')[0]}  "
                   f"{_size(record.size)}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's answer as JSON.")
def ps(as_json: bool) -> None:
    """The models the daemon has loaded, their memory and when they unload."""
    import json

    from ..client import DaemonClient

    answer = DaemonClient().get("/api/ps")
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    rows = [("NAME", "DEVICE", "WEIGHTS", "KV CACHE", "REQUESTS", "UNTIL")]
    for model in answer["models"]:
        memory = model.get("memory", {})
        until = model["expires_at"] or ("forever" if model["keep_alive_s"] is None else "in use")
        rows.append((model["name"], str(memory.get("device", "?")), _size(int(memory.get("weights_bytes", 0))),
                     _size(int(memory.get("kv_cache_bytes", 0))), str(model["requests_in_flight"]), until))
    rows += [(name, "loading", "", "", "", "") for name in answer.get("loading", [])]
    _echo_table(rows)


@main.command()
@click.argument("model")
def stop(model: str) -> None:
    """Unload MODEL from the daemon now (requests still running on it end with an error)."""
    from ..client import DaemonClient

    answer = DaemonClient().post("/api/localserve/unload", {"model": model})
    click.echo(f"stopped {answer['model']}" if answer["unloaded"] else f"{answer['model']} was not loaded")


@main.command()
@click.option("--url", default=None, help="The daemon's URL (default: LOCALSERVE_URL, else LOCALSERVE_HOST/PORT).")
@click.option("--interval", type=click.FloatRange(min=0.2), default=0.5, show_default=True,
              help="Seconds between refreshes.")
def top(url: str | None, interval: float) -> None:
    """A live dashboard of the daemon: models, KV cache, scheduler, throughput, requests, events."""
    from ..client import DaemonClient, daemon_url
    from ..tui.app import Dashboard
    from ..tui.source import HttpStatsSource

    url = (url or daemon_url()).rstrip("/")
    # A short timeout: a hung daemon should read as "disconnected", not freeze the numbers.
    Dashboard(HttpStatsSource(DaemonClient(url, timeout=5.0)), interval=interval, url=url).run()


@main.command()
@click.option("--url", default=None, help="The server (any OpenAI-compatible one); default: LOCALSERVE_URL, else "
              "LOCALSERVE_HOST/PORT, else http://127.0.0.1:8000.")
@click.option("--model", default=None, help="The model name to request, also where the tokenizer comes from; "
              "default: the server's first model.")
@click.option("--served-model-name", default=None, help="Request this name instead (then --model only picks the "
              "tokenizer).")
@click.option("--tokenizer", default=None, help="A .gguf file, HF checkpoint folder or registry name; default: "
              "--model as a path or registry name, else the server's own (its /tokenize and /detokenize).")
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions", show_default=True,
              help="/v1/completions or /v1/chat/completions.")
@click.option("--api-key", default=None, envvar="LOCALSERVE_API_KEY", help="Sent as Bearer (env LOCALSERVE_API_KEY).")
@click.option("--dataset-name", type=click.Choice(["random", "sharegpt", "prefix-repetition"]), default="random",
              show_default=True)
@click.option("--dataset-path", default=None, help="A ShareGPT JSON file (for --dataset-name sharegpt).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--random-input-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--random-output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Lengths uniform in [L*(1-r), L*(1+r)].")
@click.option("--sharegpt-output-len", type=click.IntRange(min=1), default=None,
              help="Output tokens per request; default: the recorded answer's length.")
@click.option("--prefix-repetition-prefix-len", type=click.IntRange(min=0), default=256, show_default=True)
@click.option("--prefix-repetition-suffix-len", type=click.IntRange(min=0), default=256, show_default=True)
@click.option("--prefix-repetition-num-prefixes", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--prefix-repetition-output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="Requests per second; inf sends all at once.")
@click.option("--burstiness", type=float, default=1.0, show_default=True,
              help="Gamma shape of the gaps between requests: 1 is Poisson, <1 burstier, >1 more even.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None, help="Requests in flight at most.")
@click.option("--num-warmups", type=click.IntRange(min=0), default=0, show_default=True,
              help="Copies of the first request sent first, not measured.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ignore-eos/--no-ignore-eos", default=None,
              help="Generate exactly the output length (ignore_eos, plus logit_bias -100 on EOS); default on for "
                   "random and prefix-repetition.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds a response may stay silent before the request counts as failed.")
@click.option("--metric-percentiles", default="99", show_default=True, help="Percentiles to report, e.g. 50,90,99.")
@click.option("--goodput", multiple=True, metavar="NAME:MS",
              help="SLOs for goodput, e.g. --goodput ttft:500 --goodput tpot:50 (ttft, tpot, e2el; ms).")
@click.option("--json", "as_json", is_flag=True, help="Print the result (config and metrics) as JSON, not tables.")
@click.option("--save-result", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the result with every request's record as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw latency histograms and throughput over time to a PNG (needs localserve[plot]).")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
def bench(url: str | None, goodput: tuple[str, ...], metric_percentiles: str, as_json: bool,
          save_result: Path | None, plot_path: Path | None, no_progress: bool, **options: object) -> None:
    """Load-test an OpenAI-compatible server (this one, llama.cpp's, vLLM) and report
    TTFT, TPOT, ITL, E2EL, throughput and goodput as vLLM's `bench serve` defines them."""
    import json
    from contextlib import nullcontext

    from ..bench import BenchConfig, parse_goodput, parse_percentiles, run_benchmark
    from ..bench.report import plot, print_tables, progress_bar
    from ..bench.report import save_result as write_result

    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401  (checked before the run, not after it)
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install localserve[plot]") from None
    config = BenchConfig(url=url, goodput=parse_goodput(goodput), metric_percentiles=parse_percentiles(
        metric_percentiles), **options)  # type: ignore[arg-type]
    with nullcontext(None) if no_progress else progress_bar() as hooks:
        result = run_benchmark(config, hooks)
    if save_result is not None:
        write_result(result, save_result)
    if plot_path is not None and result.metrics.completed:
        plot(result, plot_path)
    if result.metrics.completed == 0:
        raise click.ClickException(f"all {result.metrics.failed} requests failed; the first: {result.first_error}")
    if as_json:
        click.echo(json.dumps(result.to_dict(requests=False), indent=2))
    else:
        print_tables(result)


@main.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print the models as JSON.")
def list_models(as_json: bool) -> None:
    """The models in the registry."""
    import json

    from ..units import human_count
    from ..registry import open_registry

    records = open_registry().list()
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in records], indent=2))
        return
    rows = [("NAME", "FORMAT", "ARCH", "PARAMS", "QUANTIZATION", "SIZE")] + [
        (str(r.name), r.format, r.architecture, human_count(r.parameters), r.quantization.split(",")[0],
         _size(r.size)) for r in records]
    _echo_table(rows)


@main.command()
@click.argument("names", nargs=-1, required=True)
def rm(names: tuple[str, ...]) -> None:
    """Remove models from the registry (blobs another model uses are kept)."""
    from ..registry import open_registry

    registry = open_registry()
    for name in names:
        freed = registry.remove(name)
        click.echo(f"deleted {name} ({len(freed)} blob{'s' * (len(freed) != 1)} freed)")


@main.command()
@click.argument("name")
@click.option("-f", "--file", "modelfile", type=click.Path(dir_okay=False, path_type=Path), default=Path("Modelfile"),
              show_default=True, help="The Modelfile to read.")
def create(name: str, modelfile: Path) -> None:
    """Register NAME as a Modelfile makes it: a model (FROM a registry name, a .gguf
    file or an HF folder) with its own default PARAMETERs (temperature, top_p, top_k,
    min_p, num_predict, num_ctx, stop, repeat_penalty, seed, ...), SYSTEM prompt,
    TEMPLATE (a Jinja chat template), MESSAGEs and LICENSE. Requests' own fields win
    over these defaults. See docs/modelfile.md."""
    from ..registry import open_registry
    from ..registry.create import create_model
    from ..registry.modelfile import parse_modelfile

    try:
        text = modelfile.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"{modelfile}: cannot read it ({exc})", param_hint="-f") from exc
    made = parse_modelfile(text)
    record = create_model(open_registry(), name, made, modelfile.resolve().parent)
    click.echo(f"created {record.name} from {made.base}")


@main.command()
@click.argument("source")
@click.argument("destination")
def cp(source: str, destination: str) -> None:
    """Give a registered model another name (no data is copied)."""
    from ..registry import open_registry

    record = open_registry().copy(source, destination)
    click.echo(f"copied {source} to {record.name}")


def _size(size: int) -> str:
    from ..units import human_bytes

    return human_bytes(size)


def _echo_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _echo_lines(lines: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in lines)
    for label, text in lines:
        click.echo(f"{label:<{width}}  {text}")

