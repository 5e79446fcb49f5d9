"""llama.cpp's pre-tokenizers for byte-level BPE GGUF vocabularies (`tokenizer.ggml.pre`).

Before BPE runs, llama.cpp cuts the text into pieces with a list of regexes chosen by the
vocabulary's `tokenizer.ggml.pre` name (`llm_tokenizer_bpe` in llama.cpp's src/llama-vocab.cpp).
The regexes apply in sequence: each one splits every piece the previous one produced, and both
its matches and the unmatched text between them become pieces (`unicode_regex_split` in
src/unicode.cpp). HF `tokenizers` does the same with a sequence of `Split(..., "isolated")`
pre-tokenizers, so the table below holds llama.cpp's regexes as llama.cpp writes them, and
`_as_oniguruma` bridges the few places where llama.cpp does not run them as a plain regex engine
would:

- llama.cpp replaces some regexes by hand-written splitters; `_SPLITTERS` restates the two that
  do not cut where their regexes would (Kimi-K2's, and digit grouping) as regexes that do.
- Regexes with `\\p{..}` run with std::regex on a copy of the text where every non-ASCII
  character stands for its category, so llama.cpp cannot tell an upper-case letter from a
  lower-case one beyond ASCII: `\\p{Lu}`, `\\p{Ll}`, ... all mean `\\p{L}`, for ASCII too.
- Regexes without `\\p{..}` run with std::wregex on the code points after replacing non-ASCII
  whitespace by U+000B, so a class of literal non-ASCII characters never matches whitespace even
  where its ranges span some (U+3000 in `　-。`).
- std::regex's `\\d` is ASCII only, Oniguruma's any decimal digit. (Oniguruma's `$` ends a line
  where std::regex's ends the piece; in DeepSeek LLM's `\\s+$` that is the same place, as
  newlines are pieces of their own by then.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text for some `tokenizer.ggml.pre` names before BPE runs."""

    kind: str  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_<kind>
    names: tuple[str, ...]  # the `tokenizer.ggml.pre` values llama.cpp maps to it
    regexes: tuple[str, ...]  # llama.cpp's regex_exprs, applied in sequence
    ignore_merges: bool = False  # a piece that is itself in the vocab is taken whole
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token
    # False: the vocabulary spells raw UTF-8 with <0xXX> byte tokens for the rest (SentencePiece
    # style) instead of GPT-2's byte-to-character mapping (llama.cpp's `byte_encode`).
    byte_encode: bool = True
    escape_spaces: bool = False  # spaces become "▁" before the split (`escape_whitespaces`)

    def hf_pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        """The same split as HF pre-tokenizers, then GPT-2's byte-to-character mapping if used."""
        steps: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(_as_oniguruma(regex)), behavior="isolated") for regex in self.regexes
        ]
        if self.byte_encode:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        return pre_tokenizers.Sequence(steps)


@dataclass(frozen=True)
class Unsupported:
    """A llama.cpp pre-tokenizer this module does not reproduce, and why."""

    kind: str
    names: tuple[str, ...]
    reason: str


# The regexes several pre-tokenizers share, as llama.cpp spells them.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CJK_KANA = r"[一-龥぀-ゟ゠-ヿ]+"
_CJK_HANGUL = r"[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK3_WORDS = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_CASED = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_STOPS = r" ?[^(\s|.,!?…。，、।۔،)]+"
_NEWLINES = r"[^\n]+|[\n]+"
_AFMOE_DIGITS = r"\p{AFMoE_digits}"

# DeepSeek LLM's letters, in escapes: some of them (U+1FBE, U+2126, U+212A, ...) have canonical
# equivalents that a tool normalizing text to NFC would swap in, leaving ranges empty.
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z"
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
    "]+"
)

