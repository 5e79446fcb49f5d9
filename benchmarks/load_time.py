"""Start to ready: how long after its command starts each server answers with the model
loaded, and how long its first request (16 tokens in, 8 out) then takes.

    python benchmarks/load_time.py                                   # Llama-3.2-1B shape, Q4_K_M
    python benchmarks/load_time.py --shape llama-3.1-8b --repeats 3

The same GGUF file (benchmarks/real_shapes.py) through ``localserve serve`` and
``llama-server``, one at a time, interleaved. localserve's first load converts the file to
its CPU layout and stores it (``--prepared-cache``, in a fresh LOCALSERVE_HOME); every later
load maps that. "warm": the files are in the page cache; "cold": the page cache is dropped
first (needs root; skipped otherwise), so both read the weights from disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_shapes  # noqa: E402
from host_facts import cpu_summary  # noqa: E402
from servers import free_port, stop, wait_ready  # noqa: E402


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def start_to_ready(command: list[str], ready: str, url: str, env: dict[str, str], log: Path) -> tuple[float, float]:
    """(seconds until ``ready`` answers 200, seconds the first request then takes)."""
    start = time.perf_counter()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(process, ready, log, poll_s=0.02)
        ready_s = time.perf_counter() - start
        first = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", timeout=600, headers={"Authorization": "Bearer bench"},
                              json={"model": "bench", "prompt": [1, *range(300, 315)], "max_tokens": 8,
                                    "temperature": 0})
        response.raise_for_status()
        return ready_s, time.perf_counter() - first
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=list(real_shapes.SHAPES))
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = real_shapes.model_path(args.shape, args.type)
    print(cpu_summary())
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="localserve-load-") as tmp:
        env = dict(os.environ, LOCALSERVE_HOME=str(Path(tmp) / "home"), OMP_NUM_THREADS=str(args.threads))

        def run(system: str, temperature: str) -> None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            maker = real_shapes.localserve_command if system == "localserve" else real_shapes.llama_server_command
            command = maker(path, port, args.threads, 1, 1024)
            ready = url + ("/health" if system == "localserve" else "/v1/models")
            if temperature == "cold" and not drop_page_cache():
                return
            figures = start_to_ready(command, ready, url, env, Path(tmp) / f"{system}.log")
            results.setdefault((system, temperature), []).append(figures)
            print(f"  {system} {temperature}: ready {figures[0]:.2f} s, first request {figures[1]:.2f} s", flush=True)

        run("localserve", "first load")  # converts and stores the prepared layout
        for repeat in range(args.repeats):
            systems = ("localserve", "llama.cpp") if repeat % 2 == 0 else ("llama.cpp", "localserve")
            for temperature in ("warm", "cold"):
                for system in systems:
                    run(system, temperature)
    print(f"\n{path.name}, {args.threads} threads; medians (min-max) of {args.repeats}")
    for temperature in ("first load", "warm", "cold"):
        ours, theirs = results.get(("localserve", temperature)), results.get(("llama.cpp", temperature))
        if not ours:
            continue

        def cell(values: list[tuple[float, float]], i: int) -> str:
            column = [v[i] for v in values]
            return f"{statistics.median(column):.2f} ({min(column):.2f}-{max(column):.2f})"

        line = f"{temperature:10s} localserve ready {cell(ours, 0)} s, first request {cell(ours, 1)} s"
        if theirs:
            ratio = statistics.median(v[0] for v in ours) / statistics.median(v[0] for v in theirs)
            line += f" | llama-server ready {cell(theirs, 0)} s, first request {cell(theirs, 1)} s | ours/theirs {ratio:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
