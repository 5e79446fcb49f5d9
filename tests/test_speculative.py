"""Speculative decoding (engine/speculative/): prompt lookup's proposals, the adaptive
draft length, and the engine's verification in the batch, checked against the engine
without speculation: at greedy the same tokens and logprobs, bit for bit, for every model
family and format of the suite, alone and in mixed batches; when sampling, the target's
own distribution (a chi-square test against probabilities computed from its logits); and
every KV block back in the pool after requests are cancelled mid-draft."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from localserve import LLM, LocalserveError, SamplingParams
from localserve.engine.speculative import SpeculativeConfig
from localserve.engine.speculative.adaptive import Acceptance, expected_tokens
from localserve.engine.speculative.drafter import PerRequestDrafter
from localserve.engine.speculative.ngram import propose
from localserve.engine.speculative.state import TokenHistory

from .conftest import DATA, MODEL_KINDS, random_prompt

STORIES_GGUF = DATA / "models" / "stories260K.gguf"
# Drafting every step (not only when it pays), so every test verifies drafts.
ALWAYS = SpeculativeConfig(num_tokens=4, adaptive=False)


# -- prompt lookup ----------------------------------------------------------------------


def test_proposes_what_followed_the_latest_occurrence_of_the_longest_ngram() -> None:
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 0, 5, 6, 7])
    # "5 6 7" occurred at 0 (followed by 8 9 1 6); "6 7" more recently at 6 (3 4 0 5):
    # the longest n-gram wins over the more recent shorter one.
    assert propose(tokens, 4, 2, 4) == [8, 9, 1, 6]
    assert propose(tokens, 2, 2, 2) == [3, 4]
    # The latest of several occurrences of the same n-gram.
    assert propose(np.array([1, 2, 3, 1, 2, 4, 1, 2]), 3, 2, 2) == [4, 1, 2]


def test_proposes_nothing_without_a_match_and_stops_at_the_sequence_end() -> None:
    assert propose(np.array([1, 2, 3, 4, 5]), 4, 2, 4) == []
    assert propose(np.array([3]), 4, 1, 4) == []
    # The match's continuation runs into the end: the repeating part goes on.
    assert propose(np.array([7, 7, 7]), 5, 2, 4) == [7, 7, 7, 7, 7]
    assert propose(np.array([4, 1, 2, 3, 1, 2, 3, 1, 2]), 5, 2, 4) == [3, 1, 2, 3, 1]
    assert propose(np.array([1, 2, 9, 1, 2]), 0, 2, 4) == []


def test_token_history_grows_with_the_request() -> None:
    history = TokenHistory()
    tokens = list(range(10))
    assert history.sync(tokens).tolist() == tokens
    tokens += list(range(10, 700))  # past the first buffer
    assert history.sync(tokens).tolist() == tokens


def test_the_draft_length_follows_the_acceptance() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert math.isclose(expected_tokens(0.5, 2), 1.75)
    bad, good = Acceptance(), Acceptance()
    for _ in range(20):
        bad.observe(4, 0)  # every first draft token rejected
        good.observe(4, 4)
    assert bad.draft_length(8, 0.2) == 0  # drafting does not pay: none
    assert good.draft_length(8, 0.2) == 8
    middling = Acceptance(rate=0.5)
    assert 0 < middling.draft_length(8, 0.2) < middling.draft_length(8, 0.05) < 8  # cheaper rows: more
    # In a batch of 16 decoding requests rows cost what they yield: drafting only pays when
    # nearly every draft is kept.
    assert Acceptance(rate=0.8).draft_length(8, 0.2, decoding=16) == 0
    assert good.draft_length(8, 0.2, decoding=16) > 0
    # One outcome per token up to the first rejection: 2 accepted, then 1 rejected.
    counted = Acceptance(rate=0.5)
    counted.observe(4, 2)
    assert math.isclose(counted.rate, 0.544)  # 0.5 -> 0.6 -> 0.68 -> 0.544, weight 0.2 each
    # A draft model's steps count: the dearer its tokens, the fewer pay.
    likely = Acceptance(rate=0.8)
    assert [likely.draft_length(8, 0.2, token_cost=c) for c in (0.0, 0.1, 0.3, 0.5, 0.8)] == [4, 3, 2, 1, 0]


def test_options_are_checked() -> None:
    with pytest.raises(LocalserveError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=99)
    with pytest.raises(LocalserveError, match="method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(LocalserveError, match="n-gram"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)


def test_shadow_proposals_of_a_draft_model_take_a_small_share_of_the_time(monkeypatch) -> None:
    """Requests not drafting have a token proposed to check, unverified: every step by
    prompt lookup (free), by a draft model only while those proposals have taken at most
    2% of the time (one that took 1 s is followed by none for 50 s)."""
    from localserve.engine.request import Request
    from localserve.engine.speculative import speculator as module
    from localserve.engine.speculative.speculator import Speculator

    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])

    class SlowDrafter(PerRequestDrafter):
        token_cost = 0.2
        calls = 0

        def propose(self, request, tokens, count: int) -> list[int]:  # type: ignore[no-untyped-def]
            SlowDrafter.calls += 1
            clock[0] += 1.0  # a catch-up on a long prompt
            return [0] * count

    def missing_request() -> Request:
        request = Request("r", [5, 6, 7] * 3, SamplingParams(max_tokens=50), frozenset())  # lookup finds 5 6 7
        request.num_computed_tokens = request.num_tokens - 1
        return request

    # The slow one at 0, 50 and 100 s (each step a second, each of its proposals another).
    for drafter, expected_calls in ((SlowDrafter(), 3), (None, 100)):
        speculator = Speculator(SpeculativeConfig(num_tokens=4), max_model_len=100, drafter=drafter)
        speculator.acceptance = Acceptance(rate=0.0)  # drafts have missed: requests draft none
        request = missing_request()
        SlowDrafter.calls = 0
        shadows = 0
        for _ in range(100):  # a step a second
            speculator.propose([request])
            assert request.draft_token_ids == []
            shadows += request.speculation.shadow is not None  # type: ignore[union-attr]
            request.speculation.shadow = None  # type: ignore[union-attr]
            clock[0] += 1.0
        assert (SlowDrafter.calls if drafter else shadows) == expected_calls


def test_a_new_request_drafts_where_drafting_pays_for_the_catch_up() -> None:
    """A draft model first takes in a new request's prompt: at a middling acceptance the
    few steps drafting would save do not pay for a long prompt's catch-up, so the request
    waits (a draft that never agreed made each new request catch up on its prompt to draft
    a token or two); a short prompt, or drafts that are nearly always kept, pay for it."""
    from localserve.engine.request import Request
    from localserve.engine.speculative.speculator import Speculator

    class ColdDrafter(PerRequestDrafter):
        token_cost = 0.2

        def catch_up_cost(self, request_id: str, length: int) -> float:
            return length * 0.2  # nothing taken in yet, each token a row of 0.2 of the weights

        def propose(self, request, tokens, count: int) -> list[int]:  # type: ignore[no-untyped-def]
            return [1] * count

    def drafts(prompt_tokens: int, rate: float, max_tokens: int) -> int:
        speculator = Speculator(SpeculativeConfig(num_tokens=4), max_model_len=4096, drafter=ColdDrafter())
        speculator.acceptance = Acceptance(rate=rate)  # where new requests start
        request = Request("r", list(range(5, 5 + prompt_tokens)), SamplingParams(max_tokens=max_tokens), frozenset())
        request.num_computed_tokens = request.num_tokens - 1
        speculator.propose([request])
        return len(request.draft_token_ids)

    # Rate 0.45: one draft token a step, 1.04x: over 64 tokens ~2 steps saved, against a
    # catch-up of 1,000 rows at 0.2 x 0.2 (40 steps), or of 20 (0.8).
    assert drafts(1000, 0.45, 64) == 0
    assert drafts(20, 0.45, 64) == 1
    assert drafts(1000, 0.95, 64) == 0 and drafts(1000, 0.95, 1000) == 4  # 1.7x: ~28 steps in 64, ~100 in 256


# -- exactness in the engine ------------------------------------------------------------


def fingerprint(output) -> tuple:  # type: ignore[no-untyped-def]
    return (output.token_ids, [(t.token_id, t.logprob, t.top) for t in output.logprobs], output.finish_reason)


# Not batch-invariant on the CPU even without drafts: GPT-OSS's experts (biased, clamped
# SwiGLU) run as torch ops whose sums follow the batch's shape, so its logprobs move in the
# seventh digit with the batch; on an AVX2 host (Zen 3) Qwen2-MoE's do too (a top-3 logprob
# 2.4e-7 apart, the tokens the same). Their tokens are compared exactly, logprobs within 1e-5.
NOT_BATCH_INVARIANT = {"gpt_oss", "qwen2_moe"}


def assert_same(ours, expected, exact: bool = True) -> None:  # type: ignore[no-untyped-def]
    if exact:
        assert [fingerprint(o) for o in ours] == [fingerprint(o) for o in expected]
        return
    for a, b in zip(ours, expected):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-5)


def greedy(max_tokens: int = 24, **options) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3, ignore_eos=True, **options)


class ScriptedDrafter(PerRequestDrafter):
    """Proposes each request's known continuation (from a run without drafts) with every
    fifth token of it wrong: each step's drafts are kept up to a wrong one, so both verdicts
    occur whatever the model (a random tiny model seldom repeats itself for prompt lookup)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations, self.vocab = continuations, vocab

    def propose(self, request, tokens, count: int) -> list[int]:  # type: ignore[no-untyped-def]
        known = self.continuations[tuple(request.prompt_token_ids)]
        start = len(tokens) - len(request.prompt_token_ids)
        return [(t + 1) % self.vocab if (start + i) % 5 == 3 else t
                for i, t in enumerate(known[start:start + count])]


