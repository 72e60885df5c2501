"""The front of every connection on the port: a GET goes on to websockets, anything else is an
HTTP request with a body, read and answered here with h11.

websockets serves GET only (the WebSocket handshake, and ``routes.py``'s pages and probes
before it) and reads no request body. So each accepted connection starts with a
``FrontProtocol`` that reads the request head: for a GET it hands the transport, and the bytes
read so far, to the ``ServerConnection`` websockets would have used, which carries on exactly
as if it had been there from the start (the handshake, ``process_request``, TLS, limits); for
any other method (``POST /v1/audio/transcriptions``, ``POST /v1/listen``, a CORS preflight)
h11 reads the request and its body and an ``HttpApp`` (``rest.py``) answers it. One request
per connection: every answer says ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol, cast
from urllib.parse import urlsplit

import h11
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from server.serve.routes import response

logger = logging.getLogger("server.serve.http_front")

MAX_HEAD_BYTES = 16 * 1024  # request line and headers; websockets' own limits are alike
LINGER_S = 2.0  # after refusing a request, how long its unread body may still arrive


@dataclass(frozen=True)
class HttpRequest:
    """One request read in full."""

    method: str
    target: str  # path and query, as sent
    headers: Headers
    body: bytes = b""

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    def as_handshake(self) -> Request:
        """The request as websockets' ``Request`` (``access.py`` checks either kind)."""
        return Request(self.target, self.headers)


class Reply(Protocol):
    """How an ``HttpApp`` answers: one whole response, or a streamed one."""

    async def send(self, response: Response) -> None: ...

    async def start(self, status: HTTPStatus, headers: dict[str, str]) -> None: ...

    async def chunk(self, data: bytes) -> None: ...

    async def finish(self) -> None: ...


class HttpApp(Protocol):
    def check(self, request: HttpRequest) -> Response | None:
        """The answer to a request before its body is read (a refusal), or None to read it."""
        ...

    def max_body_bytes(self, request: HttpRequest) -> int:
        """The largest body this request may carry (413 beyond it)."""
        ...

    async def handle(self, request: HttpRequest, reply: Reply) -> None:
        """Answer a request whose body has been read."""
        ...


class FrontProtocol(asyncio.Protocol):
    """Reads the first request head of a connection and decides who serves it."""

    def __init__(
        self, websocket: Callable[[], asyncio.Protocol], app: HttpApp, *, head_timeout_s: float
    ) -> None:
        self._websocket = websocket
        self._app = app
        self._head_timeout_s = head_timeout_s
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._exchange: _Exchange | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._head_timeout_s, self._transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._exchange is not None:
            self._exchange.receive(data)
            return
        assert self._transport is not None
        self._buffer += data
        if b"\r\n\r\n" not in self._buffer:
            if len(self._buffer) > MAX_HEAD_BYTES:
                self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large")
            return
        if self._timer is not None:
            self._timer.cancel()
        if self._buffer.startswith(b"GET "):
            self._hand_to_websockets()
        else:
            self._exchange = _Exchange(self._transport, self._app)
            self._exchange.receive(bytes(self._buffer))
            self._buffer.clear()

    def eof_received(self) -> bool:
        return self._exchange is not None and self._exchange.eof()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._exchange is not None:
            self._exchange.lost()

    def pause_writing(self) -> None:
        if self._exchange is not None:
            self._exchange.pause_writing()

    def resume_writing(self) -> None:
        if self._exchange is not None:
            self._exchange.resume_writing()

    def _hand_to_websockets(self) -> None:
        assert self._transport is not None
        connection = self._websocket()
        self._transport.set_protocol(connection)
        connection.connection_made(self._transport)
        connection.data_received(bytes(self._buffer))
        self._buffer.clear()

    def _refuse(self, status: HTTPStatus, text: str) -> None:
        assert self._transport is not None
        if self._timer is not None:
            self._timer.cancel()
        self._transport.write(_serialize(response(status, text + "\n")))
        self._transport.close()


