"""The benchmark's tokenizer: builds prompts of exact lengths and counts output tokens
when a server sends no usage. It is localserve's own (tokenizer.json or GGUF vocab)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LocalserveError
from .config import BenchError

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

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
    from ..formats import open_checkpoint

    try:
        checkpoint = open_checkpoint(path)
    except LocalserveError:
        # A server may serve a model localserve cannot run (another architecture): its
        # tokenizer is still readable on its own.
        return _tokenizer_only(path)
    try:
        # The engine's own way (Engine.__init__ -> Checkpoint.tokenizer), so the prompts
        # are tokenized exactly as a localserve server tokenizes them.
        return checkpoint.tokenizer()
    finally:
        if checkpoint.gguf is not None:
            checkpoint.gguf.close()


def _tokenizer_only(path: Path) -> Tokenizer | None:
    from ..formats.gguf_file import read_gguf
    from ..gguf_tokenizer import tokenizer_from_gguf_metadata
    from ..tokenizer import Tokenizer

    try:
        if path.is_dir():
            return Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        with read_gguf(path) as gguf:
            if "tokenizer.ggml.model" not in gguf.metadata:
                return None
            return tokenizer_from_gguf_metadata(gguf.metadata)
    except LocalserveError as exc:
        raise BenchError(f"{path}: cannot read a tokenizer ({exc}); {_HINT}") from exc
