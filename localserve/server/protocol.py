"""Request bodies of the HTTP API, validated strictly (a string is never a number).

OpenAI's fields with OpenAI's ranges, plus the extra sampling fields vLLM accepts, so
clients and benchmark tools written for either work unchanged. Unknown fields are
ignored, as OpenAI and vLLM do. Every list and string a client sends is bounded.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.speculative.config import MAX_DRAFT_TOKENS
from ..engine.output_format import OutputFormat
from ..errors import LocalserveError
from ..chat.tool_calls import forced_format
from .model_manager import parse_keep_alive

MAX_PROMPTS = 256  # prompts in one completions request
MAX_MESSAGES = 4096
MAX_STOP = 16
MAX_N = 16
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
MAX_TEXT = 4 << 20  # characters in one string; the body limit bounds the total too

Text = Annotated[str, Field(max_length=MAX_TEXT)]
ModelField = Annotated[str, Field(min_length=1, max_length=512)]  # a model's name
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]], Field(min_length=1, max_length=1 << 20)]

def _check_keep_alive(value: str | float | None) -> str | float | None:
    parse_keep_alive(value)  # raises ValueError naming the accepted forms
    return value


# Ollama's: how long the model stays loaded after this request ("5m", 300, 0, -1)
KeepAlive = Annotated[Annotated[str, Field(max_length=64)] | float | None, AfterValidator(_check_keep_alive)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


MAX_CHOICES = 1024
JsonSchema = Annotated[dict[str, Any], Field(max_length=4096)]
Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(min_length=1,
                                                                                      max_length=MAX_CHOICES)]


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(max_length=256)] = "response"
    description: Annotated[str, Field(max_length=4096)] | None = None
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format json_schema needs its json_schema object, and only it")
        return self


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: JsonSchema | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Annotated[str, Field(max_length=65536)] | None = None
    choice: Choices | None = None
    grammar: Text | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputsField:
        given = [v for v in (self.json_, self.json_object or None, self.regex, self.choice, self.grammar)
                 if v is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar")
        return self


class SamplingFields(_Strict):
    """Fields shared by chat and text completions."""

    model: ModelField
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: Annotated[str, Field(max_length=1024)] | Annotated[
        list[Annotated[str, Field(max_length=1024)]], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Annotated[str, Field(max_length=512)] | None = None
    # vLLM's extra sampling parameters
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # localserve's own: speculative decoding's draft tokens a step for this request (0: none;
    # absent: the server's --num-speculative-tokens)
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | None = None
    # and which drafter: prompt lookup, or the server's --draft-model (absent: the server's)
    speculative_method: Literal["ngram", "draft_model"] | None = None
    keep_alive: KeepAlive = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: JsonSchema | Text | None = None
    guided_regex: Annotated[str, Field(max_length=65536)] | None = None
    guided_choice: Choices | None = None
    guided_grammar: Text | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, not {key[:40]!r}")
        return bias

    @model_validator(mode="after")
    def _stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        if len(self._output_formats()) > 1:
            raise ValueError("give one of response_format, structured_outputs and guided_*")
        return self

    def _output_formats(self) -> list[OutputFormat]:
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.json_schema
            found.append(OutputFormat("json", schema.schema_) if schema else OutputFormat("json_object"))
        if (so := self.structured_outputs) is not None:
            if so.json_ is not None:
                found.append(OutputFormat("json", _schema(so.json_)))
            elif so.json_object:
                found.append(OutputFormat("json_object"))
            elif so.regex is not None:
                found.append(OutputFormat("regex", so.regex))
            elif so.choice is not None:
                found.append(OutputFormat("choice", so.choice))
            else:
                found.append(OutputFormat("grammar", so.grammar))
        for kind, value in (("json", self.guided_json), ("regex", self.guided_regex), ("choice", self.guided_choice),
                            ("grammar", self.guided_grammar)):
            if value is not None:
                found.append(OutputFormat(kind, _schema(value) if kind == "json" else value))
        return found

    def output_format(self) -> OutputFormat | None:
        """What the output must match, from whichever field the client used."""
        found = self._output_formats()
        return found[0] if found else None


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema is an object")
    return schema


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


# An image inline: the body limit bounds it (max_body_size), the image's own limits its bytes.
ImageData = Annotated[str, Field(max_length=1 << 30)]


class ImageURL(_Strict):
    url: ImageData  # a data: URL; an http(s) one only where the daemon fetches them (--allow-image-urls)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; each model sees images at its own size


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    # Ollama's way (base64 images of a user message, laid out before its text); also
    # taken here, as vLLM takes extra content kinds.
    images: Annotated[list[ImageData], Field(max_length=MAX_MESSAGES)] | None = None
    name: Annotated[str, Field(max_length=512)] | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(max_length=512)] | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role != "user" and self.has_images():
            raise ValueError(f"images belong in user messages, not in a {self.role} message")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content

    def has_images(self) -> bool:
        return bool(self.images) or (isinstance(self.content, list)
                                     and any(isinstance(part, ImageURLPart) for part in self.content))

    def plain(self) -> dict[str, Any]:
        """The message as a dict, unset fields left out: its content one string (or None);
        with images, its parts and ``images`` as sent (chat/messages.py lays them out)."""
        plain = self.model_dump(exclude_none=True)
        return plain if self.has_images() else {**plain, "content": self.text()}


class _FunctionName(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=256)] | None = None
    # Template variables: vLLM's chat_template_kwargs ({"enable_thinking": false}), OpenAI's reasoning_effort
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=64)] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    max_reasoning_tokens: Annotated[int, Field(ge=0)] | None = None  # a thinking model's budget
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_names(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = set(kwargs or {}) & {"messages", "tools", "documents", "add_generation_prompt", "keep_null_content"}
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(sorted(taken))}: give them as fields")
        return kwargs

    @model_validator(mode="after")
    def _logprob_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise ValueError("continue_final_message needs add_generation_prompt: false and a final assistant "
                             "message")
        return self

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def forced_tools(self) -> tuple[OutputFormat, str | None] | None:
        """For tool_choice required or a named function: the JSON the output is held to
        and, when one function is named, its name."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        try:
            return forced_format(self.tools, choice, self.parallel_tool_calls)
        except LocalserveError as exc:
            raise ValueError(str(exc)) from exc

    def _output_formats(self) -> list[OutputFormat]:
        forced = self.forced_tools()
        return [*super()._output_formats(), *([forced[0]] if forced else [])]

    def template_variables(self) -> dict[str, Any]:
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        return variables

    def wanted_logprobs(self) -> int | None:
        """Alternatives per output token for the engine (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def wanted_prompt_logprobs(self) -> int | None:
        return None


class CompletionRequest(SamplingFields):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: None = None  # insertion is not supported: rejected when given

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids."""
        return _each(self.prompt)

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def wanted_prompt_logprobs(self) -> int | None:
        """Echoed prompts come with their tokens' logprobs when logprobs are asked for."""
        return self.logprobs if self.echo else None


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs in one request


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request: one text or token list, or a list of them."""

    model: ModelField
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: Annotated[str, Field(max_length=512)] | None = None  # accepted, unused
    keep_alive: KeepAlive = None

    def inputs(self) -> list[str | list[int]]:
        return _each(self.input)


def _each(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One text or token list, or a list of them, as a list of them."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


class TokenizeRequest(_Strict):
    model: ModelField
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: ModelField
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]], Field(max_length=1 << 20)]


class LoadRequest(_Strict):
    model: ModelField
    keep_alive: KeepAlive = None


class UnloadRequest(_Strict):
    model: ModelField
