"""`localserve serve` as systemd runs it: a process that tells systemd it is ready
(sd_notify over NOTIFY_SOCKET, a datagram socket the test owns), pings the watchdog,
reloads its model list from the config file on SIGHUP, drains on SIGTERM (the request
in flight completes, new ones get 503) and exits 0, logging journald's way."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .gguf_writers import STORIES_GGUF
from .server_util import stories_with_template, wait_until


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class NotifyListener:
    """The systemd end of NOTIFY_SOCKET: a thread reads every message as it comes, as systemd
    does. (Reading only while a test waits would let the socket's queue, 10 datagrams by
    default on Linux, fill between waits, and the daemon drops what it cannot send.)"""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(str(path))
        self.messages: list[dict[str, str]] = []  # every message, in order
        self._seen = 0  # how far wait_for has looked
        self._arrived = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.socket.recv(4096).decode()
            except OSError:  # closed
                return
            if not data:  # shut down
                return
            message = dict(line.split("=", 1) for line in data.splitlines())
            with self._arrived:
                self.messages.append(message)
                self._arrived.notify_all()

    def wait_for(self, key: str, timeout: float = 120, process: subprocess.Popen | None = None) -> dict[str, str]:
        """The next message with ``key`` after those an earlier call returned or passed."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for message in self.messages[self._seen:]:
                    self._seen += 1
                    if key in message:
                        return message
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {key} from the daemon within {timeout} s; got {self.messages}")
                assert process is None or process.poll() is None, "the daemon exited"
                self._arrived.wait(min(left, 1.0))

    def close(self) -> None:
        self.socket.shutdown(socket.SHUT_RDWR)
        self.socket.close()
        self._reader.join(timeout=5)


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[NotifyListener]:
    listener = NotifyListener(tmp_path / "notify.sock")
    yield listener
    listener.close()


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.ConnectError:  # not listening yet
            pass
        assert process.poll() is None and time.monotonic() < deadline, "the daemon did not become healthy"
        time.sleep(0.1)


def model_ids(url: str) -> set[str]:
    return {model["id"] for model in httpx.get(f"{url}/v1/models").json()["data"]}


@pytest.mark.slow
def test_the_daemon_under_systemd(tmp_path: Path, listener: NotifyListener) -> None:
    model = stories_with_template(tmp_path)
    config = tmp_path / "config.toml"
    config.write_text(f'model = ["stories={model}"]\ndevice = "cpu"\nkv-cache-memory = "64MiB"\n'
                      'drain-timeout = 60\nlog-level = "info"\n')
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "journal.log"
    with log.open("wb") as stdout:
        info = os.fstat(stdout.fileno())
        env = {**os.environ, "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "200000",
               "JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}", "LOCALSERVE_PORT": str(port),
               "LOCALSERVE_HOME": str(tmp_path / "home")}
        process = subprocess.Popen([sys.executable, "-m", "localserve.cli", "serve", "--config", str(config)],
                                   stdout=stdout, stderr=subprocess.STDOUT, env=env)
    try:
        ready = listener.wait_for("READY", process=process)
        assert ready["READY"] == "1" and str(port) in ready["STATUS"]
        # Ready means listening: /health answers at once (503 "starting" while the
        # model preloads, then 200).
        assert httpx.get(f"{url}/health").status_code in (200, 503)
        wait_healthy(url, process)
        listener.wait_for("WATCHDOG", timeout=5)
        listener.wait_for("WATCHDOG", timeout=5)  # pings keep coming, every WATCHDOG_USEC / 2

        # SIGHUP re-reads the config file's model list.
        config.write_text(config.read_text().replace(f'"stories={model}"', f'"stories={model}", "tiny={STORIES_GGUF}"'))
        process.send_signal(signal.SIGHUP)
        assert "MONOTONIC_USEC" in listener.wait_for("RELOADING", timeout=10)
        listener.wait_for("READY", timeout=10)
        assert model_ids(url) == {"stories", "tiny", "demo:latest"}  # demo: the new registry's built-in model
        config.write_text(config.read_text().replace(f'"stories={model}", ', "").replace('device = "cpu"', "nonsense = 1"))
        process.send_signal(signal.SIGHUP)
        listener.wait_for("READY", timeout=10)
        assert model_ids(url) == {"stories", "tiny", "demo:latest"}, "a broken config file must leave the list as it was"
        config.write_text(config.read_text().replace("nonsense = 1\n", ""))
        process.send_signal(signal.SIGHUP)
        listener.wait_for("READY", timeout=10)
        assert model_ids(url) == {"tiny", "demo:latest"}

        # Top-20 logprobs make each event a few KB, so the server cannot push the whole
        # stream into socket buffers: the request stays in flight while we read slowly.
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "logprobs": 20, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/completions",
                                                                                json=body) as stream:
            lines = stream.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))
            assert first["choices"][0]["text"]

            process.send_signal(signal.SIGTERM)
            stopping = listener.wait_for("STOPPING", timeout=10)
            assert int(stopping["EXTEND_TIMEOUT_USEC"]) > 60_000_000  # the drain timeout and then some
            refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["message"]
            assert httpx.get(f"{url}/health").status_code == 503

            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # A chunk carries every token out since the last one: one or more.
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in [first, *chunks]) == 400
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)

    # journald's form: a syslog priority on every line, no colours, no time stamps.
    lines = log.read_text().splitlines()
    assert lines and all(line[0] == "<" and line[2] == ">" for line in lines), lines[:5]
    assert "\x1b[" not in log.read_text()
    assert any(line.startswith("<6>localserve.events: reload") for line in lines)
    assert any(line.startswith("<3>localserve.server.serve: SIGHUP: could not reload") and "nonsense" in line
               for line in lines)
    # A listener that keeps reading (as systemd does) loses nothing: no message was dropped.
    assert not any("could not notify systemd" in line for line in lines)


