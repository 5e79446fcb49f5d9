"""CUDA graphs for decode steps (engine/cuda_graphs.py).

- The buckets and the padding are plain code, tested as such.
- Graph semantics with real numbers, on the CPU: the Triton kernels run in the
  interpreter, and a graph's replay re-runs its captured forward, which reads only the
  static buffers and the capture-time host values, as a real replay does. Greedy tokens
  and logprobs then equal an eager engine's (whose tokens equal transformers') over
  batches that grow, shrink and are padded (a padding row that wrote a cache slot or
  read a live row would change them).
- The capture on a faked card (tests/fake_cuda): what a real capture refuses (reading a
  value back to the host, copying host memory in) fails there, for the engine's
  capture at load in every format (test_fake_cuda.py), and the memory the graphs keep is
  reserved before the KV pool is sized.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from localserve import Engine, EngineConfig, SamplingParams
from localserve.engine import cuda_graphs, runner
from localserve.engine.cuda_graphs import (DecodeGraphs, GraphShape, capture_sizes, describe, graph_shapes, padded_shape,
                                          why_eager)
from localserve.engine.request import Request
from localserve.engine.runner import prepare_inputs, warmup_token_counts
from localserve.engine.scheduler import ScheduledBatch
from localserve.kernels.dispatch import using

from .conftest import hf_greedy, random_prompt, triton_or_skip
from .fake_cuda import DEVICE, RTX_4090, CaptureError, fake_gpu


def test_capture_sizes_are_vllms_buckets_up_to_max_num_seqs() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-3:] == [240, 248, 256]  # larger decode batches run eagerly


def test_a_decode_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    shapes = graph_shapes(20)
    assert shapes == [GraphShape(size, size, 1) for size in capture_sizes(20)]
    assert [padded_shape([1] * n, shapes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [
        GraphShape(size, size, 1) for size in (1, 2, 4, 4, 8, 8, 16, 16, 20, 20)]
    assert padded_shape([1] * 21, shapes) is None  # more sequences than the largest bucket
    assert padded_shape([1, 1, 7], shapes) is None  # a prefill chunk in the step
    assert padded_shape([], shapes) is None


def test_warm_up_sizes_cover_each_tile_and_divisibility_class() -> None:
    assert warmup_token_counts(2048) == [15, 16, 31, 32, 63, 64, 2048]
    assert warmup_token_counts(64) == [15, 16, 31, 32, 63, 64]
    assert warmup_token_counts(20) == [15, 16, 20]


def _decode_request(request_id: str, num_tokens: int, blocks: list[int]) -> Request:
    request = Request(request_id, list(range(3, 3 + num_tokens)), SamplingParams(), frozenset())
    request.num_computed_tokens = num_tokens - 1
    request.block_table = blocks
    return request


def test_padding_rows_write_no_slot_and_read_one_key() -> None:
    batch = ScheduledBatch()
    batch.add(_decode_request("a", 5, [7]), 1)
    batch.add(_decode_request("b", 20, [2, 9]), 1)
    inputs = prepare_inputs(batch, block_size=16, device=torch.device("cpu"), pad_to=GraphShape(4, 4, 1))
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [7, 22, 0, 0]
    assert inputs.positions.tolist() == [4, 19, 0, 0]
    assert meta.slot_mapping.tolist() == [7 * 16 + 4, 9 * 16 + 3, -1, -1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.tolist() == [5, 20, 1, 1]
    assert meta.block_tables.tolist() == [[7, 0], [2, 9], [0, 0], [0, 0]]
    assert (meta.max_query_len, meta.query_lens_host, meta.seq_lens_host) == (1, [1] * 4, [5, 20, 1, 1])
    assert inputs.logits_rows.tolist() == [0, 1]  # only the real rows are sampled
    assert inputs.to_sample == batch.requests

    unpadded = prepare_inputs(batch, block_size=16, device=torch.device("cpu"))
    assert unpadded.input_ids.tolist() == [7, 22]
    assert unpadded.logits_rows is None  # every row samples, in order: the hidden states as they are

    with pytest.raises(ValueError, match="cannot pad"):
        prepare_inputs(batch, block_size=16, device=torch.device("cpu"), pad_to=GraphShape(1, 1, 1))
    prefill = ScheduledBatch()
    request = _decode_request("c", 10, [1])
    request.num_computed_tokens = 0
    prefill.add(request, 10)
    with pytest.raises(ValueError, match="cannot pad"):
        prepare_inputs(prefill, block_size=16, device=torch.device("cpu"), pad_to=GraphShape(2, 2, 1))


# -- graph semantics with real numbers, on the CPU ---------------------------------------


class ReplayedForward:
    """A graph without a GPU: the replay re-runs the captured forward (which reads the
    static buffers and the host values it was captured with) into the static output."""

    def __init__(self, forward: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())


def replayed_capture(forward: Callable[[], torch.Tensor]) -> tuple[ReplayedForward, torch.Tensor]:
    out = forward()
    return ReplayedForward(forward, out), out


def replay_graphs(engine: Engine, shapes: list[GraphShape]) -> DecodeGraphs:
    """Capture the engine's graphs of ``shapes`` with ``replayed_capture`` (and its draft
    model's, when it has one) and have its steps replay them: the model's graphs."""
    graphs = DecodeGraphs(engine.model, engine.runner.kv_caches, shapes, engine.max_model_len,
                          engine.config.block_size, engine.device, replayed_capture)
    with using(engine.kernels), torch.inference_mode():
        graphs.capture()
    engine.runner.graphs = graphs
    if engine.drafter is not None:
        engine.drafter.capture_graphs(shapes, engine.max_model_len, replayed_capture)
    return graphs


@pytest.fixture
def triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel dispatches to Triton (in the interpreter) on CPU tensors."""
    triton_or_skip()
    from localserve.kernels import attention, moe, quant_linear

    for module in (attention, moe, quant_linear):
        monkeypatch.setattr(module, "use_triton", lambda tensor: True)


