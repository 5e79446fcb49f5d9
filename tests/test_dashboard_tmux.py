"""`localserve top` end to end: a real daemon serving the stories model, requests kept
running on it, and the dashboard in a detached tmux pane whose text we read back."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from localserve.server.config import ServerConfig

from .conftest import STORIES_HF
from .server_util import running_server, small_engine_config

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30.0
KV_USED = re.compile(r"device\s+[█░]+\s+(\d+)/(\d+)")
RUNNING_ROW = re.compile(r"\b[0-9a-f]{8}\s+stories\S*\s+running\b")


@contextmanager
def busy(url: str, threads: int = 4) -> Iterator[None]:
    """Keep requests running: each thread posts long completions back to back."""
    stop = threading.Event()

    def post() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                client.post("/v1/completions", json={"model": "stories", "prompt": "Once upon a time",
                                                     "max_tokens": 400, "ignore_eos": True})

    workers = [threading.Thread(target=post, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)


@contextmanager
def tmux_pane(command: str, width: int = 140, height: int = 45) -> Iterator[str]:
    """A detached session on a tmux server of its own (-L), so a tmux the user runs is
    neither touched nor consulted for the environment; yields the session's name."""
    name = f"localserve-top-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmux = ["tmux", "-L", name]
    # The pane stays after the command exits, so a crash leaves its traceback to read.
    shell = f"{command}; echo \"[exited $?]\"; sleep 60"
    subprocess.run([*tmux, "-f", "/dev/null", "new-session", "-d", "-s", name, "-x", str(width), "-y", str(height),
                    shell], check=True, cwd=ROOT, timeout=30)
    socket = subprocess.run([*tmux, "display-message", "-p", "#{socket_path}"], capture_output=True, text=True,
                            check=False, timeout=30).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, capture_output=True, timeout=30)
        if socket:
            Path(socket).unlink(missing_ok=True)  # kill-server leaves it behind


def capture(session: str) -> str:
    answer = subprocess.run(["tmux", "-L", session, "capture-pane", "-p", "-t", session],
                            capture_output=True, text=True, check=False, timeout=30)
    return answer.stdout


def shows_a_busy_daemon(screen: str) -> bool:
    kv = KV_USED.search(screen)
    return "stories" in screen and kv is not None and int(kv.group(1)) > 0 and RUNNING_ROW.search(screen) is not None


def test_top_shows_a_live_daemon() -> None:
    config = ServerConfig(models={"stories": STORIES_HF}, preload=["stories"], engine=small_engine_config(),
                          device="cpu")
    with running_server(config) as server, busy(server.url):
        env = f"env -u LOCALSERVE_API_KEY PYTHONPATH={shlex.quote(str(ROOT))}"
        command = f"{env} {shlex.quote(sys.executable)} -m localserve.cli top --url {server.url} --interval 0.3"
        with tmux_pane(command) as session:
            deadline = time.monotonic() + DEADLINE_S
            screen = ""
            while time.monotonic() < deadline:
                screen = capture(session)
                if shows_a_busy_daemon(screen):
                    break
                time.sleep(0.3)
            else:
                pytest.fail(f"the dashboard did not show the busy daemon within {DEADLINE_S:.0f} s:\n{screen}")
            assert "connected" in screen and "disconnected" not in screen
