"""Start to ready: how long after its command starts each server answers with the model
loaded, and how long its first request (16 tokens in, 8 out) then takes.

    python benchmarks/load_time.py                                   # Llama-3.2-1B shape, Q4_K_M
    python benchmarks/load_time.py --shape llama-3.1-8b --repeats 3

The same GGUF file (benchmarks/real_shapes.py) through ``localserve serve`` and
``llama-server``, one at a time, interleaved. localserve's first load converts the file to
its CPU layout and stores it (``--prepared-cache``, in a fresh LOCALSERVE_HOME); every later
load maps that. "warm": the files are in the page cache; "cold": the page cache is dropped
first (needs root; skipped otherwise), so both read the weights from disk.

"thread" is localserve with its engine on a thread of the daemon's (``--no-engine-processes``)
instead of a process of its own (the default, whose spare process imports torch while the
daemon starts).

"daemon" is how a model loads when localserve runs as a service (Ollama's way): the file
is pulled into the registry once; a daemon already running (started with no model: it
has loaded its small demo model) is asked to load it with Ollama's load call (an empty
/api/generate), timed from the call to its answer, then its first request. For a cold
load the page cache is dropped once the daemon is up. Ollama loads a model by starting a
llama-server for it: the llama-server columns are the figures to compare with.
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


HEADERS = {"Authorization": "Bearer bench"}


def first_request(url: str) -> float:
    """Seconds one request (16 tokens in, 8 out) takes."""
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", timeout=600, headers=HEADERS,
                          json={"model": "bench", "prompt": [1, *range(300, 315)], "max_tokens": 8, "temperature": 0})
    response.raise_for_status()
    return time.perf_counter() - start


def start_to_ready(command: list[str], ready: str, url: str, env: dict[str, str], log: Path) -> tuple[float, float]:
    """(seconds until ``ready`` answers 200, seconds the first request then takes)."""
    start = time.perf_counter()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(process, ready, log, poll_s=0.02)
        return time.perf_counter() - start, first_request(url)
    finally:
        stop(process)


SETTLE_S = 6.0  # after its demo model is listed: the mapped pages' read-ahead, and the spare engine process's imports (started after 2 s idle), finish


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the daemon has loaded what it loads at start (its demo model) and settled, as a
    daemon that has been running a while has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/api/ps", headers=HEADERS, timeout=5).json().get("models"):
            time.sleep(SETTLE_S)
            return
        time.sleep(0.05)
    raise RuntimeError("the daemon loaded nothing at start")


def daemon_load(command: list[str], url: str, env: dict[str, str], log: Path, cold: bool) -> tuple[float, float]:
    """A running daemon asked to load the registry model ``bench``: (seconds until it answers
    loaded, seconds the first request then takes)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(process, url + "/health", log, poll_s=0.02)
        wait_idle(url)
        if cold:
            drop_page_cache()
        start = time.perf_counter()
        response = httpx.post(f"{url}/api/generate", json={"model": "bench"}, timeout=600, headers=HEADERS)
        response.raise_for_status()
        if response.json().get("done_reason") != "load":
            raise RuntimeError(f"not a load answer: {response.text[:200]}")
        return time.perf_counter() - start, first_request(url)
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
        daemon_env = dict(env, LOCALSERVE_HOME=str(Path(tmp) / "daemon-home"))
        subprocess.run([sys.executable, "-m", "localserve.cli", "pull", str(path), "--name", "bench"], env=daemon_env,
                       check=True, stdout=subprocess.DEVNULL, timeout=1800)

        def run(system: str, temperature: str) -> None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = Path(tmp) / f"{system}.log"
            if temperature == "cold" and not drop_page_cache():
                return
            if system == "daemon":
                command = real_shapes.localserve_command(path, port, args.threads, 1, 1024, preload=False)
                figures = daemon_load(command, url, daemon_env, log, cold=temperature == "cold")
            elif system == "llama.cpp":
                figures = start_to_ready(real_shapes.llama_server_command(path, port, args.threads, 1, 1024),
                                         url + "/v1/models", url, env, log)
            else:
                command = real_shapes.localserve_command(path, port, args.threads, 1, 1024)
                if system == "thread":
                    command.append("--no-engine-processes")
                figures = start_to_ready(command, url + "/health", url, env, log)
            results.setdefault((system, temperature), []).append(figures)
            print(f"  {system} {temperature}: ready {figures[0]:.2f} s, first request {figures[1]:.2f} s", flush=True)

        run("localserve", "first load")  # converts and stores the prepared layout
        run("daemon", "first load")  # the registry's copy: converted and stored beside its blob
        for repeat in range(args.repeats):
            systems = ("localserve", "thread", "daemon", "llama.cpp")
            systems = systems if repeat % 2 == 0 else systems[::-1]
            for temperature in ("warm", "cold"):
                for system in systems:
                    run(system, temperature)
    print(f"\n{path.name}, {args.threads} threads; medians (min-max) of {args.repeats}")

    def cell(values: list[tuple[float, float]], i: int) -> str:
        column = [v[i] for v in values]
        return f"{statistics.median(column):.2f} ({min(column):.2f}-{max(column):.2f})"

    for system, what in (("localserve", "process start to ready"),
                         ("thread", "process start to ready, the engine on a thread (--no-engine-processes)"),
                         ("daemon", "load into the running daemon")):
        for temperature in ("first load", "warm", "cold"):
            ours, theirs = results.get((system, temperature)), results.get(("llama.cpp", temperature))
            if not ours:
                continue
            line = f"{what}, {temperature}: localserve {cell(ours, 0)} s, first request {cell(ours, 1)} s"
            if theirs:
                ratio = statistics.median(v[0] for v in ours) / statistics.median(v[0] for v in theirs)
                line += (f" | llama-server start to ready {cell(theirs, 0)} s, first request {cell(theirs, 1)} s"
                         f" | ours/theirs {ratio:.2f}x")
            print(line)


if __name__ == "__main__":
    main()
