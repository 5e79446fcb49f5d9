"""No failure reaches a person as a traceback: every command in a broken home, absurd
flags, names of 10,000 characters, a hostile config file and an unexpected exception end
as one line and exit status 1 or 2; a server bug is a 500 with the request id its
traceback is logged under."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from localserve.cli.main import main

from .conftest import STORIES_HF

# Nothing listens on the discard port: `run` then loads here, `ps` and `stop` fail at once.
NO_DAEMON = "http://127.0.0.1:9"
HOMES = ["a-file", "under-a-file", "in-proc", "read-only", "random-bytes-db", "text-db", "disk-full"]


def _verbs(tmp: Path) -> dict[str, list[str]]:
    """Each command, with arguments that get as far as the home (the registry name ``demo``).
    Not here: ``top`` (an interactive dashboard of the daemon) and ``doctor`` (checks the
    kernels, for minutes); neither opens the home."""
    modelfile = tmp / "Modelfile"
    modelfile.write_text("FROM demo\n")
    return {"list": ["list"], "show": ["show", "demo"], "pull": ["pull", str(tmp / "none.gguf")],
            "rm": ["rm", "demo"], "run": ["run", "demo", "hi"], "fit": ["fit", "demo"], "cp": ["cp", "demo", "copy"],
            "create": ["create", "made", "-f", str(modelfile)], "ps": ["ps"], "stop": ["stop", "demo"],
            "bench": ["bench", "--num-prompts", "1", "--no-progress"]}


def _mount_tmpfs(folder: Path, options: str) -> bool:
    """Whether a tmpfs could be mounted on ``folder`` (it takes root, or CAP_SYS_ADMIN)."""
    folder.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    except OSError:  # no mount(8) here
        return False
    return mounted.returncode == 0


@contextlib.contextmanager
def broken_home(kind: str, tmp: Path) -> Iterator[Path]:
    """A LOCALSERVE_HOME broken in the way ``kind`` says; skips what this host cannot make."""
    home, mounted = tmp / "home", False
    if kind == "a-file":
        home.write_text("not a folder")
    elif kind == "under-a-file":
        (tmp / "file").write_text("")
        home = tmp / "file" / "home"
    elif kind == "in-proc":
        home = Path("/proc/self/localserve-home")
    elif kind == "read-only":
        if os.geteuid() == 0:  # root writes through permissions: a read-only mount instead
            if not (mounted := _mount_tmpfs(home, "ro,size=1m")):
                pytest.skip("root, and no read-only tmpfs can be mounted here")
        else:
            home.mkdir()
            home.chmod(0o555)
    elif kind in ("random-bytes-db", "text-db"):
        home.mkdir()
        (home / "registry.db").write_bytes(os.urandom(8192) if kind == "random-bytes-db" else b"models = []\n" * 100)
    elif kind == "disk-full":
        if not (mounted := _mount_tmpfs(home, "size=64k")):
            pytest.skip("no tmpfs can be mounted here (needs root) to fill a disk")
    try:
        yield home
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(home)], check=True)  # lazy: a failed open may hold a file
        elif kind == "read-only":
            home.chmod(0o755)


def assert_one_line_error(exit_code: int, output: str, *expected: str) -> str:
    assert exit_code in (1, 2), output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    if exit_code == 1:  # a usage error (2) comes after click's usage lines; any other is all there is
        assert output.strip() == errors[0], output
    for text in expected:
        assert text in errors[0], output
    return errors[0]


def _cli(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localserve.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout)


@pytest.mark.parametrize("kind", HOMES)
def test_every_command_in_a_broken_home(kind: str, tmp_path: Path) -> None:
    verbs = _verbs(tmp_path)
    with broken_home(kind, tmp_path) as home:
        env = {"LOCALSERVE_HOME": str(home), "LOCALSERVE_URL": NO_DAEMON}
        runner = CliRunner(env=env)
        for verb, args in verbs.items():
            result = runner.invoke(main, args)
            assert result.exception is None or isinstance(result.exception, SystemExit), (verb, result.exception)
            line = assert_one_line_error(result.exit_code, result.output)
            if verb not in ("ps", "stop", "bench"):  # these ask the daemon, not the home
                assert str(home) in line, (verb, line)
        # A real process too: its stderr is where a traceback would show.
        result = _cli(["list"], env)
        assert_one_line_error(result.returncode, result.stdout + result.stderr, str(home))


def test_serve_in_a_broken_home(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    with broken_home("text-db", tmp_path) as home:
        result = _cli(["serve", "--port", port], {"LOCALSERVE_HOME": str(home)})
    assert_one_line_error(result.returncode, result.stdout + result.stderr, str(home))


@pytest.mark.parametrize(("kind", "expected"), [("random-bytes-db", "is not a localserve registry"),
                                                ("text-db", "is not a localserve registry"),
                                                ("a-file", "it is a file, not a folder"),
                                                ("under-a-file", "Not a directory"),
                                                ("read-only", "Read-only file system|Permission denied"),
                                                ("disk-full", "No space left on device|database or disk is full")])
def test_the_line_says_what_is_wrong(kind: str, expected: str, tmp_path: Path) -> None:
    with broken_home(kind, tmp_path) as home:
        result = CliRunner(env={"LOCALSERVE_HOME": str(home)}).invoke(main, ["list"])
    assert re.search(expected, assert_one_line_error(result.exit_code, result.output))


def test_a_catalogue_that_cannot_be_written_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localserve.registry.registry import Registry

    runner = CliRunner(env={"LOCALSERVE_HOME": str(tmp_path)})
    assert runner.invoke(main, ["list"]).exit_code == 0

    def full(self: Registry, model_id: str) -> set[str]:  # sqlite's answer when the disk fills mid-transaction
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Registry, "_delete_rows", full)
    result = runner.invoke(main, ["cp", "demo", "other"])
    assert_one_line_error(result.exit_code, result.output, f"{tmp_path / 'registry.db'}: database or disk is full")


def test_a_pull_onto_a_full_disk(tmp_path: Path) -> None:
    home = tmp_path / "home"
    if not _mount_tmpfs(home, "size=2m"):
        pytest.skip("no tmpfs can be mounted here (needs root) to fill a disk")
    try:
        env = {"LOCALSERVE_HOME": str(home), "LOCALSERVE_URL": NO_DAEMON}
        assert CliRunner(env=env).invoke(main, ["list"]).exit_code == 0  # the demo model's 1.2 MB: room is left
        result = _cli(["pull", str(STORIES_HF)], env)  # 1.2 MB more
        assert_one_line_error(result.returncode, result.stdout + result.stderr, "No space left on device", str(home))
    finally:
        subprocess.run(["umount", "--lazy", str(home)], check=True)  # lazy: a failed open may hold a file


@pytest.mark.parametrize("port", ["70000", "0", "-1"])
def test_an_impossible_port_is_a_usage_error(port: str) -> None:
    result = _cli(["serve", "--port", port], {"LOCALSERVE_URL": NO_DAEMON})
    assert_one_line_error(result.returncode, result.stdout + result.stderr, "--port")
    assert result.returncode == 2


def test_more_threads_than_cpus_run_on_the_cpus_there_are() -> None:
    usable = len(os.sched_getaffinity(0))
    run = ["run", str(STORIES_HF), "Once upon a time", "--max-tokens", "4", "--device", "cpu"]
    result = _cli([*run, "--threads", str(usable + 1)], {"LOCALSERVE_URL": NO_DAEMON})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(", there was"), result.stdout
    assert f"threads {usable + 1} is more than the {usable} CPUs this process may use: running {usable}" \
        in result.stderr
    # Tens of thousands of threads crashed OpenMP (signal 11): now a usage error.
    result = _cli([*run, "--threads", "100000"], {"LOCALSERVE_URL": NO_DAEMON})
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result.returncode, result.stdout + result.stderr, "--threads")
    for threads in ("0", "-3"):
        result = CliRunner().invoke(main, [*run, "--threads", threads])
        assert_one_line_error(result.exit_code, result.output, "--threads")


def test_a_kv_cache_larger_than_the_memory_is_refused_before_it_is_allocated() -> None:
    result = CliRunner(env={"LOCALSERVE_URL": NO_DAEMON}).invoke(
        main, ["run", str(STORIES_HF), "hi", "--device", "cpu", "--kv-cache-memory", "1024TiB"])
    assert_one_line_error(result.exit_code, result.output, "KV cache of", "this host's memory")


LONG = "a" * 10_000


@pytest.mark.parametrize("args", [["show", LONG], ["run", LONG, "hi"], ["rm", LONG], ["fit", LONG], ["cp", LONG, "b"],
                                  ["cp", "demo", LONG], ["pull", LONG], ["pull", str(STORIES_HF), "--name", LONG]],
                         ids=["show", "run", "rm", "fit", "cp-from", "cp-to", "pull", "pull-name"])
def test_a_name_of_ten_thousand_characters(args: list[str], tmp_path: Path) -> None:
    result = CliRunner(env={"LOCALSERVE_HOME": str(tmp_path), "LOCALSERVE_URL": NO_DAEMON}).invoke(main, args)
    line = assert_one_line_error(result.exit_code, result.output)
    assert re.search("10,000 characters|File name too long", line) and len(line) < 400, line


@pytest.mark.parametrize(("text", "expected"), [("model = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                                ("# padding\n" * 200_000, "larger than 1 MiB"),
                                                ('model = [["stories=/x"]]', "not of lists or tables")])
def test_a_hostile_config_file(text: str, expected: str, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    result = _cli(["serve", "--config", str(config)], {})  # a process: a file read as valid would serve on
    assert_one_line_error(result.returncode, result.stdout + result.stderr, str(config), expected)


def test_an_unexpected_error_is_one_line_unless_debugging(monkeypatch: pytest.MonkeyPatch) -> None:
    import localserve.registry

    def broken(home: Path | None = None) -> None:
        raise ValueError("a bug\nwith a second line")

    monkeypatch.setattr(localserve.registry, "open_registry", broken)
    result = CliRunner().invoke(main, ["list"])
    assert_one_line_error(result.exit_code, result.output, "internal error (a bug): ValueError: a bug",
                          "LOCALSERVE_DEBUG=1")
    assert result.exit_code == 1
    result = CliRunner(env={"LOCALSERVE_DEBUG": "1"}).invoke(main, ["list"])
    assert isinstance(result.exception, ValueError)  # raised on, with its traceback


def test_what_the_system_refuses_names_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    import localserve.registry

    def refused(home: Path | None = None) -> None:
        raise PermissionError(13, "Permission denied", "/srv/models/registry.db")

    monkeypatch.setattr(localserve.registry, "open_registry", refused)
    result = CliRunner().invoke(main, ["list"])
    assert_one_line_error(result.exit_code, result.output, "/srv/models/registry.db: Permission denied")


@pytest.mark.parametrize(("path", "shape"), [("/v1/boom", "openai"), ("/api/boom", "ollama"),
                                             ("/v1/messages", "anthropic")])
def test_a_server_bug_gives_the_request_id_its_traceback_is_logged_under(
        path: str, shape: str, caplog: pytest.LogCaptureFixture) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from localserve.server.errors import install
    from localserve.server.events import EventLog

    app = FastAPI()
    install(app)
    app.state.localserve = SimpleNamespace(events=EventLog())

    @app.post(path)
    def boom() -> None:
        raise KeyError("internal detail")

    with caplog.at_level(logging.ERROR), TestClient(app, raise_server_exceptions=False) as client:
        response = client.post(path, json={})
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{12}", request_id)
    body = response.json()
    message = {"openai": lambda: body["error"]["message"], "ollama": lambda: body["error"],
               "anthropic": lambda: body["error"]["message"]}[shape]()
    assert request_id in message and "internal detail" not in message
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None and "internal detail" in caplog.text
    assert request_id in app.state.localserve.events.recent()[-1]["message"]


# Every route the daemon serves, with a body that names a registry model: what a client
# of a daemon whose home broke while it ran could send.
ROUTES = [("GET", path) for path in ("/", "/health", "/metrics", "/v1/models", "/v1/models/demo", "/api/tags", "/api/ps",
                                     "/api/version", "/api/localserve/stats")] + [
    ("POST", path) for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
                                "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/api/chat", "/api/generate",
                                "/api/embed", "/api/embeddings", "/api/show", "/api/pull", "/api/create", "/api/copy",
                                "/api/localserve/load", "/api/localserve/unload")] + [("DELETE", "/api/delete")]
ANY_BODY = {"model": "demo", "name": "demo", "source": "demo", "destination": "copy", "from": "demo", "prompt": "hi",
            "input": "hi", "tokens": [1, 2], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "stream": False}


@pytest.mark.parametrize("garbage", [os.urandom(8192), b"models = []\n" * 100], ids=["random bytes", "text"])
def test_every_route_of_a_daemon_whose_catalogue_broke(garbage: bytes, tmp_path: Path) -> None:
    """A daemon starts only with a usable home (serve checks it first); one whose registry.db
    is replaced while it runs answers every route without a 500 or a traceback, each error
    in one line."""
    from fastapi.testclient import TestClient

    from localserve.server.app import create_app
    from localserve.server.config import ServerConfig

    from .server_util import small_engine_config

    home = tmp_path / "home"
    config = ServerConfig(models={"stories": STORIES_HF}, registry_home=home, engine=small_engine_config(),
                          device="cpu")
    with TestClient(create_app(config), base_url="http://localhost", raise_server_exceptions=False) as client:
        for leftover in home.glob("registry.db*"):  # the database and its WAL files
            leftover.unlink()
        (home / "registry.db").write_bytes(garbage)
        named = []
        for method, path in ROUTES:
            answer = client.request(method, path, json=None if method == "GET" else ANY_BODY)
            assert answer.status_code < 500, (method, path, answer.text)
            assert "Traceback" not in answer.text, (method, path)
            if answer.status_code >= 400:
                error = answer.json()["error"]
                message = error if isinstance(error, str) else error["message"]
                assert "\n" not in message, (method, path, message)
                if "is not a localserve registry" in message:
                    named.append(path)
        # The catalogue's lookups keep the connection opened at start (serving goes on);
        # what opens the registry anew says what is wrong with it.
        assert {"/api/pull", "/api/create", "/api/copy", "/api/delete"} <= set(named), named
