"""Serve a random-weight model at a real shape with ``localserve serve`` and drive it with
``localserve bench`` at rising client counts (the GPU proof's serving stage).

    python benchmarks/gpu_serving.py --workdir /tmp/proof [--json FILE]
    python benchmarks/gpu_serving.py --dry-run          # a tiny model on the CPU

Runs, each its own server:

* ``dense``: Llama-3.1-8B's shape in Q4_K_M's types (random K-quant blocks written by
  ``real_shapes.write_random_gguf``; no quantizer needed) at 1, 16, 64 and 256 clients,
  256 tokens in and 128 out: output tokens/s, TTFT and TPOT percentiles, and 64 clients'
  throughput over one client's (the batching target: 10x or more).
* ``offload``: the same model with its GPU KV pool forced small (1 GiB: 8,192 tokens) and
  host memory for swapped requests: 64 clients of 256 in / 64 out (20,480 tokens) do not fit,
  so requests are preempted and their blocks swap out and back; every request must complete.
* ``cpu-moe``: Qwen3-30B-A3B's layer (128 experts of width 768, 8 used, hidden 2048) in 4
  layers, with ``--cpu-moe`` (experts in host memory, run on the CPU): 1 and 16 clients.

A run's failure (the server not starting, a failed request) is recorded, and the next runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_shapes import SHAPES, Shape, write_random_gguf  # noqa: E402
from servers import free_port, serving  # noqa: E402

QWEN3_30B_A3B_LAYERS = Shape("qwen3moe", 4, 2048, 32, 4, 0, 151936, 1000000.0, experts=128, experts_used=8,
                             expert_ffn=768, head_dim=128, tied=False)
TINY = Shape("llama", 2, 256, 4, 2, 512, 4096, 10000.0, tied=False)
TINY_MOE = Shape("qwen3moe", 2, 256, 4, 2, 0, 4096, 10000.0, experts=8, experts_used=2, expert_ffn=256, head_dim=64)
BATCHING_TARGET = 10.0  # 64 clients' output tokens/s over one client's


@dataclass(frozen=True)
class Load:
    clients: int
    prompts: int
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Run:
    name: str
    shape: Shape
    loads: tuple[Load, ...]
    serve_args: tuple[str, ...] = ()


def plan(dry_run: bool) -> list[Run]:
    if dry_run:
        return [Run("dense", TINY, (Load(1, 2, 16, 8), Load(4, 8, 16, 8))),
                Run("cpu-moe", TINY_MOE, (Load(2, 4, 16, 8),), ("--cpu-moe",))]
    return [
        # One wave of requests per load: each client sends one (one client, two).
        Run("dense", SHAPES["llama-3.1-8b"],
            (Load(1, 2, 256, 128), Load(16, 16, 256, 128), Load(64, 64, 256, 128), Load(256, 256, 256, 128)),
            ("--max-num-seqs", "256")),
        Run("cpu-moe", QWEN3_30B_A3B_LAYERS, (Load(1, 2, 128, 32), Load(16, 32, 128, 32)), ("--cpu-moe",)),
        Run("offload", SHAPES["llama-3.1-8b"], (Load(64, 64, 256, 64),),
            ("--max-num-seqs", "64", "--kv-cache-memory", "1GiB", "--cpu-offload-gb", "16")),
    ]


def model_file(workdir: Path, shape: Shape) -> Path:
    path = workdir / f"{shape.arch}-{shape.layers}x{shape.hidden}-Q4_K_M.gguf"
    if not path.exists():
        start = time.perf_counter()
        write_random_gguf(path, shape, random_blocks=True)
        print(f"  wrote {path.name}: {path.stat().st_size / 2**30:.1f} GiB in {time.perf_counter() - start:.0f} s",
              flush=True)
    return path


def bench(url: str, path: Path, load: Load, timeout_s: float) -> dict[str, object]:
    command = [sys.executable, "-m", "localserve.cli", "bench", "--url", url, "--model", "proof", "--tokenizer",
               str(path), "--num-prompts", str(load.prompts), "--max-concurrency", str(load.clients),
               "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
               "--num-warmups", "1", "--metric-percentiles", "50,90,99", "--json", "--no-progress",
               "--request-timeout", str(timeout_s)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"bench exited {done.returncode}: {done.stderr.strip()[-600:]}")
    result = json.loads(done.stdout)
    metrics = result.get("metrics", result)
    keys = ("completed", "failed", "output_throughput", "duration", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms",
            "p99_tpot_ms")
    return {"clients": load.clients, "prompts": load.prompts, "input_len": load.input_len,
            "output_len": load.output_len, **{k: metrics[k] for k in keys if k in metrics}}


def scrape(url: str) -> dict[str, float]:
    """The engine's counters that show the offload path working: preemptions, how many of them
    recomputed instead of swapping, and the blocks that went to the CPU tier and back."""
    text = httpx.get(url + "/metrics", timeout=10).text
    wanted = ("localserve_num_preemptions", "localserve_num_recomputes", "localserve_kv_blocks_swapped_out",
              "localserve_kv_blocks_swapped_in")
    figures: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"(\w+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match and match.group(1).removesuffix("_total") in wanted:
            figures[match.group(1)] = float(match.group(2))
    return figures


def serve_and_bench(run: Run, workdir: Path, logs: Path, device: str, deadline: float) -> dict[str, object]:
    path = model_file(workdir, run.shape)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "localserve.cli", "serve", "--model", f"proof={path}", "--port", str(port),
               "--device", device, "--max-model-len", "2048", "--log-level", "warning", "--insecure-no-auth",
               *run.serve_args]
    record: dict[str, object] = {"run": run.name, "model": path.name, "serve_args": list(run.serve_args),
                                 "loads": []}
    start = time.perf_counter()
    with serving(command, url + "/health", os.cpu_count() or 1, logs / f"server-{run.name}.log"):
        record["start_to_ready_s"] = time.perf_counter() - start
        print(f"  {run.name}: ready in {record['start_to_ready_s']:.0f} s", flush=True)
        for load in run.loads:
            left = deadline - time.monotonic()
            if left < 20:
                record["skipped"] = f"{load.clients} clients and later: the stage's time ran out"
                break
            try:
                figures = bench(url, path, load, timeout_s=left)
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:  # recorded; the next load runs
                figures = {"clients": load.clients, "failed": load.prompts, "error": f"{type(exc).__name__}: "
                           f"{str(exc)[-400:]}"}
            record["loads"].append(figures)  # type: ignore[union-attr]
            print(f"  {run.name}, {load.clients} clients: {figures.get('output_throughput', 0):.0f} output tok/s, "
                  f"TTFT p50 {figures.get('p50_ttft_ms', float('nan')):.0f} ms, "
                  f"TPOT p50 {figures.get('p50_tpot_ms', float('nan')):.1f} ms, "
                  f"{figures.get('failed', '?')} failed", flush=True)
        record["metrics"] = scrape(url)
    loads = {entry["clients"]: entry for entry in record["loads"]}  # type: ignore[union-attr]
    record["failed"] = any(entry.get("failed") for entry in loads.values()) or not loads
    if loads.get(1, {}).get("output_throughput") and loads.get(64, {}).get("output_throughput"):
        ratio = loads[64]["output_throughput"] / loads[1]["output_throughput"]
        record["batching_ratio_64_to_1"] = ratio
        record["batching_target_met"] = ratio >= BATCHING_TARGET
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "localserve-proof")
    parser.add_argument("--json", type=Path, help="write the runs' figures here")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU (checks the path)")
    parser.add_argument("--runs", nargs="*", help="only these runs (dense, offload, cpu-moe)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds for every run together")
    args = parser.parse_args()
    import torch

    deadline = time.monotonic() + args.time_limit
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    args.workdir.mkdir(parents=True, exist_ok=True)
    records = []
    for run in plan(args.dry_run):
        if args.runs and run.name not in args.runs:
            continue
        if deadline - time.monotonic() < 30:
            # Unmeasured, not failed: the record says so and the exit status stays clean.
            records.append({"run": run.name, "skipped": "the stage's time ran out"})
            print(f"  {run.name}: skipped, the stage's time ran out", flush=True)
        else:
            try:
                records.append(serve_and_bench(run, args.workdir, args.json.parent if args.json else args.workdir,
                                               device, deadline))
            except Exception as exc:  # the finding; the next run still goes
                records.append({"run": run.name, "failed": True,
                                "error": f"{type(exc).__name__}: {str(exc)[-800:]}"})
                print(f"  {run.name} failed: {records[-1]['error']}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"device": device, "runs": records}, indent=1))
    sys.exit(1 if any(record.get("failed") for record in records) else 0)


if __name__ == "__main__":
    main()
