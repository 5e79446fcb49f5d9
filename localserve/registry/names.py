"""Model names: ``name[:tag]``, checked before they touch the disk.

A name is one or two lowercase path-safe components (``qwen2.5-0.5b-instruct``,
``team/llama``); a tag one more (``q4_k_m``, ``latest``). Nothing that could climb
out of the store (``..``, separators beyond the one namespace slash, absolute paths,
control characters) gets through.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from ..errors import LocalserveError

DEFAULT_TAG = "latest"
MAX_NAME_LENGTH = 300  # characters of a whole namespace/name:tag
_COMPONENT = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")


@dataclass(frozen=True, slots=True)
class ModelName:
    name: str
    tag: str = DEFAULT_TAG

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}"


def _check_component(part: str, what: str, text: str) -> None:
    if not _COMPONENT.fullmatch(part) or ".." in part:
        raise LocalserveError(
            f"{text!r} is not a valid model {what}: use lowercase letters, digits, '.', '-' and '_' "
            "(e.g. qwen2.5-0.5b-instruct:q4_k_m)")


def parse_name(text: str) -> ModelName:
    """``name[:tag]`` (case-insensitive; the tag defaults to ``latest``)."""
    if not isinstance(text, str):
        raise LocalserveError("a model name must be a short string like name:tag")
    if len(text) > MAX_NAME_LENGTH:
        raise LocalserveError(f"{text[:40]!r}... is not a valid model name: {len(text):,} characters, more than "
                              f"{MAX_NAME_LENGTH}")
    if any(unicodedata.category(char) == "Cc" for char in text):
        # Refused, not stripped: 'x\n' must not quietly become x:latest.
        raise LocalserveError(f"{text!r} is not a valid model name: it holds a control character")
    lowered = text.strip().lower()
    name, sep, tag = lowered.partition(":")
    parts = name.split("/")
    if len(parts) > 2:
        raise LocalserveError(f"{text!r} is not a valid model name: at most one '/' (namespace/name)")
    for part in parts:
        _check_component(part, "name", text)
    if sep:
        _check_component(tag, "tag", text)
    return ModelName(name, tag if sep else DEFAULT_TAG)
