"""The output processor: stop strings cut where they begin, deltas that add up to the
answer and never show text a stop string later takes back, and streams that keep the
deltas of the outputs they skip. Real stories model, real tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from localserve import Engine, EngineConfig, RequestOutput, SamplingParams
from localserve.engine.async_engine import RequestStream
from localserve.engine.output_processor import _held_back

from .conftest import STORIES_HF

PROMPT = "Once upon a time"


@pytest.mark.parametrize(("text", "stops", "expected"), [
    ("a little", ["Lily"], 0),
    ("named L", ["Lily"], 1),
    ("named Li", ["Lily", "iz"], 2),
    ("named Lily", ["Lily"], 4),  # whole: min_tokens may not have let it count yet
    ("ab\n", ["\n\nUser:", "b\nX"], 2),
    ("", ["Lily"], 0),
])
def test_held_back_is_the_longest_tail_that_begins_a_stop_string(text: str, stops: list[str], expected: int) -> None:
    assert _held_back(text, stops) == expected


def _steps(engine: Engine, params: SamplingParams) -> list[RequestOutput]:
    request_id = engine.add_request(PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(STORIES_HF, EngineConfig(num_kv_blocks=64), device="cpu")


@pytest.fixture(scope="module")
def unstopped(engine: Engine) -> list[RequestOutput]:
    return _steps(engine, SamplingParams(temperature=0, max_tokens=48))


@pytest.mark.parametrize("stop", ["Lily", "e girl", ". ", "park", "ed L", ","])
@pytest.mark.parametrize("include", [False, True])
def test_deltas_add_up_to_the_text_cut_at_the_stop_string(engine: Engine, unstopped: list[RequestOutput],
                                                          stop: str, include: bool) -> None:
    full = unstopped[-1].text
    assert stop in full  # the reference: the unstopped answer, cut where the stop string first begins
    cut = full.index(stop) + (len(stop) if include else 0)
    outputs = _steps(engine, SamplingParams(temperature=0, max_tokens=48, stop=[stop],
                                            include_stop_str_in_output=include))
    final = outputs[-1]
    assert final.finished and final.finish_reason == "stop" and final.text == full[:cut]
    assert final.stop_string == stop and all(o.stop_string is None for o in outputs[:-1])
    assert "".join(o.delta for o in outputs) == final.text
    for output in outputs:  # nothing shown is ever taken back
        assert final.text.startswith(output.text)


def test_the_earliest_stop_string_is_the_one_named(engine: Engine, unstopped: list[RequestOutput]) -> None:
    """Of several stop strings, the output names the one the text was cut at: the one
    that begins first, wherever it is in the list."""
    full = unstopped[-1].text
    assert full.index("Lily") < full.index("park")
    [final] = [o for o in _steps(engine, SamplingParams(temperature=0, max_tokens=48, stop=["park", "zzz", "Lily"]))
               if o.finished]
    assert final.stop_string == "Lily" and final.text == full[:full.index("Lily")]
    assert unstopped[-1].stop_string is None and unstopped[-1].finish_reason == "length"


def test_a_stop_string_that_never_begins_holds_nothing_back(engine: Engine, unstopped: list[RequestOutput]) -> None:
    stopped = _steps(engine, SamplingParams(temperature=0, max_tokens=48, stop=["zzz"]))
    assert [o.text for o in stopped] == [o.text for o in unstopped]
    assert all(o.delta == u.delta for o, u in zip(stopped, unstopped))
    assert "".join(o.delta for o in unstopped) == unstopped[-1].text


def test_a_stream_that_skips_outputs_keeps_their_deltas(unstopped: list[RequestOutput]) -> None:
    class Owner:
        def abort(self, request_id: str) -> None:
            pass

    async def read_after_all_arrived() -> list[RequestOutput]:
        stream = RequestStream("0", Owner())  # type: ignore[arg-type]
        for output in unstopped:
            stream._put(RequestOutput(**{f: getattr(output, f) for f in RequestOutput.__slots__}))
        return [output async for output in stream]

    read = asyncio.run(read_after_all_arrived())
    assert len(read) == 1 and read[0].finished  # the unfinished ones were skipped ...
    assert read[0].delta == unstopped[-1].text  # ... and their text kept
