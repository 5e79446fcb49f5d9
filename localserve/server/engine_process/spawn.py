"""Starting engine processes (``python -m localserve.server.engine_process``), and the spare:
one started ahead of need, importing torch and the engine while nothing waits for it, for the
next load to take. `serve` starts one first thing (its import runs beside the daemon's own)
and another whenever the daemon has been idle a while without one. Imports next to nothing,
so that start is the daemon's first act."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

_spare: tuple[subprocess.Popen[bytes], socket.socket] | None = None
_spare_lock = threading.Lock()


def start_spare() -> None:
    """Start the spare engine process, unless there is one."""
    global _spare
    with _spare_lock:
        if _spare is None:
            _spare = spawn()


def take_spare() -> tuple[subprocess.Popen[bytes], socket.socket] | None:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None and spare[0].poll() is not None:  # it died (killed) before it was needed
        spare[1].close()
        return None
    return spare


def keep_as_spare(process: subprocess.Popen[bytes], sock: socket.socket) -> bool:
    """Keep a running process that loaded nothing as the spare; False when there is one already."""
    global _spare
    with _spare_lock:
        if _spare is None and process.poll() is None:
            _spare = (process, sock)
            return True
    return False


def spawn() -> tuple[subprocess.Popen[bytes], socket.socket]:
    parent, child = socket.socketpair()
    with child:
        process = subprocess.Popen([sys.executable, "-m", "localserve.server.engine_process", "--fd", str(child.fileno())],
                                   pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
    return process, parent
