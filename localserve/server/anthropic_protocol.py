"""Request bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens),
shaped as Anthropic documents them, validated strictly and bounded as protocol.py's are,
and Anthropic's error shape.

Each request is made into the OpenAI chat request it amounts to (``chat_request``), which
the server renders, runs and reads as it does /v1/chat/completions: ``tool_use`` blocks
become an assistant turn's ``tool_calls``, ``tool_result`` blocks ``tool`` messages,
``tool_choice`` any/tool OpenAI's ``required``/named function, ``thinking`` a thinking
budget or ``enable_thinking: false``. Images, documents and server tools are refused;
``cache_control``, ``citations``, ``metadata`` and the service fields are accepted and
ignored (there is no prompt cache to steer, no bill to tag).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from ..errors import LocalserveError
from .protocol import MAX_MESSAGES, MAX_STOP, ChatCompletionRequest, ImageData, JsonSchema, ModelField, Text

MESSAGES_PATH = "/v1/messages"
MAX_TOOLS = 256
# localserve's (and vLLM's) own fields, taken on /v1/messages as on the OpenAI routes and
# checked there (the SDK sends them with extra_body=...): sampling, the structured outputs
# that steer a reply, keep_alive and template variables.
EXTENSIONS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
              "min_tokens", "ignore_eos", "keep_alive", "chat_template_kwargs", "structured_outputs",
              "guided_json", "guided_regex", "guided_choice", "guided_grammar", "num_speculative_tokens",
              "speculative_method")

Name = Annotated[str, Field(min_length=1, max_length=256)]
Id = Annotated[str, Field(min_length=1, max_length=512)]
Ignored = Annotated[dict[str, Any], Field(max_length=64)] | None  # accepted and ignored


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


B = TypeVar("B")
# A string or a list of blocks, told apart before validating, so that an error in a block
# is reported as such (not as "Input should be a valid string").
TextOr = Annotated[Annotated[Text, Tag("text")] | Annotated[B, Tag("blocks")],
                   Discriminator(lambda value: "text" if isinstance(value, str) else "blocks")]


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: Ignored = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Id
    name: Name
    input: Annotated[dict[str, Any], Field(max_length=4096)]


class ThinkingBlock(_Strict):
    """Earlier thinking in the history: dropped, as chat templates drop past reasoning."""

    type: Literal["thinking", "redacted_thinking"]


class ImageSource(_Strict):
    type: Literal["base64", "url", "file"]
    media_type: Annotated[str, Field(max_length=64)] | None = None
    data: ImageData | None = None
    url: Annotated[str, Field(max_length=8192)] | None = None  # fetched where the daemon fetches images

    @model_validator(mode="after")
    def _inline(self) -> ImageSource:
        if self.type == "file":
            raise ValueError("an image of source type file is not read: send it inline (base64)")
        if self.type == "url" and self.url is None:
            raise ValueError("a url image needs url")
        if self.type == "base64" and (self.media_type is None or self.data is None):
            raise ValueError("a base64 image needs media_type and data")
        return self


class ImageBlock(_Strict):
    type: Literal["image"]
    source: ImageSource
    cache_control: Ignored = None

    def data_url(self) -> str:
        """A data URL, or a url source's URL (fetched, or refused, as an image_url's is)."""
        if self.source.type == "url":
            assert self.source.url is not None
            return self.source.url
        return f"data:{self.source.media_type};base64,{self.source.data}"


class RefusedBlock(_Strict):
    type: Literal["document", "search_result", "container_upload", "server_tool_use",
                  "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result"]

    @model_validator(mode="after")
    def _refuse(self) -> RefusedBlock:
        raise ValueError(f"{self.type} blocks are not supported: localserve takes text, image, tool_use and "
                         "tool_result blocks")


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Id
    content: TextOr[Annotated[list[Annotated[TextBlock | ImageBlock | RefusedBlock, Field(discriminator="type")]],
                              Field(max_length=MAX_MESSAGES)]] | None = None
    is_error: bool = False  # the result's text says what went wrong; templates have no place for the flag
    cache_control: Ignored = None

    @model_validator(mode="after")
    def _text_only(self) -> ToolResultBlock:
        if isinstance(self.content, list) and any(isinstance(block, ImageBlock) for block in self.content):
            raise ValueError("image blocks in tool results are not supported: send the image in a user message")
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _joined(self.content or [])  # type: ignore[arg-type]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RefusedBlock,
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: TextOr[Annotated[list[Block], Field(max_length=MAX_MESSAGES)]]

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> Message:
        misplaced = "tool_result" if self.role == "assistant" else "tool_use"
        if isinstance(self.content, list) and any(block.type == misplaced for block in self.content):
            raise ValueError(f"{misplaced} blocks belong in {'user' if self.role == 'assistant' else 'assistant'} "
                             "messages")
        return self

    def blocks(self, kind: type[_Strict]) -> list[Any]:
        return [block for block in self.content if isinstance(block, kind)] if isinstance(self.content, list) else []

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _joined(self.blocks(TextBlock))

    def chat_messages(self) -> list[dict[str, Any]]:
        """The OpenAI chat messages this turn is: an assistant turn with its tool_use blocks
        as ``tool_calls``; a user turn's tool results as ``tool`` messages (they come first,
        as Anthropic orders them), then its text."""
        if self.role == "assistant":
            calls = [{"id": block.id, "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
                     for block in self.blocks(ToolUseBlock)]
            text = self.text()
            return [{"role": "assistant", "content": text if text or not calls else None,
                     **({"tool_calls": calls} if calls else {})}]
        results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                   for block in self.blocks(ToolResultBlock)]
        if results and not self.blocks(TextBlock) and not self.blocks(ImageBlock):
            return results
        if self.blocks(ImageBlock):  # text and images in their order, as OpenAI's content parts
            parts = [{"type": "text", "text": block.text} if isinstance(block, TextBlock)
                     else {"type": "image_url", "image_url": {"url": block.data_url()}}
                     for block in self.content if isinstance(block, (TextBlock, ImageBlock))]
            return [*results, {"role": "user", "content": parts}]
        return [*results, {"role": "user", "content": self.text()}]


def _joined(blocks: list[TextBlock]) -> str:
    # One text from several blocks, a line apart (as vLLM joins text parts): Claude Code
    # and others send a reminder and the prompt as two blocks that must not run together.
    return "\n".join(block.text for block in blocks)


class Tool(_Strict):
    """A client tool. Anthropic's own tools (``bash_...``, ``web_search_...``) have no
    schema here to hold calls to, and are refused by their ``type``."""

    type: Literal["custom"] | None = None
    name: Name
    description: Text | None = None
    input_schema: JsonSchema
    cache_control: Ignored = None

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice names a tool with type "tool", and only then')
        return self

    def to_openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return "required" if self.type == "any" else self.type


class Thinking(_Strict):
    """``enabled`` with a budget (any positive one: a small model's test thinks for 8
    tokens), ``disabled``, or ``adaptive``: the model's own way."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None  # accepted; the thinking is always shown

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('thinking takes budget_tokens with type "enabled", and only then')
        return self


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted and ignored