# -- the pieces, in-process ---------------------------------------------------------------

def serve_settings(monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str]) -> tuple[object, object]:
    """The ServerConfig (and SIGHUP model list) `localserve serve ARGS` would run with."""
    from click.testing import CliRunner

    import localserve.server.serve as serve_module
    from localserve.cli.main import main

    seen = {}

    def fake_serve(config: object, insecure_no_auth: bool, log_level: str, model_list: object) -> int:
        seen.update(config=config, model_list=model_list, log_level=log_level)
        return 0

    monkeypatch.setattr(serve_module, "serve", fake_serve)
    monkeypatch.setattr("localserve.logs.configure_logging", lambda level: None)
    result = CliRunner().invoke(main, ["serve", *args], env=env)
    assert result.exit_code == 0, result.output
    return seen["config"], seen["model_list"]


def test_settings_come_from_the_command_line_then_environment_then_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'port = 9001\nhost = "localhost"\nkeep-alive = "10m"\nkv-cache-memory = "1GiB"\n'
                      f'enable-prefix-caching = false\nmodel = "tiny={STORIES_GGUF}"\n')
    env = {"LOCALSERVE_CONFIG": str(config), "LOCALSERVE_PORT": "9002", "LOCALSERVE_MAX_LOADED_MODELS": "2",
           "LOCALSERVE_HOME": str(tmp_path / "home")}
    server, model_list = serve_settings(monkeypatch, ["--port", "9003"], env)
    assert server.port == 9003  # command line over environment over file
    assert server.max_loaded_models == 2  # environment
    assert server.host == "localhost" and server.keep_alive == 600  # file
    assert server.engine.kv_cache_memory == 1 << 30 and server.engine.enable_prefix_caching is False
    assert server.models == {"tiny": STORIES_GGUF}  # a single value for a repeatable option is a list of one
    assert server.drain_timeout == 30.0  # default
    assert model_list() == {"tiny": STORIES_GGUF}  # SIGHUP re-reads the file's list

    _, model_list = serve_settings(monkeypatch, ["--model", f"other={STORIES_GGUF}"], env)
    assert model_list is None, "models from the command line are not replaced by the file's on SIGHUP"


@pytest.mark.parametrize(("text", "message"), [
    ("hots = 1", "unknown setting 'hots' (did you mean 'host'?)"),
    ("port = ", "not a valid TOML file"),
    ("[model]\nstories = 1", "'model' must be a value, not a table"),
])
def test_a_bad_config_file_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    from click.testing import CliRunner

    from localserve.cli.main import main

    config = tmp_path / "config.toml"
    config.write_text(text)
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
    missing = CliRunner().invoke(main, ["serve", "--config", str(tmp_path / "missing.toml")])
    assert missing.exit_code == 1 and "cannot read the config file" in missing.output


def test_notifier_speaks_sd_notify(tmp_path: Path) -> None:
    from localserve.server.systemd import SystemdNotifier

    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract = f"localserve-test-{os.getpid()}"
    receiver.bind("\0" + abstract)
    receiver.settimeout(5)
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + abstract, "WATCHDOG_USEC": "1000000",
                                "WATCHDOG_PID": str(os.getpid())})
    notifier.ready("listening")
    assert receiver.recv(100) == b"READY=1\nSTATUS=listening"
    notifier.watchdog_tick(now=100.0)
    notifier.watchdog_tick(now=100.4)  # under half the interval: no ping
    notifier.watchdog_tick(now=100.6)
    assert [receiver.recv(100), receiver.recv(100)] == [b"WATCHDOG=1", b"WATCHDOG=1"]
    notifier.stopping("draining", needs_s=45)
    assert receiver.recv(100) == b"STOPPING=1\nSTATUS=draining\nEXTEND_TIMEOUT_USEC=45000000"
    receiver.close()
    notifier.notify("READY=1")  # nobody listening: logged, not raised

    assert SystemdNotifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert not SystemdNotifier({}).enabled  # outside systemd every call does nothing


