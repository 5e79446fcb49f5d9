"""`localserve bench`: metrics against independent numpy computations, the arrival
process's statistics, the datasets' token lengths, and whole runs against a real
localserve server (the stories model) through the Python API and the CLI."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import socket
import time

import numpy as np
import pytest
from click.testing import CliRunner

from localserve.bench import (BenchConfig, BenchError, BenchResult, RequestRecord, compute_metrics, parse_goodput,
                              run_benchmark)
from localserve.bench.datasets import (SampleRequest, num_special_tokens, prefix_repetition_requests,
                                       random_requests, sharegpt_requests)
from localserve.bench.load import arrival_times, drive, request_gaps
from localserve.bench.metrics import peak_concurrency
from localserve.bench.tokenizer import load_tokenizer
from localserve.cli.main import main

from .conftest import DATA, STORIES_HF

STORIES_GGUF = DATA / "models" / "stories260K.gguf"


# -- metrics ---------------------------------------------------------------------------------

def _trace(seed: int = 3, n: int = 40) -> list[RequestRecord]:
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        out = int(rng.integers(1, 30))
        ttft = float(rng.uniform(0.01, 0.5))
        itl = rng.uniform(0.001, 0.05, size=out - 1).tolist()
        start = float(rng.uniform(0, 5))
        e2el = ttft + sum(itl)
        records.append(RequestRecord(prompt_len=int(rng.integers(4, 100)), expected_output_len=out, success=True,
                                     start=start, end=start + e2el + 0.001, ttft=ttft, e2el=e2el, itl=itl,
                                     output_tokens=out, chunks=out))
    records[7] = RequestRecord(prompt_len=50, expected_output_len=9, success=False, error="HTTP 500: boom",
                               start=1.0, end=1.2)
    return records


def test_metrics_equal_numpy_on_a_synthetic_trace() -> None:
    records = _trace()
    duration = 6.5
    percentiles = (50.0, 90.0, 99.0, 99.9)
    slos = {"ttft": 300.0, "tpot": 30.0, "e2el": 600.0}
    m = compute_metrics(records, duration, percentiles, slos)
    ok = [r for r in records if r.success]
    ttft = np.array([r.ttft for r in ok]) * 1000
    e2el = np.array([r.e2el for r in ok]) * 1000
    tpot = np.array([(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]) * 1000
    itl = np.array([g for r in ok for g in r.itl]) * 1000
    for name, values in {"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": e2el}.items():
        dist = m.latencies[name]
        assert dist.count == len(values)
        assert dist.mean == pytest.approx(np.mean(values), rel=1e-12)
        assert dist.median == pytest.approx(np.median(values), rel=1e-12)
        assert dist.std == pytest.approx(np.std(values), rel=1e-12)
        for p in percentiles:
            assert dist.percentiles[p] == pytest.approx(np.percentile(values, p), rel=1e-12)
    assert (m.completed, m.failed) == (len(ok), 1)
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    assert (m.total_input_tokens, m.total_output_tokens) == (total_in, total_out)
    assert m.request_throughput == pytest.approx(len(ok) / duration)
    assert m.output_throughput == pytest.approx(total_out / duration)
    assert m.total_token_throughput == pytest.approx((total_in + total_out) / duration)
    # Goodput by hand: a request is good when it meets every SLO (TPOT 0 with one token).
    good = 0
    for r in ok:
        r_tpot = (r.e2el - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        good += r.ttft <= 0.3 and r_tpot <= 0.03 and r.e2el <= 0.6
    assert 0 < good < len(ok)  # the SLOs split this trace, so the test means something
    assert m.request_goodput == pytest.approx(good / duration)
    flat = m.to_dict()
    assert flat["p99.9_itl_ms"] == pytest.approx(np.percentile(itl, 99.9))
    assert flat["median_tpot_ms"] == pytest.approx(np.median(tpot))
    assert compute_metrics(records, duration, percentiles).request_goodput is None


def test_metrics_without_samples_and_goodput_parsing() -> None:
    m = compute_metrics([RequestRecord(4, 4, error="x", start=0, end=1)], 1.0)
    assert m.completed == 0 and m.latencies["ttft"].mean is None and m.to_dict()["p99_e2el_ms"] is None
    assert parse_goodput(["ttft:500", "tpot:50 e2el:2000"]) == {"ttft": 500, "tpot": 50, "e2el": 2000}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(BenchError):
            parse_goodput(bad)


def test_peak_concurrency_sweeps_half_open_intervals() -> None:
    def rec(start: float, end: float) -> RequestRecord:
        return RequestRecord(1, 1, start=start, end=end)

    # [0,2) [1,3) [2,4) [2.5,3.5): at 2.5 three are open; [0,2) has closed when [2,4) opens.
    assert peak_concurrency([rec(0, 2), rec(1, 3), rec(2, 4), rec(2.5, 3.5)]) == 3
    assert peak_concurrency([rec(0, 1), rec(1, 2), rec(2, 3)]) == 1
    assert peak_concurrency([]) == 0


# -- arrivals and the load driver ------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_are_gamma(burstiness: float) -> None:
    rate, n = 8.0, 2000
    gaps = request_gaps(n, rate, burstiness, np.random.default_rng(1234))
    # Mean gap 1/rate (its standard error is cv/sqrt(n) relative: <= 3.2% here).
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.1)
    cv = np.std(gaps) / np.mean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    times = arrival_times(n, rate, burstiness, np.random.default_rng(1234))
    assert times[-1] == pytest.approx(n / rate)  # rescaled as vLLM does: the load offered is exact
    assert np.all(np.diff(times) >= 0)
    assert np.std(np.diff(times)) / np.mean(np.diff(times)) == pytest.approx(cv, rel=0.05)


def test_infinite_rate_sends_at_once_and_the_cap_holds() -> None:
    assert not arrival_times(50, math.inf, 1.0, np.random.default_rng(0)).any()
    samples = [SampleRequest("x", 1, 1) for _ in range(20)]
    open_now = peak = 0

    async def send(sample: SampleRequest, t0: float) -> RequestRecord:
        nonlocal open_now, peak
        start = time.perf_counter() - t0
        open_now += 1
        peak = max(peak, open_now)
        await asyncio.sleep(0.02)
        open_now -= 1
        return RequestRecord(1, 1, success=True, start=start, end=time.perf_counter() - t0)

    trace = asyncio.run(drive(samples, send, [0.0] * 20))
    # Nobody waited: every request was sent before the first one finished.
    assert peak == 20 and max(r.start for r in trace.records) < min(r.end for r in trace.records)
    peak = 0
    trace = asyncio.run(drive(samples, send, [0.0] * 20, max_concurrency=3, num_warmups=2))
    assert peak == 3 and peak_concurrency(trace.records) == 3 and len(trace.records) == 20
    assert trace.duration >= 0.02 * 20 / 3


# -- datasets ---------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["gguf", "hf"])
def tokenizer(request):  # type: ignore[no-untyped-def]
    return load_tokenizer(str(STORIES_GGUF if request.param == "gguf" else STORIES_HF))


def test_random_prompts_have_the_lengths_drawn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    exact = random_requests(tokenizer, 24, 64, 16, 0.0, np.random.default_rng(0))
    assert {(r.prompt_len, r.expected_output_len) for r in exact} == {(64, 16)}
    assert all(len(tokenizer.encode(r.prompt)) == 64 for r in exact)
    assert len({r.prompt for r in exact}) == 24
    ranged = random_requests(tokenizer, 60, 40, 20, 0.5, np.random.default_rng(1))
    for r in ranged:
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len and 20 <= r.prompt_len <= 60
        assert 10 <= r.expected_output_len <= 30
    assert len({r.prompt_len for r in ranged}) > 10 and len({r.expected_output_len for r in ranged}) > 5
    again = random_requests(tokenizer, 24, 64, 16, 0.0, np.random.default_rng(0))
    assert [r.prompt for r in again] == [r.prompt for r in exact]  # the seed decides


def test_prefix_repetition_prompts_share_their_prefix(tokenizer) -> None:  # type: ignore[no-untyped-def]
    prefix, suffix = 48, 24
    requests = prefix_repetition_requests(tokenizer, 12, prefix, suffix, 3, 10, np.random.default_rng(2))
    specials = num_special_tokens(tokenizer)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    assert all(len(t) == prefix + suffix and r.prompt_len == prefix + suffix + specials
               for t, r in zip(ids, requests))
    groups: dict[int, list[list[int]]] = {}
    for r, t in zip(requests, ids):
        assert r.group is not None and r.expected_output_len == 10
        groups.setdefault(r.group, []).append(t)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    heads = {tuple(g[0][:prefix]) for g in groups.values()}
    assert len(heads) == 3  # three different prefixes
    for members in groups.values():
        assert all(t[:prefix] == members[0][:prefix] for t in members)
        assert len({tuple(t[prefix:]) for t in members}) == len(members)  # the suffixes differ
        assert all(t[prefix] != u[prefix] or t[prefix:] != u[prefix:] for t in members for u in members
                   if t is not u)


def test_sharegpt_parsing_and_filtering(tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    story = "Once upon a time there was a little girl named Lily who loved to play outside in the park."
    data = [
        {"id": "good1", "conversations": [{"from": "human", "value": "Tell me a story about a dog and a cat."},
                                          {"from": "gpt", "value": story}]},
        {"id": "good2", "conversations": [{"from": "system", "value": "be nice"},
                                          {"from": "human", "value": "What did Lily do in the park today?"},
                                          {"from": "gpt", "value": "She played with her ball and ran around."},
                                          {"from": "human", "value": "and then?"}]},
        {"id": "short-prompt", "conversations": [{"from": "human", "value": "Hi"},
                                                 {"from": "gpt", "value": story}]},
        {"id": "short-answer", "conversations": [{"from": "human", "value": "Tell me a story about a dog."},
                                                 {"from": "gpt", "value": "ok"}]},
        {"id": "long-prompt", "conversations": [{"from": "human", "value": "the dog ran. " * 400},
                                                {"from": "gpt", "value": story}]},
        {"id": "gpt-only", "conversations": [{"from": "gpt", "value": story}, {"from": "gpt", "value": story}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": story}]},
        {"id": "no-conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_requests(tokenizer, path, 2, None, seed=0)
    prompts = {r.prompt for r in requests}
    assert prompts == {data[0]["conversations"][0]["value"], data[1]["conversations"][1]["value"]}
    for r in requests:
        assert r.prompt_len == len(tokenizer.encode(r.prompt))
        answer = story if r.prompt.startswith("Tell") else "She played with her ball and ran around."
        assert r.expected_output_len == len(tokenizer.encode(answer, add_special_tokens=False))
    # A fixed output length keeps the short answer (only the prompt is checked) and sets every length.
    fixed = sharegpt_requests(tokenizer, path, 3, 32, seed=0)
    assert {r.expected_output_len for r in fixed} == {32} and len({r.prompt for r in fixed}) == 3
    # More prompts than pass the filter: repeated, so the count holds.
    assert len(sharegpt_requests(tokenizer, path, 7, None, seed=0)) == 7
    path.write_text(json.dumps(data[2:]))
    with pytest.raises(BenchError, match="length filter"):
        sharegpt_requests(tokenizer, path, 2, None, seed=0)


def test_missing_tokenizer_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(BenchError, match="--tokenizer"):
        load_tokenizer(str(tmp_path))  # a folder with no tokenizer.json
    with pytest.raises(BenchError, match="--tokenizer"):
        load_tokenizer(None)


# -- one streamed request, against scripted responses -------------------------------------------

def _events(*chunks: object) -> bytes:
    lines = [": ping\n\n"]  # an SSE comment, as some servers send to keep the line open
    lines += [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def _send(tokenizer, body: bytes, status: int = 200) -> RequestRecord:  # type: ignore[no-untyped-def]
    import httpx

    from localserve.bench.client import send_request

    async def go() -> RequestRecord:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport) as http:
            return await send_request(http, "http://bench.test/v1/chat/completions", {}, SampleRequest("p", 7, 9),
                                      tokenizer, time.perf_counter())

    return asyncio.run(go())


def test_client_reads_chat_streams_without_usage(tokenizer) -> None:  # type: ignore[no-untyped-def]
    def delta(content: str | None, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": {} if content is None else {"content": content},
                             "finish_reason": finish}]}

    # A role-only opening chunk (no text yet), three text chunks, an empty closing one, no usage.
    opening = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    record = _send(tokenizer, _events(opening, delta("Once"), delta(" upon a"), delta(" time"),
                                      delta(None, "length")))
    assert record.success and record.error == ""
    assert record.generated_text == "Once upon a time" and record.chunks == 3 and len(record.itl) == 2
    assert record.output_tokens_from == "tokenizer"
    assert record.output_tokens == len(tokenizer.encode("Once upon a time", add_special_tokens=False))
    assert 0 < record.ttft <= record.e2el and record.prompt_len == 7  # no usage: the local count stands
    with_usage = _send(tokenizer, _events(delta("Hi"), {"choices": [], "usage": {"prompt_tokens": 11,
                                                                                  "completion_tokens": 1}}))
    assert (with_usage.output_tokens, with_usage.output_tokens_from, with_usage.prompt_len) == (1, "usage", 11)
    failed = _send(tokenizer, _events(delta("Hi"), {"error": {"message": "engine\nfell over"}}))
    assert not failed.success and failed.error == "engine fell over"
    refused = _send(tokenizer, json.dumps({"error": {"message": "too many requests"}}).encode(), status=429)
    assert not refused.success and refused.error == "HTTP 429: too many requests"
    broken = _send(tokenizer, b"data: {not json\n\n")
    assert not broken.success and broken.error.startswith("JSONDecodeError")


# -- against a real server --------------------------------------------------------------------

class _PeakGuard:
    """Counts the server's peak of HTTP requests being answered (its guard's in_flight)."""

    @staticmethod
    def install(state) -> None:  # type: ignore[no-untyped-def]
        base = type(state.guard)

        class Peak(base):  # type: ignore[valid-type, misc]
            def __setattr__(self, name: str, value: object) -> None:
                if name == "in_flight":
                    object.__setattr__(self, "peak", max(getattr(self, "peak", 0), value))
                super().__setattr__(name, value)

        state.guard.__class__ = Peak


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    from localserve.server.config import ServerConfig

    from .server_util import running_server, small_engine_config, stories_with_template

    path = stories_with_template(tmp_path_factory.mktemp("models"))
    config = ServerConfig(models={"stories": path}, preload=["stories"], engine=small_engine_config(), device="cpu")
    with running_server(config) as running:
        running.model_path = path
        _PeakGuard.install(running.state)
        yield running


def test_run_against_the_server(server) -> None:  # type: ignore[no-untyped-def]
    server.state.guard.peak = 0
    config = BenchConfig(url=server.url, model="stories", tokenizer=str(server.model_path), num_prompts=12,
                         random_input_len=16, random_output_len=8, max_concurrency=4, num_warmups=1, seed=5)
    result = run_benchmark(config)
    m = result.metrics
    assert (m.completed, m.failed) == (12, 0), result.first_error
    for r in result.records:
        assert r.output_tokens == 8 and r.output_tokens_from == "usage"  # ignore_eos: every token asked for
        assert r.prompt_len == 16  # the server's own count (BOS included) equals the length drawn
        assert 0 < r.ttft <= r.e2el <= r.end - r.start
        assert len(r.itl) == r.chunks - 1
        assert r.generated_text
    # localserve streams one token per event while the client keeps up; a lagging client gets the
    # tokens queued meanwhile in one event (async_engine.RequestStream), so a loaded machine sees fewer
    # gaps than tokens, never more, and the metrics count every gap the records hold.
    gaps = sum(len(r.itl) for r in result.records)
    assert 0 < gaps <= sum(r.output_tokens - 1 for r in result.records)
    assert m.total_output_tokens == 96 and m.total_input_tokens == 12 * 16
    assert 1 <= m.max_concurrent_requests <= 4
    assert 1 <= server.state.guard.peak <= 4  # the server saw no more at once (the /v1/models check ran first)
    assert m.latencies["itl"].count == gaps
    data = json.loads(json.dumps(result.to_dict()))
    assert len(data["requests"]) == 12 and data["metrics"]["completed"] == 12
    assert data["config"]["ignore_eos"] is True and data["config"]["max_concurrency"] == 4
    # The server's speculative-decoding counters were read (its default drafts nothing).
    assert result.spec_decode is not None and result.spec_decode.draft_tokens == 0
    assert data["spec_decode"]["acceptance_rate"] is None


def test_speculative_decoding_counters_in_the_report() -> None:
    from dataclasses import replace

    from localserve.bench.report import summary_table
    from localserve.bench.spec_decode import SpecDecodeCounts, parse_spec_decode

    ours = (
        "# TYPE localserve_spec_decode_num_drafts_total counter\n"
        'localserve_spec_decode_num_drafts_total{model="a"} 10.0\n'
        'localserve_spec_decode_num_drafts_total{model="b"} 2.0\n'
        "# TYPE localserve_spec_decode_num_draft_tokens_total counter\n"
        'localserve_spec_decode_num_draft_tokens_total{model="a"} 40.0\n'
        'localserve_spec_decode_num_draft_tokens_total{model="b"} 8.0\n'
        "# TYPE localserve_spec_decode_num_accepted_tokens_total counter\n"
        'localserve_spec_decode_num_accepted_tokens_total{model="a"} 30.0\n'
        'localserve_spec_decode_num_accepted_tokens_total{model="b"} 6.0\n'
    )
    assert parse_spec_decode(ours) == SpecDecodeCounts(12, 48, 36)
    vllm = ours.replace("localserve_", "vllm:")
    after = parse_spec_decode(vllm)
    assert after is not None
    run = after.since(SpecDecodeCounts(2, 8, 4))
    assert run == SpecDecodeCounts(10, 40, 32) and run.acceptance_rate == 0.8 and run.acceptance_length == 4.2
    assert parse_spec_decode("# TYPE up gauge\nup 1\n") is None  # llama.cpp's: no such counters
    from rich.console import Console

    def text(result: BenchResult) -> str:
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(summary_table(result))
        return console.export_text()

    result = BenchResult(BenchConfig(), "http://x", "m", compute_metrics([], 1.0), [], spec_decode=run)
    assert re.search(r"Draft acceptance rate \(%\)\s*│\s*80\.0", text(result))
    assert re.search(r"Mean acceptance length \(tokens per verification\)\s*│\s*4\.20", text(result))
    assert "Draft" not in text(replace(result, spec_decode=None))


def test_chat_endpoint_and_server_defaults(server) -> None:  # type: ignore[no-untyped-def]
    # No --model: the server's first model is asked for, and its tokenizer from there on.
    config = BenchConfig(url=server.url + "/v1", tokenizer=str(server.model_path), endpoint="chat", num_prompts=3,
                         random_input_len=12, random_output_len=5, request_rate=50.0, burstiness=2.0)
    result = run_benchmark(config)
    assert result.model == "stories" and result.metrics.completed == 3, result.first_error
    assert all(r.output_tokens == 5 for r in result.records)
    assert all(r.prompt_len > 12 for r in result.records)  # the chat template's tokens count too


def test_cli_json_plot_and_saved_result(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    png, saved = tmp_path / "bench.png", tmp_path / "out" / "result.json"
    args = ["bench", "--url", server.url, "--model", "stories", "--tokenizer", str(server.model_path),
            "--num-prompts", "6", "--random-input-len", "10", "--random-output-len", "6", "--max-concurrency", "2",
            "--metric-percentiles", "50,99", "--goodput", "ttft:60000", "--goodput", "e2el:60000", "--json",
            "--save-result", str(saved), "--no-progress"]
    pytest.importorskip("matplotlib")
    result = CliRunner().invoke(main, [*args, "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    metrics = data["metrics"]
    assert metrics["completed"] == 6 and metrics["total_output_tokens"] == 36
    assert metrics["request_goodput"] == pytest.approx(metrics["request_throughput"])  # generous SLOs
    assert {"p50_ttft_ms", "p99_tpot_ms", "median_itl_ms", "std_e2el_ms"} <= set(metrics)
    assert "requests" not in data
    assert len(json.loads(saved.read_text())["requests"]) == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_table(server) -> None:  # type: ignore[no-untyped-def]
    args = ["bench", "--url", server.url, "--model", "stories", "--tokenizer", str(server.model_path),
            "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    for text in ("Successful requests", "Output token throughput", "TTFT", "TPOT", "ITL", "E2EL", "P99"):
        assert text in result.stdout


def test_every_request_failing_exits_1_with_the_first_error(server) -> None:  # type: ignore[no-untyped-def]
    args = ["bench", "--url", server.url, "--model", "no-such-model", "--tokenizer", str(server.model_path),
            "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4", "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert result.output.startswith("Error: all 3 requests failed; the first: HTTP 404")
    assert result.output.count("\n") == 1


def test_wrong_url_is_one_clear_line() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    result = CliRunner().invoke(main, ["bench", "--url", f"http://127.0.0.1:{port}", "--model", "stories",
                                       "--num-prompts", "2", "--no-progress"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith(f"Error: cannot reach a server at http://127.0.0.1:{port}")
    assert result.output.count("\n") == 1


# -- the server's tokenizer (/tokenize, /detokenize) ---------------------------------------------

API_KEY = "bench-key"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A daemon serving `stories` from a path (no registry entry) behind an API key."""
    from localserve.server.config import ServerConfig

    from .server_util import running_server, small_engine_config, stories_with_template

    path = stories_with_template(tmp_path_factory.mktemp("models"))
    config = ServerConfig(models={"stories": path}, preload=["stories"], engine=small_engine_config(), device="cpu",
                          api_key=API_KEY)
    with running_server(config) as running:
        running.model_path = path
        yield running


