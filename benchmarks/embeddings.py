"""Embeddings: localserve against llama-server (``--embedding``) on the same GGUF file.

    python benchmarks/llama_server.py                  # once: build llama-server (~20 min)
    python benchmarks/embeddings.py                    # Qwen3-Embedding-0.6B shape, Q8_0
    python benchmarks/embeddings.py --types F16 Q8_0 --repeats 3

The model: random weights at Qwen3-Embedding-0.6B's shape (28 layers, hidden 1024, 16/8
heads of 128, q/k norms, 151,669-token vocabulary, last-token pooling over the EOS its
tokenizer appends), written by real_shapes.py and quantized by llama.cpp's quantizer.

Workloads, each server started in turn with the same thread count:

* ``ingest``: one client embeds 128 documents of 256 tokens, 32 per /v1/embeddings
  request, one request after another (a retrieval index being built); tokens/s.
* ``query``: one client embeds 20-token queries one at a time; median latency in ms.
* ``clients``: 16 clients each embed 8 queries of 20 tokens, one per request; requests/s.

llama-server runs with ``-np S -c S*ctx`` (``--llama-slots``) and a physical batch as large
as the logical one (an input must fit one), localserve with ``--max-num-seqs 32``. With --repeats R the systems
alternate and the report gives the median and the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_server  # noqa: E402
from real_shapes import SHAPES, kv_bytes_per_token, model_path, peak_rss  # noqa: E402
from servers import free_port, serving  # noqa: E402

SHAPE = "qwen3-embedding-0.6b"
CONTEXT = 512
SLOTS = 16
UNITS = {"ingest": "tokens/s", "query": "latency ms", "clients": "requests/s"}
LOWER_IS_BETTER = {"query"}
SYSTEMS = ("localserve", "llama.cpp")


def texts(count: int, length: int, seed: int) -> list[str]:
    """Texts of ``length`` tokens: one synthetic vocabulary piece per character (see
    real_shapes.write_random_gguf), so both servers see the same token counts."""
    vocab = SHAPES[SHAPE].vocab
    pieces = [chr(c) for c in range(0x4E00, 0x4E00 + vocab) if not 0xD800 <= c < 0xE000][: vocab - 260]
    rng = np.random.default_rng(seed)
    return ["".join(pieces[int(i)] for i in rng.integers(0, len(pieces), length)) for _ in range(count)]


def command(system: str, path: Path, port: int, threads: int, slots: int) -> list[str]:
    if system == "localserve":
        return [sys.executable, "-m", "localserve.cli", "serve", "--model", f"bench={path}", "--device", "cpu",
                "--port", str(port), "--log-level", "warning", "--max-num-seqs", "32", "--max-model-len",
                str(CONTEXT), "--kv-cache-memory", str(32 * CONTEXT * kv_bytes_per_token(path)),
                "--threads", str(threads), "--insecure-no-auth"]
    binary = llama_server.binary()
    if binary is None:
        raise SystemExit("llama-server is not built: run python benchmarks/llama_server.py first")
    return [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "--embedding", "-np", str(slots), "-c", str(slots * CONTEXT), "-b", "2048",
            "-ub", "2048", "--no-webui"]


async def embed(client: httpx.AsyncClient, inputs: list[str]) -> None:
    response = await client.post("/v1/embeddings", json={"model": "bench", "input": inputs})
    response.raise_for_status()
    data = response.json()["data"]
    assert len(data) == len(inputs) and len(data[0]["embedding"]) == SHAPES[SHAPE].hidden


async def workload(url: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await embed(client, texts(4, 64, seed=1))  # warm-up
        if name == "ingest":
            documents = texts(128, 255, seed=2)  # + BOS and EOS: 257 tokens each
            start = time.perf_counter()
            for first in range(0, len(documents), 32):
                await embed(client, documents[first:first + 32])
            return len(documents) * 257 / (time.perf_counter() - start)
        if name == "query":
            latencies = []
            for query in texts(20, 19, seed=3):
                start = time.perf_counter()
                await embed(client, [query])
                latencies.append((time.perf_counter() - start) * 1000)
            return statistics.median(latencies)
        queries = texts(16 * 8, 19, seed=4)

        async def one_client(index: int) -> None:
            for query in queries[index * 8:(index + 1) * 8]:
                await embed(client, [query])

        start = time.perf_counter()
        await asyncio.gather(*(one_client(i) for i in range(16)))
        return len(queries) / (time.perf_counter() - start)


def measure(system: str, path: Path, name: str, threads: int, slots: int, workdir: Path) -> tuple[float, int]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(command(system, path, port, threads, slots), url + "/health", threads, workdir / f"{system}.log") as process:
        value = asyncio.run(workload(url, name))
        return value, peak_rss(process.pid)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q8_0"])
    parser.add_argument("--workloads", nargs="+", default=list(UNITS), choices=list(UNITS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-slots", type=int, default=SLOTS, help="llama-server's -np")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    args = parser.parse_args(argv)
    lines = []
    with tempfile.TemporaryDirectory(prefix="localserve-embeddings-") as tmp:
        for ftype in args.types:
            path = model_path(SHAPE, ftype)
            for name in args.workloads:
                runs: dict[str, list[float]] = {system: [] for system in SYSTEMS}
                rss: dict[str, int] = {}
                for repeat in range(args.repeats):
                    for system in SYSTEMS if repeat % 2 == 0 else SYSTEMS[::-1]:
                        if system not in args.systems:
                            continue
                        value, peak = measure(system, path, name, args.threads, args.llama_slots, Path(tmp))
                        runs[system].append(value)
                        rss[system] = max(rss.get(system, 0), peak)
                        print(f"  {ftype} {name} {system}: {value:.1f} {UNITS[name]}", flush=True)
                if not all(runs.values()):
                    continue  # one system alone: its figures are printed above
                ours, theirs = statistics.median(runs["localserve"]), statistics.median(runs["llama.cpp"])
                ratio = theirs / ours if name in LOWER_IS_BETTER else ours / theirs
                cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in runs.values()]
                lines.append(f"{SHAPE} {ftype} {name:8s} {UNITS[name]:11s} {cells[0]:>22s} {cells[1]:>22s} "
                             f"{ratio:6.2f} {rss['localserve'] / rss['llama.cpp']:6.2f}")
    print(f"\n{args.threads} threads; medians of {args.repeats} runs (min-max); ratio > 1: localserve better")
    print(f"{'model':30s} {'workload':8s} {'unit':11s} {'localserve':>22s} {'llama.cpp':>22s} {'ratio':>6s} "
          f"{'RSS o/t':>6s}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