# (prompt length, max_tokens, the step it arrives at): decode batches of 1 to 4 sequences
# (3 padded to 4), mixed with prefills, as requests join and finish.
ARRIVALS = [(5, 9, 0), (11, 14, 0), (17, 12, 1), (3, 10, 2), (24, 5, 16), (8, 7, 17), (6, 16, 19)]


def run_greedy(engine: Engine) -> dict[str, tuple[list[int], list[float]]]:
    """ARRIVALS' requests, greedy: each one's tokens and logprobs."""
    results: dict[str, tuple[list[int], list[float]]] = {}
    for step in range(200):
        for i, (length, max_tokens, arrival) in enumerate(ARRIVALS):
            if arrival == step:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
                engine.add_request(random_prompt(length, seed=i), params, request_id=str(i))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.token_ids, [entry.logprob for entry in out.logprobs])
        if step > ARRIVALS[-1][2] and not engine.has_unfinished_requests():
            return results
    raise AssertionError("the engine did not finish")


def test_replayed_decode_steps_equal_eager_steps(llama, triton_on_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    path, hf = llama
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=48, max_num_batched_tokens=32)
    eager = run_greedy(Engine(path, config, device="cpu"))

    engine = Engine(path, config, device="cpu")
    graphs = replay_graphs(engine, graph_shapes(4))
    padded: Counter[tuple[int, int | None]] = Counter()  # (sequences, the bucket's)
    real_prepare = runner.prepare_inputs

    def spy(batch, block_size, device, pad_to=None):  # type: ignore[no-untyped-def]
        padded[len(batch.requests), pad_to and pad_to.sequences] += 1
        return real_prepare(batch, block_size, device, pad_to)

    monkeypatch.setattr(runner, "prepare_inputs", spy)
    replayed = run_greedy(engine)

    assert sorted(replayed) == sorted(eager) == [str(i) for i in range(len(ARRIVALS))]
    for request_id, (tokens, logprobs) in eager.items():
        length, max_tokens, _ = ARRIVALS[int(request_id)]
        assert tokens == hf_greedy(hf, random_prompt(length, seed=int(request_id)), max_tokens), request_id
        assert replayed[request_id][0] == tokens, request_id
        assert replayed[request_id][1] == pytest.approx(logprobs, abs=1e-4), request_id
    # Every bucket replayed, a 3-sequence batch in the 4 bucket, and the prefills ran eagerly.
    assert {shape.sequences for shape in graphs.replays} == {1, 2, 4}
    assert padded[3, 4] > 0 and padded[4, 4] > 0 and padded[1, 1] > 0
    assert any(pad is None for _, pad in padded)


