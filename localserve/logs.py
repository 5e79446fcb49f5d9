"""The daemon's log output, on stdout, in the form its reader wants.

- journald (systemd sets ``JOURNAL_STREAM`` to the device and inode of the stream it
  reads): each line starts with a syslog priority (``<6>``), which journald turns into
  the entry's priority; no time stamp, journald adds its own. Every line of a
  traceback carries the prefix, so journald does not file the rest as plain info.
- a terminal: rich's handler, with colours (unless ``NO_COLOR`` is set).
- anything else (a pipe, a file, docker): plain lines with an ISO time, no colours.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

# Python's levels -> syslog priorities (sd-daemon.h's SD_CRIT, SD_ERR, ...), highest first.
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


class JournalFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        priority = next((p for level, p in _PRIORITIES if record.levelno >= level), 7)
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines())


def writes_to_journal(stream: TextIO) -> bool:
    """Whether ``stream`` is the journal's stream systemd connected us to."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    if not expected:
        return False
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return expected == f"{info.st_dev}:{info.st_ino}"


def log_handler(stream: TextIO) -> logging.Handler:
    if writes_to_journal(stream):
        handler: logging.Handler = logging.StreamHandler(stream)
        handler.setFormatter(JournalFormatter())
    elif stream.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(file=stream), show_path=False)  # rich honours NO_COLOR
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


def configure_logging(level: str, stream: TextIO | None = None) -> None:
    """Route every logger (uvicorn's too) to one handler on ``stream`` (stdout)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(log_handler(stream or sys.stdout))
    root.setLevel(level.upper())
