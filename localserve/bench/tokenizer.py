"""The benchmark's tokenizer: builds prompts of exact lengths and counts output tokens
when a server sends no usage. It is localserve's own (tokenizer.json or GGUF vocab)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LocalserveError
from .config import BenchError

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer

_HINT = "give --tokenizer (a .gguf file, an HF checkpoint folder or a registry name)"


def load_tokenizer(source: str | None) -> Tokenizer:
    """The tokenizer of ``source``: a path, else a registry name (as the CLI resolves
    models). Raises BenchError with what to do when there is none."""
    from ..registry import resolve_model

    if not source:
        raise BenchError(f"no tokenizer: {_HINT}")
    try:
        path = resolve_model(source)
    except LocalserveError as exc:
        raise BenchError(f"no tokenizer for {source!r} ({exc}); {_HINT}") from exc
    tokenizer = _tokenizer_at(path)
    if tokenizer is None:
        raise BenchError(f"{path} has no tokenizer (no tokenizer.json or GGUF vocabulary); {_HINT}")
    return tokenizer


def _tokenizer_at(path: Path) -> Tokenizer | None:
    # The engine's own reader (Checkpoint.tokenizer calls it), so prompts are tokenized as a
    # localserve server tokenizes them; it reads only the tokenizer, so a model another
    # server runs but localserve cannot still has one.
    from ..formats import read_tokenizer

    try:
        return read_tokenizer(path)
    except LocalserveError as exc:
        raise BenchError(f"{path}: cannot read a tokenizer ({exc}); {_HINT}") from exc
