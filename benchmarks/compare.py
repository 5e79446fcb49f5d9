"""Side by side: localserve vs llama-cpp-python's server vs HF transformers, same file, same prompts.

    python benchmarks/compare.py                       # Q8_0 and Q4_0, 32 clients, 128 in / 128 out
    python benchmarks/compare.py --types Q8_0 --num-prompts 4 --concurrency 4 --input-len 32 --output-len 16
    python benchmarks/compare.py --model my.gguf --skip-hf --json result.json

What it measures, per model file:

* localserve's server and llama-cpp-python's OpenAI server (``python -m llama_cpp.server``),
  each started as a subprocess on a free port with the same thread count, one at a time
  so they never compete for the CPU, driven by localserve's own load generator
  (``localserve.bench``) with the identical request list: --num-prompts random prompts of
  --input-len tokens, --concurrency clients, --output-len tokens each, EOS ignored,
  temperature 0. Figures as vLLM's ``bench serve`` defines them: output and total
  tokens/s, mean TTFT and mean TPOT.
* The same two servers with one client (--single-prompts prompts sent one after another):
  the issue's "single-stream decode >= 0.5x llama-cpp-python" target.
* HF transformers on the same GGUF file (it dequantizes to fp32) with the same prompt
  token ids, greedy, exactly --output-len new tokens: one prompt at a time, then all of
  them as one left-padded static batch. Only throughput and total time apply there.

Without --model it builds the ~100M-parameter random llama of benchmarks/gguf_decode.py
and quantizes it with llama.cpp's quantizer to each of --types. The ratio column is
localserve's output tokens/s over that row's (above 1: localserve is faster).

Needs: llama-cpp-python with its server extras (sse-starlette, starlette-context,
pydantic-settings), transformers with gguf and accelerate (or --skip-hf).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # localserve and tests.gguf_writers from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling gguf_decode module

from gguf_decode import build_f32_gguf, quantize
from servers import free_port, serving

from localserve.bench import (
    BenchConfig,
    BenchResult,
    SampleRequest,
    arun_benchmark,
    compute_metrics,
)
from localserve.bench.datasets import sample_requests
from localserve.bench.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from localserve.text.tokenizer import Tokenizer

LOCALSERVE = "localserve"
LLAMA_CPP = "llama-cpp-python"
HF_SEQUENTIAL = "HF one at a time"
HF_BATCH = "HF static batch"


@dataclass
class Figures:
    """One system's result on one workload; latencies are None where they do not apply (HF)."""

    system: str
    workload: str
    output_tps: float
    total_tps: float
    duration_s: float
    mean_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    completed: int = 0
    failed: int = 0


# -- models -----------------------------------------------------------------------------------

def prepare_models(args: argparse.Namespace, workdir: Path) -> dict[str, Path]:
    """{label: GGUF file}: the file given with --model, else the random model quantized per type."""
    if args.model:
        path = Path(args.model).resolve()
        return {path.stem: path}
    source = workdir / "f32.gguf"
    build_f32_gguf(source)
    models = {}
    for ftype in args.types:
        target = workdir / f"{ftype}.gguf"
        with quiet_stderr():  # llama.cpp's quantizer logs every tensor; a failure still raises
            quantize(source, target, ftype)
        models[ftype] = target
    return models


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C libraries write there, past Python's sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# -- workload ---------------------------------------------------------------------------------

def build_requests(tokenizer: Tokenizer, args: argparse.Namespace) -> list[SampleRequest]:
    """The random dataset of ``localserve bench``, sampled once so every system gets the same prompts."""
    config = bench_config(args, url="http://127.0.0.1:0", concurrency=args.concurrency)
    return sample_requests(config, tokenizer)


def bench_config(args: argparse.Namespace, url: str, concurrency: int) -> BenchConfig:
    return BenchConfig(url=url, num_prompts=args.num_prompts, random_input_len=args.input_len,
                       random_output_len=args.output_len, max_concurrency=concurrency, ignore_eos=True,
                       # One warm-up request keeps first-call costs (kernel builds, allocations) out of the figures.
                       num_warmups=1, seed=args.seed)


def prompt_ids(tokenizer: Tokenizer, requests: list[SampleRequest]) -> list[list[int]]:
    """The token ids a server sees for each prompt (BOS included), for HF, which takes ids."""
    return [tokenizer.encode(sample.prompt) for sample in requests]


# -- servers ----------------------------------------------------------------------------------

def localserve_command(path: Path, port: int, args: argparse.Namespace) -> list[str]:
    # --max-num-seqs at least the client count so the whole load is one running batch.
    return [sys.executable, "-m", "localserve.cli", "serve", "--model", f"bench={path}", "--device", "cpu",
            "--port", str(port), "--log-level", "warning", "--max-num-seqs", str(max(args.concurrency, 1)),
            "--kv-cache-memory", args.kv_cache_memory]


