"""Every llama.cpp pre-tokenizer localserve knows must split text as llama.cpp does.

The oracle is llama.cpp itself (llama-cpp-python): for each `tokenizer.ggml.pre` name in
localserve's table, a vocab-only GGUF carrying that name is loaded by llama.cpp, and its token
ids for a fixed fuzz set of strings must equal ours built from the same metadata. Byte-level
names get GPT-2's vocabulary and merges plus a few tokens no merge reaches, so that
`ignore_merges` shows; the raw UTF-8 names get Mistral's SentencePiece-style BPE vocabulary.
"""

from __future__ import annotations

import json
import logging
import random
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from localserve.text.gguf_pre_tokenizers import PRE_TOKENIZERS, UNSUPPORTED
from localserve.text.gguf_tokenizer import tokenizer_from_gguf_metadata
from localserve.text.tokenizer import Tokenizer

from .test_gguf_tokenizer import TOKENIZERS, _metadata

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

LOGGER = "localserve.text.gguf_pre_tokenizers"
BYTE_LEVEL = [name for spec in PRE_TOKENIZERS if spec.byte_encode for name in spec.names]
RAW_UTF8 = [name for spec in PRE_TOKENIZERS if not spec.byte_encode for name in spec.names]
# Tokens BPE cannot reach from GPT-2's merges: a pre-tokenizer with ignore_merges takes a piece
# spelling one of them whole, the others spell it in pieces.
UNMERGED = ["Ġxyzzy", "xyzzy", "Ġplugh", "plugh"]
# gguf-py writes each file's pre name as this placeholder, then the name replaces it (below).
PLACEHOLDER = "@@pre-tokenizer-placeholder@@"

WORDS = [
    "hello", "World", "the", "HTTPServer", "camelCase", "iPhone", "eBay", "McDonald", "XMLHttpRequest",
    "naïve", "café", "Ærø", "straße", "İstanbul", "ñandú", "e\u0301", "ǅ", "x²", "½", "Ⅻ",
    "\u212a", "\u2126", "\u1fbe",  # Kelvin, Ohm, prosgegrammeni: letters NFC would replace
    "Ελληνικά", "русский", "Привет", "مرحبا", "שלום", "हिन्दी", "ไทย",
    "中文", "日本語", "人々", "々", "〇", "ひらがな", "カタカナ", "한국어", "안녕하세요",
    "🙂", "🚀🦙", "👨\u200d👩\u200d👧", "❤️",
    "١٢٣", "١٢٣456", "١٢٣4", "12٣", "$100", "3.14159", "1,000,000",
    "don't", "I'M", "we'LL", "they're", "She'S", "it'd", "You've", "o'clock", "rock'n'roll",
    "foo_bar", "a.b.c", "<sentinel:12>", "IMGIMGABZ", "xyzzy", "plugh",
]
PUNCTUATION = list("!?.,;:-_()[]{}<>/\\|@#$%^&*+=~`'\"…。，、！？「」—")
SPACES = [" ", "  ", "   ", "    ", "\t", "\n", "\n\n", "\r", "\r\n", " \n ", "\u3000", "\u00a0", "\u2009"]


def _fuzz(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts: list[str] = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.4:
                parts.append(rng.choice(WORDS))
            elif kind < 0.55:  # digit runs of 1 to 9
                parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 9))))
            elif kind < 0.7:
                parts.append("".join(rng.choice(PUNCTUATION) for _ in range(rng.randint(1, 4))))
            elif kind < 0.8:  # case changes inside a word
                parts.append("".join(rng.choice("abcdeABCDE") for _ in range(rng.randint(2, 8))))
            else:
                parts.append(rng.choice(SPACES))
            if rng.random() < 0.6:
                parts.append(" ")
        text = "".join(parts)
        if rng.random() < 0.2:
            text = " " + text
        if rng.random() < 0.2:
            text += rng.choice(SPACES)
        texts.append(text)
    return texts


TEXTS = _fuzz(seed=1234, count=400)


