"""Slow clients cannot hold connections: uvicorn's HTTP protocol with read timeouts.

uvicorn waits for ever for a request's headers and body on a connection, so a client
sending a byte every few seconds (slowloris) holds its socket and buffers as long as it
likes, and a few thousand such clients use up the server's connections. Here:

- a request's headers must arrive whole within ``header_timeout`` seconds of the
  connection's start or, on a kept-alive connection, of the next request's first byte
  (an idle kept-alive connection is uvicorn's ``timeout_keep_alive``, 5 s);
- while a body is being read the client may not go silent for more than
  ``body_timeout`` seconds, however long the whole upload takes.

Past either, the client gets a 408 if nothing of a response was sent yet, and the
connection is closed.

h11 already caps a request's headers at 16 KiB (refused past that), so with the timeout a
connection's buffers are bounded in size and time alike.

Built on uvicorn's h11 protocol, named explicitly rather than uvicorn's "auto" choice
(httptools when installed): h11 is always installed with uvicorn, and its state machine
says where the client is in its request (``their_state``), which is all the timers need.
Parsing speed is no concern for a server whose requests take milliseconds to seconds
of model time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = b"Request Timeout: the request was not received in time\n"
_TIMEOUT_HEADERS = [(b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(_TIMEOUT_BODY)).encode()), (b"connection", b"close")]


class SlowClientProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose client sends too slowly. Use
    ``with_timeouts`` for a class to pass as ``uvicorn.Config(http=...)``."""

    header_timeout: float  # set by with_timeouts
    body_timeout: float

    @classmethod
    def with_timeouts(cls, header_timeout: float, body_timeout: float) -> type[SlowClientProtocol]:
        # A subclass, not an instance setting: uvicorn creates the protocol itself, one per
        # connection, from the class it is given.
        return type(cls.__name__, (cls,), {"header_timeout": header_timeout, "body_timeout": body_timeout})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0  # loop time of the last bytes received

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_overdue)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # pipelined requests may have been read just now

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        """Arm or cancel the timers for where the client now is in its request."""
        if self.transport.is_closing():
            self._cancel_header_timer()
            self._cancel_body_timer()
            return
        state = self.conn.their_state
        if state is not h11.IDLE:
            self._cancel_header_timer()
        elif self._header_timer is None and self.conn.trailing_data[0]:
            # The next request on a kept-alive connection has begun: its headers are due.
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_overdue)
        if state is not h11.SEND_BODY:
            self._cancel_body_timer()
        elif self._body_timer is None:
            self._body_timer = self.loop.call_later(self.body_timeout, self._check_body_progress)

    def _headers_overdue(self) -> None:
        self._header_timer = None
        self._time_out(f"request headers not complete after {self.header_timeout:g} s")

    def _check_body_progress(self) -> None:
        self._body_timer = None
        now = self.loop.time()
        if self.flow.read_paused or self.cycle.waiting_for_100_continue:
            # The client is waiting on us (the app has not taken what was sent, or has not
            # asked for the body yet): that is no silence of the client's.
            self._last_read = now
        silent = now - self._last_read
        if silent < self.body_timeout:
            self._body_timer = self.loop.call_later(self.body_timeout - silent, self._check_body_progress)
        else:
            self._time_out(f"no request body received for {self.body_timeout:g} s")

    def _time_out(self, why: str) -> None:
        if self.transport.is_closing():
            return
        client = "%s:%d - " % self.client if self.client else ""
        # Debug, not warning: a slowloris attack would write one line per connection.
        self.logger.debug("%sclosing the connection: %s", client, why)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # nothing of a response sent yet
            response = h11.Response(status_code=408, headers=_TIMEOUT_HEADERS, reason=b"Request Timeout")
            for event in (response, h11.Data(data=_TIMEOUT_BODY), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self.transport.close()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
