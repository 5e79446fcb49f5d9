"""What a grammar library costs per token on the CPU at a real vocabulary: llguidance,
xgrammar and outlines-core compile the same JSON schemas and then walk the same
documents token by token, computing each next-token mask and accepting the token.

    pip download --no-deps mistral-common && unzip -o mistral_common-*.whl 'mistral_common/data/tekken_240911.json'
    python benchmarks/structured_mask.py --vocab mistral_common/data/tekken_240911.json
    python benchmarks/structured_mask.py --vocab path/to/tokenizer.json     # any HF tokenizer

The vocabulary is a real one: Mistral-Nemo's Tekken (131,072 tokens, byte-level, tiktoken
style; mistral-common ships it) or any HF ``tokenizer.json``. Documents are tokenized by
longest match over the vocabulary's bytes (each library takes any spelling, not only the
tokenizer's own). Prints, per library and schema: the first compile's time, then per token the mean,
median and 99th percentile of mask time (one thread), and whether every token was accepted.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

# (name, schema or None for any JSON object, a document it accepts)
CASES: list[tuple[str, dict | None, str]] = [
    ("tool arguments", {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["location", "unit"], "additionalProperties": False},
     '{"location": "San Francisco, CA", "unit": "celsius", "days": 5}'),
    ("records", {
        "type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                           "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "age", "tags"], "additionalProperties": False}},
     '[{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"]}, '
     '{"name": "Alan Turing", "age": 41, "tags": ["logic", "computing", "cryptanalysis"]}]'),
    ("any JSON object", None,
     '{"summary": "The meeting moved to Thursday at 10:00.", "attendees": ["Ana", "Bo"], '
     '"confidence": 0.87, "follow_up": {"needed": true, "owner": null}}'),
]


class Vocab:
    """Token bytes by id, which ids are special, and a longest-match tokenizer."""

    def __init__(self, tokens: list[bytes], special: set[int], eos: int) -> None:
        self.tokens, self.special, self.eos = tokens, special, eos
        self.ids = {t: i for i, t in enumerate(tokens) if i not in special and t}
        self.longest = max(len(t) for t in self.ids)

    @classmethod
    def load(cls, path: Path) -> Vocab:
        data = json.loads(path.read_text())
        if "config" in data and "vocab" in data:  # Tekken: ranks after the special tokens
            specials = data["config"]["default_num_special_tokens"]
            size = data["config"]["default_vocab_size"]
            tokens = [f"<special_{i}>".encode() for i in range(specials)]
            tokens += [base64.b64decode(v["token_bytes"]) for v in data["vocab"][:size - specials]]
            return cls(tokens, set(range(specials)), eos=2)
        from localserve.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path.parent)
        added = {t.id for t in tokenizer.backend.get_added_tokens_decoder().values()} if hasattr(
            tokenizer.backend, "get_added_tokens_decoder") else set()
        tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        return cls(tokens, added, eos=tokenizer.eos_token_id or 0)

    def tokenize(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, at = [], 0
        while at < len(data):
            for length in range(min(self.longest, len(data) - at), 0, -1):
                found = self.ids.get(data[at:at + length])
                if found is not None:
                    out.append(found)
                    at += length
                    break
            else:
                raise ValueError(f"no token spells byte {data[at]:#x}")
        return out


def _llguidance(vocab: Vocab) -> Callable[[dict | None], object]:
    import llguidance
    import llguidance.torch

    class Wrapped:
        eos_token_id, bos_token_id = vocab.eos, None
        tokens, special_token_ids = vocab.tokens, sorted(vocab.special)

        def __call__(self, text: bytes) -> list[int]:
            return vocab.tokenize(text)

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))

    def compile(schema: dict | None) -> object:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema or {"type": "object"})
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        mask = llguidance.torch.allocate_token_bitmask(1, len(vocab.tokens))

        def step(token: int) -> bool:
            llguidance.torch.fill_next_token_bitmask(matcher, mask)
            allowed = bool((mask[0, token // 32] >> (token % 32)) & 1)
            return allowed and matcher.consume_token(token)
        return step
    return compile


def _xgrammar(vocab: Vocab) -> Callable[[dict | None], object]:
    import xgrammar

    info = xgrammar.TokenizerInfo(vocab.tokens, xgrammar.VocabType.RAW, vocab_size=len(vocab.tokens),
                                  stop_token_ids=[vocab.eos], add_prefix_space=False)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(schema: dict | None) -> object:
        compiled = compiler.compile_json_schema(json.dumps(schema)) if schema else compiler.compile_builtin_json_grammar()
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, len(vocab.tokens))

        def step(token: int) -> bool:
            matcher.fill_next_token_bitmask(mask)
            allowed = bool((mask[0, token // 32] >> (token % 32)) & 1)
            return allowed and matcher.accept_token(token)
        return step
    return compile


def _outlines_core(vocab: Vocab) -> Callable[[dict | None], object]:
    import outlines_core

    entries: dict[bytes, list[int]] = {}
    for i, token in enumerate(vocab.tokens):
        if i not in vocab.special and i != vocab.eos:
            entries.setdefault(token, []).append(i)
    vocabulary = outlines_core.Vocabulary(vocab.eos, entries)

    def compile(schema: dict | None) -> object:
        if schema is None:
            raise NotImplementedError("no free-form JSON: a regex cannot nest without bound")
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
        mask = torch.zeros(1, (len(vocab.tokens) + 31) // 32, dtype=torch.int32)

        def step(token: int) -> bool:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            allowed = bool((mask[0, token // 32] >> (token % 32)) & 1)
            if allowed:
                guide.advance(token)
            return allowed
        return step
    return compile


LIBRARIES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines_core}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=Path, required=True, help="tekken.json or an HF tokenizer.json")
    parser.add_argument("--libraries", nargs="+", default=list(LIBRARIES))
    parser.add_argument("--repeats", type=int, default=5, help="walks of each document")
    args = parser.parse_args()
    torch.set_num_threads(1)
    vocab = Vocab.load(args.vocab)
    print(f"vocabulary: {len(vocab.tokens):,} tokens ({args.vocab.name})")
    print(f"{'library':14} {'schema':16} {'compile ms':>10} {'mean us':>8} {'p50 us':>7} {'p99 us':>7}  tokens")
    for name in args.libraries:
        start = time.perf_counter()
        compile = LIBRARIES[name](vocab)
        print(f"{name:14} {'(vocabulary)':16} {1000 * (time.perf_counter() - start):10.0f}")
        for case, schema, document in CASES:
            tokens = vocab.tokenize(document)
            try:
                times, accepted, compile_ms = [], True, []
                for repeat in range(args.repeats):
                    start = time.perf_counter()
                    step = compile(schema)
                    compile_ms.append(1000 * (time.perf_counter() - start))
                    for token in tokens:
                        begin = time.perf_counter()
                        accepted &= bool(step(token))
                        times.append(time.perf_counter() - begin)
            except NotImplementedError as exc:
                print(f"{name:14} {case:16} {'-':>10}  {exc}")
                continue
            times_us = sorted(t * 1e6 for t in times)
            p99 = times_us[min(len(times_us) - 1, int(0.99 * len(times_us)))]
            # The first compile: xgrammar caches a schema it has seen, the others do not.
            print(f"{name:14} {case:16} {compile_ms[0]:10.1f} {statistics.mean(times_us):8.1f} "
                  f"{statistics.median(times_us):7.1f} {p99:7.1f}  {len(tokens)}{'' if accepted else ' REJECTED'}")


if __name__ == "__main__":
    main()
