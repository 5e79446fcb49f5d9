"""The OpenAI-compatible API through the official openai SDK (strict response
validation), against the real trained stories260K model; logprobs against HF
transformers on the same weights."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from localserve.server.config import ServerConfig

from .conftest import STORIES_HF
from .server_util import running_server, small_engine_config, stories_with_template

# The model's own greedy continuation of "Once upon a time" (shared/README.md).
STORY = ", there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module", params=[False, True], ids=["engine thread", "engine process"])
def server(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The daemon with its engine on a thread of its own, and in a process of its own
    (`serve --engine-processes`): every test here holds for both."""
    path = stories_with_template(tmp_path_factory.mktemp("models"))
    config = ServerConfig(models={"stories": path}, preload=["stories"], engine=small_engine_config(), device="cpu",
                          engine_processes=request.param)
    with running_server(config) as running:
        yield running


@pytest.fixture
def client(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", _strict_response_validation=True,
                         max_retries=0)


@pytest.fixture
def loose_client(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    """For legacy completion streams: the SDK types a chunk as a whole Completion, whose
    finish_reason may not be null, while OpenAI's servers (and this one) send null until
    the last chunk; strict validation would refuse every real stream."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_model():  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(STORIES_HF, torch_dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def tokenize(server, **body) -> list[int]:  # type: ignore[no-untyped-def]
    response = httpx.post(f"{server.url}/tokenize", json={"model": "stories", **body})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["stories"]
    assert client.models.retrieve("stories").id == "stories"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completion_is_the_models_story(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=24, temperature=0)
    assert STORY.startswith(completion.choices[0].text)
    assert len(completion.choices[0].text) > 40
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == 5  # BOS + 4 (shared/README.md)
    assert completion.usage.completion_tokens == 24


def test_prompt_forms_agree(server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    ids = tokenize(server, prompt="Once upon a time")
    assert ids == [1, 403, 407, 261, 378]
    by_text = client.completions.create(model="stories", prompt=["Once upon a time", "The cat"], max_tokens=8,
                                        temperature=0)
    by_ids = client.completions.create(model="stories", prompt=ids, max_tokens=8, temperature=0)
    assert [c.index for c in by_text.choices] == [0, 1]
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_text.choices[1].text != by_text.choices[0].text
    detokenized = httpx.post(f"{server.url}/detokenize", json={"model": "stories", "tokens": ids[1:]}).json()
    assert detokenized["prompt"] == "Once upon a time"


def test_chat_stream_equals_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="stories", messages=messages, max_tokens=30, temperature=0)
    stream = client.chat.completions.create(model="stories", messages=messages, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n_and_seed(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        completion = client.chat.completions.create(
            model="stories", messages=[{"role": "user", "content": "Once"}], max_tokens=12, temperature=1.0,
            n=2, seed=seed)
        assert [c.index for c in completion.choices] == [0, 1]
        assert 2 <= completion.usage.completion_tokens <= 24
        return [c.message.content for c in completion.choices]

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first[0] != first[1]  # the choices are different samples
    assert first != other


def test_stop_strings_streamed_and_not(client: openai.OpenAI, loose_client: openai.OpenAI) -> None:
    request = dict(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0, stop=["Lily"])
    whole = client.completions.create(**request)
    streamed = "".join(c.choices[0].text for c in loose_client.completions.create(**request, stream=True))
    assert whole.choices[0].text == ", there was a little girl named "
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == whole.choices[0].text


def test_chat_logprobs_match_transformers(server, client: openai.OpenAI, hf_model) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Once upon a time"}]
    completion = client.chat.completions.create(model="stories", messages=messages, max_tokens=4, temperature=0,
                                                logprobs=True, top_logprobs=3)
    prompt = tokenize(server, messages=messages)
    first = completion.choices[0].logprobs.content[0]
    reference = hf_logprobs(hf_model, prompt)[-1]
    values, ids = reference.topk(3)
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    assert first.logprob == pytest.approx(values[0].item(), abs=1e-4)
    tokenizer = server.state.manager.loaded["stories"].tokenizer
    assert [bytes(t.bytes) for t in first.top_logprobs] == [tokenizer.token_bytes(i) for i in ids.tolist()]
    assert len(completion.choices[0].logprobs.content) == completion.usage.completion_tokens


def test_echo_with_prompt_logprobs(loose_client: openai.OpenAI, hf_model) -> None:  # type: ignore[no-untyped-def]
    # Loose: the first echoed token has no logprob (null, as OpenAI sends), which the
    # SDK's types do not allow.
    ids = [1, 403, 407, 261, 378]
    completion = loose_client.completions.create(model="stories", prompt=ids, max_tokens=3, temperature=0, echo=True,
                                           logprobs=2)
    choice = completion.choices[0]
    assert choice.text.startswith("Once upon a time")
    reference = hf_logprobs(hf_model, ids)
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:5] == pytest.approx(expected, abs=1e-4)
    assert len(choice.logprobs.tokens) == len(ids) + 3
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)


def test_concurrent_streams_equal_alone(server) -> None:  # type: ignore[no-untyped-def]
    prompts = [f"Once upon a time {word}" for word in ("the", "a", "Tom", "Lily", "there", "one", "in", "we")] * 4
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)  # see loose_client

    async def alone(prompt: str) -> str:
        completion = await client.completions.create(model="stories", prompt=prompt, max_tokens=32, temperature=0)
        return completion.choices[0].text

    async def streamed(prompt: str) -> str:
        stream = await client.completions.create(model="stories", prompt=prompt, max_tokens=32, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run() -> tuple[list[str], list[str]]:
        expected = [await alone(p) for p in dict.fromkeys(prompts)]
        got = await asyncio.gather(*(streamed(p) for p in prompts))
        by_prompt = dict(zip(dict.fromkeys(prompts), expected))
        return [by_prompt[p] for p in prompts], list(got)

    expected, got = asyncio.run(run())
    assert len(got) == 32
    assert got == expected


def test_disconnects_free_every_block(server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    async def hang_up(i: int) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            body = {"model": "stories", "prompt": f"Once upon a time {i}", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        return  # closing the response hangs up mid-stream

    async def time_out(i: int) -> None:  # not streaming: the client gives up waiting
        # Well before 400 tokens are out however fast the engine runs (about 0.8 s here).
        async with httpx.AsyncClient(base_url=server.url, timeout=0.1) as http:
            body = {"model": "stories", "prompt": f"Once upon a time {i}", "max_tokens": 400, "ignore_eos": True}
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=body)

    engine = server.state.manager.loaded["stories"].engine

    def settled_finished_count() -> int:
        """Requests finished so far, once the stats have stopped changing: an engine process
        sends them every 0.25 s, so earlier tests' last requests may not be counted yet."""
        def count() -> tuple[int, int]:
            return engine.stats.num_finished_requests, engine.stats.num_running

        seen, since = count(), time.monotonic()
        while time.monotonic() - since < 0.6:
            time.sleep(0.05)
            if count() != seen:
                seen, since = count(), time.monotonic()
        return seen[0]

    def run_clients(client_count: int, client) -> int:  # type: ignore[no-untyped-def]
        """Requests that ran to their end among ``client_count`` clients that leave early,
        once all is idle."""
        before = settled_finished_count()

        async def run() -> None:
            await asyncio.gather(*(client(i) for i in range(client_count)))

        asyncio.run(run())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (engine.num_in_flight or engine.stats.kv_blocks_used):
            time.sleep(0.05)
        assert engine.num_in_flight == 0
        assert engine.stats.kv_blocks_used == 0
        assert engine.stats.num_running == 0
        return settled_finished_count() - before

    if server.state.config.engine_processes:
        # Its steps cannot be slowed from here; each request still has far more tokens to
        # make than a client waits for, so were aborts lost, every one would run to its end.
        assert run_clients(20, hang_up) < 20
        assert run_clients(5, time_out) < 5
        completion = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=10,
                                               temperature=0)
        assert STORY.startswith(completion.choices[0].text)
        return
    # Each step takes at least 5 ms, so 400 tokens take 2 s, far longer than a client takes
    # to leave and the server to notice: every request is aborted, none runs to its end,
    # however fast the machine (a race on speed made this test fail 7 runs in 10).
    step = engine.engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.005)
        return step()

    engine.engine.step = slow_step
    try:
        assert run_clients(20, hang_up) == 0
        assert run_clients(5, time_out) == 0
    finally:
        del engine.engine.step
    completion = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert STORY.startswith(completion.choices[0].text)


def _samples(text: str) -> dict[tuple[str, str], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, sample.labels.get("model", ""))] = sample.value
    return values


def test_metrics_move(server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    before = _samples(httpx.get(f"{server.url}/metrics").text)
    client.completions.create(model="stories", prompt="Once upon a time", max_tokens=5, temperature=0)
    time.sleep(0.3)  # the engine refreshes its statistics snapshot at least every 0.25 s when idle
    after = _samples(httpx.get(f"{server.url}/metrics").text)
    key = ("localserve_generation_tokens_total", "stories")
    assert after[key] >= before[key] + 5
    for name in ("localserve_time_to_first_token_seconds_count", "localserve_e2e_request_latency_seconds_count",
                 "localserve_request_queue_time_seconds_count"):
        assert after[(name, "stories")] == before.get((name, "stories"), 0) + 1
    assert after[("localserve_inter_token_latency_seconds_count", "stories")] >= 4
    assert ("localserve_kv_cache_usage_ratio", "stories") in after
    assert ("localserve_num_requests_running", "stories") in after