def check_same_as_plain(path, vocab: int, exact: bool = True) -> LLM:  # type: ignore[no-untyped-def]
    """Greedy with drafts verified every step gives what greedy without them gives, token
    for token and logprob for logprob: alone, and in a batch of requests that draft and
    requests that do not, some still prefilling (small steps, so drafts are cut to fit too)."""
    options = dict(device="cpu", num_kv_blocks=256, max_num_batched_tokens=24, enable_prefix_caching=False)
    plain, speculating = LLM(path, **options), LLM(path, speculative=ALWAYS, **options)
    prompts = [[t % vocab for t in random_prompt(n, seed=n)] for n in (9, 20, 5, 28, 12)]
    params = [greedy(24), greedy(17, num_speculative_tokens=0), greedy(9, num_speculative_tokens=2), greedy(24),
              greedy(12, num_speculative_tokens=8)]
    batch_plain = plain.generate(prompts, params)
    speculating.engine.speculator.drafter = ScriptedDrafter(
        {tuple(p): o.token_ids for p, o in zip(prompts, batch_plain)}, vocab)
    assert_same(speculating.generate(prompts[0], params[0]), batch_plain[:1], exact)
    assert_same(speculating.generate(prompts, params), batch_plain, exact)
    stats = speculating.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert speculating.engine.stats().kv_blocks_used == 0
    return speculating


