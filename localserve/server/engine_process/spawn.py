"""Starting engine processes (``python -m localserve.server.engine_process``), and the spare one the daemon
starts first thing. Imports next to nothing, so that start is the daemon's first act."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

_spare: tuple[subprocess.Popen[bytes], socket.socket] | None = None
_spare_lock = threading.Lock()


def start_spare() -> None:
    """Start an engine process that imports torch and the engine now, for the first load
    to take: the daemon calls this first thing, so the import runs beside its own."""
    global _spare
    with _spare_lock:
        if _spare is None:
            _spare = spawn()


def take_spare() -> tuple[subprocess.Popen[bytes], socket.socket] | None:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    return spare


def spawn() -> tuple[subprocess.Popen[bytes], socket.socket]:
    parent, child = socket.socketpair()
    with child:
        process = subprocess.Popen([sys.executable, "-m", "localserve.server.engine_process", "--fd", str(child.fileno())],
                                   pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
    return process, parent
