"""The interactive chat of `localserve run NAME` (no prompt), modelled on `ollama run`.

This module knows nothing about where text is generated: `chat_loop` is given a
`generate` function that turns the conversation into streamed text, plus functions to
read a line and write text, so the same loop drives a local engine, a server, or a test
script.

Input rules (Ollama's, plus backslash continuation):

* ``>>> `` prompts for a new message, ``... `` for a continuation line.
* A line starting with ``\"\"\"`` opens a block that ends at a line ending with ``\"\"\"``;
  everything between is one message. A line ending with ``\\`` continues onto the next.
* A line starting with ``/`` is a command (see `HELP`); it is never sent to the model.
* Ctrl-D ends the chat. Ctrl-C while typing drops what was typed and prompts again (it
  never ends the chat, so a stray double Ctrl-C can't lose the conversation); Ctrl-C
  while a reply streams stops it, keeping what was written.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..client import Stopped, Thinking
from ..errors import LocalserveError

__all__ = ["CONTINUATION_PROMPT", "ChatSettings", "Generate", "HELP", "PROMPT", "chat_loop", "image_data_url",
           "messages_for", "stdin_reader", "user_message", "write_stdout"]

PROMPT = ">>> "
CONTINUATION_PROMPT = "... "
QUOTES = '"""'

HELP = """\
Available commands:
  /set            Set a sampling setting or the system prompt (/set alone lists them)
  /show           Show the current settings and system prompt
  /clear          Forget the conversation (the system prompt stays)
  /image <path>   Send an image with the next message (models that read images)
  /bye, /exit     Exit (Ctrl-D works too)
  /?, /help       Show this help

Start a message with \"\"\" to write several lines, and end it with \"\"\".
End a line with \\ to continue it on the next one.
"""

SET_HELP = """\
Available settings:
  /set system <text>        System prompt (a \"\"\" block works too; no text clears it)
  /set temperature <x>      0 or more; 0 is greedy
  /set top_p <x>            More than 0, at most 1
  /set top_k <n>            0 or more; 0 is no limit
  /set max_tokens <n>       1 or more
  /set seed <n>             Any integer
"""


@dataclass
class ChatSettings:
    """What the user can change with ``/set``; `None` leaves the choice to the backend."""

    temperature: float | None = None  # None: the caller's default
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    system: str | None = None
    # Structured output: "json" (any JSON object) or a JSON schema the replies must match.
    json_schema: dict[str, Any] | None = None
    json_object: bool = False


# A backend: given the whole conversation (OpenAI-style messages, the system message first
# when set) and the settings, yields the reply's text in pieces as they are generated.
Generate = Callable[[list[dict[str, Any]], ChatSettings], Iterator[str]]
ReadLine = Callable[[str], str]
Write = Callable[[str], None]


def image_data_url(path: str | Path) -> str:
    """A local image file as a data URL for a chat message, checked as the daemon checks
    one (its size, its pixel count from the header, that it decodes)."""
    import base64

    from ..vision.image_input import ImageLimits, image_from_bytes

    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        if size > ImageLimits().max_bytes:
            raise LocalserveError(f"{path}: {size:,} bytes, over the {ImageLimits().max_bytes:,} an image may take")
        data = path.read_bytes()
    except OSError as exc:
        raise LocalserveError(f"{path}: {exc.strerror or exc}") from None
    image = image_from_bytes(data)
    return f"data:image/{image.format.lower()};base64,{base64.b64encode(data).decode()}"


def user_message(text: str, image_urls: list[str]) -> dict[str, Any]:
    """A user message: its text alone, or with images first (as Ollama lays them out) as
    OpenAI's content parts."""
    if not image_urls:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": url}} for url in image_urls),
                                        {"type": "text", "text": text}]}


def messages_for(history: list[dict[str, Any]], settings: ChatSettings) -> list[dict[str, Any]]:
    """The messages to send: the system prompt (when set) first, then the conversation.

    The dicts are copies, so a backend that edits what it is given cannot change the
    history the next turn sends.
    """
    system = [{"role": "system", "content": settings.system}] if settings.system else []
    return system + [dict(message) for message in history]


# --- Reading input ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    """One complete input: a message for the model, or a command line."""

    text: str
    is_command: bool


# `/set system """...` is the one command whose argument may be a block (as in Ollama).
_SYSTEM_BLOCK = re.compile(r'/set\s+system\s+"""')


