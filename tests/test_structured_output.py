"""Structured outputs: the engine's tokens held to a JSON schema, any JSON object, a regex,
a list of choices or a grammar (llguidance), checked by jsonschema and ``re``; through the
official openai SDK (strict response validation) on the real trained stories260K model,
whose own text is a story, never JSON, so every valid output is the grammar's doing."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch

from localserve import Engine, EngineConfig, LocalserveError, OutputFormat, SamplingParams
from localserve.engine.structured_output import allowed_tokens

from .conftest import STORIES_HF
from .server_util import stories_client

# Bounded: a string of at most 8 characters, an integer below 100, one of two words.
WEATHER = {"type": "object",
           "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "place": {"type": "string", "maxLength": 8}},
           "required": ["unit", "days", "place"], "additionalProperties": False}
LIST = {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4}
FORMATS = [
    (OutputFormat("json", WEATHER), lambda text: jsonschema.validate(json.loads(text), WEATHER)),
    (OutputFormat("json", LIST), lambda text: jsonschema.validate(json.loads(text), LIST)),
    (OutputFormat("regex", r"[0-9]{3}-[a-z]{2,4}"), lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) or 1 / 0),
    (OutputFormat("choice", ["yes", "no", "never again"]), lambda text: text in ("yes", "no", "never again") or 1 / 0),
    # Lark, and the same in llama.cpp's GBNF.
    (OutputFormat("grammar", 'start: "x=" NUMBER ";"\nNUMBER: /[1-9][0-9]?/'),
     lambda text: re.fullmatch(r"x=[1-9][0-9]?;", text) or 1 / 0),
    (OutputFormat("grammar", 'root ::= "x=" [1-9] [0-9]? ";"'), lambda text: re.fullmatch(r"x=[1-9][0-9]?;", text) or 1 / 0),
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(STORIES_HF, EngineConfig(num_kv_blocks=64), device="cpu")


def run(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list[str]:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    texts: dict[str, str] = {}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id], reasons[out.request_id] = out.text, out.finish_reason
    return [texts[i] for i in ids]


@pytest.mark.parametrize("index", range(len(FORMATS)), ids=[f.kind + str(i) for i, (f, _) in enumerate(FORMATS)])
def test_every_output_matches_its_format(engine: Engine, index: int) -> None:
    output_format, check = FORMATS[index]
    requests = [("Once upon a time", SamplingParams(max_tokens=60, temperature=temperature, seed=seed,
                                                    output_format=output_format))
                for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.5, 3))]
    for text in run(engine, requests):
        check(text)


def test_any_json_object(engine: Engine) -> None:
    """Free-form JSON from a story model: it opens an object and writes a key; the text
    is a prefix of valid JSON until max_tokens, never anything else."""
    [text] = run(engine, [("Once upon a time", SamplingParams(max_tokens=40, temperature=0.0,
                                                              output_format=OutputFormat("json_object")))])
    assert text.startswith('{"')
    [free] = run(engine, [("Once upon a time", SamplingParams(max_tokens=40, temperature=0.0))])
    assert not free.startswith("{")


def test_free_requests_beside_constrained_ones_are_unchanged(engine: Engine) -> None:
    """Batch invariance holds: a free request's greedy tokens are the same alone and in a
    batch with constrained ones."""
    free = ("Once upon a time", SamplingParams(max_tokens=24, temperature=0.0))
    [alone] = run(engine, [free])
    constrained = [("Once upon a time", SamplingParams(max_tokens=24, temperature=0.7, seed=s, output_format=f))
                   for s, (f, _) in enumerate(FORMATS)]
    mixed = run(engine, [constrained[0], free, *constrained[1:]])
    assert mixed[1] == alone and len(alone) > 40


@pytest.mark.parametrize("output_format,message", [
    (OutputFormat("regex", "[0-9"), "regex"),
    (OutputFormat("grammar", "start: undefined_rule"), "undefined_rule"),
    (OutputFormat("grammar", 'root ::= "a" (('), "grammar"),
    (OutputFormat("json", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
    (OutputFormat("json", {"type": "frobnicate"}), "frobnicate"),
])
def test_a_bad_format_is_a_clear_error(engine: Engine, output_format: OutputFormat, message: str) -> None:
    with pytest.raises(LocalserveError, match=message):
        engine.add_request("Once upon a time", SamplingParams(output_format=output_format))
    assert not engine.has_unfinished_requests()


def test_bitmask_unpacking() -> None:
    bitmask = torch.tensor([[0b1011, 0], [-1, -(1 << 31) | 1]], dtype=torch.int32)  # word 1 of row 1: bits 0 and 31
    allowed = allowed_tokens(bitmask, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 1, 3]
    assert allowed[1].nonzero().flatten().tolist() == [*range(32), 32]  # bit 31 of word 1 is past the vocabulary


# -- the HTTP API through the openai SDK ---------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with stories_client(tmp_path_factory.mktemp("models")) as client:
        yield client


MESSAGES = [{"role": "user", "content": "What is the weather like?"}]


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    whole = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=60,
                                           response_format=response_format)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), WEATHER)
    assert whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=60,
                                            response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_the_sdks_parse_helper(client: openai.OpenAI) -> None:
    """``client.chat.completions.parse`` sends a strict schema made from a pydantic model
    and parses the reply into it."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        unit: Literal["celsius", "fahrenheit"]
        days: int = Field(ge=1, le=14)
        windy: bool

    completion = client.chat.completions.parse(model="stories", messages=MESSAGES, temperature=0.8, seed=3,
                                               max_tokens=60, response_format=Weather)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 14


def test_json_object_and_vllm_fields(client: openai.OpenAI) -> None:
    text = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=12,
                                          response_format={"type": "json_object"}).choices[0].message.content
    assert text.startswith("{")
    choice = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert choice.choices[0].text in ("red", "blue")
    regex = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=12, temperature=1,
                                      seed=4, extra_body={"guided_regex": r"[A-Z][a-z]{1,5}!"})
    assert re.fullmatch(r"[A-Z][a-z]{1,5}!", regex.choices[0].text)


@pytest.mark.parametrize("body,message", [
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "nope"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "one of"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
])
def test_bad_formats_are_400s(client: openai.OpenAI, body: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="stories", messages=MESSAGES, max_tokens=4, extra_body=body)
    # and the server keeps serving
    assert client.chat.completions.create(model="stories", messages=MESSAGES, max_tokens=2).choices
