"""The server assembled: websockets' asyncio server on one port, the shared pipeline, the
open connections, signals and graceful shutdown.

One port serves both the WebSocket protocol of ``docs/protocol.md`` on ``/v1/stream``
(``connection.py``) and HTTP: the browser page, ``/healthz``, ``/readyz`` and ``/metrics``,
answered before any handshake (``routes.py``, with the API key and Origin checks of
``access.py``). OpenAI's Realtime transcription (``/v1/realtime``) and Deepgram's live API
(``/v1/listen``) are served by the same connections through their adapters
(``docs/compat.md``). Home Assistant's Wyoming protocol, when configured, has a TCP port of
its own (``wyoming.py``), whose transcriptions are streams on the same pipeline, under the
same admission, drain and shutdown.

Admission: a new stream is refused when ``max_sessions`` are open, or when as many are open
as the decode lanes are measured to keep in real time (``Pipeline.capacity``;
``ServerConfig.capacity_limit``, ``capacity_streams``): with HTTP 503 and ``Retry-After``
before the handshake (``routes.py``), or, when two handshakes passed that check at once, with
``server_full`` and close 1013 after it. The check reads the model's current estimate and
never waits on the decode lanes; ``/readyz`` says 503 while the server is full, and how the
estimate was derived.

Shutdown (``run_server``): SIGTERM first drains, when ``ServerConfig.drain_s`` is above 0:
``/readyz`` says 503 ``draining`` and new streams are refused with HTTP 503, so a load
balancer sends them to another instance, while the open sessions are served as usual until
they have all ended or ``drain_s`` has passed. Then, as on SIGINT, the rest are finished
(finals, ``done``, close 1001). Any further signal drops the open connections at once.

The server keeps only the set of open connections, to finish them on shutdown, to count them
for admission and to report the largest lag; everything about one client lives on its
``Connection`` and ``Session``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import signal
import ssl
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response
from websockets.server import ServerProtocol

from server.apis.registry import CALL_ROUTES, STREAM_APIS
from server.apis.twilio_media import CallHub, ServedConnection, TwilioConfig, Webhook
from server.apis.v1_stream import STREAM_PATH
from server.config import PipelineConfig, ServerConfig, StreamingConfig, VadConfig, WyomingConfig
from server.core.engine_api import SpeechEngine
from server.decode.pipeline import Pipeline
from server.metrics import Metrics
from server.protocol.messages import MAX_TEXT_MESSAGE_BYTES
from server.serve.connection import SHUTDOWN, Connection, Stop, close_quietly, refuse
from server.serve.http_front import FrontProtocol
from server.serve.rest import RestApp
from server.serve.routes import Full, process_request
from server.serve.turn_model import find_turn_model
from server.serve.wyoming import WyomingServer

logger = logging.getLogger("server.serve.app")

# Frames up to max_frame_bytes + this reach our own check, which answers with an error message
# before closing 1009; larger ones are cut off by websockets itself (1009 without a message).
FRAME_SIZE_SLACK_BYTES = 64 * 1024


# --------------------------------------------------------------------------- the server


class ServedStream(Protocol):
    """An open stream as the server counts and ends it: a WebSocket ``Connection``, or a
    Wyoming connection while it transcribes."""

    @property
    def done(self) -> bool: ...

    @property
    def lag_s(self) -> float: ...

    def request_stop(self, stop: Stop) -> None: ...

    def abort(self) -> None: ...


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
        wyoming: WyomingConfig | None = None,
        twilio: TwilioConfig | None = None,
    ) -> None:
        self.config = server or ServerConfig()
        self.wyoming_config = wyoming or WyomingConfig()
        # Twilio Media Streams: calls meet their subscribers here; finals go to the webhook.
        self.twilio = twilio or TwilioConfig()
        self.calls = CallHub(self.twilio.subscriber_queue_events)
        self.webhook = Webhook(self.twilio) if self.twilio.webhook_url is not None else None
        self.metrics = Metrics()
        self.pipeline = Pipeline(pipeline, metrics=self.metrics)
        self.streaming = streaming or StreamingConfig()
        if self.streaming.speakers.enabled:
            from server.engine.blas import set_numpy_blas_threads
            from server.speakers.encoder import SpeakerEncoder  # numpy only; 0.1 s to load

            set_numpy_blas_threads(1)
            self.pipeline.speakers = SpeakerEncoder.load()
        self.pipeline.turn_model = find_turn_model()
        self.vad = vad or VadConfig()
        if self.vad.detector == "silero":
            from server.turns.silero_vad import SileroModel, SileroVoicing

            # Loaded now: a missing model stops the start with its install hint.
            silero = SileroModel()
            self.pipeline.frame_voicing = functools.partial(SileroVoicing, silero)
            logger.info("voice activity: Silero VAD (%s)", silero.path)
        self._load_engine = load_engine
        self.rest = RestApp(self)
        self._connections: set[ServedStream] = set()
        self._ws_server: Server | None = None
        self._wyoming: WyomingServer | None = None
        self._port: int | None = None
        self._loading: asyncio.Task[SpeechEngine] | None = None
        self._closing = False
        self._draining = False
        self._closed: asyncio.Event | None = None
        self._no_connections = asyncio.Event()  # drain() awaits it
        self._no_connections.set()
        self.metrics.stream_lag_s.set_function(self._largest_lag_s)
        self.metrics.capacity_streams.set_function(lambda: self.capacity_streams)
        self.metrics.capacity_headroom_streams.set_function(
            lambda: self.capacity_streams - self.active_sessions
        )
        capacity = self.pipeline.capacity
        if self.config.capacity_streams is not None:
            n = self.config.capacity_streams
            capacity.set_bounds(n, n, "--capacity")
        self.metrics.capacity_measured_streams.set_function(
            lambda: capacity.measured_streams(limit=self.config.max_sessions)
        )
        admission = capacity.admission
        self.metrics.capacity_floor_streams.set_function(lambda: admission.floor or 1)
        self.metrics.capacity_ceiling_streams.set_function(
            lambda: min(admission.ceiling or self.config.max_sessions, self.config.max_sessions)
        )
        self.metrics.capacity_admission_budget_s.set(capacity.admission_budget_s)
        self.metrics.capacity_comfortable_streams.set_function(
            lambda: capacity.comfortable_streams(limit=self.config.max_sessions)
        )
        self.metrics.capacity_window_s.set_function(lambda: capacity.typical_window_s)
        self.metrics.capacity_window_cost_s.set_function(
            lambda: fit.batch_s(1, capacity.typical_window_s) if (fit := capacity.fit) else 0.0
        )
        self.metrics.draining.set_function(lambda: float(self._draining or self._closing))

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
            # Every connection starts at the HTTP front, which hands GETs to the
            # ServerConnection websockets would have used and answers POSTs itself.
            create_connection=self._front,  # type: ignore[arg-type]
            process_request=self._process_request,
            compression=None,  # PCM does not deflate; compression would cost memory per client
            open_timeout=c.open_timeout_s,
            ping_interval=c.ping_interval_s,
            ping_timeout=c.ping_timeout_s,
            close_timeout=c.close_timeout_s,
            max_size=max(self.streaming.max_frame_bytes, MAX_TEXT_MESSAGE_BYTES)
            + FRAME_SIZE_SLACK_BYTES,
            max_queue=c.max_incoming_frames,
            write_limit=c.write_limit_bytes,
            ssl=ssl_context,
        )
        self._port = int(next(iter(self._ws_server.sockets)).getsockname()[1])
        if self.wyoming_config.enabled:
            wyoming = WyomingServer(self, self.wyoming_config)
            try:
                await wyoming.start()
            except OSError:
                self._ws_server.close()
                await self._ws_server.wait_closed()
                raise
            self._wyoming = wyoming
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
        """True while ``/readyz`` says 200 (unless full): the model is warm and neither a
        drain nor a shutdown has begun."""
        return self.pipeline.ready and not self._closing and not self._draining

    @property
    def closing(self) -> bool:
        """True once ``shutdown`` has begun."""
        return self._closing

    @property
    def draining(self) -> bool:
        """True from ``drain`` until ``shutdown`` begins: new streams are refused, open
        sessions are served."""
        return self._draining and not self._closing

    @property
    def port(self) -> int:
        """The port listened on (the one chosen when configured with port 0)."""
        if self._port is None:
            raise RuntimeError("the server was not started")
        return self._port

    @property
    def wyoming_port(self) -> int:
        """The Wyoming port listened on (``WyomingConfig.port``, or the one chosen for 0)."""
        if self._wyoming is None:
            raise RuntimeError("the server does not serve Wyoming")
        return self._wyoming.port

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
        sent ``done`` is only closing, and its stream no longer costs the decode lanes (a
        client that reconnects at once must not find its own last session in the way)."""
        return sum(1 for conn in self._connections if not conn.done)

    @property
    def capacity_streams(self) -> int:
        """Streams the decode lanes are estimated to keep in real time, at most
        ``max_sessions`` (reported even with ``capacity_limit`` off)."""
        return self.pipeline.capacity.streams(limit=self.config.max_sessions)

    def full_reason(self) -> Full | None:
        """Why a new stream would be refused now, or None."""
        active = self.active_sessions
        if active >= self.config.max_sessions:
            return Full(
                "server_full",
                f"the server is at its limit of {self.config.max_sessions} concurrent "
                "sessions; try again later",
            )
        if self.config.capacity_limit and active >= (capacity := self.capacity_streams):
            return Full(
                "capacity",
                f"the server carries {capacity} real-time stream(s) and has {active} open; "
                "try again later",
            )
        return None

    def capacity_summary(self) -> str:
        """How the capacity estimate was derived, in a line (``/readyz``)."""
        limit = "" if self.config.capacity_limit else " (not enforced: --no-capacity-limit)"
        explained = self.pipeline.capacity.explain(limit=self.config.max_sessions)
        return f"{explained}{limit}; {self.active_sessions} open"

    async def drain(self) -> float:
        """Refuse new streams (``/readyz`` 503 ``draining``) and serve the open sessions
        until they have all ended or ``config.drain_s`` has passed; returns the seconds it
        took. Call ``shutdown`` next to finish the sessions still open. Returns at once when
        a shutdown has begun or ``drain_s`` is 0."""
        if self._closing or self.config.drain_s <= 0:
            return 0.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._draining = True
        open_sessions = len(self._connections)
        logger.info(
            "draining: refusing new sessions; waiting up to %.0f s for %d open session(s)",
            self.config.drain_s,
            open_sessions,
        )
        try:
            await asyncio.wait_for(self._no_connections.wait(), self.config.drain_s)
        except asyncio.TimeoutError:
            logger.info(
                "drained for %.0f s; %d session(s) still open",
                self.config.drain_s,
                len(self._connections),
            )
        else:
            if open_sessions:
                logger.info("drained: every session ended in %.1f s", loop.time() - started)
        return loop.time() - started

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
            if self._wyoming is not None:
                self._wyoming.close()
            for conn in list(self._connections):
                conn.request_stop(SHUTDOWN)
            self.calls.close()  # subscribers waiting for calls that never started
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
        if self._wyoming is not None:
            await self._wyoming.wait_closed(self.config.shutdown_timeout_s)
        if self.webhook is not None:
            # The last calls' finals get the shutdown timeout to reach the webhook.
            try:
                await asyncio.wait_for(self.webhook.wait_idle(), self.config.shutdown_timeout_s)
            except asyncio.TimeoutError:
                logger.warning("the webhook did not take the last finals in time")
            await self.webhook.close()
        # Uploads being answered finish too (new ones get 503 since the shutdown began).
        await self.rest.wait_finished(self.config.shutdown_timeout_s)
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
    def _front(self, protocol: ServerProtocol, server: Server, **options: Any) -> FrontProtocol:
        websocket = functools.partial(ServerConnection, protocol, server, **options)
        return FrontProtocol(websocket, self.rest, head_timeout_s=self.config.open_timeout_s)

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        return process_request(self, request)

    # -- WebSocket -------------------------------------------------------------------------
    async def _handle(self, ws: ServerConnection) -> None:
        session_id = secrets.token_hex(6)
        log = logging.LoggerAdapter(logger, {"session_id": session_id})
        path = urlsplit(ws.request.path if ws.request is not None else "").path
        # routes.py lets only the handshakes of the APIs' paths through
        call = CALL_ROUTES.get(path)
        adapter = (
            None if call is not None else STREAM_APIS.get(path, STREAM_APIS[STREAM_PATH]).adapter()
        )
        if self._closing or not self.pipeline.ready:
            await close_quietly(ws, 1001, "server shutting down", self.config.close_timeout_s)
            return
        if call is not None and not call.stream:
            # An events subscriber decodes nothing: not a session, and never refused as one.
            try:
                await call.connection(ws, session_id, self).run()
            except Exception:
                log.error("subscriber connection failed", exc_info=True)
                self.metrics.errors.inc(1, "internal")
                await close_quietly(ws, 1011, "internal server error", self.config.close_timeout_s)
            return
        full = self.full_reason()
        if full is not None:
            # routes.py refuses a full server's handshakes with 503; this is the race of two
            # handshakes that both passed that check before either session was counted.
            self.metrics.sessions_refused.inc(1, full.reason)
            self.metrics.errors.inc(1, "server_full")
            log.warning("refused after the handshake: %s", full.message)
            await refuse(
                ws, "server_full", full.message, 1013, self.config.close_timeout_s, adapter
            )
            return
        conn: ServedConnection = (
            call.connection(ws, session_id, self)
            if call is not None
            else Connection(
                ws,
                session_id,
                pipeline=self.pipeline,
                metrics=self.metrics,
                config=self.config,
                streaming=self.streaming,
                vad=self.vad,
                adapter=adapter,
            )
        )
        self.track(conn)
        self.metrics.sessions_total.inc()
        try:
            await conn.run()
        except Exception:
            # The catch-all: a bug must end this connection only, with 1011, and be logged.
            log.error("connection failed", exc_info=True)
            self.metrics.errors.inc(1, "internal")
            await refuse(
                ws, "internal", "internal server error", 1011, self.config.close_timeout_s, adapter
            )
        finally:
            await self.untrack(conn)

    def track(self, stream: ServedStream) -> None:
        """Count a stream among the open ones: admission, drain, shutdown and metrics."""
        self._connections.add(stream)
        self._no_connections.clear()
        self.metrics.sessions_active.set(len(self._connections))

    async def untrack(self, stream: ServedStream) -> None:
        """The stream ended."""
        self._connections.discard(stream)
        self.metrics.sessions_active.set(len(self._connections))
        if not self._connections:
            self._no_connections.set()
            await self._release_memory()

    async def _release_memory(self) -> None:
        try:
            await self.pipeline.release_memory()
        except Exception:  # memory housekeeping must never fail a connection
            logger.warning("releasing memory failed", exc_info=True)


# --------------------------------------------------------------------------- running


async def run_server(
    load_engine: Callable[[], SpeechEngine],
    *,
    server: ServerConfig | None = None,
    pipeline: PipelineConfig | None = None,
    streaming: StreamingConfig | None = None,
    vad: VadConfig | None = None,
    wyoming: WyomingConfig | None = None,
    twilio: TwilioConfig | None = None,
    on_ready: Callable[[WhisperwireServer], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully: on SIGTERM drain first
    (``WhisperwireServer.drain``); on SIGINT, someone at a terminal who wants the server
    stopped, finish the open sessions at once. A second signal drops them.

    Raises what loading the model raised (``ModelError``), after closing the socket.
    """
    app = WhisperwireServer(
        load_engine,
        server=server,
        pipeline=pipeline,
        streaming=streaming,
        vad=vad,
        wyoming=wyoming,
        twilio=twilio,
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
            logger.info("received %s", stop.result().name)
            if stop.result() is signal.SIGTERM:
                await app.drain()
        else:
            ready.cancel()
            logger.info("received %s before the model was ready", stop.result().name)
        logger.info("shutting down")
    finally:
        await app.shutdown()
        for sig in signals:
            loop.remove_signal_handler(sig)
