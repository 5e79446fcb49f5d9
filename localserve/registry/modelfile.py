"""Ollama's Modelfile: a model made from another with its own defaults.

::

    FROM demo                       # a registry name, a .gguf file or an HF folder
    PARAMETER temperature 0.7       # any of settings.PARAMETERS; stop may repeat
    PARAMETER stop "<|im_end|>"
    SYSTEM You tell short stories.
    TEMPLATE \"\"\"{% for m in messages %}...{% endfor %}\"\"\"
    MESSAGE user Tell me about the sea.
    MESSAGE assistant The sea is big and blue.
    LICENSE \"\"\"MIT ...\"\"\"

Instructions are case-insensitive, one per line; ``#`` starts a comment line. A value
is the rest of its line, a JSON-quoted string (``"a \\"quoted\\" stop"``), or text
between triple quotes, which may span lines. TEMPLATE is a Jinja chat template as Hugging
Face checkpoints have (Ollama's Go templates are refused with a clear error); ADAPTER is
not supported; REQUIRES (an Ollama version) and the parameters of Ollama's runner
(``num_thread``, ``num_gpu``, ...: settings.IGNORED_PARAMETERS) are read and ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import LocalserveError
from .settings import IGNORED_PARAMETERS, MESSAGE_ROLES, PARAMETERS, ModelSettings, check_parameter

MAX_MODELFILE = 4 << 20  # characters
INSTRUCTIONS = ("FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "MESSAGE", "LICENSE")
_WORD = re.compile(r"[A-Za-z_]+")


@dataclass(slots=True)
class Modelfile:
    base: str  # FROM: a registry name, or a file or folder (relative to the Modelfile's folder)
    settings: ModelSettings = field(default_factory=ModelSettings)
    licenses: list[str] = field(default_factory=list)


class _Reader:
    """Walks the text, tracking the line for error messages."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    @property
    def line(self) -> int:
        return self.text.count("\n", 0, self.pos) + 1

    def fail(self, message: str) -> LocalserveError:
        return LocalserveError(f"Modelfile line {self.line}: {message}")

    def at_end(self) -> bool:
        while self.pos < len(self.text):
            if self.text[self.pos] in " \t\r\n":
                self.pos += 1
            elif self.text[self.pos] == "#":
                self.rest_of_line()
            else:
                return False
        return True

    def rest_of_line(self) -> str:
        end = self.text.find("\n", self.pos)
        end = len(self.text) if end < 0 else end
        line, self.pos = self.text[self.pos:end], end
        return line

    def word(self, what: str) -> str:
        self.spaces()
        match = _WORD.match(self.text, self.pos)
        if match is None:
            raise self.fail(f"expected {what}")
        self.pos = match.end()
        return match.group()

    def spaces(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def value(self, what: str) -> str:
        """The rest of the line, a JSON-quoted string, or a triple-quoted block."""
        self.spaces()
        line = self.line
        if self.text.startswith('"""', self.pos):
            end = self.text.find('"""', self.pos + 3)
            if end < 0:
                raise LocalserveError(f"Modelfile line {line}: the {what} opened with \"\"\" is never closed")
            value, self.pos = self.text[self.pos + 3:end], end + 3
        elif self.text.startswith('"', self.pos):
            try:
                value, length = json.JSONDecoder().raw_decode(self.text, self.pos)
            except json.JSONDecodeError:
                raise self.fail(f"the {what} opens a quote it does not close on its line") from None
            self.pos = length
        else:
            value = self.rest_of_line().strip()
        if self.rest_of_line().strip():
            raise LocalserveError(f"Modelfile line {line}: text after the {what}'s closing quote")
        return value


def parse_modelfile(text: str) -> Modelfile:
    """A Modelfile's instructions; a LocalserveError names the line of anything wrong."""
    if len(text) > MAX_MODELFILE:
        raise LocalserveError(f"the Modelfile is larger than {MAX_MODELFILE:,} characters")
    reader = _Reader(text)
    base: str | None = None
    parameters: dict[str, object] = {}
    system = template = None
    messages: list[dict[str, str]] = []
    licenses: list[str] = []
    while not reader.at_end():
        line = reader.line
        instruction = reader.word("an instruction").upper()
        if instruction == "FROM":
            if base is not None:
                raise reader.fail("a second FROM (a Modelfile makes one model from one base)")
            base = reader.value("FROM")
        elif instruction == "PARAMETER":
            name = reader.word("a parameter name").lower()
            if name in IGNORED_PARAMETERS:
                reader.value(name)
                continue
            if name not in PARAMETERS:
                raise reader.fail(f"unknown parameter {name!r} (known: {', '.join(PARAMETERS)})")
            value = check_parameter(name, reader.value(name), f"Modelfile line {line}")
            if name == "stop":
                value = [*parameters.get("stop", []), *value]  # type: ignore[list-item]
            parameters[name] = value
        elif instruction == "SYSTEM":
            system = reader.value("SYSTEM")
        elif instruction == "TEMPLATE":
            template = reader.value("TEMPLATE")
        elif instruction == "MESSAGE":
            role = reader.word("a role (system, user or assistant)").lower()
            if role not in MESSAGE_ROLES:
                raise reader.fail(f"MESSAGE {role!r}: the role is one of {', '.join(MESSAGE_ROLES)}")
            messages.append({"role": role, "content": reader.value("MESSAGE")})
        elif instruction == "LICENSE":
            licenses.append(reader.value("LICENSE"))
        elif instruction == "REQUIRES":
            reader.value("REQUIRES")  # the Ollama version a Modelfile was written for
        elif instruction == "ADAPTER":
            raise reader.fail("ADAPTER (LoRA adapters) is not supported")
        else:
            raise reader.fail(f"unknown instruction {instruction!r} (known: {', '.join(INSTRUCTIONS)})")
    if not base:
        raise LocalserveError("the Modelfile has no FROM line: FROM names the model it starts from")
    settings = ModelSettings.checked(parameters, system, template, messages, "Modelfile")
    return Modelfile(base, settings, licenses)


def _quoted(value: str) -> str:
    """A value as a Modelfile holds it: triple-quoted when that reads back exactly, else JSON-quoted."""
    if '"""' not in value and not value.endswith('"'):
        return f'"""{value}"""'
    return json.dumps(value, ensure_ascii=False)


def modelfile_of(name: str, base: str, settings: ModelSettings) -> str:
    """What ``show --modelfile`` and ``/api/show`` give: a Modelfile that makes ``name``
    from ``base`` (the checkpoint it opens) with its own settings."""
    return render_modelfile(base, settings, [], f"Modelfile of {name}, as localserve show --modelfile writes it")


def render_modelfile(base: str, settings: ModelSettings, licenses: list[str], title: str = "") -> str:
    """The Modelfile that makes a model with ``settings`` from ``base`` (``show --modelfile``);
    ``parse_modelfile`` reads it back to the same settings."""
    lines = [f"# {title}"] if title else []
    lines.append(f"FROM {base}")
    if settings.template is not None:
        lines.append(f"TEMPLATE {_quoted(settings.template)}")
    if settings.system is not None:
        lines.append(f"SYSTEM {_quoted(settings.system)}")
    for name, value in settings.parameters.items():
        for item in value if isinstance(value, list) else [value]:
            lines.append(f"PARAMETER {name} {json.dumps(item, ensure_ascii=False) if isinstance(item, str) else item}")
    lines += [f"MESSAGE {m['role']} {_quoted(m['content'])}" for m in settings.messages]
    lines += [f"LICENSE {_quoted(text)}" for text in licenses]
    return "\n".join(lines) + "\n"
