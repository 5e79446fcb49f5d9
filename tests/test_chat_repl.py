"""The interactive chat loop, driven by scripted input and a fake model (no engine)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from localserve.cli import chat_repl
from localserve.cli.chat_repl import ChatSettings, chat_loop, messages_for
from localserve.errors import LocalserveError

REPLY = ("Hel", "lo", "!")


class Interrupt:
    """A scripted line that stands for Ctrl-C while typing."""


@dataclass
class Script:
    """`read_line` from a list of lines, then EOFError (Ctrl-D); records the prompts."""

    lines: list[str | type[Interrupt]]
    prompts: list[str] = field(default_factory=list)

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if line is Interrupt:
            raise KeyboardInterrupt
        return line


@dataclass
class FakeModel:
    """A `Generate` that records each call and streams `reply` in pieces."""

    reply: tuple[str, ...] = REPLY
    calls: list[tuple[list[dict[str, str]], ChatSettings]] = field(default_factory=list)

    def __call__(self, messages: list[dict[str, str]], settings: ChatSettings) -> Iterator[str]:
        self.calls.append((copy.deepcopy(messages), settings))
        return iter(self.reply)

    @property
    def sent(self) -> list[list[dict[str, str]]]:
        return [messages for messages, _ in self.calls]


@dataclass
class Chat:
    model: FakeModel
    script: Script
    writes: list[str]

    @property
    def output(self) -> str:
        return "".join(self.writes)


def chat(*lines: str | type[Interrupt], model: FakeModel | None = None, settings: ChatSettings | None = None) -> Chat:
    result = Chat(model or FakeModel(), Script(list(lines)), [])
    chat_loop(result.model, settings or ChatSettings(), result.script, result.writes.append)
    return result


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def test_history_is_sent_whole_and_replies_appended() -> None:
    result = chat("hi", "how are you?", "bye now")
    assert result.model.sent == [
        [user("hi")],
        [user("hi"), assistant("Hello!"), user("how are you?")],
        [user("hi"), assistant("Hello!"), user("how are you?"), assistant("Hello!"), user("bye now")],
    ]
    assert result.output == "Hello!\n\n" * 3


def test_reply_is_written_piece_by_piece_as_it_arrives() -> None:
    writes: list[str] = []

    def generate(messages: list[dict[str, str]], settings: ChatSettings) -> Iterator[str]:
        yield "one "
        assert writes == ["one "]  # shown before the next piece is generated
        yield "two"

    chat_loop(generate, ChatSettings(), Script(["hi"]), writes.append)
    assert writes == ["one ", "two", "\n\n"]


def test_reply_ending_in_newline_gets_one_blank_line() -> None:
    assert chat("hi", model=FakeModel(("a\n",))).output == "a\n\n"


def test_system_prompt_goes_first_and_set_system_changes_it() -> None:
    result = chat("hi", "/set system Talk like a pirate.", "again", settings=ChatSettings(system="Be brief."))
    assert result.model.sent[0] == [system("Be brief."), user("hi")]
    assert result.model.sent[1] == [system("Talk like a pirate."), user("hi"), assistant("Hello!"), user("again")]
    assert "Set system message." in result.output


def test_set_system_takes_a_block() -> None:
    result = chat('/set system """You are', "a pirate.", '"""', "hi")
    assert result.model.sent == [[system("You are\na pirate."), user("hi")]]
    assert result.script.prompts[:4] == [">>> ", "... ", "... ", ">>> "]


def test_set_system_without_text_clears_it() -> None:
    result = chat("/set system", "hi", settings=ChatSettings(system="Be brief."))
    assert result.model.sent == [[user("hi")]]


def test_clear_empties_history_but_keeps_system_prompt() -> None:
    result = chat("hi", "/clear", "again", settings=ChatSettings(system="Be brief."))
    assert result.model.sent[1] == [system("Be brief."), user("again")]
    assert "Cleared session context." in result.output


@pytest.mark.parametrize(("lines", "message"), [
    (['"""', "line one", "", "line two", '"""'], "line one\n\nline two"),
    (['"""first', "second", 'third"""'], "first\nsecond\nthird"),
    (['"""all on one line"""'], "all on one line"),
    (['"""', "/bye is text here", '"""'], "/bye is text here"),
    (['"""', "code \\", '"""'], "code \\"),  # no backslash continuation inside a block
    (["first \\", "second\\", "third"], "first \nsecond\nthird"),
])
def test_blocks_and_continuations_are_one_message(lines: list[str], message: str) -> None:
    result = chat(*lines, "next")
    assert result.model.sent[0] == [user(message)]
    assert len(result.model.sent) == 2


def test_prompts_passed_to_read_line() -> None:
    result = chat("hi", '"""', "a", '"""', "b \\", "c")
    assert result.script.prompts == [">>> ", ">>> ", "... ", "... ", ">>> ", "... ", ">>> "]


def test_set_temperature_reaches_generate() -> None:
    result = chat("hi", "/set temperature 0.7", "again")
    assert result.model.calls[0][1].temperature is None
    assert result.model.calls[1][1].temperature == 0.7
    assert "Set temperature to 0.7." in result.output


def test_every_setting_can_be_set() -> None:
    result = chat("/set temperature 0", "/set top_p 0.9", "/set top_k 40", "/set max_tokens 64", "/set seed -3",
                  "/set parameter top_k 7", "hi")
    assert result.model.calls[0][1] == ChatSettings(temperature=0.0, top_p=0.9, top_k=7, max_tokens=64, seed=-3)


@pytest.mark.parametrize("command", [
    "/set temperature -1", "/set temperature nan", "/set temperature inf", "/set temperature warm",
    "/set top_p 2", "/set top_p 0", "/set top_k x", "/set top_k -1", "/set top_k 1.5",
    "/set max_tokens 0", "/set seed x", "/set temperature", "/set colour blue",
])
def test_bad_settings_are_rejected_and_change_nothing(command: str) -> None:
    start = ChatSettings(temperature=0.2, top_p=0.5, top_k=3, max_tokens=10, seed=1)
    result = chat(command, "hi", settings=start)
    error = result.writes[0]
    assert error.startswith("error: ") and error.endswith("\n") and error.count("\n") == 1
    assert result.model.calls[0][1] == start


def test_caller_settings_object_is_left_alone() -> None:
    start = ChatSettings(temperature=0.2)
    chat("/set temperature 0.9", "/set system x", "hi", settings=start)
    assert start == ChatSettings(temperature=0.2)


def test_generate_gets_a_snapshot_of_the_settings() -> None:
    result = chat("hi", "/set seed 5", "again")
    first, second = (settings for _, settings in result.model.calls)
    assert first.seed is None and second.seed == 5


@pytest.mark.parametrize("command", ["/bye", "/exit"])
def test_bye_ends_before_reading_more(command: str) -> None:
    result = chat("hi", command, "never read")
    assert result.script.lines == ["never read"]
    assert len(result.model.calls) == 1


def test_unknown_commands_are_not_sent() -> None:
    result = chat("/foo bar", "/BYE", "hi")  # commands are case-sensitive: /BYE does not end
    assert "Unknown command '/foo'. Type /? for help\n" in result.writes
    assert "Unknown command '/BYE'. Type /? for help\n" in result.writes
    assert result.model.sent == [[user("hi")]]


def test_help_set_and_show() -> None:
    result = chat("/?", "/help", "/set", "/set temperature 0.5", "/set system Be brief.", "/show", "/show settings")
    assert result.writes[0] == result.writes[1] == chat_repl.HELP
    assert "/bye" in chat_repl.HELP
    assert all(name in result.writes[2] for name in ("system", "temperature", "top_p", "top_k", "max_tokens", "seed"))
    shown = result.writes[5]
    assert "temperature  0.5" in shown and "top_p        default" in shown and "Be brief." in shown
    assert result.writes[6] == shown
    assert not result.model.calls


def test_empty_lines_are_skipped() -> None:
    result = chat("", "   ", '""""""', "hi")
    assert result.model.sent == [[user("hi")]]
    assert result.output == "Hello!\n\n"


def test_generate_error_is_shown_and_message_dropped() -> None:
    def generate(messages: list[dict[str, str]], settings: ChatSettings) -> Iterator[str]:
        sent.append(copy.deepcopy(messages))
        if messages[-1]["content"] == "boom":
            raise LocalserveError("prompt is too long")
        yield "ok"

    sent: list[list[dict[str, str]]] = []
    writes: list[str] = []
    chat_loop(generate, ChatSettings(), Script(["hi", "boom", "again"]), writes.append)
    assert "".join(writes) == "ok\n\nerror: prompt is too long\nok\n\n"
    assert sent[2] == [user("hi"), assistant("ok"), user("again")]


def test_generate_error_mid_reply_drops_partial_reply_too() -> None:
    def generate(messages: list[dict[str, str]], settings: ChatSettings) -> Iterator[str]:
        sent.append(copy.deepcopy(messages))
        yield "par"
        if len(sent) == 1:
            raise LocalserveError("out of memory")

    sent: list[list[dict[str, str]]] = []
    writes: list[str] = []
    chat_loop(generate, ChatSettings(), Script(["hi", "again"]), writes.append)
    assert "".join(writes) == "par\nerror: out of memory\npar\n\n"
    assert sent[1] == [user("again")]


def test_interrupt_mid_reply_keeps_partial_reply() -> None:
    def generate(messages: list[dict[str, str]], settings: ChatSettings) -> Iterator[str]:
        sent.append(copy.deepcopy(messages))
        yield "Par"
        yield "tial"
        if len(sent) == 1:
            raise KeyboardInterrupt

    sent: list[list[dict[str, str]]] = []
    writes: list[str] = []
    chat_loop(generate, ChatSettings(), Script(["hi", "again"]), writes.append)
    assert "".join(writes) == "Partial\nPartial\n\n"
    assert sent[1] == [user("hi"), assistant("Partial"), user("again")]


def test_interrupt_in_write_closes_the_stream() -> None:
    closed = []

    def generate(messages: list[dict[str, str]], settings: ChatSettings) -> Iterator[str]:
        try:
            yield "a"
            yield "b"
        finally:
            closed.append(True)

    def write(text: str) -> None:
        if text == "a":
            raise KeyboardInterrupt  # Ctrl-C lands while our loop, not the backend, runs

    chat_loop(generate, ChatSettings(), Script(["hi"]), write)
    assert closed == [True]


def test_interrupt_before_any_text_drops_the_message() -> None:
    def generate(messages: list[dict[str, str]], settings: ChatSettings) -> Iterator[str]:
        sent.append(copy.deepcopy(messages))
        if len(sent) == 1:
            raise KeyboardInterrupt
        yield "ok"

    sent: list[list[dict[str, str]]] = []
    chat_loop(generate, ChatSettings(), Script(["hi", "again"]), lambda text: None)
    assert sent[1] == [user("again")]


def test_interrupt_while_typing_discards_input_and_reprompts() -> None:
    result = chat('"""', "half a block", Interrupt, "hi")
    assert result.model.sent == [[user("hi")]]
    assert result.script.prompts == [">>> ", "... ", "... ", ">>> ", ">>> "]
    assert result.writes[0] == "\nUse Ctrl + d or /bye to exit.\n"


