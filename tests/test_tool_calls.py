"""Tool calls: each family's format read from replies written as the family documents them
(and malformed ones left as content), streamed in pieces of every size equal to read whole;
through the openai SDK (strict validation) on the stories260K model with a short Hermes-style
tool template (its 512-token context cannot hold Hermes-3's own): ``required`` and named
choices give schema-valid arguments (jsonschema), streamed as OpenAI streams calls, and
``auto`` reads the model's own <tool_call> blocks."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from localserve import LocalserveError

from localserve.chat.tool_calls import PARSERS, ToolCallStream, forced_call_format, parse, parser_for_template

from .server_util import stories_client
from .test_chat_template import TEMPLATES, WEATHER_TOOL

PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"zone": "CET"})

# (parser, reply, expected content, expected calls)
REPLIES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [PARIS]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.\n", [PARIS, TIME]),
    ("hermes", "It is sunny. No tools needed.", "It is sunny. No tools needed.", []),
    ("hermes", "<tool_call>\nnot a call\n</tool_call>", "<tool_call>\nnot a call\n</tool_call>", []),
    # Cut short: the call as far as it got, as OpenAI returns a reply cut by max_tokens.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None,
     [("get_weather", '{"city": "Par')]),
    ("hermes", '<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>', None, [TIME]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [PARIS, TIME]),
    ("llama3_json", '{"answer": 4} is what I would write.', '{"answer": 4} is what I would write.', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [PARIS, TIME]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None, [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "unit": "celsius"}'
                '[TOOL_CALLS]get_time[CALL_ID]f5g6h7i8j[ARGS]{"zone": "CET"}', None, [PARIS, TIME]),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
                 '<｜tool▁sep｜>get_time\n```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     None, [PARIS, TIME]),
    ("deepseek", 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}'
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.", [TIME]),  # V3.1
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]', None, [PARIS, TIME]),
    ("pythonic", "[__import__('os').system('x')]", "[__import__('os').system('x')]", []),  # read, never run
]


def streamed(call_format, reply: str, size: int) -> tuple[str, list[tuple[str, str]], int]:  # type: ignore[no-untyped-def]
    """The content and the calls a reply streamed in pieces of ``size`` adds up to, as an
    OpenAI client puts them together, and how many argument pieces came."""
    stream, content, calls, pieces = ToolCallStream(call_format), "", {}, 0
    for start in range(0, len(reply) + 1, size):
        shown, entries = stream.feed(reply[start:start + size]) if start < len(reply) else stream.finish()
        content += shown
        for entry in entries:
            if "id" in entry:  # the head: id, type and name with empty arguments, first
                assert entry["type"] == "function" and entry["function"]["arguments"] == "" \
                    and entry["index"] not in calls
                calls[entry["index"]] = [entry["function"]["name"], ""]
            else:
                calls[entry["index"]][1] += entry["function"]["arguments"]
                pieces += 1
    if start < len(reply):
        shown, entries = stream.finish()
        content += shown
        assert not entries or all("id" not in e for e in entries)
        for entry in entries:
            calls[entry["index"]][1] += entry["function"]["arguments"]
    return content, [tuple(calls[i]) for i in range(len(calls))], pieces


@pytest.mark.parametrize("parser,reply,content,calls", REPLIES)
def test_each_format(parser: str, reply: str, content: str | None, calls) -> None:  # type: ignore[no-untyped-def]
    got_content, got = parse(parser, reply)
    assert got_content == content
    assert [(c.name, c.arguments if isinstance(args, str) else json.loads(c.arguments))
            for c, (_, args) in zip(got, calls)] == calls
    # Streamed in pieces of every size: the content and the calls add up to the same.
    for size in range(1, len(reply) + 1):
        shown, streamed_calls, pieces = streamed(PARSERS[parser], reply, size)
        assert (shown or None) == (content if got else reply), size
        assert streamed_calls == [(c.name, c.arguments) for c in got], size


@pytest.mark.parametrize("call_format,reply", [
    (PARSERS["hermes"], REPLIES[1][1]), (PARSERS["llama3_json"], REPLIES[7][1]), (PARSERS["mistral"], REPLIES[9][1]),
    (PARSERS["mistral"], REPLIES[11][1]), (PARSERS["deepseek"], REPLIES[12][1]), (PARSERS["deepseek"], REPLIES[13][1]),
    (forced_call_format("get_time"), '{"zone": "CET"}'),
    (forced_call_format(None), '[{"name": "get_time", "arguments": {"zone": "CET"}}, '
                               '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'),
], ids=["hermes", "llama3_json", "mistral", "mistral-call-id", "deepseek", "deepseek-v3.1", "named", "required"])
def test_arguments_go_out_as_they_are_generated(call_format, reply: str) -> None:  # type: ignore[no-untyped-def]
    """Fed a character at a time, each character of the arguments is sent as it comes."""
    _, calls, pieces = streamed(call_format, reply, 1)
    assert calls and pieces == sum(len(arguments) for _, arguments in calls)


def test_parser_from_template() -> None:
    hermes = (TEMPLATES / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
    nemo = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    assert parser_for_template(hermes) == "hermes" and parser_for_template(nemo) == "mistral"
    assert parser_for_template((TEMPLATES / "google-gemma-2-2b-it.jinja").read_text()) is None


# -- through the API ---------------------------------------------------------------------------------

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                              "parameters": {"type": "object", "properties": {
                                                  "zone": {"type": "string", "maxLength": 6}},
                                                  "required": ["zone"], "additionalProperties": False}}}
# Bounded arguments, so that a story model's calls end well inside max_tokens.
BOUNDED_WEATHER = {"type": "function", "function": {**WEATHER_TOOL["function"], "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TOOLS = [BOUNDED_WEATHER, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]
HERMES_STYLE = (
    "{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}- call one as "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with stories_client(tmp_path_factory.mktemp("models"), HERMES_STYLE) as client:
        yield client


def check_calls(calls, names: set[str]) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def]
    found = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        found.append((call.function.name, arguments))
    return found


# A story model does not know when to stop adding calls: "required" is asked for one here
# (parallel_tool_calls false), and for several in the next test.
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_are_schema_valid_whole_and_streamed(client: openai.OpenAI, choice) -> None:  # type: ignore[no-untyped-def]
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    for seed in range(3):
        reply = client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               temperature=1.0, seed=seed, max_tokens=120, parallel_tool_calls=False)
        message = reply.choices[0]
        assert message.finish_reason == "tool_calls" and message.message.content is None
        whole = check_calls(message.message.tool_calls, names)
        assert whole
        stream = client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                temperature=1.0, seed=seed, max_tokens=120, stream=True,
                                                parallel_tool_calls=False)
        calls: dict[int, dict] = {}
        finish, pieces = None, 0
        for chunk in stream:
            for part in chunk.choices:
                finish = part.finish_reason or finish
                for piece in part.delta.tool_calls or []:
                    entry = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                    entry["name"] += piece.function.name or ""
                    entry["arguments"] += piece.function.arguments or ""
                    pieces += bool(piece.function.arguments)
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == whole
        assert pieces > len(calls) + 2  # the arguments came as they were generated


def test_calls_cut_short(client: openai.OpenAI) -> None:
    """A reply cut by max_tokens inside a call returns the call as far as it got, with
    finish_reason "length", as OpenAI returns one; streamed, the same."""
    ask = dict(model="stories", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40)
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"city": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    arguments, finish = "", None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for part in chunk.choices:
            finish = part.finish_reason or finish
            arguments += "".join(piece.function.arguments or "" for piece in part.delta.tool_calls or [])
    assert (arguments, finish) == (call.function.arguments, "length")


def test_auto_reads_the_models_own_calls(client: openai.OpenAI) -> None:
    """The reply is steered (a regex) into Hermes' format, then read back as a call."""
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'
    steer = {"guided_regex": f"(Checking\\.\\n)?{call}(\\n{call})?"}
    reply = client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, temperature=0,
                                           max_tokens=250, extra_body=steer)
    calls = check_calls(reply.choices[0].message.tool_calls, {"get_weather"})
    assert calls and all(c[1]["unit"] == "celsius" for c in calls) and reply.choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, temperature=0,
                                           max_tokens=12)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_bad_tool_choices_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="one of"):
        client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       tool_choice="required", response_format={"type": "json_object"})


