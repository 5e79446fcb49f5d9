"""Chat templates: Hub templates render as transformers renders them, and hostile or broken
templates end in a LocalserveError (never another exception, never a hang)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from localserve.text.chat_template import ChatTemplate
from localserve.errors import LocalserveError

from .conftest import DATA

TEMPLATES = DATA / "templates"
PHI3_DIR = DATA / "tokenizers" / "phi-3-mini-hf"
MISTRAL_DIR = DATA / "tokenizers" / "mistral-v0.3-hf"

GEMMA = "google-gemma-2-2b-it.jinja"
PHI35 = "microsoft-Phi-3.5-mini-instruct.jinja"
NEMO = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
HERMES = "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"
# Each model's own tokens, so the comparison covers where templates print them.
TOKENS = {
    GEMMA: {"bos_token": "<bos>", "eos_token": "<eos>"},
    PHI35: {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    NEMO: {"bos_token": "<s>", "eos_token": "</s>"},
    HERMES: {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"},
}

SYSTEM = {"role": "system", "content": "You are terse."}
CHAT = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    # Template syntax and non-ASCII in content are data, never evaluated or escaped.
    {"role": "user", "content": "Explain {{ 7*7 }} and {% raw %} in Jinja — naïvely, <b>bold</b> \"q\"."},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                "days": {"type": "array", "items": {"type": "integer"}, "description": "Days ahead"},
            },
            "required": ["city"],
        },
    },
}
TOOL_CHAT = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "call00001", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 °C in Paris."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def hf_render():
    """transformers' own renderer, the independent reference."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")

    def render(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        rendered, _ = utils.render_jinja_template(conversations=[messages], chat_template=source,
                                                  **kwargs)
        return rendered[0]

    return render


@pytest.fixture(scope="module")
def phi3_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(PHI3_DIR))


