"""Speed on a busy machine: localserve and llama-server side by side, each with and without
a CPU-bound competitor (a Python busy loop, one core's worth of work), at the same thread
count, on the same GGUF file.

    python benchmarks/contention.py                          # Llama-3.2-1B shape, Q4_K_M
    python benchmarks/contention.py --repeats 3 --json out.json

A desktop always has other work running. Worker threads that spin while they wait for each
other, or for the event loop, take the cores that work needs and collapse throughput instead
of sharing it; the figure that matters is what fraction of its quiet-machine speed each
system keeps when a competitor runs.

Workloads, each against a freshly started server:

* ``streamed``: one client, 4 requests of 128 tokens in / 128 out, streamed; output tok/s
  (tokens over the time from sending each request to its last token).
* ``plain``: the same requests not streamed; output tok/s the same way. Streaming should cost
  nothing: the two should agree within 10%.
* ``16``: 16 clients streaming at once, 32 requests of 64 in / 32 out; output tok/s.

The report gives each system's median (and range) quiet and busy, the share it keeps busy,
and localserve's figure over llama-server's in each condition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_shapes  # noqa: E402
from host_facts import cpu_summary  # noqa: E402
from servers import free_port, serving  # noqa: E402

WORKLOADS = ("streamed", "plain", "16")
SYSTEMS = ("localserve", "llama.cpp")
AUTH = {"Authorization": "Bearer bench"}


@dataclass(frozen=True)
class Sample:
    system: str
    workload: str
    busy: bool
    tokens_per_s: float


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, tokens: int, stream: bool) -> tuple[int, float]:
    """(output tokens, seconds from sending to the last token) of one completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    start = time.perf_counter()
    if not stream:
        response = await client.post(f"{url}/v1/completions", json=body, headers=AUTH)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"]), time.perf_counter() - start
    pieces = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += sum(1 for choice in json.loads(line[6:]).get("choices", []) if choice.get("text"))
    return pieces, time.perf_counter() - start


async def run_workload(url: str, workload: str, prompts: list[str]) -> float:
    # No kept-alive connections: llama-server closes idle ones, and a reused closed one fails.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        if workload in ("streamed", "plain"):
            done = [await one_request(client, url, prompt, 128, workload == "streamed") for prompt in prompts]
            return sum(t for t, _ in done) / sum(s for _, s in done)
        queue = list(prompts)
        start = time.perf_counter()

        async def worker() -> int:
            produced = 0
            while queue:
                produced += (await one_request(client, url, queue.pop(), 32, True))[0]
            return produced

        produced = sum(await asyncio.gather(*(worker() for _ in range(16))))
        return produced / (time.perf_counter() - start)


def competitor() -> subprocess.Popen[bytes]:
    """One core's worth of CPU-bound work, as a build or a browser tab would be."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def measure(system: str, path: Path, workload: str, busy: bool, threads: int, workdir: Path) -> Sample:
    from localserve.bench.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(path))
    count, length = (4, 128) if workload != "16" else (32, 64)
    prompts = [tokenizer.decode(p[1:]) for p in real_shapes.prompt_ids(tokenizer.vocab_size, count, length, seed=7)]
    clients = 16 if workload == "16" else 1
    ctx = 1024 if clients == 1 else 256  # room for a prompt that re-tokenizes longer
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = (real_shapes.localserve_command if system == "localserve" else real_shapes.llama_server_command)(
        path, port, threads, clients, ctx)
    ready = url + ("/health" if system == "localserve" else "/v1/models")
    with serving(command, ready, threads, workdir / f"{system}.log"):
        asyncio.run(run_workload(url, "plain", prompts[:1]))  # warm-up: first-use costs are not the point here
        load = competitor() if busy else None
        try:
            value = asyncio.run(run_workload(url, workload, prompts))
        finally:
            if load is not None:
                load.kill()
                load.wait()
    return Sample(system, workload, busy, value)


def report(samples: list[Sample]) -> list[dict]:
    rows = []
    for workload in dict.fromkeys(s.workload for s in samples):
        row: dict = {"workload": workload}
        for system in SYSTEMS:
            for busy in (False, True):
                values = [s.tokens_per_s for s in samples if (s.system, s.workload, s.busy) == (system, workload, busy)]
                row[f"{system} {'busy' if busy else 'quiet'}"] = {
                    "median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}
            row[f"{system} kept"] = row[f"{system} busy"]["median"] / row[f"{system} quiet"]["median"]
        for condition in ("quiet", "busy"):
            row[f"ratio {condition}"] = row[f"localserve {condition}"]["median"] / row[f"llama.cpp {condition}"]["median"]
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    def cell(figures: dict) -> str:
        return f"{figures['median']:6.1f} ({figures['min']:.1f}-{figures['max']:.1f})"

    print(f"{'workload':9s} {'system':11s} {'quiet tok/s':>20s} {'busy tok/s':>20s} {'kept':>6s}")
    for row in rows:
        for system in SYSTEMS:
            print(f"{row['workload']:9s} {system:11s} {cell(row[f'{system} quiet']):>20s} "
                  f"{cell(row[f'{system} busy']):>20s} {row[f'{system} kept']:6.2f}")
        print(f"{'':9s} {'ours/theirs':11s} {row['ratio quiet']:20.2f} {row['ratio busy']:20.2f}")
    by_name = {row["workload"]: row for row in rows}
    if "streamed" in by_name and "plain" in by_name:
        for condition in ("quiet", "busy"):
            streamed = by_name["streamed"][f"localserve {condition}"]["median"]
            plain = by_name["plain"][f"localserve {condition}"]["median"]
            print(f"localserve streamed / not streamed, {condition}: {streamed / plain:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=list(real_shapes.SHAPES))
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(cpu_summary())
    path = real_shapes.model_path(args.shape, args.type)
    samples = []
    with tempfile.TemporaryDirectory(prefix="localserve-contention-") as tmp:
        for _ in range(args.repeats):
            for workload in args.workloads:
                for busy in (False, True):
                    for system in args.systems:  # interleaved: the VM's noise falls on both alike
                        sample = measure(system, path, workload, busy, args.threads, Path(tmp))
                        print(f"  {system:10s} {workload:8s} {'busy' if busy else 'quiet':5s} "
                              f"{sample.tokens_per_s:7.1f} tok/s", flush=True)
                        samples.append(sample)
    if set(args.systems) == set(SYSTEMS):
        rows = report(samples)
        print_rows(rows)
        if args.json:
            args.json.write_text(json.dumps({"host": cpu_summary(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
