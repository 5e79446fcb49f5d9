"""Where a prompt's images go, without torch (the daemon lays out chat prompts with it;
the engine checks a prompt it is given with it).

The chat template writes a marker where each image goes, and the model's processor turns
each marker into the image's run of image tokens, as many as the image has (its
``ImageLayout``):

- Gemma 3: the marker ``<start_of_image>`` stays, with ``"\\n\\n"`` before it, then the
  image's 256 ``<image_soft_token>`` and ``"<end_of_image>\\n\\n"``;
- Qwen2.5-VL: the marker ``<|image_pad|>`` (between ``<|vision_start|>`` and
  ``<|vision_end|>``, which the template writes) becomes the image's run of
  ``<|image_pad|>``, one per merged patch, so as many as its size makes.

A token-id prompt either holds the images' runs of image tokens already (as the daemon
sends them) or a marker id per image, laid out here the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import LocalserveError
from ..text.tokenizer import Tokenizer
from .image_input import ImageInput, check_image_count, image_from_base64


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """How a family's processor lays one image out where its marker is."""

    marker_id: int  # what the chat template writes where an image goes
    image_token_id: int  # each of the image's tokens (their embeddings come from the encoder)
    keep_marker: bool  # the marker stays before the image's tokens (Gemma 3), or they replace it (Qwen)
    end_id: int | None = None  # a token after the image's tokens (Gemma 3's <end_of_image>)
    around: str = ""  # text the processor puts before and after (Gemma 3: "\n\n")


def images_for(placement: ImagePlacement | None, sources: Sequence[str], model: str) -> list[ImageInput]:
    """A chat's images (data URLs or base64, chat/messages.image_sources) decoded for a
    model that reads images (``placement``); refused, before any is decoded, for one that
    does not or when there are too many."""
    if not sources:
        return []
    if placement is None:
        raise LocalserveError(f"{model} does not read images (its checkpoint has no vision tower)")
    check_image_count(len(sources))
    return [image_from_base64(source) for source in sources]


def lay_out(placement: ImagePlacement | None, text: str, images: Sequence[ImageInput]) -> str:
    """A rendered chat prompt with its images' markers laid out as the model's processor
    does (``images`` came from ``images_for``, so a placement exists when there are any)."""
    return placement.expand_text(text, images) if placement is not None and images else text


class ImagePlacement:
    def __init__(self, layout: ImageLayout, tokens_for: Callable[[ImageInput], int],
                 tokenizer: Tokenizer | None) -> None:
        self.layout = layout
        self.tokens_for = tokens_for  # how many image tokens an image becomes
        self.tokenizer = tokenizer

    def marker(self) -> str:
        """The text a chat template writes where an image goes."""
        return self._token_text(self.layout.marker_id)

    def expand_text(self, text: str, images: Sequence[ImageInput]) -> str:
        """A text prompt with its images' markers expanded as the processor does."""
        marker = self.marker()
        pieces = text.split(marker)
        _check_markers(len(pieces) - 1, len(images), marker)
        image_text = self._token_text(self.layout.image_token_id)
        end = self._token_text(self.layout.end_id) if self.layout.end_id is not None else ""
        around = self.layout.around
        out = [pieces[0]]
        for image, piece in zip(images, pieces[1:]):
            out.append(f"{around}{marker if self.layout.keep_marker else ''}{image_text * self.tokens_for(image)}"
                       f"{end}{around}{piece}")
        return "".join(out)

    def place(self, prompt: str | list[int], images: Sequence[ImageInput]) -> tuple[list[int], list[int]]:
        """The prompt's token ids with its images laid out, and where each image's tokens
        start."""
        layout = self.layout
        lengths = [self.tokens_for(image) for image in images]
        if isinstance(prompt, str):
            assert self.tokenizer is not None  # expand_text needed it
            ids = self.tokenizer.encode(self.expand_text(prompt, images))
        elif _laid_out(prompt, layout.image_token_id, lengths):
            ids = list(prompt)
        else:
            _check_markers(prompt.count(layout.marker_id), len(images), f"token {layout.marker_id}")
            ids, lengths_left = [], iter(lengths)
            for token in prompt:
                if token != layout.marker_id:
                    ids.append(token)
                    continue
                if layout.keep_marker:
                    ids.append(token)
                ids.extend([layout.image_token_id] * next(lengths_left))
                if layout.end_id is not None:
                    ids.append(layout.end_id)
        starts = _runs(ids, layout.image_token_id)
        if [length for _, length in starts] != lengths:
            raise LocalserveError(f"the prompt holds image places of {[length for _, length in starts]} tokens for "
                                  f"images of {lengths}")
        return ids, [start for start, _ in starts]

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            raise LocalserveError("this model has no tokenizer; pass token ids")
        text = self.tokenizer.backend.id_to_token(token_id)
        if text is None:
            raise LocalserveError(f"the tokenizer lacks the model's image token {token_id}")
        return text


def _check_markers(found: int, images: int, marker: str) -> None:
    if found != images:
        raise LocalserveError(f"the prompt has {found} image markers ({marker}) for {images} images: "
                              "put one where each image goes (the chat template does)")


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token`` in ``ids``."""
    runs = []
    position = 0
    while position < len(ids):
        if ids[position] != token:
            position += 1
            continue
        start = position
        while position < len(ids) and ids[position] == token:
            position += 1
        runs.append((start, position - start))
    return runs


def _laid_out(ids: list[int], token: int, lengths: list[int]) -> bool:
    """The prompt holds the images' runs of image tokens already (as the daemon sends it)."""
    runs = [length for _, length in _runs(ids, token)]
    return bool(runs) and runs == lengths and any(length > 1 for length in lengths)
