"""Tokenizers built from GGUF metadata must give llama.cpp's token ids.

The oracle is llama.cpp's own test vectors for three vocab-only GGUFs (Llama-2 SentencePiece,
Phi-3, GPT-2), and for Phi-3 also the model's HF tokenizer.json, an independent reference for
the special-token handling that the vectors do not exercise.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from localserve.errors import LocalserveError
from localserve.text.gguf_tokenizer import tokenizer_from_gguf_metadata
from localserve.text.tokenizer import IncrementalDetokenizer, Tokenizer

from .conftest import DATA

gguf = pytest.importorskip("gguf")

TOKENIZERS = DATA / "tokenizers"
VOCABS = ["llama-spm", "phi-3", "gpt-2"]
SEPARATOR = "\n__ggml_vocab_test__\n"

# Strings whose UTF-8 characters span several tokens in every vocabulary above.
MULTIBYTE = [
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
    "កាន់តែពិសេសអាចខលចេញ",
    "нещо на Български, Cửa Việt",
]


def _value(field: Any) -> Any:
    """One GGUFReader field as a plain Python value: `parts` holds the raw pieces of the
    key/value record and `data` the indices of the parts that are the value itself."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[index]).decode("utf-8") for index in field.data]
        return [field.parts[index].tolist()[0] for index in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


@functools.cache
def _metadata(name: str) -> dict[str, Any]:
    reader = gguf.GGUFReader(TOKENIZERS / f"ggml-vocab-{name}.gguf")
    return {key: _value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    return tokenizer_from_gguf_metadata(_metadata(name))


def _vectors(name: str) -> list[tuple[str, list[int]]]:
    base = TOKENIZERS / "testvectors" / f"ggml-vocab-{name}.gguf"
    # Every string, the last one included, is followed by the separator.
    texts = base.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    assert texts[-1] == ""
    lines = base.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == ""
    texts, lines = texts[:-1], lines[:-1]
    assert len(texts) == len(lines)
    return [(text, [int(token) for token in line.split()]) for text, line in zip(texts, lines)]


@pytest.mark.parametrize("name", VOCABS)
def test_ids_match_llama_cpp_vectors(name: str) -> None:
    # llama.cpp's test tokenizes with add_special off: no BOS in the vectors even where the
    # file says add_bos_token.
    tokenizer = _tokenizer(name)
    vectors = _vectors(name)
    failures = [
        (text, expected, got)
        for text, expected in vectors
        if (got := tokenizer.encode(text, add_special_tokens=False)) != expected
    ]
    matched = len(vectors) - len(failures)
    assert not failures, f"{matched}/{len(vectors)} vectors match; first misses: {failures[:3]}"
    assert len(vectors) == 46


@pytest.mark.parametrize("name", VOCABS)
def test_bos_follows_add_bos_token(name: str) -> None:
    tokenizer = _tokenizer(name)
    text, expected = _vectors(name)[11]  # "Hello world"
    assert text == "Hello world"
    if name == "gpt-2":  # no add_bos_token in the file, and llama.cpp's BPE default is off
        assert tokenizer.encode(text) == expected
    else:
        assert tokenizer.add_bos_token and tokenizer.bos_token_id == 1
        assert tokenizer.encode(text) == [1, *expected]
        assert tokenizer.encode("") == [1]


def test_eos_token_ids() -> None:
    assert _tokenizer("llama-spm").eos_token_id == 2
    assert _tokenizer("phi-3").eos_token_id == 32000
    assert _tokenizer("gpt-2").eos_token_id == 50256


def test_out_of_range_ids_are_ignored() -> None:
    # Written as "none" (0xFFFFFFFF) by some converters; llama.cpp keeps its default instead.
    metadata = {**_metadata("llama-spm"), "tokenizer.ggml.bos_token_id": 2**32 - 1}
    metadata["tokenizer.ggml.padding_token_id"] = 2**32 - 1
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    assert tokenizer.bos_token_id == 1 and "pad_token" not in tokenizer.config
    metadata = {**_metadata("gpt-2"), "tokenizer.ggml.eos_token_id": 2**32 - 1}
    assert tokenizer_from_gguf_metadata(metadata).eos_token_id is None


def test_add_eos_token_appends_eos() -> None:
    tokenizer = tokenizer_from_gguf_metadata({**_metadata("llama-spm"), "tokenizer.ggml.add_eos_token": True})
    assert tokenizer.encode("Hello world") == [1, 15043, 3186, 2]
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [15043, 3186]


@pytest.mark.parametrize("name", VOCABS)
def test_decode_round_trips(name: str) -> None:
    tokenizer = _tokenizer(name)
    for text, _ in _vectors(name):
        ids = tokenizer.encode(text, add_special_tokens=False)
        # SentencePiece: the space the encoder prefixed comes off again, and only that one.
        assert tokenizer.decode(ids) == text
        # BOS, where added, is dropped with the special tokens.
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_spm_leading_spaces() -> None:
    tokenizer = _tokenizer("llama-spm")
    for text in [" ", "  Hello", "\tx", " \n"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # Runs of "▁" tokens (1 to 16 long) all have the same score in Llama's vocabulary; llama.cpp
    # merges equal scores leftmost first, so a run is cut into 16s from the left: 16, 16, 5, "▁x".
    assert tokenizer.encode(" " * 37 + "x", add_special_tokens=False) == [462, 462, 418, 921]
    assert tokenizer.encode("a" + " " * 20 + "b", add_special_tokens=False) == [263, 462, 1678, 289]
    text = " " * 37 + "x" + " " * 20
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_spm_without_space_prefix() -> None:
    metadata = {**_metadata("llama-spm"), "tokenizer.ggml.add_space_prefix": False}
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [10994, 3186]  # "Hello", "▁world"
    assert tokenizer.decode([29871, 15043]) == "  Hello"  # nothing stripped


def test_spm_special_tokens_parsed_and_skipped() -> None:
    # (Phi-3 types "</s>" user-defined, so there it is text; see the Phi-3 test.)
    tokenizer = _tokenizer("llama-spm")
    # Matched whole (parse_special), with a fresh space prefix after them, as llama.cpp does.
    assert tokenizer.encode("<s>Hello</s>", add_special_tokens=False) == [1, 15043, 2]
    assert tokenizer.decode([1, 15043, 2]) == "Hello"
    assert tokenizer.decode([1, 15043, 2], skip_special_tokens=False) == "<s> Hello</s>"


def test_gpt2_special_token_parsed_and_skipped() -> None:
    tokenizer = _tokenizer("gpt-2")
    ids = tokenizer.encode("Hello<|endoftext|> world", add_special_tokens=False)
    assert ids == [15496, 50256, 995]
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "Hello<|endoftext|> world"


def test_phi3_chat_matches_hf_tokenizer() -> None:
    """Phi-3's special tokens eat the whitespace after them (llama.cpp's rstrip for Phi-3,
    rstrip in the HF tokenizer.json), "</s>" is a plain added token there; the ids must agree."""
    ours = _tokenizer("phi-3")
    reference = HFTokenizer.from_file(str(TOKENIZERS / "phi-3-mini-hf" / "tokenizer.json"))
    texts = [
        "<|user|>\nHello there<|end|>\n<|assistant|>\n",
        "<|system|>  You are helpful. <|end|>\n<|user|>\n\nHi</s>  x<|end|>",
        "a<|endoftext|> b <unk>",
        *MULTIBYTE,
    ]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip), text
    assert ours.encode("<|user|>\nHi", add_special_tokens=False) == [32010, 6324]
    assert ours.decode([32010, 6324, 32007]) == "Hi"


@pytest.mark.parametrize("name", VOCABS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_incremental_detokenizer_multibyte(name: str, with_prompt: bool) -> None:
    tokenizer = _tokenizer(name)
    prompt = tokenizer.encode("Answer:") if with_prompt else []
    for text in MULTIBYTE:
        generated = tokenizer.encode(text, add_special_tokens=False)
        # The test is only worth something where characters straddle tokens.
        assert any("\ufffd" in tokenizer.decode([token]) for token in generated)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        pieces = [detokenizer.add(token) for token in generated]
        assert not any("\ufffd" in piece for piece in pieces), pieces
        full = tokenizer.decode(prompt + generated)
        prompt_text = tokenizer.decode(prompt)
        assert full.startswith(prompt_text)
        assert "".join(pieces) == full[len(prompt_text) :]


def _gpt2_with_pre(pre: str) -> Tokenizer:
    return tokenizer_from_gguf_metadata({**_metadata("gpt-2"), "tokenizer.ggml.pre": pre})


def _pre_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    pre_tokenizer = tokenizer.backend.pre_tokenizer
    assert pre_tokenizer is not None
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def test_pre_tokenizer_regexes() -> None:
    text = "I'VE 12345 apples\n\n  ok"
    # GPT-2: digits in one run, contractions case-sensitive (so "'VE" is not one), and a
    # whitespace run gives its last space to the word after it.
    assert _pre_tokens(_tokenizer("gpt-2"), text) == ["I", "'", "VE", "Ġ12345", "Ġapples", "ĊĊĠ", "Ġok"]
    # Llama 3: digits in threes, contractions case-insensitive, newlines kept together.
    llama3 = ["I", "'VE", "Ġ", "123", "45", "Ġapples", "ĊĊ", "Ġ", "Ġok"]
    assert _pre_tokens(_gpt2_with_pre("llama-bpe"), text) == llama3
    # Qwen2: digits one by one.
    assert _pre_tokens(_gpt2_with_pre("qwen2"), text)[3:8] == ["1", "2", "3", "4", "5"]
    # Whatever the split, byte-level BPE stays lossless.
    for pre in ("llama-bpe", "qwen2"):
        tokenizer = _gpt2_with_pre(pre)
        for sample in MULTIBYTE:
            assert tokenizer.decode(tokenizer.encode(sample)) == sample


def test_llama3_defaults() -> None:
    metadata = {**_metadata("gpt-2"), "tokenizer.ggml.pre": "llama-bpe"}
    assert "tokenizer.ggml.add_bos_token" not in metadata
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    # llama.cpp adds BOS for Llama 3 vocabularies unless the file says otherwise.
    assert tokenizer.add_bos_token
    assert tokenizer.encode("Hello")[0] == 50256


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "t5"}, "'t5' is not supported"),
        ({"tokenizer.ggml.model": None}, "no tokenizer.ggml.model"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["Ġ nosuchtoken"]}, "not in the vocabulary"),
        ({"tokenizer.ggml.bos_token_id": "50256"}, "bos_token_id"),
        ({"tokenizer.ggml.token_type": [1, 2]}, "token_type"),
        ({"tokenizer.ggml.tokens": ["a", "b", "a"]}, r"'a' appears twice \(ids 0 and 2\)"),
        ({"tokenizer.ggml.tokens": ["a", 7, "b"]}, "not a list of strings"),
        ({"tokenizer.ggml.tokens": ["a", True]}, "not a list of strings"),
        ({"tokenizer.ggml.token_type": [1, 2.5, *[1] * 50255]}, "one integer per token"),
        ({"tokenizer.ggml.token_type": [1, False, *[1] * 50255]}, "one integer per token"),
        ({"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": True}, "token id is missing"),
    ],
)
def test_bad_metadata_is_a_clear_error(change: dict[str, Any], message: str) -> None:
    metadata = {**_metadata("gpt-2")}
    for key, value in change.items():
        if value is None:
            metadata.pop(key)
        else:
            metadata[key] = value
    with pytest.raises(LocalserveError, match=message):
        tokenizer_from_gguf_metadata(metadata)


def test_spm_needs_scores() -> None:
    metadata = {key: value for key, value in _metadata("llama-spm").items() if key != "tokenizer.ggml.scores"}
    with pytest.raises(LocalserveError, match="scores"):
        tokenizer_from_gguf_metadata(metadata)
