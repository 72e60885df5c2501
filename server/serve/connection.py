"""One WebSocket connection: the state machine that serves a client.

Each connection gets a ``Session`` (the streaming core) and a ``StreamDriver`` (its jobs
through the shared ``Pipeline``), and three tasks of its own: ingest (frames in), send
(messages out, from a bounded outbox) and the supervisor (timeouts, stop requests, closing).

Close codes: 1000 after ``done``; 1001 on server shutdown (after ``done``); 1003 bad audio;
1008 protocol misuse or a client that does not read; 1009 a frame too large; 1011 an internal
error (the server's catch-all); 1013 server full or session too long.

What the client says and is told goes through an ``Adapter`` (``adapters.py``): protocol v1
(``v1_stream.py``) on ``/v1/stream``, or another vendor's API translated onto the same
session, so every API shares this machinery.

Everything about one client lives here and on its ``Session``, never on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from server.apis.adapters import Adapter, SessionSettings
from server.apis.v1_stream import V1Adapter
from server.config import ServerConfig, StreamingConfig, VadConfig
from server.core.session import Session
from server.decode.pipeline import Pipeline
from server.decode.stream_driver import DriverOutcome, StreamDriver
from server.metrics import Metrics
from server.protocol.errors import StreamError
from server.protocol.messages import ReadyMessage

logger = logging.getLogger("server.serve.connection")

MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is at most 125 bytes


@dataclass(frozen=True)
class Stop:
    """Why the server ends a session that the client did not end."""

    close_code: int
    close_reason: str
    error_code: str | None = None  # an error message is sent first when set
    message: str = ""


SHUTDOWN = Stop(1001, "server shutting down")


class _Limit(enum.Enum):
    IDLE = "idle"
    TOO_LONG = "too_long"


def truncate_reason(reason: str) -> str:
    """``reason`` cut to what a close frame can carry, on a character boundary."""
    data = reason.encode("utf-8")[:MAX_CLOSE_REASON_BYTES]
    return data.decode("utf-8", "ignore")


async def close_quietly(
    ws: ServerConnection, code: int, reason: str, close_timeout_s: float
) -> None:
    """Close within twice ``close_timeout_s`` (drain, then the handshake), else drop TCP.

    ``close`` first waits for the write buffer to drain, which a client that does not read
    would hold up forever.
    """
    try:
        await asyncio.wait_for(ws.close(code, truncate_reason(reason)), 2 * close_timeout_s)
    except asyncio.TimeoutError:
        ws.transport.abort()


async def refuse(
    ws: ServerConnection,
    code: str,
    message: str,
    close_code: int,
    timeout_s: float,
    adapter: Adapter | None = None,
) -> None:
    """Send one fatal error message (in ``adapter``'s shape; v1's by default) and close with
    ``close_code``."""
    speaks = adapter or V1Adapter()
    error = speaks.error_message(code, message, fatal=True, audio_received_s=0.0)

    async def send_all() -> None:
        for text in speaks.render(error):
            await ws.send(text)

    # The client may be gone or not reading; the close below runs either way.
    with contextlib.suppress(ConnectionClosed, asyncio.TimeoutError):
        await asyncio.wait_for(send_all(), timeout_s)
    await close_quietly(ws, close_code, message, timeout_s)


class Connection:
    """One client's connection: its session, its driver and the tasks that serve it.

    ``run`` serves it to the end; ``request_stop`` and ``abort`` are how the server ends it.
    """

    def __init__(
        self,
        ws: ServerConnection,
        session_id: str,
        *,
        pipeline: Pipeline,
        metrics: Metrics,
        config: ServerConfig,
        streaming: StreamingConfig,
        vad: VadConfig,
        adapter: Adapter | None = None,
    ) -> None:
        self.ws = ws
        self.session_id = session_id
        self.pipeline = pipeline
        self.metrics = metrics
        self.config = config
        self.streaming = streaming
        self.vad = vad
        self.adapter: Adapter = adapter or V1Adapter()
        self.close_timeout_s = config.close_timeout_s
        self.log = logging.LoggerAdapter(logger, {"session_id": session_id})
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.started_at = loop.time()
        self.last_frame_at = loop.time()
        self.accepting = True  # False once the session is being finished: frames are ignored
        self.driver: StreamDriver | None = None
        self._stop: asyncio.Future[Stop] = loop.create_future()

    @property
    def lag_s(self) -> float:
        return self.driver.session.lag_s if self.driver is not None else 0.0

    @property
    def done(self) -> bool:
        """The session sent ``done``; only the close handshake is left."""
        return self.driver is not None and self.driver.session.done

    def request_stop(self, stop: Stop) -> None:
        """Finish this session from the server side (the first reason wins)."""
        if not self._stop.done():
            self._stop.set_result(stop)

    def abort(self) -> None:
        """Drop the TCP connection now (shutdown timed out)."""
        self.ws.transport.abort()

    # -- setup -----------------------------------------------------------------------------
    def _open_session(self) -> Session:
        """The adapter's session for this request; raises StreamError to refuse it."""
        engine = self.pipeline.engine
        settings = SessionSettings(
            session_id=self.session_id,
            streaming=self.streaming,
            vad=self.vad,
            multilingual=engine.dims.is_multilingual,
            model=engine.name,
            turn_model=self.pipeline.turn_model is not None,
            frame_voicing=self.pipeline.frame_voicing,
        )
        return self.adapter.open_session(settings, self.ws.request)

    # -- tasks -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the connection until it is closed; raises only on bugs (the caller's
        catch-all closes 1011)."""
        try:
            session = self._open_session()
        except StreamError as exc:
            self.log.info("refused: %s", exc)
            await refuse(
                self.ws,
                exc.code,
                str(exc),
                exc.close_code or 1008,
                self.close_timeout_s,
                self.adapter,
            )
            return
        driver = StreamDriver(
            session, self.pipeline, max_pending_messages=self.config.max_pending_messages
        )
        self.driver = driver
        driver.send(
            ReadyMessage(
                session_id=self.session_id,
                model=self.pipeline.engine.name,
                sample_rate=session.audio_format.sample_rate_hz,
                encoding=session.audio_format.encoding,
                language=session.language,
                task=session.settings.task,
                end_of_speech_ms=session.vad_config.speech_end_silence_ms,
                speakers=session.labels_speakers,
                finals=session.streaming.finals,
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
        metrics = self.metrics
        try:
            async for message in self.ws:
                self.last_frame_at = self.loop.time()
                if not self.accepting:
                    continue  # the session is being finished; later frames are not part of it
                before_s = session.audio_received_s
                try:
                    self.adapter.receive(message, driver)
                except StreamError as exc:
                    fatal = exc.close_code is not None
                    self.log.info("client error %s (fatal=%s): %s", exc.code, fatal, exc)
                    driver.send(
                        self.adapter.error_message(
                            exc.code,
                            str(exc),
                            fatal=fatal,
                            audio_received_s=session.audio_received_s,
                            cause=exc,
                        )
                    )
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
                    for text in self.adapter.render(message):
                        await self.ws.send(text)
                finally:
                    outbox.task_done()
        except ConnectionClosed:
            return

    def _limit_stop(self, limit: _Limit) -> Stop:
        if limit is _Limit.IDLE:
            return Stop(
                1000,
                "idle timeout",
                "idle_timeout",
                f"no frame received for {self.config.idle_timeout_s:g} s; finishing the session",
            )
        return Stop(
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
        stopping: Stop | None = None
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
                    self.metrics.errors.inc(1, "slow_client")
                    # The close frame waits behind data the client does not read: it gets
                    # half the usual time before the connection is dropped.
                    await close_quietly(
                        self.ws, 1008, "client does not read its messages", self.close_timeout_s / 2
                    )
                    return
                await self._drain(sender)
                if stopping is not None:
                    await close_quietly(
                        self.ws, stopping.close_code, stopping.close_reason, self.close_timeout_s
                    )
                else:
                    await close_quietly(self.ws, 1000, "done", self.close_timeout_s)
                return
            if ingest in done:
                fatal = ingest.result()  # a bug in ingest raises here: 1011
                if fatal is None:
                    return  # the client closed the connection
                await driver.close()  # "fatal" means the close comes next: no more messages
                await self._drain(sender)
                code = fatal.close_code or 1008
                await close_quietly(self.ws, code, str(fatal), self.close_timeout_s)
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
                        self.adapter.error_message(
                            stopping.error_code,
                            stopping.message,
                            fatal=True,
                            audio_received_s=driver.session.audio_received_s,
                        )
                    )
                driver.end(by_server=True)

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