def _server_count(server, text: str, add_special_tokens: bool = True) -> int:  # type: ignore[no-untyped-def]
    import httpx

    answer = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30,
                        json={"model": "stories", "prompt": text, "add_special_tokens": add_special_tokens})
    assert answer.status_code == 200, answer.text
    return answer.json()["count"]


def test_cli_bench_takes_the_tokenizer_from_the_server(keyed_server, tmp_path,  # type: ignore[no-untyped-def]
                                                      monkeypatch) -> None:
    # `stories` is neither a path nor a registry name here: only the daemon knows it.
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALSERVE_API_KEY", raising=False)
    saved = tmp_path / "result.json"
    args = ["bench", "--url", keyed_server.url, "--model", "stories", "--api-key", API_KEY, "--num-prompts", "6",
            "--random-input-len", "20", "--random-output-len", "4", "--max-concurrency", "3", "--json",
            "--save-result", str(saved), "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    assert metrics["completed"] == 6 and metrics["total_input_tokens"] == 6 * 20
    records = json.loads(saved.read_text())["requests"]
    # prompt_len is the server's own count (its usage): the prompts built with its tokenizer
    # have exactly the length drawn, BOS included.
    assert [r["prompt_len"] for r in records] == [20] * 6
    assert all(r["output_tokens"] == 4 and r["output_tokens_from"] == "usage" for r in records)
    # Without the key, the tokenizer routes refuse, and the command says why in one line.
    refused = CliRunner().invoke(main, [*args[:5], "--num-prompts", "2", "--no-progress"])
    assert refused.exit_code == 1 and refused.output.count("\n") == 1
    assert "no tokenizer for 'stories'" in refused.output and "HTTP 401" in refused.output


def test_server_tokenizer_counts_as_the_server_does(keyed_server) -> None:  # type: ignore[no-untyped-def]
    from localserve.bench.client import count_output_tokens
    from localserve.bench.datasets import _FIT_ROUNDS, allowed_token_ids
    from localserve.bench.tokenizer import ServerTokenizer

    local = load_tokenizer(str(keyed_server.model_path))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with ServerTokenizer(keyed_server.url, "stories", headers) as remote:
        assert remote.vocab_size == local.vocab_size == 512
        plain = remote.plain_text_token_ids()
        vocab_calls = remote.calls
        assert vocab_calls <= 6  # the size, the marker, then the whole vocabulary in one call
        # The same plain-text pieces as the local vocabulary's, so the same prompts for a seed.
        assert plain.tolist() == allowed_token_ids(local).tolist()
        drawn = random_requests(remote, 8, 24, 4, 0.5, np.random.default_rng(7))
        assert [r.prompt for r in drawn] == [r.prompt for r in random_requests(local, 8, 24, 4, 0.5,
                                                                                 np.random.default_rng(7))]
        for r in drawn:
            assert r.prompt_len == _server_count(keyed_server, r.prompt) == len(local.encode(r.prompt))
        # Whole prompts go over HTTP, never one call per token.
        long_calls = remote.calls
        long = random_requests(remote, 3, 300, 4, 0.0, np.random.default_rng(8))
        assert [r.prompt_len for r in long] == [300] * 3
        assert [_server_count(keyed_server, r.prompt) for r in long] == [300] * 3
        assert remote.calls - long_calls <= 3 * (2 * _FIT_ROUNDS + 2) < 300
        shared = prefix_repetition_requests(remote, 4, 16, 8, 2, 4, np.random.default_rng(9))
        assert all(r.prompt_len == _server_count(keyed_server, r.prompt) for r in shared)
        # Outputs without usage are counted after the run, one call per request.
        records = [RequestRecord(5, 4, success=True, generated_text=" there was a little girl"),
                   RequestRecord(5, 4, success=True, generated_text=""),
                   RequestRecord(5, 4, success=False, generated_text="broken")]
        count_output_tokens(records, remote)
        assert records[0].output_tokens == _server_count(keyed_server, " there was a little girl", False) > 0
        assert [r.output_tokens_from for r in records] == ["tokenizer", "tokenizer", ""]
        assert records[1].output_tokens == 0 and records[2].output_tokens == 0
    with ServerTokenizer(keyed_server.url, "stories") as keyless, pytest.raises(BenchError, match="HTTP 401"):
        keyless.encode("Once upon a time")


def test_an_explicit_tokenizer_wins_over_the_servers(keyed_server, tmp_path,  # type: ignore[no-untyped-def]
                                                     monkeypatch) -> None:
    from localserve.bench.tokenizer import ServerTokenizer, find_tokenizer
    from localserve.text.tokenizer import Tokenizer

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(BenchError, match="--tokenizer"):
        find_tokenizer(str(tmp_path), "stories", keyed_server.url, "stories", headers)  # no tokenizer.json there
    assert isinstance(find_tokenizer(None, str(keyed_server.model_path), keyed_server.url, "stories", headers),
                      Tokenizer)  # a local path: read here
    remote = find_tokenizer(None, "stories", keyed_server.url, "stories", headers)
    assert isinstance(remote, ServerTokenizer)
    remote.close()
    with pytest.raises(BenchError, match="no tokenizer for 'nothing'.*HTTP 404"):
        find_tokenizer(None, "nothing", keyed_server.url, "nothing", headers)
