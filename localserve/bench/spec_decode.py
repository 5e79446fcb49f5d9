"""Speculative decoding's counters, read from the server's /metrics before and after a run
(localserve's names and vLLM's), so the report says how many draft tokens were kept. A server
that exports neither (llama.cpp's) gives none, and the report says nothing of drafts."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Each count's counter families: localserve's, vLLM's.
_FAMILIES = {
    "drafts": ("localserve_spec_decode_num_drafts", "vllm:spec_decode_num_drafts"),
    "draft_tokens": ("localserve_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
    "accepted_tokens": ("localserve_spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
}


@dataclass(frozen=True, slots=True)
class SpecDecodeCounts:
    drafts: float  # verifications of one or more draft tokens
    draft_tokens: float  # draft tokens verified
    accepted_tokens: float  # of those, kept

    def since(self, before: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                                self.accepted_tokens - before.accepted_tokens)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def acceptance_length(self) -> float | None:
        """Tokens a verification yields on average: the kept drafts and the sampled one (vLLM's)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts > 0 else None

    def to_dict(self) -> dict[str, float | None]:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate, "acceptance_length": self.acceptance_length}


def parse_spec_decode(text: str) -> SpecDecodeCounts | None:
    """The counts in a Prometheus exposition, summed over their labels (models); None when
    it has not all three."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for field, names in _FAMILIES.items():
            if family.name in names:
                totals[field] = totals.get(field, 0.0) + sum(
                    sample.value for sample in family.samples if sample.name.endswith("_total"))
    return SpecDecodeCounts(**totals) if len(totals) == len(_FAMILIES) else None


async def read_spec_decode(http: httpx.AsyncClient, url: str) -> SpecDecodeCounts | None:
    """The server's counts now, or None where it has no /metrics or exports none."""
    try:
        response = await http.get(url + "/metrics", timeout=10.0)
        response.raise_for_status()
        return parse_spec_decode(response.text)
    except (httpx.HTTPError, ValueError):
        return None