def _read_entry(read_line: ReadLine) -> _Entry:
    """Read lines until one message or command is complete.

    Raises EOFError / KeyboardInterrupt from `read_line`; whatever was read of the entry is
    simply dropped then, which is what both want.
    """
    line = read_line(PROMPT)
    if line.startswith(QUOTES):
        # Text inside a block is a message even when it starts with "/".
        return _Entry(_read_block(line[len(QUOTES):], read_line), is_command=False)
    is_command = line.startswith("/")
    if is_command and (opener := _SYSTEM_BLOCK.match(line)):
        return _Entry(line[:opener.end() - len(QUOTES)] + _read_block(line[opener.end():], read_line), True)
    return _Entry(_read_continued(line, read_line), is_command)


def _read_block(first: str, read_line: ReadLine) -> str:
    """The text of a block whose first line (after the opening quotes) is `first`."""
    if first.endswith(QUOTES):  # opened and closed on one line: """text"""
        return first[:-len(QUOTES)]
    parts = [first]
    while not (line := read_line(CONTINUATION_PROMPT)).endswith(QUOTES):
        parts.append(line)
    parts.append(line[:-len(QUOTES)])
    # Quotes alone on the opening or closing line mark the block, they add no blank line.
    if parts[0] == "":
        parts.pop(0)
    if parts and parts[-1] == "":
        parts.pop()
    return "\n".join(parts)


def _read_continued(line: str, read_line: ReadLine) -> str:
    """`line` plus the lines it continues onto with a trailing backslash."""
    parts = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        line = read_line(CONTINUATION_PROMPT)
    parts.append(line)
    return "\n".join(parts)


# --- Settings -----------------------------------------------------------------------------

def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # float() accepts "nan" and "inf"; no sampler does
        raise ValueError
    return value


# name -> (parse, is the value allowed, what an allowed value is)
_SETTINGS: dict[str, tuple[Callable[[str], float | int], Callable[[float], bool], str]] = {
    "temperature": (_parse_float, lambda x: x >= 0, "a number >= 0"),
    "top_p": (_parse_float, lambda x: 0 < x <= 1, "a number in (0, 1]"),
    "top_k": (int, lambda x: x >= 0, "an integer >= 0"),
    "max_tokens": (int, lambda x: x >= 1, "an integer >= 1"),
    "seed": (int, lambda x: True, "an integer"),
}


def _set(settings: ChatSettings, args: str) -> str:
    """Apply ``/set ARGS`` to `settings`; returns the line to show (an error changes nothing)."""
    if not args:
        return SET_HELP
    name, value = _split(args)
    if name == "parameter":  # Ollama spells it `/set parameter temperature 0.7`
        name, value = _split(value)
    if name == "system":
        settings.system = value.strip() or None
        return "Set system message.\n" if settings.system else "Cleared system message.\n"
    if name not in _SETTINGS:
        return f"error: unknown setting '{name}'. Type /set to list them\n"
    parse, allowed, expected = _SETTINGS[name]
    if not value:
        return f"error: /set {name} needs a value ({expected})\n"
    try:
        number = parse(value)
    except ValueError:
        number = None
    if number is None or not allowed(number):
        return f"error: {name} must be {expected}, not '{value}'\n"
    setattr(settings, name, number)
    return f"Set {name} to {number}.\n"


def _split(text: str) -> tuple[str, str]:
    """The first word of `text` and the rest (inner newlines kept: a system prompt may have them)."""
    words = text.strip().split(maxsplit=1)
    return (words[0], words[1] if len(words) > 1 else "") if words else ("", "")


def _describe(settings: ChatSettings) -> str:
    """``/show settings``: every setting, with `default` for the ones left to the backend."""
    lines = ["Settings:"]
    for name in _SETTINGS:
        value = getattr(settings, name)
        lines.append(f"  {name:<12} {'default' if value is None else value}")
    answers = "a JSON schema's JSON" if settings.json_schema is not None else "JSON" if settings.json_object else "text"
    lines.append(f"  {'format':<12} {answers}")
    lines.append("System prompt:")
    lines.extend(f"  {line}" for line in (settings.system or "(none)").splitlines())
    return "\n".join(lines) + "\n"


# --- The loop -----------------------------------------------------------------------------