class CountTokensRequest(_Strict):
    """What /v1/messages/count_tokens reads: the conversation as /v1/messages renders it."""

    model: ModelField
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: TextOr[Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)]] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def chat_request(self, **fields: Any) -> ChatCompletionRequest:
        """The OpenAI chat request this is, with further ``fields`` of it; a 400 naming
        what is wrong when that request is not valid (a tool_choice naming no tool, two
        output formats)."""
        final = self.messages[-1]
        # A final assistant turn is a prefill: the reply continues it (as Anthropic's does).
        prefill = final.role == "assistant" and not final.blocks(ToolUseBlock) and bool(final.text())
        chat: dict[str, Any] = {
            "model": self.model, "messages": self._chat_messages(),
            "add_generation_prompt": not prefill, "continue_final_message": prefill, **fields,
        }
        if self.tools:
            chat["tools"] = [tool.to_openai() for tool in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice.to_openai()
            chat["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.thinking is not None and self.thinking.type != "adaptive":
            # Templates that can think or not read enable_thinking (Qwen3); others ignore it.
            kwargs = chat.get("chat_template_kwargs")
            chat["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}),
                                            "enable_thinking": self.thinking.type == "enabled"}
            if self.thinking.budget_tokens is not None:
                chat["max_reasoning_tokens"] = self.thinking.budget_tokens
        if self.output_config is not None and self.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            raise LocalserveError(_first_error(exc)) from None

    def _chat_messages(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) or self.system is None else _joined(self.system)
        messages = [{"role": "system", "content": system}] if system is not None else []
        return messages + [entry for message in self.messages for entry in message.chat_messages()]


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Unknown fields are ignored, as Anthropic's own clients expect of a
    server that lacks their newest ones; the fields named in EXTENSIONS are passed on."""

    model_config = ConfigDict(strict=True, extra="allow")

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]],
                              Field(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: Ignored = None

    def chat_request(self, **fields: Any) -> ChatCompletionRequest:
        extensions = {name: value for name, value in (self.model_extra or {}).items() if name in EXTENSIONS}
        sampling = {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "temperature": self.temperature,
                    "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream}
        return super().chat_request(**extensions, **{k: v for k, v in sampling.items() if v is not None}, **fields)


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    location = ".".join(str(part) for part in first.get("loc", ()))
    return f"{location}: {first['msg']}" if location else first["msg"]


# Anthropic's error types, by the status the server answers with
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    """Whether a request is Anthropic's API's, whose errors come in Anthropic's shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, as Anthropic answers."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
