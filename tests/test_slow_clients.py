"""Slow clients cannot hold the daemon's connections (slowloris): a request's headers must
arrive within --header-timeout, a body may not stall longer than --body-timeout, and
connections beyond --max-connections are answered 503. Before, uvicorn waited for ever:
2,000 clients sending a header byte every few seconds were never closed.

A real uvicorn server with the real app and the listener settings `localserve serve`
uses, in a thread, with 1-second timeouts; every socket has a timeout."""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from click.testing import CliRunner

from localserve.errors import LocalserveError
from localserve.server.config import ServerConfig

from .server_util import RunningServer, running_server, wait_until
from .test_service import serve_settings

TIMEOUT_S = 1.0  # both --header-timeout and --body-timeout of the test server
LATE_S = 2.0  # how much later than its timeout a slow client may be cut off (a loaded CI machine)
EARLY_S = 0.05  # asyncio may fire a timer this much early (its clock's resolution)
SOCKET_TIMEOUT_S = 10.0
SLOW_CLIENTS = 150
PARTIAL_REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: " + b"s" * 1000  # never ends
BODY_HEAD = (b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n")


@contextmanager
def running(**limits: object) -> Iterator[RunningServer]:
    with running_server(ServerConfig(device="cpu", **limits)) as server:  # type: ignore[arg-type]
        yield server


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running(header_timeout=TIMEOUT_S, body_timeout=TIMEOUT_S) as server:
        yield server


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def get(port: int, path: str = "/health") -> tuple[int, float]:
    """A plain GET on a new connection: its status and how long the answer took."""
    start = time.monotonic()
    with connect(port) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        response = read_until_closed(sock)
    return status_of(response), time.monotonic() - start


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def assert_cut_off_after_timeout(sock: socket.socket, since: float) -> None:
    response = read_until_closed(sock)
    waited = time.monotonic() - since
    assert status_of(response) == 408, response
    assert TIMEOUT_S - EARLY_S <= waited <= TIMEOUT_S + LATE_S, waited


def test_slowloris_connections_are_closed_while_others_are_served(server: RunningServer) -> None:
    """SLOW_CLIENTS connections each send a header byte every 0.2 s: every one is closed
    about --header-timeout after it opened, and /health answers at once meanwhile."""
    selector = selectors.DefaultSelector()
    opened: dict[socket.socket, float] = {}
    for _ in range(SLOW_CLIENTS):
        opened_at = time.monotonic()
        sock = connect(server.port)
        sock.setblocking(False)
        opened[sock] = opened_at
        selector.register(sock, selectors.EVENT_READ)
    sent = dict.fromkeys(opened, 0)
    closed: dict[socket.socket, float] = {}
    health: list[tuple[int, float]] = []
    start = time.monotonic()
    next_byte = start
    try:
        while len(closed) < len(opened) and time.monotonic() < start + TIMEOUT_S + LATE_S:
            for key, _ in selector.select(timeout=0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(65536):
                        continue  # the 408; the end of the connection follows
                except ConnectionResetError:
                    pass
                closed[sock] = time.monotonic()
                selector.unregister(sock)
            if time.monotonic() >= next_byte:
                next_byte += 0.2
                for sock in set(opened) - set(closed):
                    try:
                        sock.send(PARTIAL_REQUEST[sent[sock]:sent[sock] + 1])
                        sent[sock] += 1
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # closed by the server: select says so next
            if not health and time.monotonic() > start + TIMEOUT_S / 2:
                health.append(get(server.port))
    finally:
        for sock in opened:
            sock.close()
        selector.close()
    assert len(closed) == len(opened), f"{len(opened) - len(closed)} slow connections still open"
    lifetimes = [closed[sock] - opened[sock] for sock in opened]
    assert min(lifetimes) >= TIMEOUT_S - EARLY_S, min(lifetimes)
    assert min(sent.values()) >= 3  # they did send, byte by byte, while they lasted
    status, took = health[0]
    assert status == 200 and took < 1.0, health


def test_a_connection_that_sends_nothing_gets_408(server: RunningServer) -> None:
    start = time.monotonic()
    with connect(server.port) as sock:
        assert_cut_off_after_timeout(sock, start)


def test_partial_headers_get_408(server: RunningServer) -> None:
    with connect(server.port) as sock:
        start = time.monotonic()
        sock.sendall(PARTIAL_REQUEST[:40])
        assert_cut_off_after_timeout(sock, start)


def test_kept_alive_connection_times_the_next_request_from_its_first_byte(server: RunningServer) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S / 2)  # idle, within uvicorn's keep-alive of 5 s
        start = time.monotonic()
        sock.sendall(PARTIAL_REQUEST[:40])
        assert_cut_off_after_timeout(sock, start)


def test_a_stalled_body_gets_408(server: RunningServer) -> None:
    with connect(server.port) as sock:
        sock.sendall(BODY_HEAD % 100 + b'{"model": ')
        start = time.monotonic()
        assert_cut_off_after_timeout(sock, start)


def test_a_large_body_sent_steadily_is_read_however_long_it_takes(server: RunningServer) -> None:
    """1.5 MB in 10 chunks 0.25 s apart: 2.5 s in all, more than the body timeout, but
    never silent as long; the app reads it all and answers (an unknown model: 404)."""
    body = json.dumps({"model": "no-such-model", "prompt": "once upon a time " * 90_000}).encode()
    chunk = len(body) // 10 + 1
    start = time.monotonic()
    with connect(server.port) as sock:
        sock.sendall(BODY_HEAD % len(body))
        for offset in range(0, len(body), chunk):
            time.sleep(0.25)
            sock.sendall(body[offset:offset + chunk])
        head = read_response(sock)
    assert time.monotonic() - start > 2 * TIMEOUT_S
    assert head.startswith(b"HTTP/1.1 404"), head

def test_connections_beyond_the_cap_get_503() -> None:
    with running(max_connections=5) as server:
        held = [connect(server.port) for _ in range(5)]
        try:
            for sock in held:
                sock.sendall(PARTIAL_REQUEST[:40])  # slow clients, within the 10 s header timeout
            assert wait_until(lambda: server.connections == 5, timeout=5)
            status, took = get(server.port)  # the sixth
            assert status == 503 and took < 1.0
            held.pop().close()
            assert wait_until(lambda: server.connections == 4, timeout=5)
            assert get(server.port)[0] == 200  # the fifth again
        finally:
            for sock in held:
                sock.close()


def test_the_limits_come_from_serve_options(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "config.toml"
    config.write_text("max-connections = 64\n")
    env = {"LOCALSERVE_CONFIG": str(config), "LOCALSERVE_BODY_TIMEOUT": "7.5", "LOCALSERVE_HOME": str(tmp_path)}
    server, _ = serve_settings(monkeypatch, ["--header-timeout", "2"], env)
    assert (server.header_timeout, server.body_timeout, server.max_connections) == (2.0, 7.5, 64)
    defaults, _ = serve_settings(monkeypatch, [], {"LOCALSERVE_HOME": str(tmp_path)})
    assert (defaults.header_timeout, defaults.body_timeout, defaults.max_connections) == (10.0, 30.0, 1024)


@pytest.mark.parametrize("args, message", [
    (["--header-timeout", "nan"], "--header-timeout must be a number of seconds above 0 and at most 3600, not nan"),
    (["--body-timeout", "inf"], "--body-timeout must be a number of seconds above 0 and at most 3600, not inf"),
    (["--header-timeout", "0"], "--header-timeout must be"),
    (["--max-connections", "0"], "--max-connections must be a whole number from 1 to 1048576, not 0"),
])
def test_bad_limits_stop_serve_with_one_line(tmp_path, monkeypatch: pytest.MonkeyPatch, args: list[str],  # type: ignore[no-untyped-def]
                                             message: str) -> None:
    from localserve.cli.main import main

    monkeypatch.setattr("localserve.logs.configure_logging", lambda level: None)
    monkeypatch.setattr("localserve.server.serve.serve", lambda *args: 0)  # were the limits let through
    result = CliRunner().invoke(main, ["serve", *args], env={"LOCALSERVE_HOME": str(tmp_path)})
    assert result.exit_code == 1
    assert result.output.startswith("Error: " + message) and result.output.count("\n") == 1, result.output


@pytest.mark.parametrize("limits", [{"header_timeout": -1.0}, {"body_timeout": 3601.0}, {"max_connections": 1.5},
                                    {"max_connections": True}, {"header_timeout": "10"}])
def test_server_config_refuses_bad_limits(limits: dict[str, object]) -> None:
    with pytest.raises(LocalserveError):
        ServerConfig(**limits)  # type: ignore[arg-type]