def test_journal_lines_carry_their_priority_and_terminals_get_colour(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from localserve.logs import JournalFormatter, log_handler, writes_to_journal

    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("localserve.x", logging.ERROR, __file__, 1, "failed: %s", ("it",), sys.exc_info())
    lines = JournalFormatter().format(record).splitlines()
    assert lines[0] == "<3>localserve.x: failed: it" and len(lines) > 2
    assert all(line.startswith("<3>") for line in lines)  # the traceback too
    warning = logging.LogRecord("w", logging.WARNING, __file__, 1, "careful", None, None)
    assert JournalFormatter().format(warning) == "<4>w: careful"

    with (tmp_path / "out").open("w") as stream:
        info = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino}")
        assert writes_to_journal(stream)
        monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino + 1}")
        assert not writes_to_journal(stream)  # a child's stdout redirected elsewhere

    monkeypatch.delenv("JOURNAL_STREAM")
    yellow = "\x1b[33m"  # rich's colour for WARNING
    assert yellow in logged_on_a_terminal(warning)
    monkeypatch.setenv("NO_COLOR", "1")  # no-color.org: styles stay, colours go
    assert yellow not in logged_on_a_terminal(warning) and "careful" in logged_on_a_terminal(warning)
    with (tmp_path / "plain").open("w+") as stream:  # a pipe or file: plain lines
        log_handler(stream).emit(warning)
        stream.seek(0)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING w: careful\n", stream.read())


def logged_on_a_terminal(record: logging.LogRecord) -> str:
    from localserve.logs import log_handler

    controller, terminal = os.openpty()
    with os.fdopen(terminal, "w") as stream:
        log_handler(stream).emit(record)
    text = os.read(controller, 65536).decode()
    os.close(controller)
    return text


def test_the_service_users_registry_is_its_home(monkeypatch: pytest.MonkeyPatch) -> None:
    import pwd

    from localserve.registry import default_home

    monkeypatch.delenv("LOCALSERVE_HOME", raising=False)
    service_user = pwd.struct_passwd(("localserve", "x", 999, 999, "", "/var/lib/localserve", "/usr/sbin/nologin"))
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: service_user)
    assert default_home() == Path("/var/lib/localserve")
    monkeypatch.setenv("LOCALSERVE_HOME", "/srv/models")
    assert default_home() == Path("/srv/models")


def test_serve_with_no_model_answers_the_readme_on_the_built_in_demo(tmp_path: Path) -> None:
    """README's first command on a fresh machine: `localserve serve` with nothing given
    loads the demo model (no test data, no network), and its curl and SDK examples get
    answers."""
    from openai import OpenAI

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LOCALSERVE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "localserve.cli", "serve", "--port", str(port), "--device", "cpu",
                                "--kv-cache-memory", "64MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=env, cwd=tmp_path)
    try:
        wait_healthy(url, process)
        status = httpx.get(f"{url}/api/ps", timeout=10).json()
        assert [model["name"] for model in status["models"]] == ["demo:latest"]  # loaded at start
        body = {"model": "demo", "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 24}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Once upon a time"}],
                                               max_tokens=16, temperature=0)
        assert reply.choices[0].message.content.startswith(", there was a little girl named Lily")
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.parametrize("how", ["drain timeout", "second signal"])
def test_a_drain_cut_short_ends_streams_with_an_error_and_done(tmp_path: Path, how: str) -> None:
    """SIGTERM with a stream still generating past --drain-timeout, or a second SIGINT (a
    second Ctrl-C) during the drain: the stream ends with an error event and [DONE] (before:
    the connection was cut mid-stream, and after a second signal the log showed two
    CancelledError tracebacks), and the daemon exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LOCALSERVE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    drain_timeout = "0.3" if how == "drain timeout" else "60"
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "localserve.cli", "serve", "--port", str(port), "--device",
                                    "cpu", "--model", f"tiny={STORIES_GGUF}", "--kv-cache-memory", "64MiB",
                                    "--drain-timeout", drain_timeout],
                                   stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        wait_healthy(url, process)
        # Top-20 logprobs make every token's event large and slow to make: the stream is
        # still running when the drain times out.
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1800, "ignore_eos": True,
                "logprobs": 20, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/completions",
                                                                                json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            if how == "drain timeout":
                process.send_signal(signal.SIGTERM)
            else:
                process.send_signal(signal.SIGINT)
                # Signals that arrive together are one to Python's handler: the second
                # goes once the first has been acted on.
                assert wait_until(lambda: "draining" in log.read_text(), timeout=30)
                process.send_signal(signal.SIGINT)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        expected = "drain timeout (0.3 s)" if how == "drain timeout" else "told to stop at once"
        assert error["type"] == "server_error" and expected in error["message"]
        assert process.wait(timeout=30) == 0
        assert "Traceback" not in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