def test_verifying_drafts_takes_a_verification_shape() -> None:
    shapes = graph_shapes(8, 4)
    verify = [shape for shape in shapes if shape.kind == "verify"]
    assert verify == [GraphShape(1, length, length) for length in (2, 3, 4, 5)]
    batches = [shape for shape in shapes if shape.kind == "verify batch"]
    assert batches == [GraphShape(2 * b, 6 * b, 5) for b in (2, 4, 8)]
    assert graph_shapes(8, 0) == graph_shapes(8)
    # One sequence: its own length, no padding; several: any lengths up to 1 + K, and
    # each batch the smallest shape that takes it.
    assert padded_shape([3], shapes) == GraphShape(1, 3, 3) and padded_shape([5], shapes) == GraphShape(1, 5, 5)
    assert padded_shape([6], shapes) is None  # more drafts than the engine's default
    assert padded_shape([3, 3], shapes) == padded_shape([5, 1], shapes) == GraphShape(4, 12, 5)
    assert padded_shape([1, 1, 1], shapes) == GraphShape(4, 4, 1)  # no drafts: the decode bucket
    assert padded_shape([5] * 8, shapes) == GraphShape(16, 48, 5)
    assert padded_shape([2] * 9, shapes) == GraphShape(16, 48, 5)  # more than b, where the rows leave room
    assert padded_shape([5] * 9, shapes) is None and padded_shape([1] * 9, shapes) is None
    assert len(graph_shapes(256, 4)) == len(capture_sizes(256)) + 4 + 6  # verify batches: 2, 4, 8, 16, 24, 32
    assert describe(shapes) == ("decode batches of 1 to 8 sequences (4 sizes), and for one sequence verifying 1 to "
                                "4 draft tokens, and for 2 to 8 sequences verifying drafts (3 sizes)")


@pytest.mark.parametrize("sequences", [[1], [5], [1] * 8, [5] * 8, [1, 5, 2], [3, 3, 3, 3, 3]])
def test_every_batch_that_fits_a_verification_shape_pads_to_it(sequences: list[int]) -> None:
    """Any b sequences of 1 to K + 1 tokens fill 2b' sequences over b' (K + 2) rows (b'
    the bucket of b) with spare sequences of 1 to K + 1 rows."""
    shapes = graph_shapes(8, 4)
    shape = padded_shape(sequences, shapes)
    assert shape is not None
    padding = shape.padding(len(sequences), sum(sequences))
    assert padding is not None and all(1 <= rows <= shape.query_len for rows in padding)
    assert len(sequences) + len(padding) == shape.sequences and sum(sequences) + sum(padding) == shape.rows


def test_verification_padding_keeps_each_sequence_and_adds_sequences() -> None:
    batch = ScheduledBatch()
    drafting = _decode_request("a", 5, [7])
    drafting.draft_token_ids = [40, 41]
    batch.add(drafting, 3)
    batch.add(_decode_request("b", 20, [2, 9]), 1)
    inputs = prepare_inputs(batch, block_size=16, device=torch.device("cpu"), pad_to=GraphShape(4, 12, 5))
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [7, 40, 41, 22] + [0] * 8
    assert inputs.positions.tolist() == [4, 5, 6, 19] + [0, 1, 2, 3] * 2
    assert meta.slot_mapping.tolist() == [7 * 16 + 4, 7 * 16 + 5, 7 * 16 + 6, 9 * 16 + 3] + [-1] * 8
    assert meta.query_start_loc.tolist() == [0, 3, 4, 8, 12]
    assert meta.seq_lens.tolist() == [7, 20, 4, 4]
    assert meta.block_tables.tolist() == [[7, 0], [2, 9], [0, 0], [0, 0]]
    assert meta.max_query_len == 4
    assert inputs.logits_rows.tolist() == [0, 1, 2, 3]  # the real rows, each sampled
    with pytest.raises(ValueError, match="cannot pad"):
        prepare_inputs(batch, block_size=16, device=torch.device("cpu"), pad_to=GraphShape(4, 12, 2))


