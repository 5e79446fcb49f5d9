"""`localserve bench`: a load generator for any OpenAI-compatible server (localserve,
llama.cpp's and llama-cpp-python's servers, vLLM), measuring what vLLM's
``vllm bench serve`` measures, with its definitions.

    from localserve.bench import BenchConfig, run_benchmark

    result = run_benchmark(BenchConfig(url="http://127.0.0.1:8000", model="stories",
                                       random_input_len=128, random_output_len=128,
                                       num_prompts=64, max_concurrency=32))
    result.metrics.output_throughput, result.to_dict()

Modules: config (the options), tokenizer (localserve's own or the server's /tokenize, for
exact prompt lengths),
datasets (random, sharegpt, prefix-repetition), client (one streamed request, timed),
load (arrival times, concurrency cap, warm-ups), metrics (the figures), spec_decode (the
server's speculative-decoding counters over the run), runner (a whole run), report
(progress bar, tables, JSON, plot).
"""

from __future__ import annotations

from .client import RequestRecord
from .config import BenchConfig, BenchError, parse_goodput, parse_percentiles
from .datasets import SampleRequest
from .metrics import Distribution, Metrics, compute_metrics
from .runner import BenchResult, Progress, arun_benchmark, run_benchmark

__all__ = ["BenchConfig", "BenchError", "BenchResult", "Distribution", "Metrics", "Progress", "RequestRecord",
           "SampleRequest", "arun_benchmark", "compute_metrics", "parse_goodput", "parse_percentiles",
           "run_benchmark"]
