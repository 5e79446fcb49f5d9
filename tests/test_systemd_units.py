"""The systemd units and their companions in systemd/ (issue 9), checked offline.

- `systemd-analyze verify` prints nothing for the system unit (in a scratch root holding the
  host's units and stand-ins for /usr/bin/localserve and /bin/kill) nor for the user unit
  (`--user`; there only the missing /usr/bin/localserve of a host without the package is let
  pass, as --root does not work with --user).
- `systemd-analyze security --offline=yes` rates the system unit "OK" or better.
- Both units have the settings the daemon relies on (Type=notify, SIGHUP reload, a stop timeout
  longer than the drain, ...) and the system unit none of the options that break CUDA.
- sysusers.d declares the localserve user; as root, systemd-sysusers and systemd-tmpfiles apply
  the two snippets to a scratch root.
- localserve.env (all commented out) names only variables `localserve serve` reads, and
  config.toml parses to {} while its commented examples are valid `localserve serve` settings.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import click
import pytest

from localserve.cli.main import serve

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"
SYSTEM_UNIT = SYSTEMD / "localserve.service"
USER_UNIT = SYSTEMD / "user" / "localserve.service"
HOST_UNITS = Path("/usr/lib/systemd/system")
INSTALLED = "/usr/lib/systemd/system/localserve.service"  # where packaging puts the system unit

Unit = dict[str, dict[str, list[str]]]


def parse_unit(path: Path) -> Unit:
    """Section -> key -> every value given (unit files allow repeated keys)."""
    unit: Unit = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            unit.setdefault(section, {})
        else:
            key, _, value = line.partition("=")
            unit[section].setdefault(key.strip(), []).append(value.strip())
    return unit


def seconds(value: str) -> float:
    """A systemd time span of the forms used here: 60, 60s, 5min."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|)", value)
    assert match, f"unexpected time span {value!r}"
    return float(match[1]) * (60 if match[2] == "min" else 1)


def analyze(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SYSTEMD_COLORS": "0", **(env or {})}
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, env=environ, timeout=120)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch root: the host's system units, the unit as packaged, stand-in executables."""
    if not HOST_UNITS.is_dir():
        pytest.skip(f"{HOST_UNITS} (the units verify resolves dependencies against) is missing")
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(HOST_UNITS, root / HOST_UNITS.relative_to("/"), symlinks=True)
    shutil.copy(SYSTEM_UNIT, root / INSTALLED.lstrip("/"))
    (root / "usr/bin").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    for name in ("localserve", "kill"):
        (root / "usr/bin" / name).write_text("#!/bin/sh\n")
        (root / "usr/bin" / name).chmod(0o755)
    return root


def test_verify_system_unit(root: Path) -> None:
    result = analyze("verify", f"--root={root}", INSTALLED)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, output