def template_source(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def ours(name: str) -> ChatTemplate:
    return ChatTemplate(template_source(name), **TOKENS[name])


def render_one(source: str, **kwargs: Any) -> str:
    return ChatTemplate(source).render([{"role": "user", "content": "hi"}], **kwargs)


# --- Hub templates against transformers ------------------------------------------------------

def test_all_shared_templates_are_covered() -> None:
    assert {p.name for p in TEMPLATES.glob("*.jinja")} == set(TOKENS)


@pytest.mark.parametrize("name", [GEMMA, PHI35, NEMO, HERMES])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_normal_conversation_matches_transformers(hf_render, name: str,
                                                  add_generation_prompt: bool) -> None:
    template = ours(name)
    # Gemma refuses a system message; the others take system+user+assistant+user.
    messages = CHAT if name == GEMMA else [SYSTEM, *CHAT]
    # The Hermes tool-use template lists `tools` unconditionally, so it always needs them.
    tools = [WEATHER_TOOL] if name == HERMES else None
    got = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    want = hf_render(template_source(name), messages, tools=tools,
                     add_generation_prompt=add_generation_prompt, **TOKENS[name])
    assert got == want
    assert "Hi there!" in got and "{{ 7*7 }}" in got and "naïvely" in got
    for short in ([CHAT[0]], CHAT[:2] + [CHAT[2]]):
        assert template.render(short, add_generation_prompt=add_generation_prompt,
                               tools=tools) == hf_render(
            template_source(name), short, tools=tools,
            add_generation_prompt=add_generation_prompt, **TOKENS[name])


def test_gemma_system_role_is_a_clean_error() -> None:
    template = ours(GEMMA)
    with pytest.raises(LocalserveError, match="System role not supported"):
        template.render([SYSTEM, *CHAT])
    with pytest.raises(LocalserveError, match="roles must alternate"):
        template.render([CHAT[0], CHAT[0]])
    assert template.render(CHAT).startswith("<bos><start_of_turn>user\nHi there!")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hermes_tool_use_matches_transformers(hf_render, add_generation_prompt: bool) -> None:
    got = ours(HERMES).render(TOOL_CHAT, tools=[WEATHER_TOOL],
                              add_generation_prompt=add_generation_prompt)
    assert got == hf_render(template_source(HERMES), TOOL_CHAT, tools=[WEATHER_TOOL],
                            add_generation_prompt=add_generation_prompt, **TOKENS[HERMES])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in got
    assert '<|im_start|>tool\n<tool_response>\n{"temperature": 21}\n</tool_response>' in got
    assert "city(str): The city, e.g. Zürich" in got  # tojson keeps non-ASCII, like HF's
    assert "get_weather(city: str, unit: str, days: list[" in got


def test_hermes_without_tools_is_a_clean_error() -> None:
    with pytest.raises(LocalserveError, match="not iterable"):  # transformers fails here too
        ours(HERMES).render(CHAT)


def test_nemo_tool_use_matches_transformers(hf_render) -> None:
    got = ours(NEMO).render(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert got == hf_render(template_source(NEMO), TOOL_CHAT, tools=[WEATHER_TOOL],
                            add_generation_prompt=True, **TOKENS[NEMO])
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in got
    assert '[TOOL_RESULTS]{"content": {"temperature": 21}, "call_id": "call00001"}' in got
    bad_id = [*TOOL_CHAT[:3], {**TOOL_CHAT[3], "tool_call_id": "x"}]
    with pytest.raises(LocalserveError, match="length 9"):
        ours(NEMO).render(bad_id, tools=[WEATHER_TOOL])


def test_null_fields_are_dropped_like_apply_chat_template(phi3_tokenizer) -> None:
    # OpenAI clients send `content: null` with tool calls; HF drops None keys before rendering.
    messages = [TOOL_CHAT[1], {**TOOL_CHAT[2], "content": None}, TOOL_CHAT[3]]
    source = template_source(HERMES)
    want = phi3_tokenizer.apply_chat_template(messages, chat_template=source, tools=[WEATHER_TOOL],
                                              tokenize=False, add_generation_prompt=True)
    template = ChatTemplate(source, bos_token=phi3_tokenizer.bos_token,
                            eos_token=phi3_tokenizer.eos_token)
    assert template.render(messages, tools=[WEATHER_TOOL]) == want


# --- tokenizer folders against AutoTokenizer.apply_chat_template -----------------------------

CONVERSATIONS = [
    [CHAT[0]],
    [SYSTEM, *CHAT],
    CHAT,
    [SYSTEM, {"role": "user", "content": "line one\nline two\n"},
     {"role": "assistant", "content": "  spaced  "}, {"role": "user", "content": "ok"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_phi3_folder_matches_apply_chat_template(phi3_tokenizer, add_generation_prompt: bool) -> None:
    template = ChatTemplate.from_dir(PHI3_DIR)
    assert (template.bos_token, template.eos_token) == ("<s>", "<|endoftext|>")
    for messages in CONVERSATIONS:
        want = phi3_tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        assert template.render(messages, add_generation_prompt=add_generation_prompt) == want


def test_mistral_folder_has_no_template_but_renders_nemo_like_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    with pytest.raises(LocalserveError, match="no chat template"):
        ChatTemplate.from_dir(MISTRAL_DIR)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(MISTRAL_DIR))
    config = json.loads((MISTRAL_DIR / "tokenizer_config.json").read_text())
    template = ChatTemplate.from_tokenizer_config(config, templates={"default": template_source(NEMO)})
    for messages in CONVERSATIONS:
        want = tokenizer.apply_chat_template(messages, chat_template=template_source(NEMO),
                                             tokenize=False, add_generation_prompt=True)
        assert template.render(messages) == want


# --- tokenizer_config.json forms ------------------------------------------------------------

def test_config_template_list_picks_default_and_tool_use(hf_render) -> None:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False},
        "eos_token": "<|im_end|>",
        "pad_token": {"content": "<pad>"},
        "chat_template": [{"name": "default", "template": template_source(PHI35)},
                          {"name": "tool_use", "template": template_source(HERMES)}],
    }
    template = ChatTemplate.from_tokenizer_config(config)
    assert template.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>",
                                       "pad_token": "<pad>"}
    assert template.render(CHAT) == hf_render(template_source(PHI35), CHAT, add_generation_prompt=True,
                                              **template.special_tokens)
    assert template.render(TOOL_CHAT, tools=[WEATHER_TOOL]) == hf_render(
        template_source(HERMES), TOOL_CHAT, tools=[WEATHER_TOOL], add_generation_prompt=True,
        **template.special_tokens)
    # Without a tool_use entry, renders with tools use the default one.
    plain = ChatTemplate.from_tokenizer_config({"chat_template": config["chat_template"][:1]})
    assert plain.render(CHAT, tools=[WEATHER_TOOL]).startswith("<|user|>\nHi there!")


@pytest.mark.parametrize("config, match", [
    ({}, "no chat template"),
    ({"chat_template": 3}, "string or a list"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "no 'default'"),
    ({"chat_template": [{"template": "x"}]}, "name"),
    ({"chat_template": "x", "bos_token": 5}, "bos_token"),
    ({"chat_template": "{% if %}"}, "does not compile"),
    ([], "JSON object"),
])
def test_bad_configs(config: Any, match: str) -> None:
    with pytest.raises(LocalserveError, match=match):
        ChatTemplate.from_tokenizer_config(config)


def test_from_dir_prefers_jinja_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "config", "eos_token": {"content": "</s>"}}))
    assert ChatTemplate.from_dir(tmp_path).render(CHAT) == "config"
    (tmp_path / "chat_template.jinja").write_text("file {{ eos_token }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools {{ tools|length }}")
    template = ChatTemplate.from_dir(tmp_path)
    assert template.render(CHAT) == "file </s>"
    assert template.render(CHAT, tools=[WEATHER_TOOL]) == "tools 1"
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(LocalserveError, match="tokenizer_config.json: not valid JSON"):
        ChatTemplate.from_dir(tmp_path)


