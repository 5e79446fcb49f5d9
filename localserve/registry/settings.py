"""A model's own defaults, as Ollama's Modelfile gives them: sampling parameters, a
system prompt, a chat template and a conversation to start from.

The registry keeps them beside a model's files (one JSON blob, role ``settings``; see
``Registry.settings``), ``localserve create`` and ``/api/create`` write them, and the
server applies them under what each request asks for: a field the request gives wins,
then the model's parameter, then the API's own default. Parameters keep Ollama's names
(``num_predict``, ``repeat_penalty``); ``request_fields`` says what each means to the
OpenAI request this server runs every API through.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import LocalserveError

MAX_STOP = 16  # as a request's stop list (server/protocol.py)
MAX_TEXT = 1 << 20  # characters of a system prompt, template, message or license
MAX_MESSAGES = 256
MESSAGE_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class Parameter:
    kind: type  # float, int or str (stop: a list of str)
    low: float = -math.inf
    high: float = math.inf
    request_field: str | None = None  # the OpenAI/vLLM request field it sets (None: handled apart)


# Ollama's parameter names (the llama.cpp sampler's) with the ranges the request fields allow.
PARAMETERS: dict[str, Parameter] = {
    "temperature": Parameter(float, 0, 2, "temperature"),
    "top_p": Parameter(float, 0, 1, "top_p"),
    "top_k": Parameter(int, -1, 1 << 31, "top_k"),
    "min_p": Parameter(float, 0, 1, "min_p"),
    "repeat_penalty": Parameter(float, 0, 10, "repetition_penalty"),
    "presence_penalty": Parameter(float, -2, 2, "presence_penalty"),
    "frequency_penalty": Parameter(float, -2, 2, "frequency_penalty"),
    "seed": Parameter(int, -(1 << 63), (1 << 64) - 1, "seed"),
    "stop": Parameter(str, request_field="stop"),
    "num_predict": Parameter(int, -2, 1 << 31),  # -1: until the context is full; -2: fill it
    "num_ctx": Parameter(int, 1, 1 << 24),  # the context a loaded model holds
    # localserve's own: speculative decoding's draft tokens a step (the engine's bound,
    # speculative.config.MAX_DRAFT_TOKENS: the registry reaches no engine module)
    "num_speculative_tokens": Parameter(int, 0, 16, "num_speculative_tokens"),
}


# Ollama's parameters for its runner's own settings (threads, GPU layers, mmap) and
# samplers this engine does not have: a Modelfile or client that sets them is accepted,
# and they are left to the server's settings (not stored).
IGNORED_PARAMETERS = frozenset({
    "num_gpu", "num_thread", "num_batch", "num_keep", "main_gpu", "low_vram", "use_mmap", "use_mlock", "numa",
    "vocab_only", "f16_kv", "repeat_last_n", "mirostat", "mirostat_eta", "mirostat_tau", "tfs_z", "typical_p",
    "penalize_newline", "rope_frequency_base", "rope_frequency_scale", "num_gqa"})


def check_parameter(name: str, value: Any, where: str = "parameter") -> Any:
    """``value`` as ``name`` takes it (a Modelfile's text, or JSON): the right type, in range."""
    spec = PARAMETERS.get(name)
    if spec is None:
        raise LocalserveError(f"{where}: unknown parameter {name!r} (known: {', '.join(PARAMETERS)})")
    if name == "stop":
        values = [value] if isinstance(value, str) else value
        if (not isinstance(values, list) or not 1 <= len(values) <= MAX_STOP
                or not all(isinstance(v, str) and 0 < len(v) <= 1024 for v in values)):
            raise LocalserveError(f"{where}: stop takes 1 to {MAX_STOP} strings of 1 to 1,024 characters")
        return list(values)
    try:
        if isinstance(value, bool):
            raise ValueError
        if spec.kind is int:
            number: float = int(value) if isinstance(value, str) else value
            if not isinstance(number, int):
                raise ValueError
        else:
            number = float(value)
    except (TypeError, ValueError):
        raise LocalserveError(f"{where}: {name} takes {'an integer' if spec.kind is int else 'a number'}, "
                              f"not {str(value)[:40]!r}") from None
    if not spec.low <= number <= spec.high or (name == "top_p" and number == 0):
        raise LocalserveError(f"{where}: {name} {number} is out of range")
    return number


def check_text(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise LocalserveError(f"{what} must be text of at most {MAX_TEXT:,} characters")
    return value


def check_message(message: Any, where: str = "message") -> dict[str, str]:
    if not isinstance(message, Mapping) or message.get("role") not in MESSAGE_ROLES:
        raise LocalserveError(f"{where}: a message has a role ({', '.join(MESSAGE_ROLES)}) and content")
    return {"role": message["role"], "content": check_text(message.get("content", ""), f"{where}: content")}


def request_fields(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters (Ollama's names: a model's, or a request's ``options``) as the OpenAI
    request fields they set: ``max_tokens`` from ``num_predict``, whose negative values
    mean up to the context's end (no field); ``num_ctx`` sets none."""
    fields = {PARAMETERS[name].request_field: value for name, value in parameters.items()
              if PARAMETERS[name].request_field is not None}
    if parameters.get("num_predict", -1) >= 0:
        fields["max_tokens"] = max(1, parameters["num_predict"])
    return fields  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class ModelSettings:
    parameters: Mapping[str, Any] = field(default_factory=dict)
    system: str | None = None
    template: str | None = None  # a Jinja chat template, replacing the checkpoint's
    messages: tuple[Mapping[str, str], ...] = ()

    @classmethod
    def checked(cls, parameters: Mapping[str, Any] | None = None, system: str | None = None,
                template: str | None = None, messages: Sequence[Any] | None = None,
                where: str = "settings") -> ModelSettings:
        """Settings from untrusted input (a Modelfile, a request, a stored blob), each part checked."""
        if parameters is not None and not isinstance(parameters, Mapping):
            raise LocalserveError(f"{where}: parameters must be an object")
        if messages is not None and (not isinstance(messages, Sequence) or isinstance(messages, str)
                                     or len(messages) > MAX_MESSAGES):
            raise LocalserveError(f"{where}: messages must be a list of at most {MAX_MESSAGES}")
        return cls(
            parameters={name: check_parameter(name, value, where) for name, value in (parameters or {}).items()
                        if name not in IGNORED_PARAMETERS},
            system=None if system is None else check_text(system, f"{where}: system"),
            template=None if template is None else check_text(template, f"{where}: template"),
            messages=tuple(check_message(m, where) for m in messages or ()))

    def __bool__(self) -> bool:
        return bool(self.parameters or self.system is not None or self.template is not None or self.messages)

    def over(self, base: ModelSettings) -> ModelSettings:
        """These settings on top of ``base``'s (a model created from another keeps what it
        does not change); parameters merge name by name."""
        return replace(base, parameters={**base.parameters, **self.parameters},
                       system=self.system if self.system is not None else base.system,
                       template=self.template if self.template is not None else base.template,
                       messages=self.messages or base.messages)

    @property
    def context_length(self) -> int | None:
        return self.parameters.get("num_ctx")

    def request_fields(self) -> dict[str, Any]:
        return request_fields(self.parameters)

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A chat request's messages after the model's: its MESSAGE turns first, and its
        system prompt unless the request brings its own (as Ollama does)."""
        history = [dict(m) for m in self.messages] + messages
        if self.system is not None and not (messages and messages[0].get("role") == "system"):
            history.insert(0, {"role": "system", "content": self.system})
        return history

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"parameters": dict(self.parameters)}
        if self.system is not None:
            data["system"] = self.system
        if self.template is not None:
            data["template"] = self.template
        if self.messages:
            data["messages"] = [dict(m) for m in self.messages]
        return data

    def to_json(self) -> bytes:
        return json.dumps(self.as_dict(), ensure_ascii=False, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ModelSettings:
        try:
            stored = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LocalserveError(f"{where}: not JSON ({exc})") from None
        return cls.from_dict(stored, where)

    @classmethod
    def from_dict(cls, stored: Any, where: str) -> ModelSettings:
        """What ``as_dict`` wrote, checked (a stored blob, or ``/api/show``'s ``settings``)."""
        if not isinstance(stored, dict):
            raise LocalserveError(f"{where}: not a JSON object")
        return cls.checked(stored.get("parameters"), stored.get("system"), stored.get("template"),
                           stored.get("messages"), where)

    def parameter_lines(self) -> list[str]:
        """Ollama's ``parameters`` text (``/api/show``): a name and a value a line, a list one line per item."""
        lines = []
        for name, value in self.parameters.items():
            for item in value if isinstance(value, list) else [value]:
                lines.append(f"{name:<30} {json.dumps(item, ensure_ascii=False) if isinstance(item, str) else item}")
        return lines