def test_replayed_verification_steps_equal_eager_steps(llama, triton_on_cpu) -> None:  # type: ignore[no-untyped-def]
    """One request at a time verifying 1 to 4 draft tokens a step (prompt lookup on a prompt
    that repeats itself, and adaptive lengths), through the verification graphs: the
    tokens and logprobs of the eager engine with the same drafts."""
    from localserve.engine.speculative import SpeculativeConfig

    path, _ = llama
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=48, max_num_batched_tokens=32,
                          speculative=SpeculativeConfig(num_tokens=4, adaptive=False))

    def run(engine: Engine) -> list[tuple[list[int], list[float]]]:
        outputs = []
        for seed in range(3):
            prompt = random_prompt(6, seed=seed) * 3  # a repeating prompt: lookup finds drafts
            engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs.append((out.token_ids, [entry.logprob for entry in out.logprobs]))
        return outputs

    eager_engine = Engine(path, config, device="cpu")
    eager = run(eager_engine)
    engine = Engine(path, config, device="cpu")
    graphs = replay_graphs(engine, graph_shapes(4, 4))
    replayed = run(engine)
    for (tokens, logprobs), (ours, our_logprobs) in zip(eager, replayed):
        assert ours == tokens
        assert our_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert sorted(shape.query_len for shape in graphs.graphs if shape.kind == "verify") == [2, 3, 4, 5]
    kinds = {shape.kind for shape in graphs.replays}
    assert kinds == {"verify", "decode"}
    assert engine.speculator.stats.num_drafts == eager_engine.speculator.stats.num_drafts > 0


def test_replayed_batches_verifying_drafts_equal_eager_steps(llama, triton_on_cpu) -> None:  # type: ignore[no-untyped-def]
    """ARRIVALS' requests with drafts every step (their known continuations, every fifth
    token wrong): batches of several sequences with drafts of different lengths replay the
    verification batch shapes, padded by spare sequences, and give the eager engine's
    tokens and logprobs with the same drafts, and plain greedy decoding's tokens."""
    from localserve.engine.speculative import SpeculativeConfig

    from .test_speculative import ScriptedDrafter

    path, _ = llama
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=32)
    plain = run_greedy(Engine(path, config, device="cpu"))
    continuations = {tuple(random_prompt(length, seed=i)): plain[str(i)][0] for i, (length, _, _) in enumerate(ARRIVALS)}
    drafting = dataclasses.replace(config, speculative=SpeculativeConfig(num_tokens=4, adaptive=False))

    def engine_with_drafts() -> Engine:
        engine = Engine(path, drafting, device="cpu")
        engine.speculator.drafter = ScriptedDrafter(continuations, engine.spec.vocab_size)
        return engine

    eager_engine = engine_with_drafts()
    eager = run_greedy(eager_engine)
    engine = engine_with_drafts()
    graphs = replay_graphs(engine, graph_shapes(4, 4))
    replayed = run_greedy(engine)
    assert sorted(replayed) == sorted(eager) == [str(i) for i in range(len(ARRIVALS))]
    for request_id, (tokens, logprobs) in eager.items():
        assert tokens == plain[request_id][0], request_id
        assert replayed[request_id][0] == tokens, request_id
        assert replayed[request_id][1] == pytest.approx(logprobs, abs=1e-4), request_id
    batches = {shape for shape in graphs.replays if shape.kind == "verify batch"}
    assert {GraphShape(4, 12, 5), GraphShape(8, 24, 5)} <= batches, graphs.replays
    assert engine.speculator.stats.num_accepted_tokens == eager_engine.speculator.stats.num_accepted_tokens > 0


