"""The JSON files that come with a model (config.json, the shard index, tokenizer and
generation configs), read with bounds: a size limit before anything is read, UTF-8,
no nesting deeper than Python's parser can take, and one-line errors that name the file
and never quote its bytes."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from .errors import LocalserveError

# A tokenizer_config.json with a large added-tokens table is ~10 MB; configs are a few KB.
MAX_JSON_BYTES = 64 << 20


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The parsed content of ``path``, a regular file of at most ``max_bytes``."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO or device would block or never end
            raise LocalserveError(f"{path}: not a regular file")
        if info.st_size > max_bytes:
            raise LocalserveError(f"{path}: {info.st_size:,} bytes, over the {max_bytes:,} a model's JSON file may take")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise LocalserveError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise LocalserveError(f"{path}: cannot be read ({exc.strerror})") from None
    return parse_json(text, str(path))


def parse_json(text: str, what: str) -> Any:
    """``text`` parsed; ``what`` names it in errors."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LocalserveError(f"{what}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:  # the parser recurses once per level: a file nested ~1,000 deep ends it
        raise LocalserveError(f"{what}: nested too deep to be a model's JSON file") from None


def read_json_object(path: Path, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """``read_json`` of a file that must hold one JSON object."""
    value = read_json(path, max_bytes)
    if not isinstance(value, dict):
        raise LocalserveError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
