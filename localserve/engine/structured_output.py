"""Structured outputs: a request's tokens held to a JSON schema, any JSON object, a regex,
a list of choices or a grammar, by llguidance (the library llama.cpp and vLLM use).

Why llguidance (benchmarks/structured_mask.py, Mistral-Nemo's 131,072-token vocabulary, one
CPU thread): a mask costs 25-65 µs a token on average against xgrammar's 20-27 µs, both
negligible beside a decode step; but a new schema compiles in about 1 ms against xgrammar's
2-37 ms (agents send new tool schemas with every request, and a compile blocks the step),
it needs no other package, takes Lark and llama.cpp's GBNF grammars, and covers JSON Schema
more fully. outlines-core compiled in 137-423 ms, took 0.7-1.2 ms a token, and cannot
express free-form JSON.

Per request a ``Constraint`` follows the tokens: the runner asks every constrained row for
its next-token mask on a worker thread while the model runs (llguidance releases the GIL),
the sampler sets the forbidden tokens' logits to -inf, and the output processor feeds the
chosen token back. JSON comes out with ``", "`` and ``": "`` between items and no other
whitespace, so a small model cannot wander off into endless blank space.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ..errors import LocalserveError
from .output_format import OutputFormat, first_line

if TYPE_CHECKING:
    import llguidance

    from ..text.tokenizer import Tokenizer

class Constraint:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (an EOS the
        request was told to ignore, a stop token it did not expect)."""
        return self.matcher.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the start, the grammar allows next (draft tokens
        are cut there before they are verified)."""
        return self.matcher.validate_tokens(tokens)

    @property
    def finished(self) -> bool:
        """The grammar has ended: nothing but EOS could follow."""
        return self.matcher.is_stopped()


class StructuredOutputs:
    """One model's grammar machinery: its vocabulary as llguidance sees it (indexed when
    the first constrained request arrives, so models never asked pay nothing) and a worker
    thread that computes the masks of a step's constrained rows while the model runs."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structured-output")
        self._executor: llguidance.LLExecutor | None = None

    def constraint(self, output_format: OutputFormat) -> Constraint:
        """A fresh matcher for ``output_format``; raises LocalserveError naming what is wrong."""
        import llguidance

        grammar = output_format.grammar()
        if self._llg_tokenizer is None:
            # The HF tokenizers object (GGUF vocabularies are rebuilt as one).
            self._llg_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=self._eos_token_ids or None)
        matcher = llguidance.LLMatcher(self._llg_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise LocalserveError(f"structured output {output_format.kind}: {first_line(matcher.get_error())}")
        return Constraint(matcher)

    def masks(self, requests: list[tuple[Constraint | None, list[int]]]) -> Future[tuple[list[int], torch.Tensor]] | None:
        """Start computing the next-token masks of the constrained rows of a step whose
        sampled requests are ``requests``: each one's constraint (None: free) and draft
        tokens, its rows one per position it samples (1 + its drafts; the mask of a draft's
        position is the grammar's after the drafts before it). None if no row is
        constrained. The future gives the row indices and their bitmasks, int32
        ``[rows, ceil(vocab / 32)]``."""
        rows: list[int] = []
        entries = []
        first = 0
        for constraint, drafts in requests:
            if constraint is not None:
                entries.append((constraint.matcher, len(rows), list(drafts)))
                rows.extend(range(first, first + 1 + len(drafts)))
            first += 1 + len(drafts)
        if not entries:
            return None
        return self._worker.submit(self._fill, rows, entries)

    def _fill(self, rows: list[int], entries: list) -> tuple[list[int], torch.Tensor]:  # type: ignore[type-arg]
        import llguidance  # not llguidance.torch: importing it sets up torch.compile

        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=1)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        plain = [(matcher, row) for matcher, row, drafts in entries if not drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, len(rows))
        drafted = [entry for entry in entries if entry[2]]
        if drafted:  # each matcher steps through its drafts for their masks, and is rolled back
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), words * 4, len(rows))
        return rows, bitmask


def with_forced_tokens(masks: tuple[list[int], torch.Tensor] | None, forced: dict[int, int],
                       vocab_size: int) -> tuple[list[int], torch.Tensor]:
    """``masks`` (rows and bitmasks) with each row in ``forced`` (row -> token) allowed
    that one token alone, in place of any grammar's mask."""
    rows, bitmask = masks if masks is not None else ([], torch.zeros(0, (vocab_size + 31) // 32, dtype=torch.int32))
    new_rows = [row for row in forced if row not in rows]
    if new_rows:
        rows = rows + new_rows
        bitmask = torch.cat([bitmask, torch.zeros(len(new_rows), bitmask.shape[1], dtype=torch.int32)])
    for row, token in forced.items():
        word = torch.zeros(bitmask.shape[1], dtype=torch.int64)
        word[token // 32] = 1 << (token % 32)
        bitmask[rows.index(row)] = word.to(torch.int32)  # bit 31 wraps to the sign bit, as llguidance's does
    return rows, bitmask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[rows, vocab_size]`` from bitmasks of 32 tokens a word (bit ``i % 32`` of
    word ``i // 32``)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
