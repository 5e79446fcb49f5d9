"""Tokenizers built from a GGUF file's metadata, tokenizing exactly as llama.cpp does.

A GGUF carries no tokenizer.json: the vocabulary, scores, token types and merges sit in
`tokenizer.ggml.*` metadata. This module turns them into an HF `tokenizers.Tokenizer` whose
token ids equal llama.cpp's (checked against llama.cpp's own test vectors):

- `llama` (SentencePiece-style, llama.cpp's SPM): llama.cpp merges the adjacent pair whose
  result has the highest score, leftmost first on a tie, and falls back to `<0xXX>` byte tokens
  for what no token covers. A BPE model reproduces that when its merge ranks follow the scores
  of the merged tokens, with every way of splitting a token into two tokens as a merge.
- `gpt2` (BPE): the file's merges as they are, after the split llama.cpp makes for the
  `tokenizer.ggml.pre` name (gguf_pre_tokenizers). Nearly all of these vocabularies are
  byte-level (GPT-2's byte-to-character mapping); a few pre-tokenizers mean raw UTF-8 with
  `<0xXX>` byte tokens instead, and one of those spaces as "▁".

Control, unknown and user-defined tokens are matched whole in the text before the model runs,
as llama.cpp does with parse_special on: control and unknown ones as special tokens (dropped by
decode with skip_special_tokens), user-defined ones as plain added tokens (always kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ..errors import LocalserveError
from .gguf_pre_tokenizers import PreTokenizer, pre_tokenizer_for
from .tokenizer import Tokenizer

# llama.cpp's token types (`tokenizer.ggml.token_type`, gguf-py's TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp treats as end-of-generation and therefore forces to control type whatever the
# file says, so they are special (matched in prompts, skipped on decode) here too.
_EOG_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"}
)

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space

@dataclass(frozen=True)
class _Vocab:
    tokens: list[str]
    types: list[int]
    ids: dict[str, int]


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (keys as in the file, values as Python)."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise LocalserveError("GGUF metadata has no tokenizer.ggml.model; pass token ids instead of text")
    vocab = _read_vocab(metadata)
    if model == "llama":
        backend, add_bos = _spm_backend(metadata, vocab), True
        default_bos, default_eos = 1, 2  # llama.cpp's defaults for SentencePiece vocabularies
    elif model == "gpt2":
        pre = pre_tokenizer_for(metadata.get("tokenizer.ggml.pre"))
        backend, add_bos = _bpe_backend(metadata, vocab, pre), pre.add_bos
        default_bos = default_eos = None
    else:
        raise LocalserveError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'llama', 'gpt2'); "
            "pass token ids instead of text"
        )

    bos_id = _token_id(metadata, "tokenizer.ggml.bos_token_id", default_bos, vocab)
    eos_id = _token_id(metadata, "tokenizer.ggml.eos_token_id", default_eos, vocab)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos_id is None) or (add_eos and eos_id is None):
        raise LocalserveError("GGUF metadata: add_bos_token/add_eos_token is set but the token id is missing")
    _add_special_tokens(backend, metadata, vocab)
    backend.post_processor = _post_processor(vocab, bos_id if add_bos else None, eos_id if add_eos else None)

    config: dict[str, Any] = {
        "bos_token": vocab.tokens[bos_id] if bos_id is not None else None,
        "eos_token": vocab.tokens[eos_id] if eos_id is not None else None,
        "add_bos_token": add_bos,
        # The post-processor already appends EOS; recorded for readers of the config.
        "add_eos_token": add_eos,
    }
    for name in ("unknown", "padding"):
        token_id = _token_id(metadata, f"tokenizer.ggml.{name}_token_id", None, vocab)
        if token_id is not None:
            config["unk_token" if name == "unknown" else "pad_token"] = vocab.tokens[token_id]
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return Tokenizer(backend, config)


def _read_vocab(metadata: Mapping[str, Any]) -> _Vocab:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not _is_list_of(tokens, str) or not tokens:
        raise LocalserveError("GGUF metadata: tokenizer.ggml.tokens is missing or not a list of strings")
    # llama.cpp renames empty tokens so that every token has a distinct, non-empty text.
    if "" in tokens:
        tokens = [token or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]
    ids = dict(zip(tokens, range(len(tokens))))
    if len(ids) != len(tokens):  # a repeated token: find the first, to name it
        seen: dict[str, int] = {}
        for index, token in enumerate(tokens):
            if token in seen:
                raise LocalserveError(
                    f"GGUF metadata: token {token!r} appears twice (ids {seen[token]} and {index})"
                )
            seen[token] = index
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        types = [_NORMAL] * len(tokens)
    elif not _is_list_of(types, int) or len(types) != len(tokens):
        raise LocalserveError("GGUF metadata: tokenizer.ggml.token_type must hold one integer per token")
    return _Vocab(tokens=tokens, types=list(types), ids=ids)


def _spm_backend(metadata: Mapping[str, Any], vocab: _Vocab) -> HFTokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    if not _is_list_of(scores, (int, float)) or len(scores) != len(vocab.tokens):
        raise LocalserveError("GGUF metadata: a 'llama' tokenizer needs tokenizer.ggml.scores, one per token")
    unk_id = _token_id(metadata, "tokenizer.ggml.unknown_token_id", 0, vocab)
    model = models.BPE(
        vocab=vocab.ids,
        merges=_merges_from_scores(vocab.tokens, scores),
        unk_token=vocab.tokens[unk_id] if unk_id is not None else None,
        byte_fallback=True,  # llama.cpp spells what no token covers as <0xXX> byte tokens
        fuse_unk=False,
    )
    backend = HFTokenizer(model)
    # llama.cpp prefixes each stretch of text that starts the input or follows a special token
    # with a space, then escapes spaces (only spaces) as "▁". Added tokens are cut out of the text
    # before normalizing, so Prepend here runs once per such stretch, as there, and on none when
    # the stretch is empty.
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", _SPM_SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), escape]) if add_space_prefix else escape
    )
    # Byte tokens become bytes, and the bytes of one character come together again.
    steps: list[decoders.Decoder] = [
        decoders.Replace(_SPM_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        # The space the encoder put in front comes off again (one, at the very start).
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges that replay llama.cpp's score-driven SPM merging.

    llama.cpp starts from single characters and repeatedly joins the adjacent pair whose joined
    text is a token with the highest score. As merges, that is every split of every token into two
    tokens, ranked by the score of the token they make. Equal scores (Llama's runs of "▁", all
    scored -1e9) are merged leftmost-first by llama.cpp; ranking the longer result first has the
    same effect here, because then a run grows from its left end before a new pair further right
    is started. (Two splits of one token competing at overlapping places could still be picked
    differently; llama.cpp's test vectors for Llama-2 and Phi-3 all come out equal.)
    """
    ids = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[index]), -len(token), index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _bpe_backend(metadata: Mapping[str, Any], vocab: _Vocab, pre: PreTokenizer) -> HFTokenizer:
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if not _is_list_of(raw_merges, str):
        raise LocalserveError("GGUF metadata: a 'gpt2' tokenizer needs tokenizer.ggml.merges (strings)")
    merges: list[tuple[str, str]] = []
    for merge in raw_merges:
        # Split at the first space after the first character, as llama.cpp does (the byte-level
        # alphabet has no space, so that is the separator).
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else (merge, "")
        if left not in vocab.ids or right not in vocab.ids:
            raise LocalserveError(f"GGUF metadata: merge {merge[:80]!r} names a token not in the vocabulary")
        if left + right not in vocab.ids:  # the tokenizers library would panic building it
            raise LocalserveError(f"GGUF metadata: merge {merge[:80]!r} makes a token not in the vocabulary")
        merges.append((left, right))
    model = models.BPE(
        vocab=vocab.ids,
        merges=merges,
        ignore_merges=pre.ignore_merges,
        # Raw UTF-8 vocabularies spell what no token covers as <0xXX> byte tokens, as llama.cpp does.
        byte_fallback=not pre.byte_encode,
    )
    backend = HFTokenizer(model)
    if pre.escape_spaces:
        backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    backend.pre_tokenizer = pre.hf_pre_tokenizer()
    if pre.byte_encode:
        backend.decoder = decoders.ByteLevel()
    else:
        steps: list[decoders.Decoder] = [decoders.ByteFallback(), decoders.Fuse()]
        if pre.escape_spaces:
            steps.insert(0, decoders.Replace(_SPM_SPACE, " "))
        backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: HFTokenizer, metadata: Mapping[str, Any], vocab: _Vocab) -> None:
    # llama.cpp lets Phi-3's added tokens swallow the whitespace after them, all but <unk>, <s>
    # and <|endoftext|> (so does Phi-3's tokenizer.json); it recognises Phi-3 by the model's name.
    name = metadata.get("general.name")
    phi3 = isinstance(name, str) and any(key in name.lower() for key in ("phi-3", "phi3"))
    special: list[AddedToken] = []
    plain: list[AddedToken] = []
    for token, token_type in zip(vocab.tokens, vocab.types):
        is_special = token_type in (_CONTROL, _UNKNOWN) or token in _EOG_TEXTS
        if not is_special and token_type != _USER_DEFINED:
            continue
        rstrip = phi3 and token not in ("<unk>", "<s>", "<|endoftext|>")
        # normalized=False: matched in the raw text, before "▁" escaping, as llama.cpp does.
        added = AddedToken(token, normalized=False, special=is_special, rstrip=rstrip)
        (special if is_special else plain).append(added)
    # Every content is in the model's vocabulary, so these keep their ids from the file.
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _post_processor(vocab: _Vocab, bos_id: int | None, eos_id: int | None) -> processors.PostProcessor | None:
    """BOS/EOS around the text when add_special_tokens, as llama.cpp's add_bos / add_eos."""
    if bos_id is None and eos_id is None:
        return None
    # The template names the tokens by key, not by their text, which may hold ':' or spaces
    # that the template syntax would misread.
    parts: list[str] = []
    special: list[dict[str, Any]] = []
    for key, token_id in (("bos", bos_id), ("eos", eos_id)):
        if token_id is not None:
            special.append({"id": key, "ids": [token_id], "tokens": [vocab.tokens[token_id]]})
    if bos_id is not None:
        parts.append("bos")
    parts.append("$A")
    if eos_id is not None:
        parts.append("eos")
    return processors.TemplateProcessing(single=parts, special_tokens=special)


def _token_id(metadata: Mapping[str, Any], key: str, default: int | None, vocab: _Vocab) -> int | None:
    value = metadata.get(key)
    if value is None:
        value = default
    elif isinstance(value, bool) or not isinstance(value, int):
        raise LocalserveError(f"GGUF metadata: {key} = {value!r} is not a token id")
    elif not 0 <= value < len(vocab.tokens):
        # Files write "none" as 0xFFFFFFFF (-1 as uint32); llama.cpp ignores an id outside the
        # vocabulary and keeps its default, and so do we.
        value = default
    return value if value is not None and 0 <= value < len(vocab.tokens) else None


def _is_list_of(value: Any, kinds: type | tuple[type, ...]) -> bool:
    if not isinstance(value, (list, tuple)):
        return False
    # The distinct types first: one pass in C over a 128k-entry vocabulary, not 128k isinstance calls.
    return all(issubclass(kind, kinds) and not issubclass(kind, bool) for kind in set(map(type, value)))
