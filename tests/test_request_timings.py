"""The timestamps a RequestOutput carries for metrics: queue time, TTFT, end-to-end latency."""

from __future__ import annotations

from localserve import Engine, EngineConfig, RequestOutput, SamplingParams

from .conftest import random_prompt


def test_timestamps_are_ordered_and_count_the_queue(llama) -> None:
    path, _ = llama
    # One sequence at a time: the second request waits in the queue for the first to finish.
    engine = Engine(path, EngineConfig(num_kv_blocks=64, max_num_seqs=1), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [engine.add_request(random_prompt(12, seed=i), params) for i in range(2)]
    outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    for rid in ids:
        first, last = outputs[rid][0], outputs[rid][-1]
        assert first.finish_time is None and first.first_token_time is not None
        assert last.finished
        assert last.arrival_time <= last.first_scheduled_time <= last.first_token_time <= last.finish_time
        assert (first.arrival_time, first.first_scheduled_time, first.first_token_time) == (
            last.arrival_time, last.first_scheduled_time, last.first_token_time)
    one, two = (outputs[rid][-1] for rid in ids)
    assert two.first_scheduled_time >= one.finish_time