def test_greedy_is_unchanged_with_prompt_lookup_on_a_trained_model() -> None:
    """The real drafter on a model that repeats its prompt: mixed verdicts, same tokens."""
    options = dict(device="cpu", num_kv_blocks=256, max_num_batched_tokens=24)
    plain, speculating = LLM(STORIES_GGUF, **options), LLM(STORIES_GGUF, speculative=ALWAYS, **options)
    prompts = ["Once upon a time, there was a little girl named Lily. She loved to play outside. Once upon a time",
               "Tom had a red ball. Tom liked the red ball. One day, Tom", "The cat sat on the mat."]
    params = [greedy(60), greedy(40, num_speculative_tokens=6), greedy(30)]
    expected = [fingerprint(o) for o in plain.generate(prompts, params)]
    assert [fingerprint(o) for o in speculating.generate(prompts, params)] == expected
    stats = speculating.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert speculating.engine.stats().kv_blocks_used == 0


def test_greedy_is_unchanged_on_a_trained_gguf() -> None:
    check_same_as_plain(STORIES_GGUF, vocab=512)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_greedy_is_unchanged_for_every_family(tiny_models, kind: str) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_models.get(kind)
    check_same_as_plain(path, vocab=json.loads((path / "config.json").read_text())["vocab_size"],
                        exact=kind not in NOT_BATCH_INVARIANT)


def test_greedy_with_drafts_equals_transformers(llama) -> None:  # type: ignore[no-untyped-def]
    """Against the independent reference too: transformers' greedy generate, one prompt at a
    time, equals the engine's tokens while it verifies (mostly wrong) drafts in one batch."""
    from .conftest import VOCAB, hf_greedy

    path, hf = llama
    prompts = [random_prompt(n, seed=200 + n) for n in (7, 33, 64)]
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    llm = LLM(path, device="cpu", num_kv_blocks=256, enable_prefix_caching=False, speculative=ALWAYS)
    llm.engine.speculator.drafter = ScriptedDrafter({tuple(p): e for p, e in zip(prompts, expected)}, VOCAB)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("name", ["tiny-gptq-4bit-g32-actorder", "tiny-awq-4bit-g64"])
def test_greedy_is_unchanged_for_gptq_and_awq(name: str) -> None:
    path = DATA / "models" / name
    check_same_as_plain(path, vocab=json.loads((path / "config.json").read_text())["vocab_size"])


def test_greedy_is_unchanged_for_quantized_gguf(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gguf = pytest.importorskip("gguf")
    from .gguf_writers import tiny_llama, write_gguf

    path = tmp_path / "tiny-q4_0.gguf"
    write_gguf(path, tiny_llama(), gguf.GGMLQuantizationType.Q4_0)
    check_same_as_plain(path, vocab=512)


def test_stops_inside_the_accepted_drafts() -> None:
    """A stop string, a stop token or max_tokens met within one step's accepted tokens ends
    the request there, as without drafts."""
    plain = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64)
    speculating = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64, speculative=ALWAYS)
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside. Once upon a time"
    [reference] = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40))
    second_word = reference.token_ids[5]
    for params in (SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]),
                   SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[second_word]),
                   SamplingParams(temperature=0, max_tokens=7),
                   SamplingParams(temperature=0, max_tokens=40, min_tokens=9, stop_token_ids=[second_word])):
        [expected] = plain.generate(prompt, params)
        [ours] = speculating.generate(prompt, params)
        assert (ours.token_ids, ours.text, ours.finish_reason) == \
            (expected.token_ids, expected.text, expected.finish_reason)
    assert speculating.engine.speculator.stats.num_accepted_tokens > 0
    assert speculating.engine.stats().kv_blocks_used == 0


