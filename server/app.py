"""The network side: websockets' asyncio server, HTTP routes, limits, signals, shutdown.

One port serves both:

- ``/v1/stream``: the WebSocket protocol of ``docs/protocol.md``. Each connection gets a
  ``Session`` (the streaming core) and a ``StreamDriver`` (its jobs through the shared
  ``Pipeline``), and three tasks of its own: ingest (frames in), send (messages out, from a
  bounded outbox) and the supervising handler (timeouts, shutdown, closing).
- ``/`` and the page's files (``client/web``), ``/healthz``, ``/readyz``, ``/metrics``, answered
  in ``process_request`` before any WebSocket handshake. Authentication (API key) and the
  Origin check also happen there, so refused clients get an HTTP 401 or 403.

Close codes: 1000 after ``done``; 1001 on server shutdown (after ``done``); 1003 bad audio;
1008 protocol misuse or a client that does not read; 1009 a frame too large; 1011 an internal
error; 1013 server full or session too long.

Admission: a new stream is refused (``server_full``, 1013) when ``max_sessions`` are open, or
when as many are open as the decode worker is measured to keep in real time
(``Pipeline.capacity``; ``ServerConfig.capacity_limit``). The check reads the model's current
estimate and never waits on the decode worker; ``/readyz`` says 503 while the server is full.

Everything about one client lives on its ``_Connection`` and ``Session``; the server only keeps
the set of open connections, to finish them on shutdown, to count them for admission and to
report the largest lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import enum
import hmac
import importlib.resources
import json
import logging
import re
import secrets
import signal
import ssl
from collections.abc import Callable
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from .config import AudioFormat, PipelineConfig, ServerConfig, StreamingConfig, VadConfig
from .engine_api import SpeechEngine
from .errors import ProtocolError, StreamError
from .messages import MAX_TEXT_MESSAGE_BYTES, ErrorMessage, ReadyMessage
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .pipeline import DriverOutcome, Pipeline, StreamDriver
from .session import Session

logger = logging.getLogger("server.app")

STREAM_PATH = "/v1/stream"
# Frames up to max_frame_bytes + this reach our own check, which answers with an error message
# before closing 1009; larger ones are cut off by websockets itself (1009 without a message).
FRAME_SIZE_SLACK_BYTES = 64 * 1024
MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is at most 125 bytes
QUERY_FIELDS = ("sample_rate", "encoding", "language", "task")
_STATIC_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".wasm": "application/wasm",
}


# --------------------------------------------------------------------------- stop reasons


@dataclass(frozen=True)
class _Stop:
    """Why the server ends a session that the client did not end."""

    close_code: int
    close_reason: str
    error_code: str | None = None  # an error message is sent first when set
    message: str = ""


class _Limit(enum.Enum):
    IDLE = "idle"
    TOO_LONG = "too_long"


def _truncate_reason(reason: str) -> str:
    data = reason.encode("utf-8")[:MAX_CLOSE_REASON_BYTES]
    return data.decode("utf-8", "ignore")


# --------------------------------------------------------------------------- HTTP


def _response(
    status: HTTPStatus,
    body: bytes | str,
    content_type: str = "text/plain; charset=utf-8",
    headers: dict[str, str] | None = None,
) -> Response:
    data = body.encode("utf-8") if isinstance(body, str) else body
    h = Headers()
    h["Date"] = email.utils.formatdate(usegmt=True)
    h["Connection"] = "close"
    h["Content-Type"] = content_type
    h["Content-Length"] = str(len(data))
    h["Cache-Control"] = "no-store"
    h["X-Content-Type-Options"] = "nosniff"
    for name, value in (headers or {}).items():
        h[name] = value
    return Response(status.value, status.phrase, h, data)


def _web_file(name: str) -> tuple[bytes, str] | None:
    """A file of the browser page (``client/web``) and its content type, or None."""
    if not _STATIC_NAME_RE.fullmatch(name) or ".." in name:
        return None
    suffix = name[name.rfind(".") :] if "." in name else ""
    content_type = CONTENT_TYPES.get(suffix)
    if content_type is None:
        return None
    try:
        resource = importlib.resources.files("client").joinpath("web").joinpath(name)
        if not resource.is_file():
            return None
        return resource.read_bytes(), content_type
    except (ModuleNotFoundError, OSError):
        return None


def _single_header(headers: Headers, name: str) -> str | None:
    values = headers.get_all(name)
    return values[0] if len(values) == 1 else None


# --------------------------------------------------------------------------- the server


class WhisperwireServer:
    """The streaming server: listening socket, shared pipeline, open connections.

    Use as an async context manager (``start``, ``wait_ready``; ``shutdown`` on exit), or call
    those yourself. ``load_engine`` runs on the decode thread (MLX lives there); any
    ``SpeechEngine`` will do, so tests inject test doubles.
    """

    def __init__(
        self,
        load_engine: Callable[[], SpeechEngine],
        *,
        server: ServerConfig | None = None,
        pipeline: PipelineConfig | None = None,
        streaming: StreamingConfig | None = None,
        vad: VadConfig | None = None,
    ) -> None:
        self.config = server or ServerConfig()
        self.metrics = Metrics()
        self.pipeline = Pipeline(pipeline, metrics=self.metrics)
        self.streaming = replace(
            streaming or StreamingConfig(), max_frame_bytes=self.config.max_frame_bytes
        )
        self.vad = vad or VadConfig()
        self._load_engine = load_engine
        self._connections: set[_Connection] = set()
        self._ws_server: Server | None = None
        self._port: int | None = None
        self._loading: asyncio.Task[SpeechEngine] | None = None
        self._closing = False
        self._closed: asyncio.Event | None = None
        self.metrics.stream_lag_s.set_function(self._largest_lag_s)
        self.metrics.capacity_streams.set_function(lambda: self.capacity_streams)
        self.metrics.capacity_headroom_streams.set_function(
            lambda: self.capacity_streams - self.active_sessions
        )

    # -- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen, and load and warm up the model in the background (``/readyz`` tells when).

        Raises ``OSError`` when the address is taken, ``ssl.SSLError`` / ``OSError`` for bad
        TLS files.
        """
        c = self.config
        ssl_context: ssl.SSLContext | None = None
        if c.tls_cert_path is not None and c.tls_key_path is not None:
            ssl_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ssl_context.load_cert_chain(c.tls_cert_path, c.tls_key_path)
        self._ws_server = await serve(
            self._handle,
            c.host,
            c.port,
            process_request=self._process_request,
            compression=None,  # PCM does not deflate; compression would cost memory per client
            open_timeout=c.open_timeout_s,
            ping_interval=c.ping_interval_s,
            ping_timeout=c.ping_timeout_s,
            close_timeout=c.close_timeout_s,
            max_size=max(c.max_frame_bytes, MAX_TEXT_MESSAGE_BYTES) + FRAME_SIZE_SLACK_BYTES,
            max_queue=c.max_incoming_frames,
            write_limit=c.write_limit_bytes,
            ssl=ssl_context,
        )
        self._port = int(next(iter(self._ws_server.sockets)).getsockname()[1])
        self._loading = asyncio.create_task(
            self.pipeline.start(self._load_engine, warmup=c.warmup), name="whisperwire-load"
        )

    async def wait_ready(self) -> None:
        """Wait until the model is loaded and warmed; raises what loading raised."""
        if self._loading is None:
            raise RuntimeError("start() the server first")
        await asyncio.shield(self._loading)

    @property
    def ready(self) -> bool:
        """True while ``/readyz`` says 200: the model is warm and no shutdown has begun."""
        return self.pipeline.ready and not self._closing

    @property
    def port(self) -> int:
        """The port listened on (the one chosen when configured with port 0)."""
        if self._port is None:
            raise RuntimeError("the server was not started")
        return self._port

    @property
    def url(self) -> str:
        """``ws://host:port`` (``wss://`` with TLS), without a path."""
        scheme = "wss" if self.config.tls else "ws"
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{self.port}"

    @property
    def http_url(self) -> str:
        """``http://host:port`` (``https://`` with TLS): where the page and probes are."""
        return "http" + self.url.removeprefix("ws")

    @property
    def active_sessions(self) -> int:
        """Streaming sessions open right now and not yet done: a connection whose session
        sent ``done`` is only closing, and its stream no longer costs the decode worker (a
        client that reconnects at once must not find its own last session in the way)."""
        return sum(1 for conn in self._connections if not conn.done)

    @property
    def capacity_streams(self) -> int:
        """Streams the decode worker is estimated to keep in real time, at most
        ``max_sessions`` (reported even with ``capacity_limit`` off)."""
        return self.pipeline.capacity.streams(limit=self.config.max_sessions)

    def _full(self) -> str | None:
        """Why a new stream would be refused now (the ``server_full`` message), or None."""
        active = self.active_sessions
        if active >= self.config.max_sessions:
            return (
                f"the server is at its limit of {self.config.max_sessions} concurrent "
                "sessions; try again later"
            )
        if self.config.capacity_limit and active >= (capacity := self.capacity_streams):
            return (
                f"the server carries {capacity} real-time stream(s) and has {active} open; "
                "try again later"
            )
        return None

    async def shutdown(self) -> None:
        """Stop accepting, finish every open session (finals, ``done``, close 1001), stop
        the pipeline. Idempotent; awaits everything it stops."""
        if self._closed is not None:
            await self._closed.wait()
            return
        self._closed = asyncio.Event()
        self._closing = True
        try:
            await self._shutdown()
        finally:
            self._closed.set()

    async def _shutdown(self) -> None:
        open_sessions = len(self._connections)
        if open_sessions:
            logger.info("shutting down: finishing %d open session(s)", open_sessions)
        if self._ws_server is not None:
            # Stop listening; handshakes still in progress are refused with HTTP 503.
            self._ws_server.close(close_connections=False)
            for conn in list(self._connections):
                conn.request_stop(_SHUTDOWN)
            try:
                await asyncio.wait_for(
                    self._ws_server.wait_closed(), self.config.shutdown_timeout_s
                )
            except asyncio.TimeoutError:
                logger.warning(
                    "%d session(s) did not finish within %.0f s; dropping them",
                    len(self._connections),
                    self.config.shutdown_timeout_s,
                )
                self.abort_connections()
                await self._ws_server.wait_closed()
        if self._loading is not None and not self._loading.done():
            # The load runs on the decode thread and cannot be interrupted; close() waits
            # for it to return.
            self._loading.cancel()
        if self._loading is not None:
            await asyncio.wait({self._loading})
            if not self._loading.cancelled():
                self._loading.exception()  # retrieved; wait_ready() reports it
        await self.pipeline.close()
        logger.info("server stopped")

    def abort_connections(self) -> None:
        """Drop every open connection now, without finals or a close handshake."""
        for conn in list(self._connections):
            conn.abort()

    async def __aenter__(self) -> WhisperwireServer:
        await self.start()
        try:
            await self.wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def _largest_lag_s(self) -> float:
        return max((c.lag_s for c in self._connections), default=0.0)

    # -- HTTP ------------------------------------------------------------------------------
    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == STREAM_PATH:
            return self._check_stream_request(request)
        if path == "/healthz":
            return _response(HTTPStatus.OK, "ok\n")
        if path == "/readyz":
            if not self.ready:
                state = "shutting down" if self._closing else "loading the model"
                return _response(HTTPStatus.SERVICE_UNAVAILABLE, f"not ready: {state}\n")
            full = self._full()
            if full is not None:
                return _response(HTTPStatus.SERVICE_UNAVAILABLE, f"not ready: full: {full}\n")
            return _response(HTTPStatus.OK, "ready\n")
        if path == "/metrics":
            return _response(HTTPStatus.OK, self.metrics.render(), METRICS_CONTENT_TYPE)
        name = "index.html" if path == "/" else path.removeprefix("/static/").lstrip("/")
        found = _web_file(name)
        if found is not None:
            return _response(HTTPStatus.OK, found[0], found[1])
        return _response(HTTPStatus.NOT_FOUND, f"not found: {path[:100]}\n")

    def _check_stream_request(self, request: Request) -> Response | None:
        """Refuse the handshake (HTTP status) for an unready server, a bad token or Origin."""
        if not self.ready:
            self.metrics.sessions_refused.inc(1, "not_ready")
            return _response(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the server is not ready (loading the model or shutting down); retry later\n",
                headers={"Retry-After": "5"},
            )
        if self.config.api_key is not None and not self._authorized(request):
            self.metrics.sessions_refused.inc(1, "unauthorized")
            return _response(
                HTTPStatus.UNAUTHORIZED,
                "missing or wrong API key: send 'Authorization: Bearer KEY' or ?token=KEY\n",
                headers={"WWW-Authenticate": 'Bearer realm="whisperwire"'},
            )
        origin = _single_header(request.headers, "Origin")
        if request.headers.get_all("Origin") and not self._origin_allowed(origin, request):
            self.metrics.sessions_refused.inc(1, "forbidden_origin")
            return _response(HTTPStatus.FORBIDDEN, "this Origin may not connect\n")
        return None

    def _authorized(self, request: Request) -> bool:
        assert self.config.api_key is not None
        expected = self.config.api_key.encode("utf-8")
        offered: list[str] = []
        auth = _single_header(request.headers, "Authorization")
        if auth is not None:
            scheme, _, value = auth.partition(" ")
            if scheme.lower() == "bearer":
                offered.append(value.strip())
        offered.extend(parse_qs(urlsplit(request.path).query).get("token", []))
        # compare_digest: the time taken must not tell how many leading bytes were right.
        return any(hmac.compare_digest(o.encode("utf-8"), expected) for o in offered)

    def _origin_allowed(self, origin: str | None, request: Request) -> bool:
        """Browsers always send Origin: allow the listed ones and the server's own page."""
        if origin is None:
            return False  # several Origin headers
        allowed = self.config.allowed_origins
        if "*" in allowed or origin in allowed:
            return True
        host = _single_header(request.headers, "Host")
        scheme = "https" if self.config.tls else "http"
        return host is not None and origin == f"{scheme}://{host}"

    # -- WebSocket -------------------------------------------------------------------------
    async def _handle(self, ws: ServerConnection) -> None:
        session_id = secrets.token_hex(6)
        log = logging.LoggerAdapter(logger, {"session_id": session_id})
        if self._closing or not self.pipeline.ready:
            await _close_quietly(ws, 1001, "server shutting down", self.config.close_timeout_s)
            return
        full = self._full()
        if full is not None:
            # "capacity": refused by the estimate, below max_sessions.
            at_max = self.active_sessions >= self.config.max_sessions
            self.metrics.sessions_refused.inc(1, "server_full" if at_max else "capacity")
            self.metrics.errors.inc(1, "server_full")
            log.warning("refused: %s", full)
            await _refuse(ws, "server_full", full, 1013, self.config.close_timeout_s)
            return
        conn = _Connection(self, ws, session_id)
        self._connections.add(conn)
        self.metrics.sessions_active.set(len(self._connections))
        self.metrics.sessions_total.inc()
        try:
            await conn.run()
        except Exception:
            # The catch-all: a bug must end this connection only, with 1011, and be logged.
            log.error("connection failed", exc_info=True)
            self.metrics.errors.inc(1, "internal")
            await _refuse(ws, "internal", "internal server error", 1011, conn.close_timeout_s)
        finally:
            self._connections.discard(conn)
            self.metrics.sessions_active.set(len(self._connections))
            if not self._connections:
                await self._release_memory()

    async def _release_memory(self) -> None:
        try:
            await self.pipeline.release_memory()
        except Exception:  # memory housekeeping must never fail a connection
            logger.warning("releasing memory failed", exc_info=True)


