"""A draft model: a smaller model of the served model's vocabulary proposes each request's
next tokens, greedily, in one batch over every drafting request.

It keeps its own paged KV cache (a pool of as many blocks as the served model's, sized
together with it), and per request the tokens whose K/V that cache holds. Each step it
first feeds what the request gained since (its prompt the first time, in chunks within
the step's token budget; then the tokens the last verification kept), which also yields
the first draft token, then runs one decode step per further draft token. Cached K/V of
drafts that were rejected are simply written over: the cache is only ever read up to the
tokens the request shares with what was fed. A request's blocks go when it ends, or when the
pool runs short and it is not drafting (preempted, or resting while its drafts miss).

Drafting greedily makes each proposal a function of the request's tokens, so the
speculator's acceptance rule (speculator.py) keeps the output exact at any temperature.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ...errors import LocalserveError
from ...formats import Checkpoint, open_checkpoint
from ...formats.layout import check_tensors
from ...formats.weights import tensor_sizes, weight_sizes
from ...kernels import KVCache
from ...kernels.dispatch import KernelChoice, using
from ...text.tokenizer import Tokenizer
from ..config import EngineConfig
from ..kv_cache import BlockPool, allocate_kv_tensors, kv_bytes_per_block
from ..loading import load_model
from ..cuda_graphs import Capture, DecodeGraphs, GraphShape
from ..runner import Span, add_padding_rows, attention_metadata, host_tensor, warm_up_model
from ..stats import LoadProgress
from .drafter import DraftQuery

log = logging.getLogger(__name__)

# A tensor of one of the layers (blk.3.attn_q.weight, model.layers.3.mlp.up_proj.weight), not the
# embeddings, head or final norm.
_IN_A_LAYER = re.compile(r"\.\d+\.")

# How far the two vocabularies' sizes may differ (llama.cpp allows the same): checkpoints
# of one tokenizer often pad their embedding tables to different multiples.
VOCAB_SIZE_SLACK = 128


@dataclass(slots=True)
class DraftSequence:
    """One request's state in the draft cache."""

    blocks: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # the tokens whose K/V the cache holds, by position
    confirmed: int = 0  # how many of ``fed`` are known to be the request's own tokens


