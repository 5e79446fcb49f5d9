"""Speculative decoding's options: which drafter, and how many tokens it may propose."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import LocalserveError

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``num_tokens``: the most draft tokens a request verifies in one step (its default:
    a request's ``num_speculative_tokens`` overrides it; 0 turns speculation off).

    ``ngram`` (prompt lookup) proposes what followed the latest earlier occurrence of the
    sequence's last ``ngram_max`` tokens, else of fewer, down to ``ngram_min``: no model,
    free to compute, right where an answer repeats its prompt or itself (edits, quotes,
    code, RAG answers).

    ``draft_model`` runs ``draft_model`` (a .gguf file or HF checkpoint folder: a smaller
    model of the same vocabulary, e.g. Llama-3.2-1B for Llama-3.1-8B) greedily for each
    request's drafts, batched over the requests in its own KV pool."""

    method: str = "ngram"
    num_tokens: int = 0
    ngram_min: int = 2
    ngram_max: int = 4
    # Let each request's recent acceptance choose how many of num_tokens it drafts (none
    # while drafting does not pay); off: always as many as the drafter finds.
    adaptive: bool = True
    draft_model: str | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, f"speculative method {self.method!r} is not one of {', '.join(METHODS)}"),
            (0 <= self.num_tokens <= MAX_DRAFT_TOKENS, f"num_speculative_tokens must be in [0, {MAX_DRAFT_TOKENS}]"),
            ((self.method == "draft_model") == (self.draft_model is not None),
             "a draft model goes with the draft_model method, and that method needs one"),
            (1 <= self.ngram_min <= self.ngram_max <= 16, "the n-gram sizes must satisfy 1 <= min <= max <= 16"),
        ]
        for ok, message in checks:
            if not ok:
                raise LocalserveError(f"invalid speculative option: {message}")


MAX_DRAFT_TOKENS = 16
