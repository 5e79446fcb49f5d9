"""Each tool-call parser against real outputs of its family, quoted from public sources
(tests/data/recorded_tool_outputs.json gives each one's source and whether it was a run's
output or the vendor's documented example): read whole, and streamed a character at a time,
the calls and the content are what the model meant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from localserve.chat.reply import ReplyFormat, whole
from localserve.chat.tool_calls import PARSERS, parse

from .test_tool_calls import streamed

CASES: list[dict[str, Any]] = json.loads((Path(__file__).parent / "data" / "recorded_tool_outputs.json")
                                         .read_text(encoding="utf-8"))["cases"]
# The models' stop tokens: the engine stops on them and leaves them out of the text.
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|eot|>", "</s>", "<｜end▁of▁sentence｜>")


def generated(case: dict[str, Any]) -> str:
    text = case["text"]
    for token in END_TOKENS:
        text = text.removesuffix(token)
    return text


def expected(case: dict[str, Any]) -> dict[str, Any]:
    # Variants no parser of the family reads (Qwen2.5-Coder's bare fenced JSON, Llama's
    # built-in brave_search.call(...) and prompted <function=...> forms) stay content.
    wanted = dict(case.get("strict_parser_expected") or case["expected"])
    if case.get("variant") == "trailing_text_after_call":
        # Text after the calls is dropped, as SGLang drops it: OpenAI never answers with
        # content after calls, and what a model writes there imagines the calls' results.
        wanted["content"] = None
    return wanted


def blank_to_none(text: str | None) -> str | None:
    return text.strip() or None if text else None


@pytest.mark.parametrize("case", [c for c in CASES if c["family"] != "think"],
                         ids=lambda c: f"{c['family']}-{c['model'][:40]}")
def test_recorded_calls(case: dict[str, Any]) -> None:
    text, wanted = generated(case), expected(case)
    content, calls = parse(case["family"], text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c["name"], c["arguments"]) for c in wanted["calls"]]
    assert blank_to_none(content) == blank_to_none(wanted["content"])
    shown, streamed_calls, _ = streamed(PARSERS[case["family"]], text, 1)
    assert streamed_calls == [(c.name, c.arguments) for c in calls]
    assert blank_to_none(shown) == blank_to_none(content if calls else text)


@pytest.mark.parametrize("case", [c for c in CASES if c["family"] == "think"], ids=lambda c: c["model"][:40])
def test_recorded_thinking(case: dict[str, Any]) -> None:
    """Qwen3 writes its own <think>: the reply is read as thinking, then the answer."""
    message = whole(ReplyFormat(opens_thinking=False, tool_parser="hermes"), generated(case))
    assert blank_to_none(message.reasoning_content) == case["expected"]["reasoning"]
    assert blank_to_none(message.content) == case["expected"]["content"] and not message.tool_calls


def test_every_family_is_covered() -> None:
    families = {c["family"] for c in CASES}
    assert families == {*PARSERS, "think"} and all(c["source"] and c["evidence"] in ("recorded", "documented")
                                                   for c in CASES)
