"""Speculative decoding (docs/architecture.md): drafters propose tokens, one step of the
model verifies every running request's drafts in the batch, and the sampling rule keeps
what the model would have produced. ``speculator.Speculator`` is the engine's one entry;
this module itself stays light (the CLI reads the options without numpy or torch)."""

from .config import MAX_DRAFT_TOKENS, METHODS, SpeculativeConfig

__all__ = ["MAX_DRAFT_TOKENS", "METHODS", "SpeculativeConfig"]