def llama_cpp_command(path: Path, port: int, args: argparse.Namespace) -> list[str]:
    # interrupt_requests defaults to true there: a new request would cut the running stream
    # short, so concurrent clients would get truncated outputs. It serves one sequence at a
    # time; the others wait in its queue (and that wait shows in their TTFT).
    n_ctx = 1 << math.ceil(math.log2(args.input_len + args.output_len + 16))
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
            "--n_ctx", str(max(n_ctx, 512)), "--interrupt_requests", "false", "--verbose", "false"]


def bench_server(url: str, tokenizer: Tokenizer, requests: list[SampleRequest], args: argparse.Namespace,
                 system: str, workload: str, concurrency: int) -> tuple[Figures, BenchResult]:
    config = bench_config(args, url, concurrency)
    result = with_max_tokens_counted(asyncio.run(arun_benchmark(config, tokenizer=tokenizer, requests=requests)))
    return server_figures(result, system, workload), result


def with_max_tokens_counted(result: BenchResult) -> BenchResult:
    """Count max_tokens for streams that sent no usage (llama-cpp-python's server sends none).

    The load generator then re-tokenizes the streamed text, and a random-weight model's
    byte-level output merges into fewer tokens (about 100 of 128 here), which would
    understate that server's throughput by a fifth. With EOS suppressed it generates
    exactly max_tokens (its non-streamed usage says so, finish_reason "length")."""
    fixed = 0
    for record in result.records:
        if record.success and record.output_tokens_from == "tokenizer":
            record.output_tokens, record.output_tokens_from = record.expected_output_len, "max_tokens"
            fixed += 1
    if fixed:
        m = result.metrics
        result.metrics = compute_metrics(result.records, m.duration, result.config.metric_percentiles,
                                         result.config.goodput)
    return result


def server_figures(result: BenchResult, system: str, workload: str) -> Figures:
    m = result.metrics
    if m.failed:
        print(f"  {system}: {m.failed} requests failed, first: {result.first_error}", flush=True)
    ttft, tpot = m.latencies.get("ttft"), m.latencies.get("tpot")
    return Figures(system, workload, m.output_throughput, m.total_token_throughput, m.duration,
                   ttft.mean if ttft else None, tpot.mean if tpot else None, m.completed, m.failed)


def run_servers(path: Path, tokenizer: Tokenizer, requests: list[SampleRequest], args: argparse.Namespace,
                workdir: Path) -> tuple[list[Figures], list[Figures]]:
    """(loaded rows, single-stream rows) for both servers, each server started and stopped in turn."""
    loaded, single = [], []
    servers = ((LOCALSERVE, localserve_command, "/health"), (LLAMA_CPP, llama_cpp_command, "/v1/models"))
    for system, command, ready_path in servers:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        print(f"  {system}: starting on port {port}", flush=True)
        with serving(command(path, port, args), url + ready_path, args.threads, workdir / f"{system}.log"):
            figures, _ = bench_server(url, tokenizer, requests, args, system,
                                      f"{len(requests)} prompts, {args.concurrency} clients", args.concurrency)
            print(f"  {system}: {figures.output_tps:.1f} output tok/s", flush=True)
            loaded.append(figures)
            one, _ = bench_server(url, tokenizer, requests[:args.single_prompts], args, system,
                                  f"{args.single_prompts} prompts, 1 client", 1)
            print(f"  {system} single stream: {one.output_tps:.1f} output tok/s", flush=True)
            single.append(one)
    return loaded, single


# -- HF transformers --------------------------------------------------------------------------

def load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    # transformers reads GGUF from a folder + file name and dequantizes every tensor.
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, output_len: int) -> None:
    # min_new_tokens = max_new_tokens: EOS cannot end a sequence early, as ignore_eos on the servers.
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=output_len,
                       min_new_tokens=output_len, do_sample=False, pad_token_id=0)