def test_verify_user_unit(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_RUNTIME_DIR": str(runtime)}
    result = analyze("--user", "verify", str(USER_UNIT), env=env)
    lines = (result.stdout + result.stderr).strip().splitlines()
    if not os.access("/usr/bin/localserve", os.X_OK):  # not installed on this host: expected
        missing = "localserve.service: Command /usr/bin/localserve is not executable: No such file or directory"
        lines = [line for line in lines if line != missing]
    assert not lines, "\n".join(lines)


def test_security_exposure_is_ok_or_better(root: Path) -> None:
    result = analyze("security", "--offline=yes", f"--root={root}", INSTALLED)
    match = re.search(r"Overall exposure level for localserve\.service: (\d+\.\d+) (\w+)", result.stdout)
    assert result.returncode == 0 and match, result.stdout + result.stderr
    exposure, level = float(match[1]), match[2]
    assert level in ("PERFECT", "SAFE", "OK") and exposure < 5.0, (exposure, level)


@pytest.mark.parametrize("path", [SYSTEM_UNIT, USER_UNIT], ids=["system", "user"])
def test_unit_settings(path: Path) -> None:
    service = parse_unit(path)["Service"]
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    assert service["ExecStart"] == ["/usr/bin/localserve serve"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["KillMode"] == ["mixed"] and service["Restart"] == ["on-failure"]
    assert seconds(service["WatchdogSec"][0]) > 0
    drain_default = next(p.default for p in serve.params if p.name == "drain_timeout")
    assert seconds(service["TimeoutStopSec"][0]) > drain_default + 5  # drain, then ~5 s to close
    if path == SYSTEM_UNIT:
        assert service["User"] == ["localserve"] and service["Group"] == ["localserve"]
        assert service["StateDirectory"] == ["localserve"]
        assert service["EnvironmentFile"] == ["-/etc/localserve/localserve.env"]
        env = [item for value in service["Environment"] for item in shlex.split(value)]
        assert "LOCALSERVE_HOME=%S/localserve" in env and "LOCALSERVE_CONFIG=/etc/localserve/config.toml" in env
        for breaks_cuda in ("PrivateDevices", "PrivateUsers", "MemoryDenyWriteExecute", "ProcSubset"):
            assert breaks_cuda not in service, f"{breaks_cuda}= hides or breaks the GPU"
        assert parse_unit(path)["Install"]["WantedBy"] == ["multi-user.target"]
    else:
        assert "User" not in service and not any("LOCALSERVE_" in value for value in service.get("Environment", []))
        assert service["EnvironmentFile"] == ["-%E/localserve/localserve.env"]
        assert parse_unit(path)["Install"]["WantedBy"] == ["default.target"]


def test_sysusers_declares_the_user() -> None:
    entries = [shlex.split(line) for line in (SYSTEMD / "localserve.sysusers").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    user = next(entry for entry in entries if entry[:2] == ["u", "localserve"])
    assert user[4] == "/var/lib/localserve" and user[5].endswith("nologin")


@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-tmpfiles --root chowns, which needs root")
def test_sysusers_and_tmpfiles_apply(tmp_path: Path) -> None:
    if not (shutil.which("systemd-sysusers") and shutil.which("systemd-tmpfiles")):
        pytest.skip("systemd-sysusers or systemd-tmpfiles is not installed")
    (tmp_path / "etc").mkdir()
    commands = [["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "localserve.sysusers")],
                ["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(SYSTEMD / "localserve.tmpfiles")]]
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
    passwd = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    uid = int(passwd["localserve"][2])
    for folder in ("var/lib/localserve", "var/cache/localserve"):
        info = (tmp_path / folder).stat()
        assert (info.st_uid, info.st_mode & 0o777) == (uid, 0o750), folder
    assert (tmp_path / "etc/localserve").stat().st_mode & 0o777 == 0o755
    assert pwd.getpwnam("root").pw_uid == (tmp_path / "etc/localserve").stat().st_uid


def serve_options() -> dict[str, click.Option]:
    """`localserve serve`'s options by long name without the dashes (keep-alive)."""
    return {flag[2:]: param for param in serve.params if isinstance(param, click.Option)
            for flag in param.opts if flag.startswith("--")}


def test_env_file_names_only_serve_options() -> None:
    text = (SYSTEMD / "localserve.env").read_text()
    assert all(line.startswith("#") for line in text.splitlines() if line.strip()), "everything commented out"
    readable = {option.envvar for option in serve_options().values() if isinstance(option.envvar, str)}
    named = set(re.findall(r"\bLOCALSERVE_[A-Z0-9_]+", text))
    assert named and not named - readable, f"`localserve serve` does not read {sorted(named - readable)}"
    assert "CUDA_VISIBLE_DEVICES" in text


def test_config_example_parses_and_names_serve_options() -> None:
    text = (SYSTEMD / "config.toml").read_text()
    assert tomllib.loads(text) == {}
    examples = [line.lstrip("#") for line in text.splitlines() if re.match(r"#\s*[A-Za-z0-9_-]+\s*=", line)]
    settings = tomllib.loads("\n".join(examples))
    options = serve_options()
    assert "model" in settings and not set(settings) - set(options) - {"config"}, sorted(set(settings) - set(options))
    ctx = click.Context(serve)
    for key, value in settings.items():  # each value as the option would take it
        assert isinstance(value, list) == options[key].multiple, key
        options[key].type_cast_value(ctx, value)