def test_penalties_and_bias_see_the_drafts_before_each_position() -> None:
    plain = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64)
    speculating = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64, speculative=ALWAYS)
    prompt = "Once upon a time, there was a little girl named Lily. Once upon a time, there was"
    for params in (greedy(30, repetition_penalty=1.3), greedy(30, frequency_penalty=0.8, presence_penalty=0.5),
                   greedy(30, logit_bias={383: -5.0})):
        [expected] = plain.generate(prompt, params)
        [ours] = speculating.generate(prompt, params)
        assert fingerprint(ours) == fingerprint(expected)


def test_structured_outputs_draft_what_their_grammar_allows() -> None:
    """Requests held to a schema, a regex, choices or a grammar verify drafts too: the
    grammar cuts each proposal where it stops allowing it, and each draft's position is
    masked as the grammar stands after the drafts before it. Greedy gives what decoding
    without drafts gives; sampled outputs match their format."""
    from localserve import OutputFormat

    from .conftest import STORIES_HF
    from .test_structured_output import FORMATS

    options = dict(device="cpu", num_kv_blocks=256)
    plain, speculating = LLM(STORIES_HF, **options), LLM(STORIES_HF, speculative=ALWAYS, **options)
    prompts = ["Once upon a time", "Tom had a red ball.", "The cat sat", "Lily"]
    tokenizer = plain.engine.tokenizer
    for output_format, check in FORMATS:
        params = greedy(40, output_format=output_format)
        expected = plain.generate(prompts, params)
        speculating.engine.speculator.drafter = ScriptedDrafter(
            {tuple(tokenizer.encode(p)): o.token_ids for p, o in zip(prompts, expected)}, 512)
        before = speculating.engine.speculator.stats.num_accepted_tokens
        assert [fingerprint(o) for o in speculating.generate(prompts, params)] == [fingerprint(o) for o in expected]
        assert speculating.engine.speculator.stats.num_accepted_tokens > before, output_format
        # Proposals the grammar forbids (the last token again and again) are cut, not verified.
        speculating.engine.speculator.drafter = RepeatDrafter()
        sampled = [SamplingParams(max_tokens=60, temperature=1.0, seed=seed, output_format=output_format)
                   for seed in range(4)]
        for output in speculating.generate(prompts, sampled):
            check(output.text)
    [free] = speculating.generate("Once upon a time", greedy(20, output_format=OutputFormat("json_object")))
    assert free.text.startswith('{"')


def test_a_structured_output_after_thinking_drafts_while_thinking_too() -> None:
    """A request that thinks before its grammar's part drafts while thinking, up to the
    token that would close its thinking: the tokens of decoding without drafts. (The story
    model's thinking is made to end where it writes " Lily", which it does by itself.)"""
    from localserve import OutputFormat

    from .conftest import STORIES_HF

    options = dict(device="cpu", num_kv_blocks=256)
    plain, speculating = LLM(STORIES_HF, **options), LLM(STORIES_HF, speculative=ALWAYS, **options)
    tokenizer = plain.engine.tokenizer
    end = tuple(tokenizer.encode(" named Lily", add_special_tokens=False)[-2:])
    prompts = ["Once upon a time, there was a little girl", "Once upon a time, there was a girl"]
    params = greedy(40, thinking_end=end, output_format=OutputFormat("regex", r" and [a-z]+ [a-z]+\."))
    expected = plain.generate(prompts, params)
    assert all(o.text.endswith(".") and " Lily and " in o.text for o in expected)  # thought, then the grammar
    speculating.engine.speculator.drafter = ScriptedDrafter(
        {tuple(tokenizer.encode(p)): o.token_ids for p, o in zip(prompts, expected)}, 512)
    assert [fingerprint(o) for o in speculating.generate(prompts, params)] == [fingerprint(o) for o in expected]
    assert speculating.engine.speculator.stats.num_accepted_tokens > 0