def _serialize(resp: Response) -> bytes:
    lines = [f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}"]
    lines += [f"{name}: {value}" for name, value in resp.headers.raw_items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (resp.body or b"")


class _Exchange:
    """One HTTP request and its answer over h11, on a connection the front kept."""

    def __init__(self, transport: asyncio.Transport, app: HttpApp) -> None:
        self._transport = transport
        self._app = app
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._head: HttpRequest | None = None
        self._limit = 0
        self._body = bytearray()
        self._task: asyncio.Task[None] | None = None
        self._writable = asyncio.get_running_loop().create_future()
        self._writable.set_result(None)
        self._done = False
        self._linger: asyncio.TimerHandle | None = None

    # -- reading ---------------------------------------------------------------------------
    def receive(self, data: bytes) -> None:
        if self._done or self._task is not None:
            return  # one request per connection; what follows the first is not read
        self._h11.receive_data(data)
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._answer_now(response(HTTPStatus.BAD_REQUEST, f"bad request: {exc}\n"))
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                if not self._begin(event):
                    return
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > self._limit:
                    self._too_large()
                    return
            elif isinstance(event, h11.EndOfMessage):
                assert self._head is not None
                request = HttpRequest(
                    self._head.method, self._head.target, self._head.headers, bytes(self._body)
                )
                self._body.clear()
                self._task = asyncio.create_task(self._handle(request), name="whisperwire-http")
                return
            elif isinstance(event, h11.ConnectionClosed):
                self._transport.close()
                return

    def _begin(self, event: h11.Request) -> bool:
        headers = Headers()
        for name, value in event.headers:
            headers[name.decode("latin-1")] = value.decode("latin-1")
        self._head = HttpRequest(
            event.method.decode("ascii"), event.target.decode("latin-1"), headers
        )
        refused = self._app.check(self._head)
        if refused is not None:
            self._answer_now(refused)
            return False
        self._limit = self._app.max_body_bytes(self._head)
        length = headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self._limit:
            self._too_large()
            return False
        if self._h11.they_are_waiting_for_100_continue:
            self._write(h11.InformationalResponse(status_code=100, headers=[]))
        return True

    def _too_large(self) -> None:
        self._answer_now(
            response(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the request body is larger than {self._limit} bytes\n",
            )
        )

    def _answer_now(self, resp: Response) -> None:
        # A refusal before the body is read: the client may still be sending it. Closing at
        # once would reset the connection (unread data) and could destroy the answer on its
        # way; so the answer goes out, our side half-closes, and what still arrives is read
        # and dropped until the client closes too or LINGER_S has passed.
        self._done = True
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._transport.write(_serialize(resp))
        if not self._transport.can_write_eof():
            self._transport.close()
            return
        self._transport.write_eof()
        loop = asyncio.get_running_loop()
        self._linger = loop.call_later(LINGER_S, self._transport.close)

    async def _handle(self, request: HttpRequest) -> None:
        try:
            await self._app.handle(request, _H11Reply(self))
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:
            logger.info("%s %s: the client went away", request.method, request.path)
        except Exception:
            logger.error("%s %s failed", request.method, request.path, exc_info=True)
            if self._h11.our_state is h11.SEND_RESPONSE:
                resp = response(HTTPStatus.INTERNAL_SERVER_ERROR, "internal server error\n")
                await _H11Reply(self).send(resp)
        finally:
            self._done = True
            self._transport.close()

    # -- writing ---------------------------------------------------------------------------
    def _write(self, event: h11.Event) -> None:
        data = self._h11.send(event)
        if data:
            self._transport.write(data)

    async def write(self, event: h11.Event) -> None:
        await asyncio.shield(self._writable)
        if self._transport.is_closing():
            raise ConnectionResetError("the client went away")
        self._write(event)

    def pause_writing(self) -> None:
        if self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if not self._writable.done():
            self._writable.set_result(None)

    def eof(self) -> bool:
        """The client closed its side; True to keep ours open for an answer."""
        if self._task is not None or self._done:
            # HTTP/1.1 clients do not half-close while they wait for an answer: the client
            # went away, and what is being done for it stops.
            self.lost()
            return False
        self.receive(b"")  # a request cut short: h11 calls it malformed, answered with 400
        return True

    def lost(self) -> None:
        """The client went away: stop whatever is being done for it."""
        self._done = True
        if self._linger is not None:
            self._linger.cancel()
        self.resume_writing()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task


class _H11Reply:
    def __init__(self, exchange: _Exchange) -> None:
        self._exchange = exchange

    async def send(self, resp: Response) -> None:
        headers = list(resp.headers.raw_items())
        await self._exchange.write(
            h11.Response(status_code=resp.status_code, headers=headers, reason=resp.reason_phrase)
        )
        if resp.body:
            await self._exchange.write(h11.Data(data=bytes(resp.body)))
        await self._exchange.write(h11.EndOfMessage())

    async def start(self, status: HTTPStatus, headers: dict[str, str]) -> None:
        # No Content-Length: h11 sends the body chunked.
        fields = [*headers.items(), ("Connection", "close"), ("Cache-Control", "no-store")]
        await self._exchange.write(
            h11.Response(status_code=status.value, headers=fields, reason=status.phrase)
        )

    async def chunk(self, data: bytes) -> None:
        await self._exchange.write(h11.Data(data=data))

    async def finish(self) -> None:
        await self._exchange.write(h11.EndOfMessage())