def hf_sequential(model: Any, prompts: list[list[int]], output_len: int) -> Figures:
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        tensor = torch.tensor([ids])
        hf_generate(model, tensor, torch.ones_like(tensor), output_len)
        if i == 0 and len(prompts) > 1:
            estimate = (time.perf_counter() - start) * len(prompts)
            print(f"  {HF_SEQUENTIAL}: about {estimate:.0f}s for {len(prompts)} prompts (--skip-hf skips it)",
                  flush=True)
    return throughput_figures(HF_SEQUENTIAL, prompts, output_len, time.perf_counter() - start)


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch, padded on the left so every row's last prompt token sits at the end."""
    width = max(len(ids) for ids in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def hf_batch(model: Any, prompts: list[list[int]], output_len: int) -> Figures:
    ids, mask = left_padded(prompts)
    start = time.perf_counter()
    hf_generate(model, ids, mask, output_len)
    return throughput_figures(HF_BATCH, prompts, output_len, time.perf_counter() - start)


def throughput_figures(system: str, prompts: list[list[int]], output_len: int, seconds: float) -> Figures:
    output = len(prompts) * output_len
    total = output + sum(len(ids) for ids in prompts)
    return Figures(system, f"{len(prompts)} prompts", output / seconds, total / seconds, seconds,
                   completed=len(prompts))


def run_hf(path: Path, prompts: list[list[int]], output_len: int) -> list[Figures]:
    print(f"  HF transformers: loading {path.name} (dequantized to fp32)", flush=True)
    model = load_hf(path)
    hf_generate(model, torch.tensor([prompts[0][:8]]), torch.ones((1, min(8, len(prompts[0]))), dtype=torch.long), 2)
    rows = [hf_sequential(model, prompts, output_len)]
    print(f"  {HF_SEQUENTIAL}: {rows[-1].output_tps:.1f} output tok/s", flush=True)
    rows.append(hf_batch(model, prompts, output_len))
    print(f"  {HF_BATCH}: {rows[-1].output_tps:.1f} output tok/s", flush=True)
    return rows


# -- report -----------------------------------------------------------------------------------

def ratio(reference: Figures | None, row: Figures) -> float | None:
    """localserve's output tokens/s over the row's; None when either is missing or zero."""
    if reference is None or reference.output_tps <= 0 or row.output_tps <= 0:
        return None
    return reference.output_tps / row.output_tps


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[Figures]) -> str:
    """system | output tok/s | total tok/s | mean TTFT ms | mean TPOT ms | total s | ratio,
    the ratio against the localserve row (the first row named localserve)."""
    reference = next((r for r in rows if r.system == LOCALSERVE), None)
    header = (f"{'system':18s} {'workload':28s} {'output tok/s':>12s} {'total tok/s':>12s} {'mean TTFT ms':>12s} "
              f"{'mean TPOT ms':>12s} {'total s':>8s} {'ratio':>6s}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.system:18s} {r.workload:28s} {r.output_tps:12.1f} {r.total_tps:12.1f} "
                     f"{_cell(r.mean_ttft_ms, '12.1f'):>12s} {_cell(r.mean_tpot_ms, '12.1f'):>12s} "
                     f"{r.duration_s:8.1f} {_cell(ratio(reference, r), '6.2f'):>6s}")
    return "\n".join(lines)


def decode_ratio(ours: Figures | None, theirs: Figures | None) -> float | None:
    """Decode speed alone, their mean TPOT over ours: the prompt's prefill (in TTFT) left out."""
    if ours is None or theirs is None or not ours.mean_tpot_ms or not theirs.mean_tpot_ms:
        return None
    return theirs.mean_tpot_ms / ours.mean_tpot_ms


def single_stream_line(rows: list[Figures]) -> str:
    """Both servers' one-client figures and localserve's ratios against llama-cpp-python,
    judged against the issue's target (single-stream decode >= 0.5x llama-cpp-python)."""
    by_system = {r.system: r for r in rows}
    ours, theirs = by_system.get(LOCALSERVE), by_system.get(LLAMA_CPP)
    parts = [f"{r.system} {r.output_tps:.1f} tok/s (TTFT {_cell(r.mean_ttft_ms, '.0f')} ms, "
             f"TPOT {_cell(r.mean_tpot_ms, '.1f')} ms)" for r in rows]
    line = "single stream: " + ", ".join(parts)
    for name, value in (("output tok/s", ratio(ours, theirs) if theirs else None),
                        ("decode (TPOT)", decode_ratio(ours, theirs))):
        if value is not None:
            line += f"\n  ratio by {name}: {value:.2f} ({'meets' if value >= 0.5 else 'misses'} the >= 0.5x target)"
    return line


# -- main -------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0"], help="llama.cpp quant types to build")
    parser.add_argument("--model", help="an existing .gguf file instead of the random model")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32, help="clients in flight at once")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--single-prompts", type=int, default=4, help="prompts sent one by one for single stream")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-memory", default="2GiB", help="localserve's --kv-cache-memory")
    parser.add_argument("--skip-hf", action="store_true",
                        help="skip HF transformers (one at a time at 32 x 128 tokens takes minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    args = parser.parse_args(argv)
    args.single_prompts = max(1, min(args.single_prompts, args.num_prompts))
    return args


def compare_one(label: str, path: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    print(f"\n== {label}: {path.name}", flush=True)
    tokenizer = load_tokenizer(str(path))
    requests = build_requests(tokenizer, args)
    loaded, single = run_servers(path, tokenizer, requests, args, workdir)
    if not args.skip_hf:
        loaded += run_hf(path, prompt_ids(tokenizer, requests), args.output_len)
    return {"label": label, "file": str(path), "rows": [asdict(r) for r in loaded],
            "single_stream": [asdict(r) for r in single], "table": format_table(loaded),
            "single_stream_line": single_stream_line(single)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # HF runs in this process; the servers get the same count
    results = []
    with tempfile.TemporaryDirectory(prefix="localserve-compare-") as tmp:
        for label, path in prepare_models(args, Path(tmp)).items():
            results.append(compare_one(label, path, args, Path(tmp)))
    print(f"\n{args.num_prompts} prompts, {args.input_len} in / {args.output_len} out tokens, "
          f"{args.concurrency} clients, {args.threads} threads; ratio = localserve output tok/s / that row's")
    for result in results:
        print(f"\n{result['label']}\n{result['table']}\n{result['single_stream_line']}")
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
