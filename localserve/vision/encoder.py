"""The engine's one way into images: where a request's images sit in its prompt, their
encoding (batched, once per image: an LRU cache keyed by the image's hash) before the
step whose prefill chunk reaches them, and the rule that keeps a bidirectional image
whole within one chunk.

The engine calls ``place`` when a request arrives, ``fit_chunk`` when the scheduler cuts a
prefill chunk and ``encode_step`` before a step runs; the runner reads the spans'
embeddings into the model's input rows (``image_rows``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..text.tokenizer import Tokenizer
from .footprint import BATCH_PATCHES, batches, encoder_activation_bytes
from .image_input import ImageInput, ImageLimits, check_image_count
from .placement import ImagePlacement

if TYPE_CHECKING:
    from .gemma3 import Gemma3Vision
    from .qwen3_vl import Qwen3VisionTransformer
    from .qwen_vl import QwenVisionTransformer

    # Each has config, bidirectional and encode_images.
    VisionModel = Gemma3Vision | QwenVisionTransformer | Qwen3VisionTransformer

# Encoded images kept for reuse (a chat resends its images every turn): their bytes at most.
DEFAULT_CACHE_BYTES = 256 << 20


@dataclass(slots=True, eq=False)
class ImageSpan:
    """One image in a prompt: its tokens are positions ``start`` to ``start + length``."""

    start: int
    length: int
    image: ImageInput
    bidirectional: bool  # its tokens see each other (Gemma 3): one prefill chunk must hold them all
    # [length, parts, text hidden] while the prefill needs them: part 0 replaces the image
    # tokens' embeddings; part i > 0 is added to their hidden states after the text model's
    # layer i - 1 (Qwen3-VL's deepstack features).
    embeds: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.length


class ImageEncoder:
    def __init__(self, model: VisionModel, tokenizer: Tokenizer | None, vocab_size: int, device: torch.device,
                 limits: ImageLimits = ImageLimits(), cache_bytes: int = DEFAULT_CACHE_BYTES,
                 batch_patches: int = BATCH_PATCHES) -> None:
        self.model = model
        self.batch_patches = batch_patches  # the most patches one encoder batch holds (footprint.py)
        self.placement = ImagePlacement(model.config.layout(), model.config.tokens_for, tokenizer)
        self.vocab_size = vocab_size
        self.device = device
        self.limits = limits
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cached_bytes = 0
        self.num_encoded = 0  # images run through the encoder (not served from the cache)

    def activation_bytes(self) -> int:
        """An encoder batch's activations at their peak, estimated (footprint.py)."""
        return encoder_activation_bytes(self.model.config, next(self.model.parameters()).dtype, self.batch_patches)

    # -- a request arrives -------------------------------------------------------------

    def place(self, prompt: str | list[int], images: Sequence[ImageInput]) -> tuple[list[int], list[ImageSpan]]:
        """The prompt's token ids with each image's tokens in place (placement.py), and
        where each image's tokens are."""
        check_image_count(len(images), self.limits)
        ids, starts = self.placement.place(prompt, images)
        spans = [ImageSpan(start, self.placement.tokens_for(image), image, self.model.bidirectional)
                 for start, image in zip(starts, images)]
        return ids, spans

    def prompt_ids(self, ids: list[int]) -> list[int]:
        """The ids the model looks up: an image token past the embedding table (some
        configs place it there) looks up token 0, as transformers does; the image's
        embeddings replace it anyway."""
        image_token = self.placement.layout.image_token_id
        return [0 if token == image_token else token for token in ids] if image_token >= self.vocab_size else ids

    def rope_positions(self, ids: list[int], spans: Sequence[ImageSpan]) -> tuple[torch.Tensor, int]:
        """Qwen-VL's M-RoPE positions of a laid-out prompt (``[3, len(ids)]``) and the delta
        of the positions past it over their index (vision/mrope.py)."""
        from .mrope import mrope_positions

        config = self.model.config
        assert hasattr(config, "grid"), "M-RoPE positions for a model whose images have no grid"
        return mrope_positions(ids, config.image_token_id, [config.grid(span.image) for span in spans],
                               config.spatial_merge_size)

    # -- scheduling --------------------------------------------------------------------

    @staticmethod
    def fit_chunk(spans: Sequence[ImageSpan], start: int, num_new: int) -> int:
        """``num_new`` tokens from ``start``, cut back to before an image whose tokens must
        see each other and would be split; an image that starts the chunk is taken whole
        (over the step's budget, when the budget is smaller than an image)."""
        end = start + num_new
        for span in spans:
            if span.bidirectional and span.start < end < span.end:
                return span.start - start if span.start > start else span.end - start
        return num_new

    # -- a step ------------------------------------------------------------------------

    def encode_step(self, chunks: Sequence[tuple[Sequence[ImageSpan], int, int]]) -> None:
        """Embeddings for every image a step's prefill chunks (spans, start, end) reach,
        those not cached encoded in batches of at most ``batch_patches`` patches; the
        embeddings of images a chunk has passed are dropped (the cache keeps its copy)."""
        wanted: dict[bytes, list[ImageSpan]] = {}
        for spans, start, end in chunks:
            for span in spans:
                if span.end <= start:
                    span.embeds = None
                elif span.start < end and span.embeds is None:
                    cached = self._cache.get(span.image.digest)
                    if cached is not None:
                        self._cache.move_to_end(span.image.digest)
                        span.embeds = cached
                    else:
                        wanted.setdefault(span.image.digest, []).append(span)
        if not wanted:
            return
        images = [spans[0].image for spans in wanted.values()]
        encoded: list[torch.Tensor] = []
        with torch.inference_mode():
            for batch in batches(images, self.model.config.patches_for, self.batch_patches):
                encoded.extend(self.model.encode_images(batch))
        self.num_encoded += len(images)
        for digest, rows in zip(wanted, encoded):
            rows = rows.clone()  # its own storage: the cache may keep it while it drops the batch's others
            for span in wanted[digest]:
                span.embeds = rows
            self._remember(digest, rows)

    def _remember(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.cache_bytes:
            return
        self._cache[digest] = rows
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= dropped.numel() * dropped.element_size()