_DEFAULT = PreTokenizer(
    "DEFAULT", ("default",), (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
)

# One entry per llama.cpp pre-tokenizer type (two where the names of one type differ in flags),
# in the order of llama.cpp's name map (`llama_vocab::impl::load`).
PRE_TOKENIZERS: tuple[PreTokenizer, ...] = (
    _DEFAULT,
    PreTokenizer("MINICPM5", ("minicpm5",), (
        r"\p{N}{1,3}",
        _CONTRACTIONS
        + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True),
    PreTokenizer(
        "LLAMA3",
        (
            "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
            "jina-v5-nano",
        ),
        (_LLAMA3,), ignore_merges=True, add_bos=True,
    ),
    PreTokenizer("DEEPSEEK_LLM", ("deepseek-llm",), (
        r"[\r\n]",
        _DEEPSEEK_LETTERS,
        r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
        r"\s+$",
        _CJK_HANGUL,
        r"\p{N}+",
    )),
    PreTokenizer("DEEPSEEK_CODER", ("deepseek-coder",), (
        r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}",
    )),
    PreTokenizer("DEEPSEEK3_LLM", ("deepseek-v3",), (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS)),
    PreTokenizer("SPARK2_5", ("spark2_5",), (
        r"\p{N}{1,3}",
        _CJK_KANA,
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}",
    )),
    PreTokenizer("YOUTU", ("youtu",), (
        r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True),
    PreTokenizer("FALCON", ("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    PreTokenizer("MPT", ("mpt",), (_GPT2,)),
    PreTokenizer("STARCODER", ("starcoder",), (r"\p{N}", _GPT2)),
    PreTokenizer(
        "GPT2",
        (
            "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
            "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4",
        ),
        (_GPT2,),
    ),
    PreTokenizer("JAIS2", ("jais-2",), (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
        r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    )),
    PreTokenizer("SARVAM_MOE", ("sarvam-moe",), (_NEWLINES,), byte_encode=False, escape_spaces=True),
    PreTokenizer("WHITESPACE", ("whitespace",), (r"\S+",), byte_encode=False),
    PreTokenizer("REFACT", ("refact",), (r"\p{N}", _GPT2)),
    PreTokenizer("COMMAND_R", ("command-r",), (r"\p{N}", _GPT2)),
    PreTokenizer("QWEN2", ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), (_QWEN2,)),
    PreTokenizer("QWEN35", ("qwen35",), (
        _CONTRACTIONS
        + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )),
    PreTokenizer("STABLELM2", ("stablelm2",), (_QWEN2,)),
    PreTokenizer("OLMO", ("olmo",), (_GPT2,)),
    PreTokenizer("DBRX", ("dbrx",), (_LLAMA3,)),
    PreTokenizer("SMAUG", ("smaug-bpe",), (_LLAMA3,)),
    PreTokenizer("PORO", ("poro-chat",), (_STOPS,)),
    PreTokenizer("CHATGLM4", ("chatglm-bpe",), (_LLAMA3,)),
    PreTokenizer("CHATGLM4", ("glm4", "glm5"), (_LLAMA3,), ignore_merges=True),
    PreTokenizer("VIKING", ("viking",), (_STOPS, r"\p{N}")),
    PreTokenizer("JAIS", ("jais",), (_GPT2,)),
    PreTokenizer("TEKKEN", ("tekken",), (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True, add_bos=True),
    PreTokenizer("SMOLLM", ("smollm",), (r"\p{N}", _GPT2)),
    PreTokenizer("CODESHELL", ("codeshell",), (r"\p{N}", _GPT2)),
    PreTokenizer("BLOOM", ("bloom",), (_STOPS,)),
    PreTokenizer("GPT3_FINNISH", ("gpt3-finnish",), (_STOPS,)),
    PreTokenizer("EXAONE", ("exaone",), (r"\p{N}", _GPT2)),
    PreTokenizer("EXAONE_MOE", ("exaone-moe",), (
        _CONTRACTIONS
        + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    )),
    PreTokenizer("CHAMELEON", ("chameleon",), (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ), add_bos=True),
    PreTokenizer("MINERVA", ("minerva-7b",), (r"\p{N}", _GPT2)),
    PreTokenizer("GPT4O", ("gpt-4o", "llama4", "kanana2", "talkie"), (_GPT4O,)),
    PreTokenizer("GRANITE_EMB_MULTI", ("granite-embed-multi-97m",), (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS + "?"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS + "?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True),
    PreTokenizer("TINY_AYA", ("tiny_aya", "cohere2moe"), (r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O_CASED)),
    PreTokenizer("SUPERBPE", ("superbpe",), (r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    PreTokenizer("TRILLION", ("trillion",), (_GPT2,)),
    PreTokenizer("GRANITE_DOCLING", ("granite-docling",), (_GPT2,)),
    PreTokenizer("BAILINGMOE", ("bailingmoe", "bailingmoe2", "llada-moe"), (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    )),
    PreTokenizer("SEED_CODER", ("seed-coder",), (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    )),
    PreTokenizer("HUNYUAN", ("hunyuan",), (_QWEN2,)),
    PreTokenizer("HUNYUAN_DENSE", ("hunyuan-dense",), (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS)),
    PreTokenizer("HY_V4", ("hy_v4",), (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS)),
    PreTokenizer("JOYAI_LLM", ("joyai-llm",), (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS)),
    PreTokenizer("KIMI_K2", ("kimi-k2",), (r"\p{Han}+",)),
    PreTokenizer("UFAKZEKA", ("ufakzeka",), (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )),
    PreTokenizer("GROK_2", ("grok-2",), (_QWEN2,)),
    PreTokenizer("AFMOE", ("afmoe",), (
        _AFMOE_DIGITS,
        r"[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
        _DEEPSEEK3_WORDS,
    )),
    PreTokenizer("LAGUNA", ("laguna",), (_NEWLINES, _QWEN2)),
    PreTokenizer("MINIMAX_M2", ("minimax-m2",), (_GPT4O,)),
    PreTokenizer("SOLAR_OPEN", ("solar-open",), (_QWEN2,)),
    PreTokenizer("MELLUM2", ("mellum2",), (r"\p{N}", _GPT2)),
)

# Two pre-tokenizers llama.cpp has that HF tokenizers cannot express. Both are for vocabularies
# spelling raw UTF-8 with spaces as "▁", and in both llama.cpp takes a piece made of newlines
# whole when it is a token but merges every other piece, even one that is a token, while an HF
# BPE model either takes every such piece whole (ignore_merges) or none.
UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported(
        "GEMMA4", ("gemma4", "granite-embed-multi-311m"),
        "a run of newlines that is a token is taken whole, every other piece is merged",
    ),
    Unsupported(
        "MMBERT", ("mmbert",),
        "a run of newlines that is a token is taken whole, every other piece is merged; "
        "every '▁' starts a word",
    ),
)

_BY_NAME: dict[str, PreTokenizer] = {name: spec for spec in PRE_TOKENIZERS for name in spec.names}
_UNSUPPORTED_BY_NAME: dict[str, Unsupported] = {name: spec for spec in UNSUPPORTED for name in spec.names}


def pre_tokenizer_for(name: object) -> PreTokenizer:
    """The pre-tokenizer for a `tokenizer.ggml.pre` value (None: the key is missing).

    Where there is none to match llama.cpp, this is llama.cpp's default, with a warning: llama.cpp
    itself uses the default for a missing name and refuses an unknown one, but a model whose text
    is split a little differently still runs, while one refused does not run at all.
    """
    if isinstance(name, str) and name in _BY_NAME:
        return _BY_NAME[name]
    if name is None:
        log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's default pre-tokenizer, as llama.cpp "
                    "does (token ids may differ from the model's own tokenizer)")
    elif isinstance(name, str) and name in _UNSUPPORTED_BY_NAME:
        unsupported = _UNSUPPORTED_BY_NAME[name]
        log.warning("GGUF pre-tokenizer %r (llama.cpp's %s: %s) is not supported; using llama.cpp's default "
                    "pre-tokenizer (token ids will differ from llama.cpp's)", name, unsupported.kind,
                    unsupported.reason)
    else:
        log.warning("GGUF pre-tokenizer %r (tokenizer.ggml.pre) is unknown; using llama.cpp's default "
                    "pre-tokenizer (token ids may differ from the model's own tokenizer)", name)
    return _DEFAULT


# Kimi-K2's split, from llama.cpp's hand-written `unicode_regex_split_custom_kimi_k2`: a run of
# Han characters (its own code point ranges, not Unicode's Han script); else a word of other
# letters, any case (no marks), after one optional non-letter and with an optional contraction;
# then llama3's digits, punctuation and whitespace rules.
_HAN = (
    r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}"
    r"\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}"
)
_KIMI_K2 = (
    rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's hand-written digit grouping (`unicode_regex_split_custom_afmoe`): a run of digits
# is cut into threes from the right, and the text since the previous cut (everything that is not
# a digit) stays in front of the run's first group instead of becoming a piece of its own.
_DIGITS_BY_THREE = r"\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"

# Regexes llama.cpp does not run as regexes but through hand-written code, restated. (Its
# hand-written gpt2, llama3, qwen2, qwen35 and newline splitters cut exactly where their regexes
# do: the final "\s+" GPT-2's original regex has and llama.cpp's copy lacks takes a single
# whitespace before a word, which the copy leaves unmatched, a piece all the same.)
_SPLITTERS: dict[str, str] = {
    r"\p{Han}+": _KIMI_K2,
    _AFMOE_DIGITS: _DIGITS_BY_THREE,
    r"\d{1,3}(?=(?:\d{3})*\b)": _DIGITS_BY_THREE,  # tiny_aya's, sent to the same code
}

_CATEGORY_NAMES = ("\\p{Lu}", "\\p{Ll}", "\\p{Lt}", "\\p{Lm}", "\\p{Lo}")


def _as_oniguruma(regex: str) -> str:
    """`regex` as Oniguruma (HF tokenizers' engine) must spell it to split where llama.cpp does."""
    if regex in _SPLITTERS:
        return _SPLITTERS[regex]
    wide = "\\p{" not in regex  # run by std::wregex on code points, non-ASCII whitespace as \v
    out: list[str] = []
    in_class = False
    class_start = 0
    for token in _regex_tokens(regex):
        if token in _CATEGORY_NAMES:
            out.append("\\p{L}")
        elif token == "\\d":
            out.append("0-9" if in_class else "[0-9]")
        elif token == "[" and not in_class:
            in_class, class_start = True, len(out)
            out.append(token)
        elif token == "]" and in_class:
            in_class = False
            body = "".join(out[class_start + 1 :])
            if wide and not body.startswith("^") and any(ord(char) > 127 for char in body):
                out.append("&&[\\x00-\\x7F\\S]")  # no non-ASCII whitespace: llama.cpp made it \v
            out.append(token)
        else:
            out.append(token)
    return "".join(out)


def _regex_tokens(regex: str) -> Iterator[str]:
    """`regex` as its characters, with an escape and a `\\p{..}` each one token."""
    index = 0
    while index < len(regex):
        if regex.startswith("\\p{", index):
            end = regex.index("}", index) + 1
        elif regex[index] == "\\":
            end = index + 2
        else:
            end = index + 1
        yield regex[index:end]
        index = end
