"""Request bodies of Ollama's API, as Ollama's clients send them, bounded like the
OpenAI ones (protocol.py). A model may be named ``model`` or, as older clients do, ``name``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import LocalserveError
from ..registry.modelfile import Modelfile, parse_modelfile
from ..registry.settings import ModelSettings
from .protocol import MAX_EMBEDDING_INPUTS, MAX_MESSAGES, MAX_STOP, JsonSchema, KeepAlive, ModelField, Text


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ModelRequest(_Body):
    model: ModelField

    @model_validator(mode="before")
    @classmethod
    def _name_is_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data and "name" in data:
            return {**data, "model": data["name"]}
        return data


class PullRequest(ModelRequest):
    insecure: bool = False  # accepted: there is no registry of Ollama's to be insecure with
    stream: bool = True


class CreateRequest(ModelRequest):
    """``/api/create``: Ollama's fields, or an older client's whole Modelfile."""

    model_config = ConfigDict(strict=False, extra="ignore", populate_by_name=True)

    base: Annotated[str | None, Field(alias="from", max_length=4096)] = None
    modelfile: Annotated[str, Field(max_length=4 << 20)] | None = None
    parameters: dict[str, Any] | None = None
    system: Text | None = None
    template: Text | None = None
    messages: Annotated[list[dict[str, Any]], Field(max_length=256)] | None = None
    license: Text | Annotated[list[Text], Field(max_length=16)] | None = None
    files: dict[str, Any] | None = None
    adapters: dict[str, Any] | None = None
    quantize: str | None = None
    stream: bool = True

    def modelfile_or_fields(self) -> Modelfile:
        """What to make, checked (a LocalserveError says what is wrong)."""
        if self.files or self.adapters:
            raise LocalserveError("creating from uploaded files or adapters is not supported: name a model in the "
                                  "registry (or a file on the server's machine) as `from`")
        if self.quantize:
            raise LocalserveError("quantize is not supported: pull the quantization you want")
        if self.modelfile is not None:
            return parse_modelfile(self.modelfile)
        if not self.base:
            raise LocalserveError("from: name the model to start from")
        licenses = [self.license] if isinstance(self.license, str) else list(self.license or [])
        settings = ModelSettings.checked(self.parameters, self.system, self.template, self.messages, "create")
        return Modelfile(self.base, settings, licenses)


class CopyRequest(_Body):
    source: ModelField
    destination: ModelField


class Options(_Body):
    """Ollama's runtime options. Those that shape sampling are used; the rest (num_ctx,
    num_gpu, num_thread, mirostat, ...) are accepted and left to the server's settings."""

    model_config = ConfigDict(strict=False, extra="ignore")  # clients send 0 for 0.0

    seed: int | None = None
    num_predict: int | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    temperature: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=MAX_STOP)] | None = None
    num_ctx: int | None = None
    num_speculative_tokens: int | None = None  # localserve's own (speculative decoding)


Format = Literal["", "json"] | JsonSchema | None
Think = bool | Literal["low", "medium", "high"] | None


class _GenerationBody(ModelRequest):
    format: Format = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: Think = None


class ChatBody(_GenerationBody):
    # Messages stay dicts here: they become OpenAI's messages, validated as those.
    messages: Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=256)] | None = None


class GenerateBody(_GenerationBody):
    prompt: Text | None = None
    suffix: Text | None = None
    system: Text | None = None
    template: Text | None = None
    context: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]], Field(max_length=1 << 20)] | None = None
    raw: bool = False
    images: Annotated[list[Any], Field(max_length=64)] | None = None


class EmbedBody(ModelRequest):
    """``/api/embed``: one text or a list of them."""

    input: Text | Annotated[list[Text], Field(max_length=MAX_EMBEDDING_INPUTS)] | None = None
    truncate: bool = True  # inputs past the context keep their start; false: refused
    dimensions: Annotated[int, Field(ge=1)] | None = None
    options: Options | None = None  # accepted: nothing in it shapes an embedding
    keep_alive: KeepAlive = None


class EmbeddingsBody(ModelRequest):
    """``/api/embeddings``, the older route: one prompt."""

    prompt: Text = ""
    options: Options | None = None
    keep_alive: KeepAlive = None
