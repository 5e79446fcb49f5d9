"""What is on disk: a catalogue of models over a content-addressed blob store, and the
sources models are pulled from."""

from __future__ import annotations

import errno
import os
import pwd
from pathlib import Path

from .names import DEFAULT_TAG, ModelName, parse_name
from .registry import ModelFile, ModelRecord, Registry, UnknownModelError


# The system service's user (systemd/localserve.sysusers), whose home is the service's registry.
SERVICE_USER = "localserve"


def default_home() -> Path:
    """``LOCALSERVE_HOME``; else, for the service's user, its home (/var/lib/localserve, so
    ``sudo -u localserve localserve pull`` fills the service's registry); else the user's
    XDG data folder (``~/.local/share/localserve``)."""
    if home := os.environ.get("LOCALSERVE_HOME"):
        return Path(home).expanduser()
    try:
        user = pwd.getpwuid(os.geteuid())
    except KeyError:  # a uid without a passwd entry (containers)
        user = None
    if user is not None and user.pw_name == SERVICE_USER:
        return Path(user.pw_dir)
    from platformdirs import user_data_dir

    return Path(user_data_dir("localserve", appauthor=False))


def open_registry(home: Path | None = None) -> Registry:
    return Registry(home or default_home())


def resolve_model(text: str, registry: Registry | None = None) -> Path:
    """A checkpoint path from what a user typed: an existing file or folder, else a
    registry name (``name[:tag]``)."""
    path = Path(text).expanduser()
    try:
        if path.exists():
            return path
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        # No file can have that name: it can only be a registry name (parse_name says what is wrong with it).
    name = parse_name(text)  # before the registry is opened: a bad name touches no disk
    return (registry or open_registry()).path(name)


__all__ = ["DEFAULT_TAG", "ModelFile", "ModelName", "ModelRecord", "Registry", "UnknownModelError",
           "default_home", "open_registry", "parse_name", "resolve_model"]
