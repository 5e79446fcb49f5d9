"""What a benchmark run is asked to do: one dataclass, shared by the CLI and the Python API.

Names and defaults follow vLLM's ``vllm bench serve`` where it has the same knob, so a
command line moves between the two with few changes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import LocalserveError

DatasetName = Literal["random", "sharegpt", "prefix-repetition"]
Endpoint = Literal["completions", "chat"]
DATASETS: tuple[str, ...] = ("random", "sharegpt", "prefix-repetition")
ENDPOINTS: tuple[str, ...] = ("completions", "chat")
GOODPUT_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


class BenchError(LocalserveError):
    """A benchmark that cannot run (bad option, unreachable server, no tokenizer) or
    whose every request failed; the CLI prints it as one line and exits 1."""


@dataclass
class BenchConfig:
    # -- where and what ------------------------------------------------------------------
    url: str | None = None  # the server's base URL; None: localserve.client.daemon_url()
    model: str | None = None  # the name sent in requests; None: the server's first model
    served_model_name: str | None = None  # sent instead of `model` (then `model` only picks the tokenizer)
    tokenizer: str | None = None  # .gguf file, HF folder or registry name; None: `model`, else the server's /tokenize
    endpoint: Endpoint = "completions"  # /v1/completions or /v1/chat/completions
    api_key: str | None = None  # sent as Bearer; None: env LOCALSERVE_API_KEY
    # -- the dataset ------------------------------------------------------------------------
    dataset_name: DatasetName = "random"
    dataset_path: str | None = None  # a ShareGPT JSON file
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0  # lengths uniform in [L*(1-r), L*(1+r)]
    sharegpt_output_len: int | None = None  # None: the recorded answer's length
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    # -- the load ---------------------------------------------------------------------------
    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is a Poisson process
    max_concurrency: int | None = None  # requests in flight at most (client side)
    num_warmups: int = 0  # copies of the first request sent before measuring
    seed: int = 0
    ignore_eos: bool | None = None  # None: on for random and prefix-repetition (fixed output lengths)
    request_timeout: float = 600.0  # seconds a stream may stay silent before it counts as failed
    # -- what is reported -------------------------------------------------------------------
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: {"ttft": 500, "tpot": 50}

    def __post_init__(self) -> None:
        self.metric_percentiles = tuple(float(p) for p in self.metric_percentiles)
        checks = [
            (self.endpoint in ENDPOINTS, f"endpoint must be one of {', '.join(ENDPOINTS)}"),
            (self.dataset_name in DATASETS, f"dataset must be one of {', '.join(DATASETS)}"),
            (self.num_prompts >= 1, "num_prompts must be at least 1"),
            (self.request_rate > 0, "request_rate must be positive (inf sends all at once)"),
            (self.burstiness > 0, "burstiness must be positive"),
            (self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency must be at least 1"),
            (self.num_warmups >= 0, "num_warmups must be 0 or more"),
            (0.0 <= self.random_range_ratio < 1.0, "random_range_ratio must be in [0, 1)"),
            (self.random_input_len >= 1 and self.random_output_len >= 1, "random lengths must be at least 1"),
            (min(self.prefix_repetition_prefix_len, self.prefix_repetition_suffix_len) >= 0
             and self.prefix_repetition_num_prefixes >= 1 and self.prefix_repetition_output_len >= 1,
             "prefix-repetition lengths must be positive"),
            (all(0 <= p <= 100 for p in self.metric_percentiles), "percentiles must be in [0, 100]"),
            (set(self.goodput) <= set(GOODPUT_METRICS) and all(v > 0 for v in self.goodput.values()),
             f"goodput takes {', '.join(GOODPUT_METRICS)} with positive milliseconds"),
        ]
        for ok, message in checks:
            if not ok:
                raise BenchError(message)
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise BenchError("the sharegpt dataset needs --dataset-path (a ShareGPT JSON file)")

    @property
    def effective_ignore_eos(self) -> bool:
        # Synthetic datasets ask for exact output lengths; real conversations end where
        # the model ends them unless the user says otherwise.
        if self.ignore_eos is not None:
            return self.ignore_eos
        return self.dataset_name in ("random", "prefix-repetition")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["api_key"] = "***" if self.api_key else None  # a result file must not leak it
        data["request_rate"] = _json_number(self.request_rate)
        data["burstiness"] = _json_number(self.burstiness)
        data["metric_percentiles"] = list(self.metric_percentiles)
        data["ignore_eos"] = self.effective_ignore_eos
        return data


def _json_number(value: float) -> float | str:
    # JSON has no infinity; "inf" reads back with float().
    return "inf" if math.isinf(value) else value


def parse_goodput(items: list[str] | tuple[str, ...]) -> dict[str, float]:
    """vLLM's ``--goodput ttft:500 tpot:50`` form (milliseconds); items may also be
    separated by commas or spaces inside one argument."""
    slos: dict[str, float] = {}
    for item in " ".join(items).replace(",", " ").split():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise BenchError(f"goodput {item!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise BenchError(f"goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise BenchError(f"goodput {item!r}: the SLO must be positive")
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> (50.0, 90.0, 99.0), as vLLM's --metric-percentiles."""
    try:
        values = tuple(float(part) for part in text.replace(" ", ",").split(",") if part)
    except ValueError:
        raise BenchError(f"metric percentiles {text!r}: expected numbers separated by commas (e.g. 50,90,99)") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise BenchError(f"metric percentiles {text!r}: each must be in [0, 100]")
    return values