def _write_vocab(path: Path, metadata: dict[str, Any]) -> None:
    """A vocab-only GGUF (no tensors) with `metadata`'s tokenizer keys."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in metadata:
        writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_bos_token_id(metadata["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


class VocabFiles:
    """One vocabulary's GGUF with any pre name: gguf-py writes it once with a placeholder name,
    and each name's file is that one with the placeholder's length-prefixed string replaced (a
    vocab-only file has no offsets to shift), 50k tokens being too slow to write 90 times."""

    def __init__(self, directory: Path, metadata: dict[str, Any]) -> None:
        self.directory, self.metadata = directory, metadata
        template = directory / "template.gguf"
        _write_vocab(template, {**metadata, "tokenizer.ggml.pre": PLACEHOLDER})
        self.template = template.read_bytes()
        assert self.template.count(_gguf_string(PLACEHOLDER)) == 1

    def path(self, pre: str) -> Path:
        path = self.directory / f"{re.sub(r'[^A-Za-z0-9._-]', '_', pre)}.gguf"
        path.write_bytes(self.template.replace(_gguf_string(PLACEHOLDER), _gguf_string(pre)))
        return path

    def ours(self, pre: str) -> Tokenizer:
        return tokenizer_from_gguf_metadata({**self.metadata, "tokenizer.ggml.pre": pre})


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory: pytest.TempPathFactory) -> VocabFiles:
    metadata = _metadata("gpt-2")
    metadata = {
        **metadata,
        "tokenizer.ggml.tokens": [*metadata["tokenizer.ggml.tokens"], *UNMERGED],
        "tokenizer.ggml.token_type": [*metadata["tokenizer.ggml.token_type"], *[1] * len(UNMERGED)],
    }
    return VocabFiles(tmp_path_factory.mktemp("gpt2-vocab"), metadata)


@pytest.fixture(scope="module")
def raw_utf8_files(tmp_path_factory: pytest.TempPathFactory) -> VocabFiles:
    """Mistral v0.3's vocabulary: raw UTF-8 with "▁" for spaces and <0xXX> byte tokens."""
    config = json.loads((TOKENIZERS / "mistral-v0.3-hf" / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = config["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {added["id"] for added in config["added_tokens"] if added["special"]}
    byte_token = re.compile(r"<0x[0-9A-F]{2}>")
    types = [3 if i in special else 6 if byte_token.fullmatch(token) else 1 for i, token in enumerate(tokens)]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in config["model"]["merges"]]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    return VocabFiles(tmp_path_factory.mktemp("raw-utf8-vocab"), metadata)


class LlamaCpp:
    """llama.cpp's tokenizer for one vocab-only GGUF."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=add_special, special=False)


@contextmanager
def _llama_cpp(path: Path) -> Iterator[LlamaCpp]:
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        yield LlamaCpp(llm)
    finally:
        llm.close()


def _assert_agree(ours: Tokenizer, reference: LlamaCpp, texts: list[str]) -> None:
    misses = [
        (text, expected, got)
        for text in texts
        if (got := ours.encode(text, add_special_tokens=False)) != (expected := reference.encode(text))
    ]
    agreed = len(texts) - len(misses)
    assert not misses, f"{agreed}/{len(texts)} agree; first misses (text, llama.cpp, ours): {misses[:3]}"
    # With add_special, BOS follows each pre-tokenizer's add_bos default in both.
    for text in texts[:20]:
        assert ours.encode(text) == reference.encode(text, add_special=True), text


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_level_pre_tokenizer_matches_llama_cpp(gpt2_files: VocabFiles, name: str) -> None:
    with _llama_cpp(gpt2_files.path(name)) as reference:
        _assert_agree(gpt2_files.ours(name), reference, TEXTS)


def _llama_cpp_survives(text: str) -> bool:
    # llama.cpp asserts that no piece it merges holds a space (find_bpe_rank) and aborts the
    # process otherwise; under "whitespace" a run of whitespace with a space in it is such a piece.
    return not any(" " in run and len(run) > 1 for run in re.findall(r"\s+", text))


@pytest.mark.parametrize("name", RAW_UTF8)
def test_raw_utf8_pre_tokenizer_matches_llama_cpp(raw_utf8_files: VocabFiles, name: str) -> None:
    texts = TEXTS if name != "whitespace" else [text for text in TEXTS if _llama_cpp_survives(text)]
    assert len(texts) >= 100
    ours = raw_utf8_files.ours(name)
    with _llama_cpp(raw_utf8_files.path(name)) as reference:
        _assert_agree(ours, reference, texts)
    # "▁" and <0xXX> byte tokens decode back to the text.
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == LOGGER and record.levelno == logging.WARNING
    ]


def test_missing_pre_is_llama_cpp_default(
    gpt2_files: VocabFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # llama.cpp itself tokenizes with its default pre-tokenizer when the key is missing.
    metadata = {key: value for key, value in gpt2_files.metadata.items() if key != "tokenizer.ggml.pre"}
    path = tmp_path / "no-pre.gguf"
    _write_vocab(path, metadata)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ours = tokenizer_from_gguf_metadata(metadata)
    messages = _warnings(caplog)
    assert len(messages) == 1 and "no tokenizer.ggml.pre" in messages[0] and "\n" not in messages[0]
    with _llama_cpp(path) as reference:
        _assert_agree(ours, reference, TEXTS)


@pytest.mark.parametrize("name", ["no-such-pre", *(name for spec in UNSUPPORTED for name in spec.names)])
def test_unknown_or_unsupported_pre_is_llama_cpp_default(
    gpt2_files: VocabFiles, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ours = gpt2_files.ours(name)
    messages = _warnings(caplog)
    assert len(messages) == 1 and repr(name) in messages[0] and "default" in messages[0], messages
    assert "\n" not in messages[0]
    if name == "no-such-pre":  # llama.cpp refuses a name it does not know
        with pytest.raises(ValueError), _llama_cpp(gpt2_files.path(name)):
            pass
    with _llama_cpp(gpt2_files.path("default")) as reference:
        _assert_agree(ours, reference, TEXTS)


def test_known_pre_does_not_warn(gpt2_files: VocabFiles, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        gpt2_files.ours("deepseek-coder")
    assert _warnings(caplog) == []


def test_table_has_each_name_once() -> None:
    names = [name for spec in PRE_TOKENIZERS for name in spec.names]
    names += [name for spec in UNSUPPORTED for name in spec.names]
    assert len(names) == len(set(names))
    for name in ("deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon", "starcoder", "tekken", "smollm",
                 "gpt-4o", "default"):
        assert name in BYTE_LEVEL