def test_from_dir_falls_back_to_the_processor_template(tmp_path: Path) -> None:
    """Image-text checkpoints may keep their template in the processor's chat_template.json
    only; it serves when the tokenizer has none, and never overrides the tokenizer's."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "processor {{ eos_token }}"}))
    assert ChatTemplate.from_dir(tmp_path).render(CHAT) == "processor <eos>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": "tokenizer"}))
    assert ChatTemplate.from_dir(tmp_path).render(CHAT) == "tokenizer"


# --- helpers and jinja features, against transformers ----------------------------------------

@pytest.mark.parametrize("source", [
    "{{ x|tojson }}",
    "{{ x|tojson(indent=2) }}",
    "{{ x|tojson(separators=(',', ':'), sort_keys=true) }}",
    "{{ x|tojson(ensure_ascii=true) }}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% continue %}{% endif %}[{{ m.role }}]{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ loop.index }}/{{ loop.length }}{{ loop.last }} {% endfor %}",
    "{% for m in messages %}{{ loop.revindex }}{{ loop.previtem.role if loop.previtem }}"
    "{{ loop.nextitem.role if loop.nextitem }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% for n in tree recursive %}({{ n.name }}{% if n.kids %}{{ loop(n.kids) }}{% endif %}){% endfor %}",
    "{% for k, v in x|dictsort %}{{ k }}={{ v }};{% endfor %}{% for i in range(3) %}{{ i }}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}{% endfor %}{{ ns.n }}",
    "{{ dict(a=1, b=2)|tojson }} {{ dict.fromkeys(['x', 'y'], 0)|tojson }}",
    "{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(' | ') }}",
    "{{ messages[-1]['content'].split(' ')[0].upper() }} {{ 'ab' * 3 }} {{ 2 ** 10 }} {{ 'x' ~ 1 ~ none }}",
    "{% generation %}kept {{ bos_token }}{% endgeneration %}",
    "  {% if add_generation_prompt %}\n    gen\n  {% endif %}\n{{ tools is none }}{{ documents is none }}",
    "{{ documents|map(attribute='title')|join(',') }} {{ enable_thinking }} {{ unk_token }}",
])
def test_features_match_transformers(hf_render, source: str) -> None:
    extra = {"x": {"b": "é<&>'", "a": [1, 2.5, None, True]},
             "tree": [{"name": "a", "kids": [{"name": "b", "kids": []}, {"name": "c"}]}],
             "enable_thinking": False}
    documents = [{"title": "T1", "text": "one"}, {"title": "T2", "text": "two"}] \
        if "documents|" in source else None
    tokens = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>",
                            special_tokens={"unk_token": "<unk>"})
    messages = [SYSTEM, *CHAT]
    got = template.render(messages, documents=documents, **extra)
    assert got == hf_render(source, messages, documents=documents, add_generation_prompt=True,
                            **tokens, **extra)


def test_strftime_now() -> None:
    before = datetime.now().strftime("%d %b %Y")
    got = render_one("{{ strftime_now('%d %b %Y') }}")
    assert got in {before, datetime.now().strftime("%d %b %Y")}


def test_extra_variables_override_special_tokens_and_inputs_are_not_touched() -> None:
    template = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token is defined }}",
                            bos_token="<s>")
    messages = [{"role": "user", "content": "hi", "name": None}]
    assert template.render(messages, bos_token="[B]") == "[B]hiFalse"
    assert messages == [{"role": "user", "content": "hi", "name": None}]


# --- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",  # jinja alone would print nothing here; we refuse outright
    "{{ cycler.__init__.__globals__ }}",
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{{ [].__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__subclasses__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ messages|attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{% set ns = namespace(_private=1) %}",
])
def test_sandbox_escapes_are_refused(source: str) -> None:
    with pytest.raises(LocalserveError, match="Python internals"):
        render_one(source)


@pytest.mark.parametrize("source", [
    "{{ lipsum(1000000) }}",  # not provided: one call would write unbounded text
    "{{ dict.mro() }}",
    "{{ 'a' + 1 }}",
    "{{ messages[0].content.nosuch() }}",
    "{{ 1 / 0 }}",
    "{{ undefined_thing.attr }}",
    "{{ x|tojson }}",  # undefined is not JSON
    "{{ '%d' % 'x' }}",
])
def test_runtime_errors_are_clean(source: str) -> None:
    with pytest.raises(LocalserveError, match="chat template failed"):
        render_one(source)


def test_raise_exception_message_and_line() -> None:
    source = "line one\n{% if messages|length < 2 %}\n{{ raise_exception('Need two messages, got ' ~ messages|length) }}\n{% endif %}"
    with pytest.raises(LocalserveError, match="rejected the conversation: Need two messages, got 1"):
        render_one(source)
    with pytest.raises(LocalserveError, match="at line 2: 'nope' is undefined"):
        render_one("ok\n{{ nope.x }}")


@pytest.mark.parametrize("source", [
    "{% for m in messages %}",
    "{{ messages[0] }",
    "{% if x %}x",
    "{{ x|no_such_filter }}",
    "{% no_such_tag %}",
    "{{ (" * 2000 + "1" + ")" * 2000 + " }}",
])
def test_broken_templates_fail_at_construction(source: str) -> None:
    with pytest.raises(LocalserveError, match="does not compile"):
        ChatTemplate(source)


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(LocalserveError, match=r"line 3"):
        ChatTemplate("a\nb\n{% endfor %}")
    with pytest.raises(LocalserveError, match="must be a string"):
        ChatTemplate(None)  # type: ignore[arg-type]
    tokens = ChatTemplate("x", bos_token="<s>", special_tokens={"eos_token": "</s>", "pad_token": None})
    assert tokens.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    with pytest.raises(LocalserveError, match="special token"):
        ChatTemplate("x", special_tokens={"pad_token": 3})  # type: ignore[dict-item]


@pytest.mark.parametrize("messages, match", [
    ([], "empty conversation"),
    ("hello", "list of objects"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"role": "user", "content": object()}], "JSON values"),
    ([{"role": "user", "content": {1: {2: {}}}}], None),
])
def test_bad_messages(messages: Any, match: str | None) -> None:
    template = ChatTemplate("{{ messages|length }}")
    if match is None:
        assert template.render(messages) == "1"
    else:
        with pytest.raises(LocalserveError, match=match):
            template.render(messages)
    nested: Any = "x"
    for _ in range(100):
        nested = [nested]
    with pytest.raises(LocalserveError, match="nested"):
        template.render([{"role": "user", "content": nested}])


# --- runaway templates --------------------------------------------------------------------------

@pytest.mark.parametrize("source, match", [
    ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    # Silent nested loops never reach the output cap; the step budget ends them.
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran too long"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output passed"),
    ("{{ 'a' * 10**9 }}", "over its limit|bits"),
    ("{{ [1] * 10**9 }}", "over its limit|bits"),
    ("{{ 2 ** 100000000 }}", "over its limit|bits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "over its limit|bits"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "over its limit|bits"),
    ("{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "over its limit|bits"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
])
def test_runaway_templates_stop(source: str, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(LocalserveError, match=match):
        render_one(source)
    assert time.monotonic() - start < 30  # a generous bound for a loaded machine


def test_step_budget_stops_exponential_recursion() -> None:
    source = ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
              "{{ f(60) }}")
    with pytest.raises(LocalserveError, match="ran too long"):
        ChatTemplate(source, max_steps=20_000).render([{"role": "user", "content": "hi"}])


def test_output_cap_scales_with_inputs() -> None:
    # The cap bounds template-made text; long conversations still fit.
    template = ChatTemplate(template_source(PHI35), max_output_chars=1000)
    long = "word " * 20_000
    assert long in template.render([{"role": "user", "content": long}])
    with pytest.raises(LocalserveError, match="output passed"):
        ChatTemplate("{% for i in range(5000) %}x{% endfor %}", max_output_chars=1000).render(CHAT)
    # A failed render leaves nothing behind: the next one works.
    assert template.render(CHAT[:1]) == "<|user|>\nHi there!<|end|>\n<|assistant|>\n"
