"""Sampling through the whole engine on the real stories model (real tokenizer)."""

from __future__ import annotations

import pytest

from localserve import LLM, SamplingParams

from .conftest import STORIES_HF


PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went", "One day"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(STORIES_HF, device="cpu", num_kv_blocks=256)


def test_same_seed_same_text_alone_or_batched(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=1234)
    [alone] = llm.generate(PROMPTS[0], seeded)
    others = [SamplingParams(temperature=1.0, max_tokens=30 + i, seed=i) for i in range(3)]
    batched = llm.generate(["x " + p for p in PROMPTS[1:]] + [PROMPTS[0]], others + [seeded])
    assert batched[-1].token_ids == alone.token_ids and batched[-1].text == alone.text
    [other_seed] = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=99))
    assert other_seed.token_ids != alone.token_ids


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30))
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=30))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_stop_strings_are_cut(llm: LLM) -> None:
    [out] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, stop=["Lily", "zzz"]))
    assert out.text == ", there was a little girl named " and out.finish_reason == "stop"
    [kept] = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, stop=["Lily"], include_stop_str_in_output=True)
    )
    assert kept.text == ", there was a little girl named Lily"
    # A stop string split across tokens ("little girl") is found too.
    [split] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, stop=["e girl"]))
    assert split.text == ", there was a littl"


def test_stop_token_ids_and_length(llm: LLM) -> None:
    [full] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop_token = full.token_ids[6]
    first = full.token_ids.index(stop_token)
    [stopped] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]))
    assert stopped.token_ids == full.token_ids[: first + 1] and stopped.finish_reason == "stop"
    # The stop token ends the text without joining it, unless asked for (as vLLM does).
    assert stopped.text == llm.tokenizer.decode(full.token_ids[:first]) != full.text
    [kept] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token],
                                                     include_stop_str_in_output=True))
    assert kept.text == llm.tokenizer.decode(full.token_ids[: first + 1])


def test_min_tokens_defers_stop_strings(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=60, stop=[","], min_tokens=5)
    [out] = llm.generate(PROMPTS[0], params)
    # Greedy text starts with ","; stop strings are only looked for once 5 tokens exist,
    # so that first comma stays and the text stops at the next one.
    assert out.finish_reason == "stop" and len(out.token_ids) >= 5
    assert out.text == ", there was a little girl named Lily. She loved to play outside in the park. One day"