_SHUTDOWN = _Stop(1001, "server shutting down")


async def _close_quietly(
    ws: ServerConnection, code: int, reason: str, close_timeout_s: float
) -> None:
    """Close within twice ``close_timeout_s`` (drain, then the handshake), else drop TCP.

    ``close`` first waits for the write buffer to drain, which a client that does not read
    would hold up forever.
    """
    try:
        await asyncio.wait_for(ws.close(code, _truncate_reason(reason)), 2 * close_timeout_s)
    except asyncio.TimeoutError:
        ws.transport.abort()


async def _refuse(
    ws: ServerConnection, code: str, message: str, close_code: int, timeout_s: float
) -> None:
    """Send one fatal error message and close with ``close_code``."""
    # The client may be gone or not reading; the close below runs either way.
    with contextlib.suppress(ConnectionClosed, asyncio.TimeoutError):
        await asyncio.wait_for(ws.send(ErrorMessage(code, message, True, 0.0).to_json()), timeout_s)
    await _close_quietly(ws, close_code, message, timeout_s)


class _Connection:
    """One client's connection: its session, its driver and the tasks that serve it."""

    def __init__(self, server: WhisperwireServer, ws: ServerConnection, session_id: str) -> None:
        self.server = server
        self.ws = ws
        self.session_id = session_id
        self.config = server.config
        self.close_timeout_s = server.config.close_timeout_s
        self.log = logging.LoggerAdapter(logger, {"session_id": session_id})
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.started_at = loop.time()
        self.last_frame_at = loop.time()
        self.accepting = True  # False once the session is being finished: frames are ignored
        self.driver: StreamDriver | None = None
        self._stop: asyncio.Future[_Stop] = loop.create_future()

    @property
    def lag_s(self) -> float:
        return self.driver.session.lag_s if self.driver is not None else 0.0

    @property
    def done(self) -> bool:
        """The session sent ``done``; only the close handshake is left."""
        return self.driver is not None and self.driver.session.done

    def request_stop(self, stop: _Stop) -> None:
        """Finish this session from the server side (the first reason wins)."""
        if not self._stop.done():
            self._stop.set_result(stop)

    def abort(self) -> None:
        """Drop the TCP connection now (shutdown timed out)."""
        self.ws.transport.abort()

    # -- setup -----------------------------------------------------------------------------
    def _open_session(self) -> Session:
        """A session configured from the URL query; raises ProtocolError (1008) for bad
        values. The query takes the same fields, and gets the same checks, as ``config``."""
        engine = self.server.pipeline.engine
        session = Session(
            self.session_id,
            engine,
            audio_format=AudioFormat(),
            streaming=self.server.streaming,
            vad=self.server.vad,
            multilingual=engine.dims.is_multilingual,
        )
        params = parse_qs(urlsplit(self.ws.request.path if self.ws.request else "").query)
        fields: dict[str, Any] = {}
        for key in QUERY_FIELDS:
            values = params.get(key)
            if not values:
                continue
            value = values[-1]
            if key == "sample_rate":
                if not value.isdigit() or len(value) > 6:
                    raise ProtocolError(
                        f"query parameter 'sample_rate' must be an integer; got {value[:20]!r}",
                        close_code=1008,
                    )
                fields[key] = int(value)
            else:
                fields[key] = value
        if fields:
            try:
                session.receive_text(json.dumps({"type": "config", **fields}))
            except ProtocolError as exc:
                raise ProtocolError(f"in the URL query: {exc}", close_code=1008) from exc
        session.events_to_send()  # configuring emits nothing; start from a clean slate
        return session

    # -- tasks -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the connection until it is closed; raises only on bugs (the caller's
        catch-all closes 1011)."""
        try:
            session = self._open_session()
        except StreamError as exc:
            self.log.info("refused: %s", exc)
            await _refuse(self.ws, exc.code, str(exc), exc.close_code or 1008, self.close_timeout_s)
            return
        driver = StreamDriver(
            session, self.server.pipeline, max_pending_messages=self.config.max_pending_messages
        )
        self.driver = driver
        driver.send(
            ReadyMessage(
                session_id=self.session_id,
                model=self.server.pipeline.engine.name,
                sample_rate=session.audio_format.sample_rate_hz,
                encoding=session.audio_format.encoding,
                language=session.language,
                task=session.streaming.task,
            )
        )
        self.log.info(
            "session started: %d Hz %s, language %s",
            session.audio_format.sample_rate_hz,
            session.audio_format.encoding,
            session.language,
        )
        sender = asyncio.create_task(self._send_loop(driver), name=f"send-{self.session_id}")
        ingest = asyncio.create_task(self._ingest(driver), name=f"ingest-{self.session_id}")
        try:
            await self._supervise(driver, ingest, sender)
        finally:
            self.accepting = False
            await driver.close()
            for task in (ingest, sender):
                task.cancel()
            await asyncio.wait({ingest, sender})
            for task in (ingest, sender):
                if not task.cancelled() and task.exception() is not None:
                    self.log.debug("%s ended with %r", task.get_name(), task.exception())
            self.log.info(
                "session ended: %.1f s of audio, %.1f s connected",
                session.audio_received_s,
                self.loop.time() - self.started_at,
            )

    async def _ingest(self, driver: StreamDriver) -> StreamError | None:
        """Read frames until the client closes. Returns the fatal StreamError that ended the
        stream, or None when the client went away."""
        session = driver.session
        metrics = self.server.metrics
        try:
            async for message in self.ws:
                self.last_frame_at = self.loop.time()
                if not self.accepting:
                    continue  # the session is being finished; later frames are not part of it
                before_s = session.audio_received_s
                try:
                    if isinstance(message, str):
                        driver.receive_text(message)
                    else:
                        driver.receive_audio(message)
                except StreamError as exc:
                    fatal = exc.close_code is not None
                    self.log.info("client error %s (fatal=%s): %s", exc.code, fatal, exc)
                    driver.send(ErrorMessage(exc.code, str(exc), fatal, session.audio_received_s))
                    if fatal:
                        self.accepting = False
                        return exc
                finally:
                    metrics.audio_received_s.inc(max(0.0, session.audio_received_s - before_s))
                if session.audio_received_s > self.config.max_session_s:
                    self.request_stop(self._limit_stop(_Limit.TOO_LONG))
        except ConnectionClosed:
            pass
        return None

    async def _send_loop(self, driver: StreamDriver) -> None:
        """Send queued messages in order; ends when the connection closes."""
        outbox = driver.outbox
        try:
            while True:
                message = await outbox.get()
                try:
                    await self.ws.send(message.to_json())
                finally:
                    outbox.task_done()
        except ConnectionClosed:
            return

    def _limit_stop(self, limit: _Limit) -> _Stop:
        if limit is _Limit.IDLE:
            return _Stop(
                1000,
                "idle timeout",
                "idle_timeout",
                f"no frame received for {self.config.idle_timeout_s:g} s; finishing the session",
            )
        return _Stop(
            1013,
            "session too long",
            "limit",
            f"sessions are limited to {self.config.max_session_s:g} s; finishing the session",
        )

    def _next_deadline(self) -> tuple[_Limit | None, float | None]:
        """(a limit that has passed, or None; seconds until the next one, or None)."""
        if self.driver is None or self.driver.session.ended or not self.accepting:
            return None, None  # the client said end: it waits for done and owes no frames
        now = self.loop.time()
        session_left = self.started_at + self.config.max_session_s - now
        idle_left = self.last_frame_at + self.config.idle_timeout_s - now
        if session_left <= 0:
            return _Limit.TOO_LONG, None
        if idle_left <= 0:
            return _Limit.IDLE, None
        return None, min(session_left, idle_left)

    async def _supervise(
        self,
        driver: StreamDriver,
        ingest: asyncio.Task[StreamError | None],
        sender: asyncio.Task[None],
    ) -> None:
        stopping: _Stop | None = None
        while True:
            expired, timeout = self._next_deadline()
            if expired is not None:
                self.request_stop(self._limit_stop(expired))
            waiting: set[asyncio.Future[Any]] = {ingest, sender, driver.outcome}
            if stopping is None:
                waiting.add(self._stop)
            done, _ = await asyncio.wait(
                waiting,
                timeout=None if stopping is not None else timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if driver.outcome in done:
                outcome = driver.outcome.result()  # a session bug raises here: 1011
                if outcome is DriverOutcome.OVERFLOW:
                    self.server.metrics.errors.inc(1, "slow_client")
                    # The close frame waits behind data the client does not read: it gets
                    # half the usual time before the connection is dropped.
                    await _close_quietly(
                        self.ws, 1008, "client does not read its messages", self.close_timeout_s / 2
                    )
                    return
                await self._drain(sender)
                if stopping is not None:
                    await _close_quietly(
                        self.ws, stopping.close_code, stopping.close_reason, self.close_timeout_s
                    )
                else:
                    await _close_quietly(self.ws, 1000, "done", self.close_timeout_s)
                return
            if ingest in done:
                fatal = ingest.result()  # a bug in ingest raises here: 1011
                if fatal is None:
                    return  # the client closed the connection
                await driver.close()  # "fatal" means the close comes next: no more messages
                await self._drain(sender)
                code = fatal.close_code or 1008
                await _close_quietly(self.ws, code, str(fatal), self.close_timeout_s)
                return
            if sender in done:
                sender.result()
                return  # the connection closed under us
            if stopping is None and self._stop.done():
                stopping = self._stop.result()
                self.log.info("finishing the session: %s", stopping.close_reason)
                self.accepting = False
                if stopping.error_code is not None:
                    driver.send(
                        ErrorMessage(
                            stopping.error_code,
                            stopping.message,
                            True,
                            driver.session.audio_received_s,
                        )
                    )
                driver.end()

    async def _drain(self, sender: asyncio.Task[None]) -> None:
        """Wait (bounded) until the outbox is sent, so the close comes after the last message."""
        assert self.driver is not None
        joined = asyncio.ensure_future(self.driver.outbox.join())
        try:
            done, _ = await asyncio.wait(
                {joined, sender}, timeout=self.close_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                self.log.warning("client did not take its last messages in time")
        finally:
            joined.cancel()


# --------------------------------------------------------------------------- running


async def run_server(
    load_engine: Callable[[], SpeechEngine],
    *,
    server: ServerConfig | None = None,
    pipeline: PipelineConfig | None = None,
    streaming: StreamingConfig | None = None,
    vad: VadConfig | None = None,
    on_ready: Callable[[WhisperwireServer], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully.

    Raises what loading the model raised (``ModelError``), after closing the socket.
    """
    app = WhisperwireServer(
        load_engine, server=server, pipeline=pipeline, streaming=streaming, vad=vad
    )
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[signal.Signals] = loop.create_future()

    def _on_signal(sig: signal.Signals) -> None:
        if not stop.done():
            stop.set_result(sig)
        else:
            logger.warning("second %s: dropping the open sessions without their finals", sig.name)
            app.abort_connections()

    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, sig)
    try:
        await app.start()
        logger.info("loading the model; %s/readyz turns 200 when it is ready", app.http_url)
        ready = asyncio.ensure_future(app.wait_ready())
        first: set[asyncio.Future[Any]] = {ready, stop}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()  # raises ModelError and the like
            logger.info("listening on %s", app.url)
            if on_ready is not None:
                on_ready(app)
            await stop
        else:
            ready.cancel()
        logger.info("received %s; shutting down", stop.result().name)
    finally:
        await app.shutdown()
        for sig in signals:
            loop.remove_signal_handler(sig)
