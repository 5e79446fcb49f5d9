"""Per-request settings, validated on construction: how to generate (``SamplingParams``) or
how to pool an embedding (``PoolingParams``). Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LocalserveError
from .speculative.config import MAX_DRAFT_TOKENS, METHODS
from .output_format import OutputFormat


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives; 0 = only the chosen token
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    skip_special_tokens: bool = True
    output_format: OutputFormat | None = None  # structured output: what the text must match
    # A thinking model whose output begins inside its think block: the tokens that close
    # it. ``output_format`` then holds the answer after them, not the thinking; and with a
    # budget, once this many tokens are out with the block still open, they are forced.
    thinking_end: tuple[int, ...] = ()
    thinking_budget: int | None = None
    # Speculative decoding: the most draft tokens this request verifies a step (0: none);
    # None follows the engine's setting (EngineConfig.speculative). ``speculative_method``:
    # which drafter ("ngram", always there; "draft_model" where the engine has one); None:
    # the engine's.
    num_speculative_tokens: int | None = None
    speculative_method: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (or -1 for no limit)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (all(type(t) is int and t >= 0 for t in self.logit_bias), "logit_bias keys must be token ids (ints >= 0)"),
            (all(isinstance(b, int | float) and -100 <= b <= 100 for b in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            (self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= MAX_DRAFT_TOKENS,
             f"num_speculative_tokens must be in [0, {MAX_DRAFT_TOKENS}]"),
            (self.speculative_method is None or self.speculative_method in METHODS,
             f"speculative_method must be one of {', '.join(METHODS)}"),
            (self.thinking_budget is None or (self.thinking_budget >= 0 and len(self.thinking_end) > 0),
             "thinking_budget must be >= 0 and come with the tokens that end the thinking"),
        ]
        for ok, message in checks:
            if not ok:
                raise LocalserveError(f"invalid sampling parameters: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class PoolingParams:
    """What an embedding request asks for. ``dimensions``: keep the first this many
    values (Matryoshka truncation), applied before normalizing; ``normalize``: scale to
    unit L2 norm (what OpenAI's API and Ollama's /api/embed return)."""

    dimensions: int | None = None
    normalize: bool = True

    def check(self, hidden_size: int) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise LocalserveError(f"dimensions must be in [1, {hidden_size}] (the model's embedding size)")
