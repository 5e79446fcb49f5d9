"""Talking to systemd: the sd_notify protocol (``Type=notify`` units).

systemd passes a datagram socket in ``NOTIFY_SOCKET``; the daemon sends newline-
separated ``KEY=VALUE`` lines to it (``READY=1``, ``STOPPING=1``, ``WATCHDOG=1``, ...).
Outside systemd the variable is unset and every call does nothing. The protocol is
one ``sendto``, so it is written here rather than taken from libsystemd's bindings,
which need a C build against libsystemd.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        # "@name" is a socket in the abstract namespace, written with a leading NUL.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        if self._address.startswith(("/", "\0")):
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Sent from the event loop: a receiver that stopped reading must not stall
            # the daemon, so a full socket drops the message instead of blocking.
            self._socket.setblocking(False)
        self.watchdog_interval_s = _watchdog_interval(environ)
        self._last_ping = 0.0
        self._warned = False
        # Children (a JIT compiler, say) must not speak for the daemon.
        if environ is os.environ:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(name, None)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, *fields: str) -> None:
        """Send ``fields`` (``KEY=VALUE``) in one message; a failure is logged once, never raised."""
        if self._socket is None:
            return
        try:
            self._socket.sendto("\n".join(fields).encode(), self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("could not notify systemd at %r: %s", self._address, exc)
                self._warned = True

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def reloading(self) -> None:
        # systemd 253+ wants the monotonic time of the reload with RELOADING=1.
        self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str, needs_s: float) -> None:
        """Draining started and takes at most ``needs_s``: systemd waits that long from now."""
        self.notify("STOPPING=1", f"STATUS={status}", f"EXTEND_TIMEOUT_USEC={int(needs_s * 1e6)}")

    def watchdog_tick(self, now: float | None = None) -> None:
        """Called often (every event-loop tick): pings when half the watchdog interval passed."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic() if now is None else now
        if now - self._last_ping >= self.watchdog_interval_s / 2:
            self._last_ping = now
            self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Seconds from ``WATCHDOG_USEC``, when it is set for this process (``WATCHDOG_PID``)."""
    pid = environ.get("WATCHDOG_PID")
    if pid is not None and pid != str(os.getpid()):
        return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1e6 if usec > 0 else None
