"""Where a prompt's images go, without torch (the daemon lays out chat prompts with it;
the engine checks a prompt it is given with it).

The chat template writes a marker where each image goes (Gemma 3: ``<start_of_image>``).
In a text prompt each marker becomes what the processor makes of it: for Gemma 3,
``"\\n\\n<start_of_image>"``, ``tokens_per_image`` image tokens and ``"<end_of_image>\\n\\n"``.
A token-id prompt either holds the images' runs of image tokens already (as the daemon
sends them) or a marker id per image, followed here by the image tokens and the end token.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import LocalserveError
from ..text.tokenizer import Tokenizer
from .config import Gemma3ImageConfig
from .image_input import ImageInput, check_image_count, image_from_base64


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
    return placement.expand_text(text, len(images)) if placement is not None and images else text


class ImagePlacement:
    def __init__(self, config: Gemma3ImageConfig, tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    def marker(self) -> str:
        """The text a chat template writes where an image goes."""
        return self._token_text(self.config.boi_token_id)

    def expand_text(self, text: str, count: int) -> str:
        """A text prompt with its ``count`` image markers expanded as the processor does."""
        marker = self.marker()
        _check_markers(text.count(marker), count, marker)
        config = self.config
        expansion = (f"\n\n{marker}{self._token_text(config.image_token_id) * self.tokens_per_image}"
                     f"{self._token_text(config.eoi_token_id)}\n\n")
        return text.replace(marker, expansion)

    def place(self, prompt: str | list[int], count: int) -> tuple[list[int], list[int]]:
        """The prompt's token ids with ``count`` images laid out, and where each image's
        tokens start."""
        config = self.config
        if isinstance(prompt, str):
            assert self.tokenizer is not None  # expand_text needed it
            ids = self.tokenizer.encode(self.expand_text(prompt, count))
        elif _runs(prompt, config.image_token_id, self.tokens_per_image):
            ids = list(prompt)  # laid out already
        else:
            _check_markers(prompt.count(config.boi_token_id), count, f"token {config.boi_token_id}")
            image = [config.image_token_id] * self.tokens_per_image + [config.eoi_token_id]
            ids = []
            for token in prompt:
                ids.append(token)
                if token == config.boi_token_id:
                    ids.extend(image)
        starts = _runs(ids, config.image_token_id, self.tokens_per_image)
        if len(starts) != count:
            raise LocalserveError(f"the prompt holds {len(starts)} image places for {count} images")
        return ids, starts

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


def _runs(ids: list[int], token: int, length: int) -> list[int]:
    """The starts of the runs of ``token`` in ``ids``; each must be ``length`` long."""
    starts = []
    position = 0
    while position < len(ids):
        if ids[position] != token:
            position += 1
            continue
        start = position
        while position < len(ids) and ids[position] == token:
            position += 1
        if position - start != length:
            raise LocalserveError(f"the prompt holds {position - start} image tokens in a row where an image "
                                  f"takes {length}")
        starts.append(start)
    return starts