def test_a_thinking_budget_ends_where_it_ends_without_drafts() -> None:
    """A request thinking on a budget drafts up to the budget's end, then its closing
    tokens are forced, then it drafts again: the tokens of decoding without drafts."""
    options = dict(device="cpu", num_kv_blocks=256)
    plain, speculating = LLM(STORIES_GGUF, **options), LLM(STORIES_GGUF, speculative=ALWAYS, **options)
    end = tuple(plain.engine.tokenizer.encode("</think>", add_special_tokens=False))
    prompts = ["Once upon a time", "Tom had a red ball.", "The cat sat"]
    params = [greedy(40, thinking_budget=budget, thinking_end=end) for budget in (0, 6, 13)]
    expected = plain.generate(prompts, params)
    speculating.engine.speculator.drafter = ScriptedDrafter(
        {tuple(plain.engine.tokenizer.encode(p)): o.token_ids for p, o in zip(prompts, expected)}, 512)
    outputs = speculating.generate(prompts, params)
    assert [fingerprint(o) for o in outputs] == [fingerprint(o) for o in expected]
    # (The first token is the model's even at a budget of 0.)
    assert all(list(end) == o.token_ids[b:b + len(end)] for o, b in zip(outputs, (1, 6, 13)))
    assert speculating.engine.speculator.stats.num_accepted_tokens > 0


# -- sampling: the target's distribution --------------------------------------------------


def test_sampled_tokens_follow_the_target_distribution() -> None:
    """Prompt lookup drafting the second and third tokens (the prompt repeats the phrase
    they continue): see ``check_sampled_distribution``."""
    llm = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=1024, max_num_seqs=64, speculative=ALWAYS)
    check_sampled_distribution(llm, "Once upon a time, there was a little girl named Lily. She loved to play. "
                                    "Once upon a time, there was a")


def check_sampled_distribution(llm: LLM, text: str) -> None:
    """Tokens sampled at temperature 1 within the top 3, with drafts verified: the
    frequencies of the pairs (second, third) after the likeliest first token, against the
    probabilities the model gives them (the second's, times the third's given the second),
    a chi-square test. Keeping a draft token more or less often than the model samples it
    moves them off."""
    prompt = llm.engine.tokenizer.encode(text)

    def top3(ids: list[int]) -> dict[int, float]:
        """The model's distribution for the next token, within its 3 likeliest."""
        [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=3, num_speculative_tokens=0))
        top = dict(out.logprobs[0].top)
        total = sum(math.exp(v) for v in top.values())
        return {t: math.exp(v) / total for t, v in top.items()}

    first = max(top3(prompt).items(), key=lambda item: item[1])[0]
    expected = {(a, b): pa * pb for a, pa in top3(prompt + [first]).items()
                for b, pb in top3(prompt + [first, a]).items()}
    samples = 3000
    outputs = llm.generate([prompt] * samples, [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, seed=i,
                                                               ignore_eos=True) for i in range(samples)])
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    pairs = [(o.token_ids[1], o.token_ids[2]) for o in outputs if o.token_ids[0] == first]
    assert len(pairs) > samples // 3
    counts = {pair: pairs.count(pair) for pair in set(pairs)}
    assert set(counts) <= set(expected), "a pair outside the top 3"
    chi2 = sum((counts.get(pair, 0) - p * len(pairs)) ** 2 / (p * len(pairs)) for pair, p in expected.items())
    # 8 degrees of freedom: 26.1 is the 0.1% point. The seeds fix the draws: no flakiness.
    assert chi2 < 26.1, f"chi-square {chi2:.1f}: {counts} against {expected}"


# -- the KV cache -------------------------------------------------------------------------


class RepeatDrafter(PerRequestDrafter):
    """Proposes the last token again, as many times as allowed: drafts every step."""

    def propose(self, request, tokens, count: int) -> list[int]:  # type: ignore[no-untyped-def]
        return [int(tokens[-1])] * count


