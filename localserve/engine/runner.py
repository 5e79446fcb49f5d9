"""Turns a scheduled batch into flat tensors, runs the model once, samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..kernels import AttentionMetadata, KVCache
from ..kernels.dispatch import KernelChoice, using
from .cuda_graphs import DecodeGraphs, GraphShape
from .pooling import finish, fold_chunk
from .request import Request
from .sampling_params import SamplingParams
from .outputs import TokenLogprobs
from .sampler import Sampler, SamplerOutput, SamplingRow, token_logprobs
from .scheduler import ScheduledBatch
from .structured_output import StructuredOutputs, with_forced_tokens


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]; [3, tokens] for M-RoPE rows of a prompt with images (Qwen-VL)
    meta: AttentionMetadata
    # Rows whose logits are computed: first each finishing request's last token (sampled;
    # with draft tokens, that row and theirs), then the prompt positions owed a prompt
    # logprob; None: every row, in order (a decode step where all sample: no index to copy through).
    logits_rows: torch.Tensor | None
    to_sample: list[Request]  # the requests the sampled rows belong to, in order (1 + drafts rows each)
    prompt_requests: list[Request]  # the request of each prompt-logprob row
    prompt_targets: list[int]  # the prompt token each prompt-logprob row predicts
    # Embedding requests' chunks: (request, first row, rows, position of the first row).
    pooled_chunks: list[tuple[Request, int, int, int]]
    # Rows that take an image's embeddings instead of their tokens' (rows, embeddings).
    embeds_at: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[Request]  # the requests that produced a token (their prompt is now fully computed)
    sampler_output: SamplerOutput | None  # for them, in order: 1 + len(draft_token_ids) rows each
    prompt_logprobs: list[tuple[Request, TokenLogprobs]]  # new entries, in position order per request
    embeddings: list[tuple[Request, torch.Tensor]]  # embedding requests whose prompt is done, with their vector


@dataclass(slots=True)
class Span:
    """One sequence's rows in a step: positions ``start`` to ``end`` (exclusive) are written
    to the cache slots its ``block_table`` names, and attend to every position before."""

    start: int
    end: int
    block_table: list[int]
    # Position ranges whose tokens see each other too (an image's in Gemma 3).
    bidirectional: list[tuple[int, int]] = field(default_factory=list)


def attention_metadata(spans: list[Span], block_size: int, device: torch.device,
                       padding: Sequence[int] = ()) -> AttentionMetadata:
    """The attention metadata of a step over ``spans`` (in row order), with padding
    sequences of ``padding`` rows each after them: from position 0, writing no cache slot
    (-1), attending to their own keys' places in block 0."""
    slots: list[int] = []
    query_start, seq_lens, query_lens = [0], [], []
    for span in spans:
        table = span.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(span.start, span.end))
        query_lens.append(span.end - span.start)
        query_start.append(query_start[-1] + query_lens[-1])
        seq_lens.append(span.end)
    bidirectional = {b: span.bidirectional for b, span in enumerate(spans) if span.bidirectional}
    max_blocks = max([len(span.block_table) for span in spans] + [-(-rows // block_size) for rows in padding])
    tables = [span.block_table + [0] * (max_blocks - len(span.block_table)) for span in spans]
    for rows in padding:
        slots.extend([-1] * rows)
        query_start.append(query_start[-1] + rows)
        seq_lens.append(rows)
        query_lens.append(rows)
        tables.append([0] * max_blocks)
    return AttentionMetadata(
        slot_mapping=host_tensor(slots, torch.int64, device),
        query_start_loc=host_tensor(query_start, torch.int32, device),
        seq_lens=host_tensor(seq_lens, torch.int32, device),
        block_tables=host_tensor(tables, torch.int32, device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        bidirectional=bidirectional or None,
    )


def add_padding_rows(input_ids: list[int], positions: list[int], padding: Sequence[int]) -> None:
    """Append the rows of padding sequences of ``padding`` rows each: token 0, from
    position 0 (their metadata: ``attention_metadata``)."""
    for rows in padding:
        input_ids.extend([0] * rows)
        positions.extend(range(rows))


def host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # type: ignore[type-arg]
    """``values`` as a tensor on ``device``. On the CPU without the .to: between a step's
    kernels every torch call runs with cold caches (~40 us where a warm loop takes 3), so
    the step makes as few as it can."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _rope_positions(positions: list[int], rope_rows: list[tuple[int, torch.Tensor]],
                    device: torch.device) -> torch.Tensor:
    """The step's rotary positions: ``[rows]``, or ``[3, rows]`` when a prompt with images
    of an M-RoPE model is in it (every other row's three positions are one)."""
    if not rope_rows:
        return host_tensor(positions, torch.int64, device)
    three = torch.tensor(positions, dtype=torch.int64).expand(3, -1).clone()
    for row, values in rope_rows:
        three[:, row:row + values.shape[1]] = values
    return three if device.type == "cpu" else three.to(device, non_blocking=True)


def prepare_inputs(batch: ScheduledBatch, block_size: int, device: torch.device,
                   pad_to: GraphShape | None = None) -> ModelInputs:
    """The batch as flat tensors on ``device``; with ``pad_to``, grown to that shape by
    padding sequences (token 0, see ``attention_metadata``), never sampled (how a CUDA
    graph's shape takes a smaller batch)."""
    input_ids: list[int] = []
    positions: list[int] = []
    # M-RoPE rows of prompts with images ([3, n] each, Qwen-VL), and the row where each starts.
    rope_rows: list[tuple[int, torch.Tensor]] = []
    spans: list[Span] = []
    rows = 0  # rows before the request's
    sample_rows, to_sample = [], []
    prompt_rows, prompt_requests, prompt_targets = [], [], []
    pooled_chunks = []
    image_rows: list[int] = []
    image_embeds: list[torch.Tensor] = []
    for request, num_new in zip(batch.requests, batch.num_new_tokens):
        start = request.num_computed_tokens
        end = start + num_new
        drafts = request.draft_token_ids  # (a decode's: start is its last token)
        input_ids.extend(request.token_ids[start:end])
        input_ids.extend(drafts[:end - request.num_tokens])
        if request.mrope_positions is not None and start < request.num_prompt_tokens:
            rope_rows.append((rows, request.rope_positions(start, end)))
            positions.extend(range(start, end))  # stand-ins: rope_rows replaces them
        else:  # past an image prompt's end its three positions are one, its index + delta
            positions.extend(range(start + request.position_delta, end + request.position_delta))
        span = Span(start, end, request.block_table)
        for image in request.images:
            first, last = max(start, image.start), min(end, image.end)
            if first < last:
                assert image.embeds is not None, "the step's images are encoded before it runs"
                image_rows.extend(range(rows + first - start, rows + last - start))
                image_embeds.append(image.embeds[first - image.start:last - image.start])
                if image.bidirectional:
                    span.bidirectional.append((image.start, image.end))
        spans.append(span)
        owed_from = request.prompt_logprobs_owed_from  # past any recorded before a recompute
        if owed_from is not None:  # position p predicts prompt token p + 1
            owed = range(max(start, owed_from), min(end, request.num_prompt_tokens - 1))
            prompt_rows.extend(rows + p - start for p in owed)
            prompt_requests.extend([request] * len(owed))
            prompt_targets.extend(request.prompt_token_ids[p + 1] for p in owed)
        if request.pooling is not None:  # an embedding: its hidden states are pooled, nothing sampled
            pooled_chunks.append((request, rows, num_new, start))
        elif end == request.num_tokens + len(drafts):  # the chunk reaches the last token: sample (and verify)
            sample_rows.extend(range(rows + num_new - 1 - len(drafts), rows + num_new))
            to_sample.append(request)
        rows += num_new

    padding: list[int] = []
    if pad_to is not None:
        fitting = pad_to.padding(len(batch.requests), rows)
        if fitting is None or max(batch.num_new_tokens) > pad_to.query_len:
            raise ValueError(f"cannot pad a batch of {len(batch.requests)} sequences (query lengths up to "
                             f"{max(batch.num_new_tokens)}) to {pad_to}")
        padding = fitting
    add_padding_rows(input_ids, positions, padding)
    logits_rows = sample_rows + prompt_rows
    return ModelInputs(
        input_ids=host_tensor(input_ids, torch.int64, device),
        positions=_rope_positions(positions, rope_rows, device),
        meta=attention_metadata(spans, block_size, device, padding),
        logits_rows=None if len(logits_rows) == len(input_ids) and logits_rows == list(range(len(input_ids)))
        else host_tensor(logits_rows, torch.int64, device),
        to_sample=to_sample,
        prompt_requests=prompt_requests,
        prompt_targets=prompt_targets,
        pooled_chunks=pooled_chunks,
        embeds_at=(host_tensor(image_rows, torch.int64, device), torch.cat(image_embeds)) if image_rows else None,
    )


def scratch_prefill(num_tokens: int, block_table: list[int], block_size: int, device: torch.device) -> ModelInputs:
    """The inputs of one sequence's prefill of ``num_tokens`` tokens (all id 0) over
    ``block_table``: a step to measure or warm up with, no request behind it."""
    request = Request("scratch", [0] * num_tokens, SamplingParams(), frozenset())
    request.block_table = block_table
    batch = ScheduledBatch()
    batch.add(request, num_tokens)
    return prepare_inputs(batch, block_size, device)


def warm_up_model(model: torch.nn.Module, kv_caches: list[KVCache], block_size: int, device: torch.device,
            kernels: KernelChoice, token_counts: list[int]) -> None:
    """Run a one-sequence step of each size, so the kernels they need are compiled before
    the first request. Its keys land in block 0, free at load."""
    with using(kernels), torch.inference_mode():
        for num_tokens in token_counts:
            inputs = scratch_prefill(num_tokens, [0] * -(-num_tokens // block_size), block_size, device)
            model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta)


def warmup_token_counts(step_tokens: int) -> list[int]:
    """Step sizes whose forwards compile the Triton kernel variants steps need: the
    quantized GEMMs tile rows by 16, 32 or 64 as the step grows, and Triton compiles a
    kernel apart for a row count divisible by 16; one size of each kind, and the largest
    step. (Decode sizes are compiled by the CUDA graphs' capture.)"""
    return sorted({count for count in (15, 16, 31, 32, 63, 64) if count < step_tokens} | {step_tokens})


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        kernels: KernelChoice = KernelChoice(),
    ) -> None:
        self.model = model
        self.kernels = kernels
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None  # set once captured (on CUDA)
        self.structured: StructuredOutputs | None = None  # set by the engine when the model has a tokenizer

    def warm_up(self, token_counts: list[int]) -> None:
        warm_up_model(self.model, self.kv_caches, self.block_size, self.device, self.kernels, token_counts)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run one step: the model over the batch, then one logits pass for the rows that
        are sampled and the prompt positions owed a prompt logprob; on the engine's kernels."""
        with using(self.kernels):
            return self._execute(batch)

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch) -> RunnerOutput:
        shape = self.graphs.padded_shape(batch.num_new_tokens) if self.graphs else None
        inputs = prepare_inputs(batch, self.block_size, self.device, pad_to=shape)
        if shape is not None and (inputs.embeds_at is not None or inputs.positions.dim() == 2):
            # A graph's forward takes token ids and one position per row: image rows run eagerly.
            shape = None
            inputs = prepare_inputs(batch, self.block_size, self.device)
        # A request verifying draft tokens samples each of its 1 + k positions as a plain
        # decode of that position would: its rows come one after another.
        row_requests = [(r, j) for r in inputs.to_sample for j in range(1 + len(r.draft_token_ids))]
        # Structured outputs' masks are worked out on another thread while the model runs.
        masks = self.structured.masks([(r.active_constraint, r.draft_token_ids) for r in inputs.to_sample]) \
            if self.structured else None
        if shape is not None:
            hidden = self.graphs.replay(shape, inputs.input_ids, inputs.positions, inputs.meta)  # type: ignore[union-attr]
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                embeds_at=inputs.embeds_at)
        embeddings = self._pool(hidden, inputs.pooled_chunks)
        if not inputs.to_sample and not inputs.prompt_requests:
            return RunnerOutput([], None, [], embeddings)
        logits = self.model.compute_logits(hidden if inputs.logits_rows is None else hidden[inputs.logits_rows])
        num_sampled = len(row_requests)
        prompt_logprobs: list[tuple[Request, TokenLogprobs]] = []
        if inputs.prompt_requests:
            found = token_logprobs(logits[num_sampled:], inputs.prompt_targets,
                                   [r.params.prompt_logprobs or 0 for r in inputs.prompt_requests])
            prompt_logprobs = list(zip(inputs.prompt_requests, found))
        sampler_output = None
        if inputs.to_sample:
            rows = [
                SamplingRow(
                    params=r.params,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=r.output_token_ids + r.draft_token_ids[:j],  # drafts before this position
                    generator=r.generator,
                    eos_token_ids=r.eos_token_ids,
                )
                for r, j in row_requests
            ]
            grammar_masks = masks.result() if masks else None
            forced = {i: r.forced_token_ids[0] for i, (r, j) in enumerate(row_requests) if r.forced_token_ids}
            if forced:
                grammar_masks = with_forced_tokens(grammar_masks, forced, logits.shape[1])
            sampler_output = self.sampler(logits[:num_sampled], rows, grammar_masks)
        return RunnerOutput(inputs.to_sample, sampler_output, prompt_logprobs, embeddings)

    @staticmethod
    def _pool(hidden: torch.Tensor, chunks: list[tuple[Request, int, int, int]]) -> list[tuple[Request, torch.Tensor]]:
        """Fold each embedding request's chunk into its pooled state; the vectors of
        those whose prompt this step finished."""
        done = []
        for request, first_row, rows, start in chunks:
            assert request.pooling is not None and request.pooling_method is not None
            reaches_end = start + rows == request.num_tokens
            request.pooled = fold_chunk(request.pooling_method, request.pooled, hidden[first_row:first_row + rows],
                                        start, reaches_end)
            if reaches_end:
                assert request.pooled is not None
                done.append((request, finish(request.pooling_method, request.pooled, request.num_tokens,
                                             request.pooling)))
        return done
