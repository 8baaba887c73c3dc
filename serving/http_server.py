"""The HTTP server under the app: uvicorn with its h11 protocol, plus what that protocol lacks
against slow or hostile clients:

- a deadline for a request's headers (from the connection, or from the first byte of a request
  on a kept-alive one) and a limit on any pause within a request body: 408, then close;
- a cap on open connections: one beyond it gets 503 to its first request and is closed;
- protocol errors (a garbage request line, `Content-Length: abc`) answered with an OpenAI error
  body instead of uvicorn's plain text;
- on shutdown, a request still being received is answered 503 and closed at once (uvicorn
  would wait for the rest of it for the whole grace period); idle connections close as before.

Idle keep-alive connections close after `timeout_keep_alive` (uvicorn's own timer).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.openai_schema import error_body

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    timeout_headers: float  # seconds
    timeout_body: float
    limit_concurrency: int | None  # open connections


def error_bytes(status: int, reason: str, message: str, type_: str = "invalid_request_error",
                code: str | None = None, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI error body, ending the connection."""
    body = json.dumps(error_body(message, type_, None, code)).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _over_capacity(scope, receive, send) -> None:
    """The app a connection beyond the cap gets: 503 (an OpenAI error body), then close."""
    body = json.dumps(error_body("too many open connections; retry later", "service_unavailable",
                                 None, "too_many_connections")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"retry-after", b"1"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, a connection cap, JSON protocol errors and a
    shutdown that does not wait for half-sent requests (module docstring)."""

    def __init__(self, *args, limits: HttpLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.read_timer: asyncio.TimerHandle | None = None
        self.reading: str | None = None  # "headers" or "body" while waiting on the client

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        cap = self.limits.limit_concurrency
        if cap is not None and len(self.connections) > cap:
            log.warning("%d connections open (limit %d): answering 503", len(self.connections), cap)
            self.app = _over_capacity
        self._expect("headers")

    def connection_lost(self, exc) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow(after_response=True)

    def _follow(self, after_response: bool = False) -> None:
        """Sets the read deadline from what the client is sending now: a request's headers (one
        deadline, however the bytes trickle in), its body (a limit on each pause), or nothing
        (its request is whole, or, after a response, uvicorn's keep-alive timer runs)."""
        if self.transport.is_closing():
            return self._expect(None)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._expect("body", restart=True)
        elif state is h11.IDLE and not after_response:
            self._expect("headers")  # bytes of a request came (uvicorn's keep-alive timer stopped)
        else:
            self._expect(None)

    def _expect(self, what: str | None, restart: bool = False) -> None:
        if what == self.reading and not restart:
            return
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None
        self.reading = what
        if what is not None:
            seconds = self.limits.timeout_headers if what == "headers" else self.limits.timeout_body
            self.read_timer = self.loop.call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        self.read_timer = None
        if self.transport.is_closing():
            return
        if self.reading == "headers":
            late = bool(self.conn.trailing_data[0])  # part of a request came; else it sent nothing
            seconds, what = self.limits.timeout_headers, "request headers"
        else:
            if self.flow.read_paused:
                return self._expect("body", restart=True)  # we stopped reading, not the client
            late = self.cycle is not None and not self.cycle.response_started
            seconds, what = self.limits.timeout_body, "request body"
        if not late:
            self.transport.close()
            return
        self._write_and_close(error_bytes(408, "Request Timeout", f"the {what} did not arrive in "
                                          f"time (nothing for {seconds:g}s)", code="request_timeout"))

    def _write_and_close(self, response: bytes) -> None:
        """Sends `response` and closes; the request's app, if one runs, sees a disconnect."""
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()  # a response is under way: no room for another one
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.write(response)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # h11 refused the request (bad request line, headers, Content-Length or chunk framing).
        self._write_and_close(error_bytes(400, "Bad Request", "invalid HTTP request: a malformed request "
                                          "line, header or body framing", code="invalid_http_request"))

    def shutdown(self) -> None:
        cycle = self.cycle
        if self.conn.their_state is h11.SEND_BODY and cycle is not None and not cycle.response_started:
            # Its body is still arriving: it will not be served. Say so rather than wait for it.
            self._write_and_close(error_bytes(503, "Service Unavailable", "the server is shutting down",
                                              "service_unavailable", headers=(("retry-after", "5"),)))
            return
        super().shutdown()


def uvicorn_config(app, config, **kwargs):
    """The uvicorn.Config of `app` under a ServerConfig's HTTP settings (host, port, timeouts,
    connection cap), over GuardedH11Protocol."""
    import uvicorn

    limits = HttpLimits(timeout_headers=config.timeout_headers, timeout_body=config.timeout_body,
                        limit_concurrency=config.limit_concurrency or None)
    return uvicorn.Config(app, host=config.host, port=config.port,
                          http=functools.partial(GuardedH11Protocol, limits=limits),
                          timeout_keep_alive=config.timeout_keep_alive, **kwargs)