def test_a_draft_model_drafts_through_replayed_graphs(llama, triton_on_cpu, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A draft model (the model's first layer) drafting for ARRIVALS' requests with its own
    graphs, captured in the same shapes: its one-token steps (and catch-ups of one token)
    replay the decode buckets, its catch-ups of a kept draft and the token after it the
    verification shapes (prompts run eagerly), and every
    request gets the eager engine's tokens and logprobs, with the same drafts kept."""
    from .test_speculative import draft_config, shallow_copy

    path, hf = llama
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=32,
                          speculative=draft_config(shallow_copy(hf, tmp_path / "draft")))
    eager_engine = Engine(path, config, device="cpu")
    eager = run_greedy(eager_engine)
    engine = Engine(path, config, device="cpu")
    assert engine.drafter is not None
    replay_graphs(engine, graph_shapes(4, 4))
    draft_graphs = engine.drafter.graphs
    assert draft_graphs is not None
    replayed = run_greedy(engine)
    for request_id, (tokens, logprobs) in eager.items():
        assert replayed[request_id][0] == tokens, request_id
        assert replayed[request_id][1] == pytest.approx(logprobs, abs=1e-4), request_id
    kinds = {shape.kind for shape in draft_graphs.replays}
    assert "decode" in kinds and kinds & {"verify", "verify batch"}, draft_graphs.replays
    stats, eager_stats = engine.speculator.stats, eager_engine.speculator.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (eager_stats.num_draft_tokens,
                                                                   eager_stats.num_accepted_tokens)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both verdicts


# -- the capture on a faked card ---------------------------------------------------------


def test_the_fake_capture_refuses_what_cuda_refuses() -> None:
    """The checks the engine's captures pass (test_fake_cuda.py) can fail."""
    with fake_gpu(RTX_4090):
        x = torch.ones(4, device=DEVICE)
        with pytest.raises(CaptureError, match="read back"), torch.cuda.graph(torch.cuda.CUDAGraph()):
            (x * 2).sum().item()
        with pytest.raises(CaptureError, match="host memory"), torch.cuda.graph(torch.cuda.CUDAGraph()):
            x + torch.arange(4).to(DEVICE)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="never captured"):
            graph.replay()
        with torch.cuda.graph(graph):
            y = x * 2 + 1  # device work only: captured
        graph.replay()
    assert graph.replays == 1 and y.shape == (4,)


def test_capture_at_load_reserves_its_memory_and_replays(tiny_models, caplog) -> None:
    path = tiny_models.get("qwen2_moe", torch.float16)[0]
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, gpu_memory_utilization=0.05)
    with fake_gpu(RTX_4090) as gpu, caplog.at_level(logging.INFO, logger="localserve"):
        engine = Engine(path, config, device="cuda:0")
        graphs = engine.runner.graphs
        assert graphs is not None and sorted(graphs.graphs, key=lambda shape: shape.rows) == [
            GraphShape(size, size, 1) for size in (1, 2, 4, 8, 16)]
        assert all(graph.captured for graph, _ in graphs.graphs.values())
        (pool,) = gpu.mode.graph_pools.values()  # one pool, shared by every size
        assert pool > 0
        kept = (pool + sum(out.untyped_storage().nbytes() for _, out in graphs.graphs.values())
                + sum(getattr(graphs.static, f.name).nbytes for f in dataclasses.fields(graphs.static)))
        for i in range(3):
            engine.add_request(list(range(3, 13 + 5 * i)), SamplingParams(max_tokens=5))
        while engine.has_unfinished_requests():
            engine.step()
    with fake_gpu(RTX_4090), caplog.at_level(logging.INFO, logger="localserve"):
        eager = Engine(path, dataclasses.replace(config, disable_cuda_graphs=True), device="cuda:0")
    assert graphs.replays == {GraphShape(4, 4, 1): 4}  # 3 sequences prefilled in one step, then 4 decode steps
    assert "CUDA graphs captured for decode batches of 1 to 16 sequences (5 sizes)" in caplog.text
    assert "CUDA graphs are off: disable_cuda_graphs is set" in caplog.text
    assert eager.runner.graphs is None
    # What the graphs keep (their pool, outputs and static inputs) fits the reserve the
    # KV pool left them: the eager engine's pool is larger by that reserve.
    block_bytes = engine.runner.kv_caches[0].key[0].nbytes * 2 * engine.spec.num_layers
    reserve = (eager.kv.device.num_blocks - engine.kv.device.num_blocks) * block_bytes
    assert kept <= reserve + block_bytes
    assert reserve <= 2 * kept + block_bytes


