"""Where `localserve serve` takes its settings from, first match wins: the command
line, the environment (``--foo-bar`` is ``LOCALSERVE_FOO_BAR``), a TOML config
file, the defaults.

The config file's keys are the long option names, values as on the command line,
a list for a repeatable option::

    host = "0.0.0.0"
    keep-alive = "10m"
    model = ["stories=/srv/models/stories260K-hf"]

It is ``--config`` (``LOCALSERVE_CONFIG``), else ``~/.config/localserve/config.toml``
when that exists. The system service points ``LOCALSERVE_CONFIG`` at
``/etc/localserve/config.toml``.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..errors import LocalserveError

ENV_PREFIX = "LOCALSERVE_"
MAX_CONFIG_BYTES = 1 << 20  # a config file of every option takes a few KiB


def default_config_path() -> Path:
    from platformdirs import user_config_path

    return user_config_path("localserve", appauthor=False) / "config.toml"


def option_keys(command: click.Command) -> dict[str, click.Option]:
    """The config file's keys (long option names: ``keep-alive``) -> their options."""
    keys = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for flag in param.opts:
                if flag.startswith("--") and param.name != "config":
                    keys[flag.removeprefix("--")] = param
    return keys


def read_config(path: Path, command: click.Command) -> dict[str, Any]:
    """The settings in the TOML file ``path``, keyed by ``command``'s parameter names."""
    data = _parse_toml(path)
    keys = option_keys(command)
    settings: dict[str, Any] = {}
    for key, value in data.items():
        option = keys.get(key) or keys.get(key.replace("_", "-"))
        if option is None:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise LocalserveError(f"{path}: unknown setting {key!r}{hint}; the settings are the long options of "
                                  f"`localserve {command.name}` without the dashes")
        if isinstance(value, dict):
            raise LocalserveError(f"{path}: {key!r} must be a value, not a table")
        if isinstance(value, list) and any(isinstance(item, (list, dict)) for item in value):
            raise LocalserveError(f"{path}: {key!r} must be a value or a list of values, not of lists or tables")
        if option.multiple and not isinstance(value, list):
            value = [value]
        settings[option.name] = value  # type: ignore[index]
    return settings


def _parse_toml(path: Path) -> dict[str, Any]:
    """The file's TOML, refused with one line naming it when it cannot be read, is no TOML,
    or is larger or more deeply nested than a config file ever is (tomllib recurses once
    per nested array or table, so a hostile file would exhaust the stack)."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)  # a bounded read: the path may be /dev/zero or huge
    except OSError as exc:
        raise LocalserveError(f"{path}: cannot read the config file ({exc.strerror})") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise LocalserveError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, more than a config file holds")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise LocalserveError(f"{path}: not a valid TOML file: {exc}") from exc
    except RecursionError:
        raise LocalserveError(f"{path}: not a valid config file: arrays or tables nested too deeply") from None


def config_file_option(command: click.Command) -> click.Command:
    """Add ``--config FILE`` to ``command``: an eager option, so the file is read
    before the other options and fills in what the command line and environment left
    unset (click's ``default_map``)."""

    def load(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
        path = Path(value).expanduser() if value else default_config_path()
        if value is None and not path.is_file():
            return None  # the default file is optional; a named one is not
        ctx.default_map = {**(ctx.default_map or {}), **read_config(path, ctx.command)}
        return path

    return click.option("--config", type=click.Path(dir_okay=False), envvar=f"{ENV_PREFIX}CONFIG", is_eager=True,
                        callback=load, show_envvar=True,
                        help="A TOML file of settings (keys: these options' long names). "
                             "[default: ~/.config/localserve/config.toml when it exists]")(command)


def env_for_every_option(command: click.Command) -> click.Command:
    """Let every option ``--foo-bar`` of ``command`` be set from ``LOCALSERVE_FOO_BAR`` too."""
    for key, option in option_keys(command).items():
        if option.envvar is None and not key.startswith("no-"):
            option.envvar = ENV_PREFIX + key.upper().replace("-", "_")
            option.show_envvar = True
    return command


def reread(path: Path | None, command: click.Command, name: str, default: Any) -> Callable[[], Any]:
    """A function that reads setting ``name`` from the config file anew (for SIGHUP)."""

    def value() -> Any:
        if path is None or not path.is_file():
            return default
        return read_config(path, command).get(name, default)

    return value
