"""Where ``localserve run`` generates: on the daemon when one serves the model, else
in this process. Both stream text pieces and stop generating when the iterator is
closed (Ctrl-C in the chat)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .chat_repl import ChatSettings
from ..client import DaemonClient, DaemonError, Stopped, Thinking
from ..errors import LocalserveError
from ..registry.settings import ModelSettings

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.output_format import OutputFormat
    from ..vision.image_input import ImageInput


class Backend(Protocol):
    has_template: bool  # whether chat messages can be rendered (else prompts are completed as plain text)
    where: str  # said to the user: "daemon at http://..." or "in-process"
    settings: ModelSettings  # the model's own defaults (a Modelfile's), under the user's flags

    def chat(self, messages: list[dict[str, Any]], settings: ChatSettings) -> Iterator[str]: ...

    def complete(self, prompt: str, settings: ChatSettings) -> Iterator[str]: ...


def _sampling_fields(settings: ChatSettings) -> dict[str, Any]:
    fields = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
              "max_tokens": settings.max_tokens, "seed": settings.seed}
    return {key: value for key, value in fields.items() if value is not None}


def _response_format(settings: ChatSettings) -> dict[str, Any]:
    """The API's ``response_format`` for ``--schema`` / ``--format json``."""
    if settings.json_schema is not None:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output",
                                                                           "schema": settings.json_schema}}}
    return {"response_format": {"type": "json_object"}} if settings.json_object else {}


def _output_format(settings: ChatSettings) -> OutputFormat | None:
    from ..engine.output_format import OutputFormat

    if settings.json_schema is not None:
        return OutputFormat("json", settings.json_schema)
    return OutputFormat("json_object") if settings.json_object else None


@dataclass
class DaemonBackend:
    """The daemon applies the model's settings itself; ``settings`` tells the CLI what they are."""

    client: DaemonClient
    model: str
    has_template: bool
    settings: ModelSettings = ModelSettings()

    @property
    def where(self) -> str:
        return f"daemon at {self.client.url}"

    def chat(self, messages: list[dict[str, Any]], settings: ChatSettings) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, **_sampling_fields(settings), **_response_format(settings)}
        return self.client.stream_text("/v1/chat/completions", body)

    def complete(self, prompt: str, settings: ChatSettings) -> Iterator[str]:
        body = {"model": self.model, "prompt": prompt, **_sampling_fields(settings), **_response_format(settings)}
        return self.client.stream_text("/v1/completions", body)


class LocalBackend:
    """An engine of this process's own, for one conversation at a time."""

    where = "in-process"

    def __init__(self, engine: Engine, settings: ModelSettings = ModelSettings()) -> None:
        self.engine = engine
        self.settings = settings
        self.template = engine.checkpoint.chat_template_or_none(settings.template)
        self.has_template = self.template is not None

    def chat(self, messages: list[dict[str, Any]], settings: ChatSettings) -> Iterator[str]:
        from ..chat import reasoning
        from ..chat.messages import image_sources, render_messages
        from ..vision.placement import images_for, lay_out

        template = self.template
        assert template is not None
        placement = self.engine.image_placement
        images = images_for(placement, image_sources(messages), "this model")
        # The model's own system prompt and opening turns, as the daemon puts them.
        text = render_messages(self.settings.conversation(messages),
                               lambda plain, **how: template.render(plain, add_generation_prompt=True, **how))
        text = lay_out(placement, text, images)
        # The template writes BOS itself where the model wants it.
        stream = self._stream(self._encode(text, add_special_tokens=False), settings, images)
        if not reasoning.thinks(self.template.source):
            return stream
        return _split_thinking(stream, reasoning.ReasoningSplitter(inside=reasoning.starts_inside(text)))

    def complete(self, prompt: str, settings: ChatSettings) -> Iterator[str]:
        return self._stream(self._encode(prompt), settings)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Once, here: the prompt's length decides max_tokens, and the ids go to the engine.
        if self.engine.tokenizer is None:
            raise LocalserveError("this model has no tokenizer, so it cannot take text")
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _stream(self, prompt: list[int], settings: ChatSettings, images: Sequence[ImageInput] = ()) -> Iterator[str]:
        from ..engine.sampling_params import SamplingParams

        room = max(self.engine.max_model_len - len(prompt), 1)  # the engine refuses a prompt with no room
        fields = {**self.settings.request_fields(), **_sampling_fields(settings)}  # the user's flags win
        fields["max_tokens"] = min(fields.get("max_tokens", room), room)
        request_id = self.engine.add_request(prompt, SamplingParams(**fields, output_format=_output_format(settings)),
                                             images=images)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    if output.delta:
                        yield output.delta
                    if output.finished and output.finish_reason == "length":
                        yield Stopped("length")
        finally:
            if self.engine.has_unfinished_requests():
                self.engine.abort(request_id)  # Ctrl-C, or an error: free the sequence


def _split_thinking(stream: Iterator[str], splitter: Any) -> Iterator[str]:
    """A thinking model's text as ``Thinking`` pieces and answer pieces, as the daemon sends them."""
    try:
        for piece in stream:
            yield from _pieces(*splitter.feed(piece))
        yield from _pieces(*splitter.finish())
    finally:
        stream.close()  # type: ignore[attr-defined]  # a generator: cancels the request


def _pieces(thinking: str, answer: str) -> Iterator[str]:
    if thinking:
        yield Thinking(thinking)
    if answer:
        yield answer


def daemon_backend(client: DaemonClient, model: str) -> DaemonBackend | None:
    """The daemon, if it serves ``model`` (under the name it gives it: a ``--model`` name
    wins over the registry's, as everywhere in the daemon); None if it knows no such name."""
    try:
        name = client.get(f"/v1/models/{model}")["id"]
    except DaemonError as exc:
        if exc.status == 404:
            return None
        raise
    shown = client.post("/api/show", {"model": name})
    settings = ModelSettings.from_dict(shown.get("settings") or {}, f"{name}'s settings")
    return DaemonBackend(client, name, bool(shown.get("template")), settings)
