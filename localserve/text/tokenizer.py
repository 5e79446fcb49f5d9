"""Tokenizers (HF tokenizer.json) and incremental detokenization."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from ..errors import LocalserveError
from ..json_files import MAX_JSON_BYTES, read_json

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_GIL_FREE_CHARS = 16_384  # texts longer than this are encoded with the GIL released


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 byte values (GPT-2's scheme):
    printable Latin-1 bytes stand for themselves, the rest map to code points 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 256
    for b in range(256):
        if b not in printable:
            alphabet[chr(extra)] = b
            extra += 1
    return alphabet


# How many tokens before the unread ones are decoded along with them, so that
# context-dependent decoding (SentencePiece's leading space) comes out right.
_CONTEXT_TOKENS = 5


class Tokenizer:
    """Text <-> token ids, with the checkpoint's special-token conventions."""

    def __init__(self, backend: HFTokenizer, config: dict[str, Any]) -> None:
        self.backend = backend
        self.config = config
        self.bos_token_id = self._special_id(config.get("bos_token"))
        self.eos_token_id = self._special_id(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        decoder = backend.decoder
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise LocalserveError(f"{model_dir}: no tokenizer.json; pass token ids instead of text")
        if (size := path.stat().st_size) > MAX_JSON_BYTES:
            raise LocalserveError(f"{path}: {size:,} bytes, over the {MAX_JSON_BYTES:,} a tokenizer may take")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise LocalserveError(f"{path}: cannot be read as a tokenizer ({reason})") from exc
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.exists():
            loaded = read_json(config_path)
            config = loaded if isinstance(loaded, dict) else {}
        return cls(backend, config)

    def _special_id(self, token: Any) -> int | None:
        if isinstance(token, dict):  # {"content": "<s>", ...} in older configs
            token = token.get("content")
        return self.backend.token_to_id(token) if isinstance(token, str) else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS and self.backend.padding is None:
            # encode() holds the GIL throughout (tens of ms for a long prompt, during which
            # the daemon's event loop waits); encode_batch() lets it go. For one text
            # without padding the two give the same ids.
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer_config's add_bos_token is what HF honours even when the
        # tokenizer.json post-processor does not add BOS itself.
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own (what OpenAI's logprobs report):
        SentencePiece's word marker as a space, byte tokens as their byte."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
            return piece.encode()  # an added token written as plain text
        if byte := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(byte[1], 16)])
        return piece.replace("\u2581", " ").encode()


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, one call per new token.

    Decodes a short window of already-emitted tokens together with the new ones and
    emits only the text beyond the window's own decoding; holds text back while it
    ends in an incomplete UTF-8 sequence (U+FFFD), so no half character escapes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)  # first token whose text is not emitted yet
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