def test_server_options_choose_the_parsers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--tool-parser names a format the template does not show (pythonic here);
    --reasoning-parser none leaves <think> text in content. The CLI offers every format."""
    import click

    from localserve.cli.main import serve

    from .test_reasoning import THINKING_TEMPLATE

    choices = {p.name: p.type.choices for p in serve.params if isinstance(p.type, click.Choice)}
    assert set(choices["tool_parser"]) == {"auto", "none", *PARSERS}
    with stories_client(tmp_path, THINKING_TEMPLATE, tool_parser="pythonic", reasoning_parser="none") as client:
        steer = {"guided_regex": r'\[get_time\(zone="(CET|UTC)"\)\]'}
        reply = client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, temperature=0,
                                               max_tokens=40, extra_body=steer)
        assert check_calls(reply.choices[0].message.tool_calls, {"get_time"})
        thinking = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=30,
                                                  extra_body={"guided_regex": r"[a-z]{3,8}</think>Yes\."})
        message = thinking.choices[0].message
        assert "</think>" in message.content and "reasoning_content" not in (message.model_extra or {})


def test_python_chat_reads_calls_as_the_server_does(client: openai.OpenAI, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """LLM.chat with tools: required and named choices, and auto reading the model's own
    calls, give the calls the server gives."""
    from localserve import LLM, OutputFormat, SamplingParams

    from .server_util import stories_with_template

    llm = LLM(stories_with_template(tmp_path, HERMES_STYLE), device="cpu", num_kv_blocks=64)
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'
    asks = [({"tool_choice": "required"}, None), ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                                                  None), ({}, call)]
    for choice, steer in asks:
        params = SamplingParams(temperature=0, max_tokens=120, output_format=OutputFormat("regex", steer) if steer else None)
        [out] = llm.chat(MESSAGES, params, tools=TOOLS, parallel_tool_calls=False, **choice)
        served = client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, temperature=0,
                                                max_tokens=120, parallel_tool_calls=False, **choice,
                                                extra_body={"guided_regex": steer} if steer else None).choices[0]
        ours = [(c.name, c.arguments) for c in out.message.tool_calls]
        assert ours and ours == [(c.function.name, c.function.arguments) for c in served.message.tool_calls]
        assert out.message.content == served.message.content and out.finish_reason == "stop"
        assert out.message.to_openai()["tool_calls"][0]["function"]["name"] == ours[0][0]
    with pytest.raises(LocalserveError, match="not both"):
        llm.chat(MESSAGES, SamplingParams(output_format=OutputFormat("json_object")), tools=TOOLS, tool_choice="required")
