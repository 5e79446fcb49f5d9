"""Texts and (query, document) pairs to an encoder's token ids, as sentence-transformers
makes them: the tokenizer's own template adds [CLS]/[SEP] (BERT) or <s></s> (RoBERTa),
and an input over the limit loses tokens from its end (a pair's from the longer side
first: the ``tokenizers`` library's longest-first truncation, which transformers' fast
tokenizers call too). No padding: the runner packs inputs whole."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

from ..errors import LocalserveError
from ..text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EncodedInput:
    """One input's ids and segment ids (1 for a BERT pair's second text), as the model reads them."""

    ids: list[int]
    type_ids: list[int]
    truncated: bool  # it was longer than the limit and lost its end


class EncoderTokenizer:
    def __init__(self, backend: HFTokenizer, max_length: int, lowercase: bool = False) -> None:
        backend.no_padding()  # some tokenizer.json files pad to a fixed length; the runner packs instead
        if lowercase and not _lowercases(backend.normalizer):
            # sentence_bert_config's do_lower_case: sentence-transformers puts Lowercase first.
            rest = [] if backend.normalizer is None else [backend.normalizer]
            backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), *rest])
        try:
            backend.enable_truncation(max_length, strategy="longest_first")
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise LocalserveError(f"the tokenizer cannot truncate to {max_length} tokens ({exc})") from None
        self.backend = backend
        self.max_length = max_length

    @classmethod
    def from_dir(cls, model_dir: Path, max_length: int, lowercase: bool = False) -> EncoderTokenizer:
        if not (model_dir / "tokenizer.json").is_file():
            raise LocalserveError(f"{model_dir}: no tokenizer.json (a tokenizer given only as vocab.txt or "
                                  "sentencepiece.bpe.model is not supported yet)")
        # The backend is our own copy, so setting its truncation touches nothing else.
        return cls(Tokenizer.from_dir(model_dir).backend, max_length, lowercase)

    def encode(self, texts: Sequence[str]) -> list[EncodedInput]:
        return self._batch(list(texts))

    def encode_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[EncodedInput]:
        """Each (query, document) as one input, the pair template between them."""
        return self._batch([(query, document) for query, document in pairs])

    def _batch(self, inputs: list[str] | list[tuple[str, str]]) -> list[EncodedInput]:
        try:
            # encode_batch lets the GIL go while it works (the daemon's event loop keeps running).
            encodings = self.backend.encode_batch(inputs)
        except Exception as exc:  # a pair's template alone over the limit, say
            reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise LocalserveError(f"cannot tokenize the input ({reason})") from None
        return [EncodedInput(e.ids, e.type_ids, truncated=bool(e.overflowing)) for e in encodings]


def _lowercases(normalizer: normalizers.Normalizer | None) -> bool:
    if normalizer is None:
        return False
    if isinstance(normalizer, normalizers.Sequence):
        return any(_lowercases(part) for part in normalizer)
    if isinstance(normalizer, normalizers.BertNormalizer):
        return bool(normalizer.lowercase)
    return isinstance(normalizer, normalizers.Lowercase)