def test_eof_ends_quietly() -> None:
    assert chat().output == ""
    result = chat('"""', "never finished")  # EOF inside a block drops it
    assert result.output == "" and not result.model.calls


def test_messages_for_copies_history() -> None:
    history = [user("hi")]
    messages = messages_for(history, ChatSettings(system="sys"))
    assert messages == [system("sys"), user("hi")]
    messages[1]["content"] = "changed"
    assert history == [user("hi")]
    assert messages_for(history, ChatSettings()) == [user("hi")]


def test_stdin_reader_uses_input(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt: prompts.append(prompt) or "typed")
    assert chat_repl.stdin_reader()(">>> ") == "typed"
    assert prompts == [">>> "]


def test_stdin_reader_passes_on_eof(monkeypatch: pytest.MonkeyPatch) -> None:
    def eof(prompt: str) -> str:
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    with pytest.raises(EOFError):
        chat_repl.stdin_reader()(">>> ")


def test_write_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    chat_repl.write_stdout("piece")
    assert capsys.readouterr().out == "piece"


def test_thinking_is_shown_apart_and_kept_out_of_the_history(monkeypatch: pytest.MonkeyPatch) -> None:
    from localserve.client import Thinking

    model = FakeModel(reply=(Thinking("Let me "), Thinking("see."), "It is ", "4."))
    result = chat("2+2?", "and 3+3?", model=model)
    assert any(isinstance(w, Thinking) for w in result.writes)  # the writer decides how it looks
    assert model.sent[1] == [user("2+2?"), assistant("It is 4."), user("and 3+3?")]

    class Terminal:
        def __init__(self, tty: bool) -> None:
            self.tty, self.text = tty, ""

        def isatty(self) -> bool:
            return self.tty

        def write(self, text: str) -> None:
            self.text += text

        def flush(self) -> None:
            pass

    for tty, expected in ((True, "\x1b[2mLet me\x1b[0mIt is 4."), (False, "It is 4.")):
        terminal = Terminal(tty)
        monkeypatch.setattr("sys.stdout", terminal)
        for piece in (Thinking("Let me"), "It is 4."):
            chat_repl.write_stdout(piece)
        assert terminal.text == expected  # dimmed on a terminal, left out when piped