def test_cancelled_requests_return_every_block() -> None:
    llm = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=128, speculative=ALWAYS)
    engine = llm.engine
    engine.speculator.drafter = RepeatDrafter()
    prompt = "Once upon a time, there was a little girl named Lily. Once upon a time, there was a"
    ids = [engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
           for _ in range(4)]
    while engine.speculator.stats.num_drafts < 6:
        engine.step()
    # Mid-draft: the next step's drafts proposed, then the requests cancelled.
    engine.speculator.propose(engine.scheduler.running)
    assert any(r.draft_token_ids for r in engine.scheduler.running)
    for request_id in ids:
        engine.abort(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_blocks_used == 0


def test_rejected_drafts_give_their_blocks_back() -> None:
    """After each step a request holds the blocks of its tokens and no more: the blocks
    that only rejected draft tokens reached are freed at once."""
    llm = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=128, block_size=4,
              speculative=SpeculativeConfig(num_tokens=8, adaptive=False))
    engine = llm.engine
    engine.speculator.drafter = RepeatDrafter()
    engine.add_request("Once upon a time, there was a little girl named Lily. Once upon a time, there was a",
                       SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            # Room for the computed tokens, and for the last at most (the next step's).
            assert len(request.block_table) <= engine.kv.blocks_for(request.num_tokens)
            assert request.num_computed_tokens == request.num_tokens - 1
    stats = engine.speculator.stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.stats().kv_blocks_used == 0


# -- a draft model -----------------------------------------------------------------------


def draft_config(path, num_tokens: int = 4) -> SpeculativeConfig:  # type: ignore[no-untyped-def]
    return SpeculativeConfig(method="draft_model", draft_model=str(path), num_tokens=num_tokens, adaptive=False)


def shallow_copy(hf, path):  # type: ignore[no-untyped-def]
    """The model with its first layer only (its embeddings and head shared): a draft that
    agrees with it on some tokens and not on others, whatever the seed."""
    import copy

    draft = copy.deepcopy(hf)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    draft.save_pretrained(path)
    return path


def test_greedy_is_unchanged_with_a_draft_model(llama, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A draft model (the target's first layer) proposing in one batch for requests that
    draft, that do not, and that are still prefilling (the draft catches up on their
    prompts in chunks of the step's budget): token for token and logprob for logprob what
    decoding without it gives, mixed verdicts, every block of both pools back at the end."""
    from .conftest import VOCAB

    path, hf = llama
    draft = shallow_copy(hf, tmp_path / "draft")
    options = dict(device="cpu", num_kv_blocks=256, max_num_batched_tokens=24, enable_prefix_caching=False)
    plain, speculating = LLM(path, **options), LLM(path, speculative=draft_config(draft), **options)
    prompts = [[t % VOCAB for t in random_prompt(n, seed=n)] for n in (9, 20, 5, 60, 12)]
    params = [greedy(24), greedy(17, num_speculative_tokens=0), greedy(9, num_speculative_tokens=2), greedy(24),
              greedy(12, num_speculative_tokens=8)]
    assert_same(speculating.generate(prompts, params), plain.generate(prompts, params))
    stats = speculating.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert speculating.engine.stats().kv_blocks_used == 0
    assert speculating.engine.speculator.drafter.pool.num_used == 0  # type: ignore[attr-defined]
    # Its costs, from the two files' weights: a draft token streams its layer and head, a token
    # taken in its layer alone (one of the model's two layers: under half the model's bytes).
    drafter = speculating.engine.drafter
    assert drafter is not None and 0 < drafter.feed_cost < min(drafter.token_cost, 0.5)


@pytest.mark.parametrize("cpu_blocks", [0, 64], ids=["recompute", "swap"])
def test_a_draft_model_under_preemption_and_prefix_caching(llama, tmp_path, cpu_blocks: int) -> None:  # type: ignore[no-untyped-def]
    """A pool too small for the batch (requests preempted: recomputed, or swapped to the CPU
    tier), prompts sharing a prefix (cached blocks), prompts longer than a step: with a draft
    model, the tokens of decoding without one, and both pools empty at the end."""
    path, hf = llama
    options = dict(device="cpu", num_kv_blocks=24, block_size=8, max_num_batched_tokens=32, num_cpu_blocks=cpu_blocks)
    plain = LLM(path, **options)
    speculating = LLM(path, speculative=draft_config(shallow_copy(hf, tmp_path / "d")), **options)
    shared = random_prompt(24, seed=99)
    prompts = [shared + random_prompt(n, seed=n) for n in (5, 9, 13, 30)] + [random_prompt(40, seed=7)]
    params = greedy(30)
    assert_same(speculating.generate(prompts, params), plain.generate(prompts, params))
    stats = speculating.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert (stats.swap_out_blocks > 0) == (cpu_blocks > 0)
    assert speculating.engine.speculator.stats.num_accepted_tokens > 0
    assert stats.kv_blocks_used == 0 and speculating.engine.speculator.drafter.pool.num_used == 0  # type: ignore[attr-defined]


def test_a_full_draft_pool_only_stops_drafting(llama, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With too few draft blocks for every request, some draft and some do not: the same
    tokens, and the pool empty at the end."""
    from localserve.engine.kv_cache import BlockPool

    path, hf = llama
    options = dict(device="cpu", num_kv_blocks=256, block_size=4)
    plain = LLM(path, **options)
    speculating = LLM(path, speculative=draft_config(shallow_copy(hf, tmp_path / "d")), **options)
    drafter = speculating.engine.speculator.drafter
    drafter.pool = BlockPool(12)  # type: ignore[attr-defined]  # two of the prompts at most
    prompts = [random_prompt(n, seed=n) for n in (17, 19, 21)]
    assert_same(speculating.generate(prompts, greedy(16)), plain.generate(prompts, greedy(16)))
    assert speculating.engine.speculator.stats.num_drafts > 0
    assert drafter.pool.num_used == 0  # type: ignore[attr-defined]


def test_a_request_on_a_draft_model_engine_can_ask_for_prompt_lookup(llama, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """speculative_method per request: "ngram" drafts by prompt lookup on an engine with a
    draft model (whose cache it leaves alone), the others use the draft model."""
    path, hf = llama
    options = dict(device="cpu", num_kv_blocks=256)
    plain = LLM(path, **options)
    speculating = LLM(path, speculative=draft_config(shallow_copy(hf, tmp_path / "d")), **options)
    drafter = speculating.engine.speculator.drafter
    prompt = random_prompt(7, seed=5) * 4  # repeats itself: lookup finds drafts
    [expected] = plain.generate(prompt, greedy(20))
    engine = speculating.engine
    engine.add_request(prompt, greedy(20, speculative_method="ngram"), request_id="lookup")
    while engine.has_unfinished_requests():
        engine.step()
        assert not drafter.sequences  # type: ignore[attr-defined]  # the draft model never asked
    assert engine.speculator.stats.num_accepted_tokens > 0
    [ours] = speculating.generate(prompt, greedy(20, speculative_method="ngram"))
    assert fingerprint(ours) == fingerprint(expected)
    [drafted] = speculating.generate(prompt, greedy(20))  # the engine's: the draft model
    assert fingerprint(drafted) == fingerprint(expected)
    with pytest.raises(LocalserveError, match="speculative_method"):
        SamplingParams(speculative_method="medusa")


def test_a_draft_model_of_the_same_weights_drafts_what_the_model_decodes() -> None:
    """The trained model's HF conversion drafting for its GGUF: the same tokenizer checked,
    nearly every draft kept, the text unchanged."""
    from .conftest import STORIES_HF

    options = dict(device="cpu", num_kv_blocks=128)
    plain = LLM(STORIES_GGUF, **options)
    speculating = LLM(STORIES_GGUF, speculative=draft_config(STORIES_HF), **options)
    prompts = ["Once upon a time", "Tom had a red ball.", "The cat sat on the mat and"]
    params = greedy(40)
    assert [fingerprint(o) for o in speculating.generate(prompts, params)] == \
        [fingerprint(o) for o in plain.generate(prompts, params)]
    stats = speculating.engine.speculator.stats
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
    # Where the next request's acceptance starts: the drafter's recent record.
    assert speculating.engine.speculator.acceptance.rate > 0.9


def test_sampling_with_a_draft_model_follows_the_target_distribution() -> None:
    """The chi-square test above with the draft model's greedy drafts (the same weights):
    a draft kept exactly as often as the model samples it."""
    from .conftest import STORIES_HF

    llm = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=1024, max_num_seqs=64,
              speculative=draft_config(STORIES_HF))
    check_sampled_distribution(llm, "Once upon a time, there was a little girl named")


def test_a_draft_model_must_share_the_vocabulary(llama, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A clear error at load for a draft of another vocabulary: of another size, without a
    tokenizer to compare, or with one that differs in a single token."""
    import shutil

    from .conftest import STORIES_HF

    path, _ = llama
    with pytest.raises(LocalserveError, match="vocabulary of 256 tokens, the model 512"):
        LLM(STORIES_GGUF, device="cpu", num_kv_blocks=32, speculative=draft_config(path))
    bare = shutil.copytree(STORIES_HF, tmp_path / "bare", ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(LocalserveError, match="only one of it and the model has a tokenizer"):
        LLM(STORIES_GGUF, device="cpu", num_kv_blocks=32, speculative=draft_config(bare))
    other = shutil.copytree(STORIES_HF, tmp_path / "other")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = (next(token for token, i in vocab.items() if i == n) for n in (300, 301))
    vocab[first], vocab[second] = 301, 300  # two tokens' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(LocalserveError, match="does not share the model's tokenizer .token id 300"):
        LLM(STORIES_GGUF, device="cpu", num_kv_blocks=32, speculative=draft_config(other))
    with pytest.raises(LocalserveError, match="draft model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(LocalserveError, match="draft model"):
        SpeculativeConfig(draft_model=str(path))


def test_cancelled_requests_return_the_draft_models_blocks(llama, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, hf = llama
    llm = LLM(path, device="cpu", num_kv_blocks=128, speculative=draft_config(shallow_copy(hf, tmp_path / "d")))
    engine = llm.engine
    ids = [engine.add_request(random_prompt(30 + i, seed=i), SamplingParams(temperature=0, max_tokens=60,
                                                                          ignore_eos=True)) for i in range(4)]
    while engine.speculator.stats.num_drafts < 6:
        engine.step()
    engine.speculator.propose(engine.scheduler.running)
    pool = engine.speculator.drafter.pool  # type: ignore[attr-defined]
    assert pool.num_used > 0
    for request_id in ids:
        engine.abort(request_id)
    assert engine.stats().kv_blocks_used == 0 and pool.num_used == 0


# -- the HTTP API -------------------------------------------------------------------------


def test_a_request_asks_for_drafts_through_the_openai_sdk(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``num_speculative_tokens`` in the body (the server's default here: none): the same
    greedy text either way, the drafts counted in /metrics, a bad value a 400."""
    import httpx
    import openai

    from .server_util import stories_client

    prompt = "Once upon a time, there was a little girl named Lily. She loved to play. Once upon a time, there"
    with stories_client(tmp_path) as client:
        texts = [client.completions.create(model="stories", prompt=prompt, max_tokens=40, temperature=0,
                                           extra_body={"num_speculative_tokens": k}).choices[0].text for k in (0, 4)]
        assert texts[0] == texts[1] and texts[0]
        metrics = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics", timeout=30).text
        accepted = [line for line in metrics.splitlines()
                    if line.startswith("localserve_spec_decode_num_accepted_tokens_total{")]
        assert accepted and float(accepted[0].split()[-1]) > 0
        with pytest.raises(openai.BadRequestError, match="num_speculative_tokens"):
            client.completions.create(model="stories", prompt=prompt, max_tokens=4,
                                      extra_body={"num_speculative_tokens": 17})
        lookup = client.completions.create(model="stories", prompt=prompt, max_tokens=40, temperature=0, extra_body={
            "num_speculative_tokens": 4, "speculative_method": "ngram"}).choices[0].text
        assert lookup == texts[0]
        with pytest.raises(openai.BadRequestError, match="served without a draft model"):
            client.completions.create(model="stories", prompt=prompt, max_tokens=4,
                                      extra_body={"num_speculative_tokens": 4, "speculative_method": "draft_model"})
        with pytest.raises(openai.BadRequestError, match="speculative_method"):
            client.completions.create(model="stories", prompt=prompt, max_tokens=4,
                                      extra_body={"speculative_method": "medusa"})
        # Ollama's API takes it among the options (the official client passes them through).
        import ollama

        base = str(client.base_url).removesuffix("/v1/")
        ollama_client = ollama.Client(host=base, timeout=60)
        before = float(accepted[0].split()[-1])
        replies = [ollama_client.generate("stories", prompt, raw=True, options={
            "temperature": 0, "num_predict": 40, "num_speculative_tokens": k}).response for k in (0, 4)]
        assert replies[0] == replies[1] == texts[0]
        metrics = httpx.get(base + "/metrics", timeout=30).text
        after = [line for line in metrics.splitlines()
                 if line.startswith("localserve_spec_decode_num_accepted_tokens_total{")]
        assert float(after[0].split()[-1]) > before


def test_a_modelfile_parameter_sets_a_models_default() -> None:
    from localserve.engine.speculative import MAX_DRAFT_TOKENS
    from localserve.registry.settings import PARAMETERS, ModelSettings

    assert PARAMETERS["num_speculative_tokens"].high == MAX_DRAFT_TOKENS  # the registry's copy of the bound
    settings = ModelSettings.checked(parameters={"num_speculative_tokens": 4})
    assert settings.request_fields() == {"num_speculative_tokens": 4}
    with pytest.raises(LocalserveError, match="num_speculative_tokens"):
        ModelSettings.checked(parameters={"num_speculative_tokens": 17})


def test_the_cli_options_make_the_engine_option() -> None:
    import click

    from localserve.cli.main import engine_config

    assert engine_config({"speculative": "ngram", "num_speculative_tokens": 6}).speculative == \
        SpeculativeConfig(num_tokens=6)
    assert engine_config({"speculative": "ngram", "num_speculative_tokens": None}).speculative.num_tokens == 4
    assert engine_config({"speculative": None, "num_speculative_tokens": None}).speculative.num_tokens == 0
    with pytest.raises(click.UsageError, match="--speculative"):
        engine_config({"speculative": None, "num_speculative_tokens": 3})
    assert engine_config({"speculative": None, "draft_model": STORIES_GGUF}).speculative == \
        SpeculativeConfig(method="draft_model", draft_model=str(STORIES_GGUF), num_tokens=4)
    with pytest.raises(click.UsageError, match="--draft-model goes with --speculative draft_model"):
        engine_config({"speculative": "ngram", "draft_model": STORIES_GGUF})


def test_run_drafts_with_a_draft_model_from_the_command_line(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``localserve run --draft``: the reply of plain ``run``, with the draft model loaded."""
    from click.testing import CliRunner

    from localserve.cli.main import main
    from localserve.engine import engine

    from .conftest import STORIES_HF

    loaded = []
    load = engine.load_draft_model
    monkeypatch.setattr(engine, "load_draft_model", lambda path, *args: loaded.append(path) or load(path, *args))

    def run(*options: str) -> str:
        result = CliRunner().invoke(main, ["run", str(STORIES_GGUF), "Once upon a time", "--max-tokens", "30",
                                           "--temperature", "0", *options])
        assert result.exit_code == 0, result.output
        return result.output

    assert run("--draft", str(STORIES_HF), "--num-speculative-tokens", "3") == run()
    assert loaded == [str(STORIES_HF)]
    result = CliRunner().invoke(main, ["run", str(STORIES_GGUF), "hi", "--draft-model", "no-such-model"])
    assert result.exit_code != 0 and "no-such-model" in result.output