class DraftModelDrafter:
    """Proposes each query's tokens with the draft model (see the module doc)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], num_blocks: int, block_size: int,
                 device: torch.device, kernels: KernelChoice, vocab_limit: int, token_cost: float,
                 feed_cost: float, step_tokens: int) -> None:
        self.model, self.kv_caches, self.device, self.kernels = model, kv_caches, device, kernels
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.vocab_limit = vocab_limit  # token ids the served model has: drafts stay below
        self.token_cost = token_cost  # a draft token's cost, as a share of one served decode step
        self.feed_cost = feed_cost  # a token taken in: a row of its layers (a chunk's last alone meets the head)
        self.step_tokens = step_tokens  # tokens fed in one step at most (a prompt is caught up in chunks)
        self.sequences: dict[str, DraftSequence] = {}
        self.graphs: DecodeGraphs | None = None  # set once captured (capture_graphs, on CUDA)

    def warm_up(self, token_counts: list[int]) -> None:
        """Compile the kernels of the draft's steps before the first request (on a GPU):
        its catch-up sizes, and its one-token decode steps."""
        warm_up_model(self.model, self.kv_caches, self.block_size, self.device, self.kernels,
                      sorted({1, *token_counts}))

    def capture_graphs(self, shapes: list[GraphShape], max_model_len: int, capture: Capture) -> None:
        """Capture its steps' CUDA graphs in the model's shapes (its one-token steps, and its
        catch-ups of a few tokens a request after a verification; prompts run eagerly)."""
        graphs = DecodeGraphs(self.model, self.kv_caches, shapes, max_model_len, self.block_size, self.device, capture)
        with using(self.kernels), torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    def propose_all(self, queries: list[DraftQuery]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in queries]
        with using(self.kernels), torch.inference_mode():
            reaching, logits = self._catch_up(queries)
            if reaching:
                for index, token in zip(reaching, self._greedy(logits)):
                    drafts[index].append(token)
            self._decode(queries, drafts, reaching)
        return drafts

    def _catch_up(self, queries: list[DraftQuery]) -> tuple[list[int], torch.Tensor | None]:
        """Feed each query's tokens the cache lacks, within the step's budget, in one
        forward: the indices of the queries whose tokens are now all fed, in order, and
        the logits of their last tokens."""
        budget = self.step_tokens
        spans, input_ids, positions, rows, reaching = [], [], [], [], []
        for index, query in enumerate(queries):
            if budget == 0:
                break  # the rest catch up in later steps
            tokens = query.tokens
            length = tokens.shape[0]
            sequence = self.sequences.setdefault(query.request.request_id, DraftSequence())
            valid = sequence.confirmed  # then the fed drafts the request has kept
            while valid < min(len(sequence.fed), length - 1) and sequence.fed[valid] == tokens[valid]:
                valid += 1
            valid = min(valid, length - 1)  # the last token is fed again: its logits give the first draft
            end = min(length, valid + budget)
            if not self._grow(sequence, length + query.count - 1):
                # No room: the requests not drafting now (preempted, or resting) make way.
                self._evict_except({q.request.request_id for q in queries})
                if not self._grow(sequence, length + query.count - 1):
                    continue  # this request does not draft for now
            budget -= end - valid
            del sequence.fed[valid:]
            sequence.fed.extend(tokens[valid:end].tolist())
            sequence.confirmed = end
            spans.append(Span(valid, end, sequence.blocks))
            input_ids.extend(sequence.fed[valid:end])
            positions.extend(range(valid, end))
            if end == length:
                rows.append(len(input_ids) - 1)
                reaching.append(index)
        return reaching, self._forward(input_ids, positions, spans, rows) if spans else None

    def _greedy(self, logits: torch.Tensor | None) -> list[int]:
        assert logits is not None
        return logits[:, :self.vocab_limit].argmax(dim=-1).tolist()

    def _decode(self, queries: list[DraftQuery], drafts: list[list[int]], reaching: list[int]) -> None:
        """One decode step per further draft token, over the queries that want one more."""
        for depth in range(1, max((queries[i].count for i in reaching), default=0)):
            going = [i for i in reaching if queries[i].count > depth]
            spans, input_ids, positions = [], [], []
            for index in going:
                sequence = self.sequences[queries[index].request.request_id]
                position = len(sequence.fed)
                token = drafts[index][-1]
                sequence.fed.append(token)
                spans.append(Span(position, position + 1, sequence.blocks))
                input_ids.append(token)
                positions.append(position)
            logits = self._forward(input_ids, positions, spans, list(range(len(going))))
            for index, token in zip(going, self._greedy(logits)):
                drafts[index].append(token)

    def _forward(self, input_ids: list[int], positions: list[int], spans: list[Span],
                 rows: list[int]) -> torch.Tensor:
        """The logits of ``rows`` after a forward over ``spans``: a captured graph's replay
        where one holds the step (padded as the model's are), else eagerly."""
        shape = self.graphs.padded_shape([span.end - span.start for span in spans]) if self.graphs else None
        padding = (shape.padding(len(spans), len(input_ids)) or []) if shape else []
        add_padding_rows(input_ids, positions, padding)
        ids, places = host_tensor(input_ids, torch.int64, self.device), host_tensor(positions, torch.int64, self.device)
        meta = attention_metadata(spans, self.block_size, self.device, padding)
        if shape is not None and self.graphs is not None:
            hidden = self.graphs.replay(shape, ids, places, meta)
        else:
            hidden = self.model(ids, places, self.kv_caches, meta)
        return self.model.compute_logits(hidden[host_tensor(rows, torch.int64, self.device)])

    def _grow(self, sequence: DraftSequence, positions: int) -> bool:
        """Blocks for ``positions`` positions; False when the pool has too few free."""
        missing = -(-positions // self.block_size) - len(sequence.blocks)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            return False
        sequence.blocks.extend(self.pool.allocate(missing)[0])
        return True

    def _evict_except(self, keep: set[str]) -> None:
        for request_id in [r for r in self.sequences if r not in keep]:
            self.release(request_id)  # a later catch-up refills it

    def catch_up_cost(self, request_id: str, length: int) -> float:
        sequence = self.sequences.get(request_id)
        return (length - (sequence.confirmed if sequence else 0)) * self.feed_cost

    def release(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.pool.free(sequence.blocks)


@dataclass(slots=True)
class DraftModel:
    """A loaded draft model, before its cache is sized (``Engine`` sizes the two pools
    together, then asks for the drafter)."""

    model: torch.nn.Module
    checkpoint: Checkpoint
    kv_dtype: torch.dtype
    vocab_limit: int
    token_cost: float
    feed_cost: float

    def block_bytes(self, block_size: int) -> int:
        return kv_bytes_per_block(self.checkpoint.spec, block_size, self.kv_dtype)

    def drafter(self, num_blocks: int, block_size: int, device: torch.device, kernels: KernelChoice,
                step_tokens: int) -> DraftModelDrafter:
        caches = allocate_kv_tensors(self.checkpoint.spec, num_blocks, block_size, self.kv_dtype, device)
        return DraftModelDrafter(self.model, caches, num_blocks, block_size, device, kernels, self.vocab_limit,
                                 self.token_cost, self.feed_cost, step_tokens)


def load_draft_model(path: str | Path, target: Checkpoint, target_tokenizer: Tokenizer | None,
                     config: EngineConfig, device: torch.device, dtype: torch.dtype, kernels: KernelChoice,
                     context: int, progress: LoadProgress) -> DraftModel:
    """The draft model at ``path``, checked to share ``target``'s vocabulary, loaded on
    ``device`` in ``dtype`` for positions up to ``context``."""
    checkpoint = open_checkpoint(path)
    check_tensors(checkpoint)
    spec = checkpoint.spec
    if spec.pooling is not None:
        raise LocalserveError(f"draft model {path}: an embedding model cannot draft tokens")
    check_vocabulary(path, checkpoint, target, target_tokenizer)
    model = load_model(checkpoint, config, device, dtype, kernels, context, progress, cpu_moe=False)
    # A decode step streams the weights: a draft token costs about its share of the bytes.
    draft_bytes = weight_sizes(checkpoint, dtype).loaded_bytes
    target_bytes = max(weight_sizes(target, dtype).loaded_bytes, 1)
    token_cost = min(1.0, draft_bytes / target_bytes)
    layer_bytes = sum(tensor.loaded_bytes for tensor in tensor_sizes(checkpoint, dtype) if _IN_A_LAYER.search(tensor.name))
    feed_cost = min(token_cost, layer_bytes / target_bytes)
    kv_dtype = config.resolve_kv_cache_dtype(dtype, device, checkpoint.quantized_gguf)
    log.info("draft model %s: %d layers, a draft token about %.0f%% of a decode step's weights", path,
             spec.num_layers, 100 * token_cost)
    return DraftModel(model, checkpoint, kv_dtype, min(spec.vocab_size, target.spec.vocab_size), token_cost,
                      feed_cost)


class DraftSizes(NamedTuple):
    weights: int  # loaded weight bytes
    block_bytes: int  # KV bytes per block
    hidden_size: int  # of its hidden states (what its CUDA graphs' outputs hold per row)


def planned_sizes(config: EngineConfig, dtype: torch.dtype, device: torch.device | None) -> DraftSizes:
    """The sizes of ``config``'s draft model, from its metadata, for a plan before any load
    (``fit``, the daemon's estimate; ``device`` None: a GPU planned for); zeros without one."""
    if config.speculative.draft_model is None:
        return DraftSizes(0, 0, 0)
    draft = open_checkpoint(config.speculative.draft_model)
    kv_dtype = config.resolve_kv_cache_dtype(dtype, device, draft.quantized_gguf)
    return DraftSizes(weight_sizes(draft, dtype).loaded_bytes, kv_bytes_per_block(draft.spec, config.block_size, kv_dtype),
                      draft.spec.hidden_size)


def check_vocabulary(path: str | Path, draft: Checkpoint, target: Checkpoint, target_tokenizer: Tokenizer | None) -> None:
    """The draft's token ids must mean the served model's: the same tokens below the
    smaller of the two sizes, which differ by at most VOCAB_SIZE_SLACK."""
    sizes = draft.spec.vocab_size, target.spec.vocab_size
    if abs(sizes[0] - sizes[1]) > VOCAB_SIZE_SLACK:
        raise LocalserveError(f"draft model {path} has a vocabulary of {sizes[0]:,} tokens, the model "
                              f"{sizes[1]:,}: a draft model needs the same tokenizer")
    draft_tokenizer = draft.tokenizer()
    if (draft_tokenizer is None) != (target_tokenizer is None):
        raise LocalserveError(f"draft model {path}: only one of it and the model has a tokenizer to compare")
    if draft_tokenizer is None or target_tokenizer is None:
        return
    limit = min(sizes)
    ours = {token: i for token, i in draft_tokenizer.backend.get_vocab(with_added_tokens=True).items() if i < limit}
    theirs = {token: i for token, i in target_tokenizer.backend.get_vocab(with_added_tokens=True).items()
              if i < limit}
    if ours != theirs:
        differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:1]
        where = f" (token id {differing[0][1]}: {differing[0][0]!r})" if differing else ""
        raise LocalserveError(f"draft model {path} does not share the model's tokenizer{where}")