def test_both_backends_tell_thinking_from_the_answer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In-process, a thinking template's reply is split as the daemon splits it; through the
    daemon, reasoning_content pieces arrive as Thinking (a regex steers the story model
    into closing its think block)."""
    from localserve import Engine, EngineConfig
    from localserve.cli.run_backends import LocalBackend
    from localserve.client import DaemonClient, Thinking
    from localserve.server.config import ServerConfig

    from .server_util import running_server, small_engine_config, stories_with_template
    from .test_reasoning import THINKING_TEMPLATE

    path = stories_with_template(tmp_path, THINKING_TEMPLATE)
    local = LocalBackend(Engine(path, EngineConfig(num_kv_blocks=64), device="cpu"))
    pieces = list(local.chat([user("Hi")], ChatSettings(temperature=0, max_tokens=12)))
    assert pieces and all(isinstance(p, Thinking) for p in pieces)  # the prompt opened the block; no </think> came
    config = ServerConfig(models={"stories": path}, preload=["stories"], engine=small_engine_config(), device="cpu")
    with running_server(config) as server:
        body = {"model": "stories", "messages": [user("Hi")], "temperature": 0, "max_tokens": 30,
                "max_reasoning_tokens": 6, "guided_regex": r"Yes\."}
        streamed = list(DaemonClient(server.url).stream_text("/v1/chat/completions", body))
    thinking = "".join(p for p in streamed if isinstance(p, Thinking))
    assert thinking and "".join(p for p in streamed if not isinstance(p, Thinking)) == "Yes."


def test_an_image_goes_with_the_next_message_only(tmp_path) -> None:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), "red").save(buffer, format="PNG")
    (tmp_path / "red.png").write_bytes(buffer.getvalue())
    result = chat(f"/image {tmp_path / 'red.png'}", "what is it?", "and now?")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert result.model.sent[0] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]}]
    assert result.model.sent[1][-1] == user("and now?")
    assert "Added image" in result.output


def test_an_image_that_cannot_be_read_is_refused_and_the_chat_goes_on(tmp_path) -> None:
    (tmp_path / "text.png").write_text("not an image")
    result = chat(f"/image {tmp_path / 'missing.png'}", f"/image {tmp_path / 'text.png'}", "hi")
    assert result.model.sent == [[user("hi")]]
    assert result.output.count("error: ") == 2 and "No such file" in result.output