def test_verification_graphs_are_captured_at_load_and_replayed(tiny_models, caplog) -> None:  # type: ignore[no-untyped-def]
    """With speculative decoding on, the engine also captures the verification shapes
    (one sequence, and batches), under the capture's checks; a request drafting alone
    replays one sequence's, several at once the batches'."""
    from localserve.engine.speculative import SpeculativeConfig

    path = tiny_models.get("llama", torch.bfloat16)[0]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.05,
                          speculative=SpeculativeConfig(num_tokens=2, adaptive=False))
    with fake_gpu(RTX_4090), caplog.at_level(logging.INFO, logger="localserve"):
        engine = Engine(path, config, device="cuda:0")
        graphs = engine.runner.graphs
        assert graphs is not None and sorted(shape.rows for shape in graphs.graphs if shape.kind == "verify") == [2, 3]
        engine.add_request(random_prompt(5, seed=1) * 4, SamplingParams(max_tokens=12, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        alone = engine.speculator.stats.num_drafts
        assert alone > 0
        assert sum(count for shape, count in graphs.replays.items() if shape.kind == "verify") == alone
        for seed in (2, 3, 4):  # several at once: the verification batch shapes
            engine.add_request(random_prompt(4, seed=seed) * 5, SamplingParams(max_tokens=12, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    assert "and for one sequence verifying 1 to 2 draft tokens, and for 2 to 4 sequences verifying drafts" \
        in caplog.text
    assert engine.speculator.stats.num_drafts > alone
    assert any(shape.kind == "verify batch" for shape in graphs.replays), graphs.replays


def test_a_draft_model_on_a_fake_card_warms_up_at_load_and_drafts(tiny_models, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a GPU the draft model's kernels are compiled at load too (its catch-up sizes and
    its one-token steps) and its steps captured in graphs, under the card's rules, and it
    drafts on the device."""
    from localserve.engine.speculative import SpeculativeConfig, draft_model

    path = tiny_models.get("llama", torch.bfloat16)[0]
    warmed: list[list[int]] = []
    real = draft_model.warm_up_model
    monkeypatch.setattr(draft_model, "warm_up_model", lambda *args: warmed.append(args[-1]) or real(*args))
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.05,
                          speculative=SpeculativeConfig(method="draft_model", draft_model=str(path), num_tokens=2,
                                                        adaptive=False))
    with fake_gpu(RTX_4090):
        engine = Engine(path, config, device="cuda:0")
        assert warmed and warmed[0][0] == 1 and warmed[0][-1] == 64
        engine.add_request(random_prompt(9, seed=3), SamplingParams(max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.speculator.stats.num_accepted_tokens > 0  # the model drafting for itself
    assert engine.drafter is not None and engine.drafter.pool.num_used == 0
    # Its steps were captured at load under the card's rules, in the model's pool, and replayed.
    assert engine.drafter.graphs is not None and sum(engine.drafter.graphs.replays.values()) > 0


def test_why_an_engine_runs_eagerly() -> None:
    assert why_eager(EngineConfig(), num_layers=4) is None
    assert why_eager(EngineConfig(disable_cuda_graphs=True), num_layers=4) == "disable_cuda_graphs is set"
    # The torch references take the batch's lengths from host lists, which a graph freezes.
    assert "disable_triton" in why_eager(EngineConfig(disable_triton=True), num_layers=4)
    # Experts in host memory run on the CPU, which a graph cannot capture.
    for cpu_moe in (1, "all"):
        assert "cpu_moe" in why_eager(EngineConfig(cpu_moe=cpu_moe), num_layers=4)


def test_a_capture_out_of_memory_leaves_the_engine_eager(tiny_models, caplog, monkeypatch) -> None:
    path = tiny_models.get("llama", torch.bfloat16)[0]
    real = cuda_graphs.CudaGraphCapture.__call__
    calls = []

    def second_fails(self, forward):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(self, forward)

    monkeypatch.setattr(cuda_graphs.CudaGraphCapture, "__call__", second_fails)
    with fake_gpu(RTX_4090) as gpu, caplog.at_level(logging.INFO, logger="localserve"):
        engine = Engine(path, EngineConfig(max_num_seqs=4, num_kv_blocks=16), device="cuda:0")
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.runner.graphs is None
    assert "capturing them ran out of GPU memory" in caplog.text
    assert gpu.mode.ops["localserve::paged_attention"] > 0
