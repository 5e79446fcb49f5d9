"""The benchmark's tokenizer: builds prompts of exact lengths and counts output tokens
when a server sends no usage.

Where it comes from (``find_tokenizer``): ``--tokenizer`` when given; else ``--model`` (or
the served name) as a local path or registry name, read by localserve's own code
(tokenizer.json or GGUF vocab); else the server's own, through its ``/tokenize`` and
``/detokenize`` routes (localserve's and vLLM's), so a model the daemon serves from
``--model NAME=PATH`` needs nothing more. ``ServerTokenizer`` keeps that cheap: every call
carries a whole text or token list, results are cached, and the vocabulary's plain-text
pieces are read in a few calls of thousands of tokens each, not one call per token.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import numpy as np

from ..errors import LocalserveError
from .config import BenchError

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer

_HINT = "give --tokenizer (a .gguf file, an HF checkpoint folder or a registry name)"
# A token id past any vocabulary: localserve refuses it naming the vocabulary's size.
_PAST_ANY_VOCAB = (1 << 31) - 1
_VOCAB_SIZE_ERROR = re.compile(r"in \[0, (\d+)\)")
_LARGEST_VOCAB = 1 << 24  # a search for the size gives up beyond this
# Markers put between tokens to read many tokens' texts from one /detokenize call:
# control characters no plain-text token holds (so no plain token is lost to a split),
# then rarer printable ones for tokenizers that cannot spell control characters.
_MARKERS = ("\x1f", "\x1e", "\x1d", "\x1c", "\x07", "\u00a6", "\u00a7", "|")
_VOCAB_CHUNK = 16384  # tokens per /detokenize call when reading the vocabulary
_CACHE_ENTRIES = 256  # recent encodes and decodes kept (a prompt is decoded, then re-encoded)


class BenchTokenizer(Protocol):
    """What the benchmark needs of a tokenizer (localserve's Tokenizer or ServerTokenizer)."""

    eos_token_id: int | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def is_plain_text(text: str) -> bool:
    """A token's text that is whole printable text on its own: not only whitespace, no
    U+FFFD (a lone UTF-8 continuation byte), no control characters but space, newline, tab."""
    return bool(text.strip()) and "\ufffd" not in text and all(c.isprintable() or c in " \n\t" for c in text)


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


def find_tokenizer(explicit: str | None, local_name: str | None, url: str, served_name: str,
                   headers: dict[str, str] | None = None) -> Tokenizer | ServerTokenizer:
    """``explicit`` (--tokenizer) when given, and nothing else; else ``local_name`` as a
    local path or registry name; else the server's at ``url`` for the model it serves as
    ``served_name`` (``headers``: the API key). Raises BenchError naming both misses."""
    if explicit:
        return load_tokenizer(explicit)
    try:
        return load_tokenizer(local_name or served_name)
    except BenchError as exc:
        local_miss = str(exc).removesuffix(f"; {_HINT}")
    server = ServerTokenizer(url, served_name, headers)
    try:
        server.encode("hello")  # one call: does the server tokenize for this model at all?
    except BenchError as exc:
        server.close()
        raise BenchError(f"{local_miss}, and the server's tokenizer is not available ({exc}); {_HINT}") from None
    return server


def _tokenizer_at(path: Path) -> Tokenizer | None:
    # The engine's own reader (Checkpoint.tokenizer calls it), so prompts are tokenized as a
    # localserve server tokenizes them; it reads only the tokenizer, so a model another
    # server runs but localserve cannot still has one.
    from ..formats import read_tokenizer

    try:
        return read_tokenizer(path)
    except LocalserveError as exc:
        raise BenchError(f"{path}: cannot read a tokenizer ({exc}); {_HINT}") from exc


class ServerTokenizer:
    """A server's tokenizer for one model, through ``POST /tokenize`` ({"model", "prompt",
    "add_special_tokens"} -> {"tokens", ...}) and ``POST /detokenize`` ({"model", "tokens"}
    -> {"prompt"}), as localserve and vLLM serve them. Synchronous (the benchmark builds
    its prompts before the load starts, and counts outputs after it ends); ``calls``
    counts the HTTP requests made. The server decodes without special tokens, and its
    BOS/EOS ids are not known here (None)."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __init__(self, url: str, model: str, headers: dict[str, str] | None = None, timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.calls = 0
        self._http = httpx.Client(base_url=self.url, headers=headers or {}, timeout=timeout, transport=transport)
        self._encoded: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._decoded: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._vocab_size: int | None = None
        self._plain: np.ndarray | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServerTokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        ids = self._encoded.get(key)
        if ids is None:
            data = self._json("/tokenize", {"model": self.model, "prompt": text,
                                            "add_special_tokens": add_special_tokens})
            tokens = data.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise BenchError(f"{self.url}/tokenize did not answer with a list of token ids")
            ids = tokens
            _remember(self._encoded, key, ids)
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not ids:
            return ""
        key = tuple(ids)
        text = self._decoded.get(key)
        if text is None:
            text = self._detokenize(list(ids))
            _remember(self._decoded, key, text)
        return text

    def _detokenize(self, ids: list[int]) -> str:
        text = self._json("/detokenize", {"model": self.model, "tokens": ids}).get("prompt")
        if not isinstance(text, str):
            raise BenchError(f"{self.url}/detokenize did not answer with a text")
        return text

    # -- the vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = self._find_vocab_size()
        return self._vocab_size

    def _find_vocab_size(self) -> int:
        # localserve names its size when refusing an id past it; any other server is asked
        # whether an id decodes, doubling then halving (some 50 calls for 2**24).
        response = self._post("/detokenize", {"model": self.model, "tokens": [_PAST_ANY_VOCAB]})
        if response.status_code != 200 and (match := _VOCAB_SIZE_ERROR.search(response.text)):
            return int(match[1])

        def decodes(token: int) -> bool:
            return self._post("/detokenize", {"model": self.model, "tokens": [token]}).status_code == 200

        if not decodes(0):
            raise BenchError(f"{self.url}/detokenize refuses token 0 of {self.model!r}; {_HINT}")
        low, high = 0, 1  # decodes(low), and high is the first power of two tried that may not
        while decodes(high):
            low, high = high, high * 2
            if high > _LARGEST_VOCAB:
                raise BenchError(f"{self.url}/detokenize takes any token id: cannot tell the vocabulary; {_HINT}")
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if decodes(middle) else (low, middle)
        return high

    def plain_text_token_ids(self) -> np.ndarray:
        """The ids whose text is whole printable text on its own (``is_plain_text``), as
        datasets.allowed_token_ids finds them in a local tokenizer's vocabulary: each
        token is decoded between markers, thousands to a call, and the text split."""
        if self._plain is None:
            marker, separator = self._separator()
            size = self.vocab_size
            # The separator's own tokens (the marker's among them) are read one by one.
            own = sorted(set(separator))
            allowed = [token for token in own if token < size and is_plain_text(self._detokenize([token]))]
            for start in range(0, size, _VOCAB_CHUNK):
                chunk = [token for token in range(start, min(start + _VOCAB_CHUNK, size)) if token not in own]
                allowed += self._plain_among(chunk, marker, separator)
            allowed.sort()
            if not allowed:
                raise BenchError("the server's tokenizer has no plain-text tokens to build random prompts from")
            self._plain = np.asarray(allowed, dtype=np.int64)
        return self._plain

    def _separator(self) -> tuple[str, list[int]]:
        # The marker between spaces, so that a byte token next to it does not run into it
        # (SentencePiece's byte fallback decodes runs of byte tokens together), and only
        # whitespace, which never changes is_plain_text's answer, joins each token's text.
        for marker in _MARKERS:
            separator = self.encode(f" {marker} ", add_special_tokens=False)
            if separator and self._detokenize(separator * 3).count(marker) == 3:
                return marker, separator
        raise BenchError(f"cannot read {self.model!r}'s vocabulary through {self.url}/detokenize; {_HINT}")

    def _plain_among(self, ids: list[int], marker: str, separator: list[int]) -> list[int]:
        if not ids:
            return []
        tokens = list(separator)
        for token in ids:
            tokens += [token, *separator]
        parts = self._detokenize(tokens).split(marker)
        if len(parts) == len(ids) + 2:
            return [token for token, text in zip(ids, parts[1:-1]) if is_plain_text(text)]
        # A token holding the marker itself (or merging with it) shifts the split: halve
        # until it is alone, and leave it out.
        if len(ids) == 1:
            return []
        half = len(ids) // 2
        return self._plain_among(ids[:half], marker, separator) + self._plain_among(ids[half:], marker, separator)

    # -- HTTP -----------------------------------------------------------------------------------

    def _post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        self.calls += 1
        try:
            return self._http.post(route, json=body)
        except httpx.HTTPError as exc:
            raise BenchError(f"{self.url}{route}: {str(exc) or type(exc).__name__}") from exc

    def _json(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        from .client import http_error

        response = self._post(route, body)
        if response.status_code != 200:
            raise BenchError(f"{self.url}{route} answered {http_error(response)}")
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise BenchError(f"{self.url}{route} did not answer with a JSON object")
        return data


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    cache[key] = value
    if len(cache) > _CACHE_ENTRIES:
        cache.popitem(last=False)