@dataclass
class _Session:
    generate: Generate
    settings: ChatSettings
    write: Write
    history: list[dict[str, Any]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)  # data URLs, for the next message

    def command(self, text: str) -> bool:
        """Run one command line; False when it ends the chat."""
        name, args = _split(text)
        if name in ("/bye", "/exit"):
            return False
        if name == "/clear":
            self.history.clear()
            self.write("Cleared session context.\n")
        elif name == "/set":
            self.write(_set(self.settings, args))
        elif name == "/show" and args.strip() in ("", "settings"):
            self.write(_describe(self.settings))
        elif name == "/show":
            self.write(f"error: unknown /show option '{args.strip()}'. Try /show settings\n")
        elif name == "/image":
            self._add_image(args.strip())
        elif name in ("/?", "/help"):
            self.write(HELP)
        else:
            self.write(f"Unknown command '{name}'. Type /? for help\n")
        return True

    def _add_image(self, path: str) -> None:
        if not path:
            self.write("Usage: /image <path>\n")
            return
        try:
            self.images.append(image_data_url(path))
        except LocalserveError as error:
            self.write(f"error: {error}\n")
            return
        self.write(f"Added image {path}: it goes with your next message.\n")

    def send(self, text: str) -> None:
        """One turn: send `text` (with the images added since the last) and the history
        before it, and stream the reply."""
        self.history.append(user_message(text, self.images))
        self.images = []
        pieces: list[str] = []
        stream: Iterator[str] | None = None
        try:
            # A copy of the settings, so a backend that keeps them sees no later /set.
            stream = self.generate(messages_for(self.history, self.settings), replace(self.settings))
            for piece in stream:
                if not isinstance(piece, Thinking):  # the reasoning stays out of the history
                    pieces.append(piece)
                self.write(piece)
        except KeyboardInterrupt:
            self.write("\n")
            self._finish("".join(pieces))
            return
        except LocalserveError as error:
            # The model never answered this message, so it is not part of the conversation.
            self.history.pop()
            if pieces:
                self.write("\n")  # end the partial reply's line
            self.write(f"error: {error}\n")
            return
        finally:
            # Closing a generator interrupted outside its own code (Ctrl-C in write) lets the
            # backend cancel the request instead of leaving it running.
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        reply = "".join(pieces)
        self._finish(reply)
        self.write("\n" if reply.endswith("\n") else "\n\n")  # one blank line after the reply

    def _finish(self, reply: str) -> None:
        if reply:
            self.history.append({"role": "assistant", "content": reply})
        else:
            # Nothing came back (stopped at once): drop the question too, so the history
            # never holds two user messages in a row, which some chat templates reject.
            self.history.pop()


def chat_loop(generate: Generate, settings: ChatSettings, read_line: ReadLine, write: Write,
              images: list[str] | None = None) -> None:
    """Chat until ``/bye``, ``/exit`` or end of input (EOFError from `read_line`);
    ``images`` (data URLs) go with the first message.

    `settings` is the starting point; ``/set`` changes a copy, so the caller's object is
    left as it was. Errors a user can cause (`LocalserveError` from `generate`) are shown
    and the chat goes on; anything else is a bug and propagates.
    """
    session = _Session(generate, replace(settings), write, images=list(images or []))
    while True:
        try:
            entry = _read_entry(read_line)
        except EOFError:
            return
        except KeyboardInterrupt:
            # The terminal shows ^C after the typed text; start afresh on the next line.
            write("\nUse Ctrl + d or /bye to exit.\n")
            continue
        if entry.is_command:
            if not session.command(entry.text):
                return
        elif entry.text.strip():
            session.send(entry.text)


# --- Terminal I/O -------------------------------------------------------------------------

def stdin_reader() -> ReadLine:
    """A `read_line` for a terminal: `input()`, with line editing and history when the
    platform has `readline`."""
    try:
        import readline  # noqa: F401  -- importing it is what makes input() use it
    except ImportError:  # e.g. Windows without pyreadline
        pass

    def read_line(prompt: str) -> str:
        try:
            return input(prompt)
        except EOFError:
            if sys.stdin.isatty():
                write_stdout("\n")  # Ctrl-D leaves the cursor after the prompt; free the line
            raise

    return read_line


def write_stdout(text: str) -> None:
    """Write `text` to stdout at once (streamed replies must not wait in a buffer); a
    model's reasoning dimmed on a terminal, and left out when the output is piped; a
    reply cut at its length limit says so on stderr."""
    if isinstance(text, Stopped):
        # Said on stderr, so that a piped reply stays the model's text alone.
        sys.stdout.flush()
        sys.stderr.write("\n[stopped at the length limit: --max-tokens (/set max_tokens in a chat) or a "
                         "Modelfile's PARAMETER num_predict sets another]\n")
        sys.stderr.flush()
        return
    if isinstance(text, Thinking):
        if not sys.stdout.isatty():
            return
        text = f"\x1b[2m{text}\x1b[0m"
    sys.stdout.write(text)
    sys.stdout.flush()
