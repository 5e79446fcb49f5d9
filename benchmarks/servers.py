"""Servers as the benchmarks run them: a subprocess on a free port, ready once a URL
answers 200, stopped with SIGTERM (localserve drains) and killed if it lingers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

READY_TIMEOUT_S = 300.0  # a cold start loads and (for localserve) plans the KV cache


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(command: list[str], ready_url: str, threads: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` until the block ends; ready once ``ready_url`` answers 200. It gets
    the user's environment, without what importing localserve set for this process (its
    OpenMP wait policy: llama-server uses libgomp too, and runs as its users run it; a
    localserve server sets its own again)."""
    from localserve.omp_wait import SET_HERE

    env = {key: value for key, value in os.environ.items() if key not in SET_HERE}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=Path(__file__).resolve().parents[1])
    try:
        wait_ready(process, ready_url, log)
        yield process
    finally:
        stop(process)


def wait_ready(process: subprocess.Popen[bytes], url: str, log: Path, poll_s: float = 0.5) -> None:
    """Until ``url`` answers 200, asking every ``poll_s`` seconds (start-up timings poll
    finely)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; last output:\n{tail(log)}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"server not ready at {url} after {READY_TIMEOUT_S:.0f}s; last output:\n{tail(log)}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (localserve drains), then kill if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
