"""Home Assistant's Wyoming protocol on a TCP port of its own (``--wyoming-port``).

Each connection is a ``WyomingConnection``: it reads events (``server.apis.wyoming`` frames
and translates them) and serves ``describe``, ``ping`` and one transcription at a time, as
many in a row as the client sends. A transcription is a stream like any other: its own
``Session`` and ``StreamDriver`` on the shared ``Pipeline`` (the same decode lanes and
batches as the WebSocket streams), admitted by the same rules (``full_reason``: the session
limit and the capacity estimate), counted while it lasts (``/metrics``, ``/readyz``,
drain), bounded by the same idle and length limits and finished the same way on shutdown.

Errors: input that breaks the protocol (a header line that is not one, a length over its
bound, audio before ``audio-start``, audio not in whole frames, a second ``audio-start``)
gets an ``error`` event {text, code} and the connection is closed, as Home Assistant waits
for a ``transcript`` or a closed connection and would wait forever after an error it reads
past. An unknown event type gets an ``error`` and the connection goes on. A refused
transcription (server full, loading, draining) gets ``error`` and a close too.

Wyoming has no authentication: the port listens on loopback unless the operator names
another address, and the log says which it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from wyoming.event import Event
from wyoming.ping import Pong

from server.apis.wyoming import (
    PROGRAM_NAME,
    AudioConverter,
    EventDecoder,
    Reply,
    Started,
    TranscriptStream,
    WyomingAudioFormat,
    encode_event,
    error_event,
    info_event,
    language_code,
)
from server.config import WyomingConfig
from server.core.session import Session
from server.decode.stream_driver import DriverOutcome, StreamDriver
from server.protocol.errors import ProtocolError, StreamError
from server.protocol.formats import AudioFormat
from server.protocol.messages import ErrorMessage
from server.serve.connection import SHUTDOWN, Stop
from server.serve.rest import RestServer
from server.serve.routes import Full

logger = logging.getLogger("server.serve.wyoming")

READ_BYTES = 64 * 1024
SERVICE_TYPE = "_wyoming._tcp.local."


class WyomingHost(RestServer, Protocol):
    """What a Wyoming connection uses of the server (``WhisperwireServer`` is the real one):
    what the file APIs read, and the stream admission and counting."""

    @property
    def draining(self) -> bool: ...

    def full_reason(self) -> Full | None: ...

    def track(self, stream: WyomingConnection) -> None:
        """Count an open transcription among the server's streams."""
        ...

    async def untrack(self, stream: WyomingConnection) -> None:
        """The transcription ended."""
        ...


class _Refused(StreamError):
    """A transcription the server does not take now (full, loading, draining)."""

    close_code: int | None = 1013

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _UnknownEvent(ProtocolError):
    code = "unknown_event"


@dataclass
class _Transcription:
    """One transcription on a connection: from ``audio-start`` to ``transcript-stop``."""

    session_id: str
    driver: StreamDriver
    stream: TranscriptStream
    converter: AudioConverter
    started_at: float
    log: logging.LoggerAdapter[logging.Logger]
    sender: asyncio.Task[None] | None = None
    ending: bool = False  # audio-stop (or the server's stop): only the transcript is left

    @property
    def session(self) -> Session:
        return self.driver.session


class WyomingConnection:
    """One client's TCP connection: its events in, the replies and transcriptions out.

    ``run`` serves it to the end; ``request_stop`` and ``abort`` are how the server ends it.
    While a transcription is open the server counts the connection as a stream (``track``).
    """

    def __init__(
        self,
        host: WyomingHost,
        config: WyomingConfig,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        info: Callable[[], Event],
    ) -> None:
        self.host = host
        self.config = config
        self.reader = reader
        self.writer = writer
        self._info = info
        self.connection_id = secrets.token_hex(6)
        self.log = logging.LoggerAdapter(logger, {"session_id": self.connection_id})
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.last_event_at = loop.time()
        self._decoder = EventDecoder(max_payload_bytes=host.streaming.max_frame_bytes)
        # Events read ahead of the one being served: TCP holds the rest back.
        self._incoming: asyncio.Queue[Event | StreamError | None] = asyncio.Queue(
            maxsize=host.config.max_incoming_frames
        )
        self._stop: asyncio.Future[Stop] = loop.create_future()
        self._language: str | None = None  # the last transcribe's, for the next audio-start
        self._tx: _Transcription | None = None

    # -- what the server reads and calls -----------------------------------------------------
    @property
    def done(self) -> bool:
        """No transcription is open, or its session sent ``done``."""
        return self._tx is None or self._tx.session.done

    @property
    def lag_s(self) -> float:
        return self._tx.session.lag_s if self._tx is not None else 0.0

    def request_stop(self, stop: Stop) -> None:
        """Finish the open transcription (its transcript goes out), then close; the first
        reason wins."""
        if not self._stop.done():
            self._stop.set_result(stop)

    def abort(self) -> None:
        """Drop the TCP connection now."""
        self.writer.transport.abort()

    # -- serving -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve until the client leaves or the server ends the connection; raises only on
        bugs (the caller's catch-all logs them and drops the connection)."""
        reading = asyncio.create_task(self._read(), name=f"wyoming-read-{self.connection_id}")
        try:
            await self._serve()
        except ConnectionError:
            self.log.info("the client went away")
        finally:
            reading.cancel()
            await asyncio.wait({reading})
            if self._tx is not None:
                await self._finish(self._tx)
            await self._close()

    async def _read(self) -> None:
        """Bytes from the socket, events into ``_incoming``; None at the end of the stream,
        the ``StreamError`` that makes the rest unreadable."""
        try:
            while True:
                data = await self.reader.read(READ_BYTES)
                if not data:
                    await self._incoming.put(None)
                    return
                self._decoder.receive_data(data)
                while (event := self._decoder.next_event()) is not None:
                    await self._incoming.put(event)
        except StreamError as exc:
            await self._incoming.put(exc)
        except ConnectionError:
            await self._incoming.put(None)

    async def _serve(self) -> None:
        stopping: Stop | None = None
        getting: asyncio.Task[Event | StreamError | None] | None = None
        try:
            while True:
                tx = self._tx
                waiting: set[asyncio.Future[Any]] = set()
                if tx is None or not tx.ending:
                    # After audio-stop, the next request waits until the transcript is out:
                    # the events of one connection are served in order.
                    if getting is None:
                        getting = asyncio.create_task(self._incoming.get())
                    waiting.add(getting)
                if tx is not None:
                    assert tx.sender is not None
                    waiting |= {tx.driver.outcome, tx.sender}
                if stopping is None:
                    waiting.add(self._stop)
                timeout, expired = self._next_deadline(stopping)
                done, _ = await asyncio.wait(
                    waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    if expired is None:
                        self.log.info(
                            "closing a connection idle for %.0f s", self.config.idle_connection_s
                        )
                        return
                    self.request_stop(expired)
                    continue
                if tx is not None and tx.driver.outcome in done:
                    if tx.driver.outcome.result() is DriverOutcome.OVERFLOW:  # a bug raises
                        self.host.metrics.errors.inc(1, "slow_client")
                        self.abort()
                        return
                    await self._drain(tx)
                    await self._finish(tx)
                    if stopping is not None:
                        return
                    continue
                if tx is not None and tx.sender in done:
                    tx.sender.result()
                    return  # the connection was lost while sending
                if getting is not None and getting in done:
                    item, getting = getting.result(), None
                    if item is None:
                        return  # the client closed the connection
                    if not await self._handle(item):
                        return
                    continue
                if stopping is None and self._stop.done():
                    stopping = self._stop.result()
                    self.log.info("finishing: %s", stopping.close_reason)
                    if tx is None:
                        return
                    if stopping.error_code is not None:
                        tx.driver.send(self._error_message(stopping.error_code, stopping.message))
                    tx.driver.end(by_server=True)
                    tx.ending = True
        finally:
            if getting is not None:
                getting.cancel()

    def _next_deadline(self, stopping: Stop | None) -> tuple[float | None, Stop | None]:
        """(seconds until the next limit, or None; the stop it brings, None: close)."""
        now = self.loop.time()
        tx = self._tx
        if tx is None:
            return max(0.0, self.last_event_at + self.config.idle_connection_s - now), None
        if tx.ending or stopping is not None:
            return None, None  # the client said audio-stop: it waits and owes no events
        c = self.host.config
        session_left = tx.started_at + c.max_session_s - now
        idle_left = self.last_event_at + c.idle_timeout_s - now
        if session_left <= idle_left:
            return max(0.0, session_left), self._too_long()
        return max(0.0, idle_left), Stop(
            1000,
            "idle timeout",
            "idle_timeout",
            f"no event received for {c.idle_timeout_s:g} s; finishing the transcription",
        )

    def _too_long(self) -> Stop:
        limit = self.host.config.max_session_s
        return Stop(
            1013,
            "session too long",
            "limit",
            f"transcriptions are limited to {limit:g} s; finishing the transcription",
        )

    async def _handle(self, item: Event | StreamError) -> bool:
        """Serve one event; False when the connection is to be closed."""
        if isinstance(item, StreamError):
            await self._fail(item)  # the byte stream cannot be read on
            return False
        self.last_event_at = self.loop.time()
        try:
            await self._on_event(item)
        except StreamError as exc:
            if exc.close_code is not None:
                await self._fail(exc)
                return False
            self.log.info("client error %s: %s", exc.code, exc)
            await self._tell(error_event(exc.code, str(exc)), code=exc.code)
        return True

    async def _on_event(self, event: Event) -> None:
        kind, data = event.type, event.data
        tx = self._tx
        if kind == "describe":
            await self._tell(self._info())
        elif kind == "ping":
            text = data.get("text")
            await self._tell(Pong(text=text if isinstance(text, str) else None).event())
        elif kind == "select-program":
            if data.get("name") != PROGRAM_NAME:
                raise ProtocolError(f"no such program; this server has {PROGRAM_NAME!r}")
        elif kind == "transcribe":
            if tx is not None:
                raise ProtocolError(
                    "transcribe while a transcription is open: send audio-stop first",
                    close_code=1008,
                )
            self._language = language_code(data.get("language"))
        elif kind == "audio-start":
            if tx is not None:
                raise ProtocolError(
                    "audio-start while a transcription is open: send audio-stop first",
                    close_code=1008,
                )
            self._open(WyomingAudioFormat.from_data(kind, data))
        elif kind == "audio-chunk":
            if tx is None:
                raise ProtocolError(
                    "audio-chunk before audio-start: send audio-start {rate, width, channels} "
                    "first",
                    close_code=1008,
                )
            self._check_format(tx, data)
            self._feed(tx, tx.converter.convert(event.payload or b""))
        elif kind == "audio-stop":
            if tx is None:
                raise ProtocolError("audio-stop before audio-start", close_code=1008)
            self._feed(tx, tx.converter.flush())
            tx.driver.end()
            tx.ending = True
        else:
            raise _UnknownEvent(
                f"unknown event type {kind[:40]!r}: this server takes describe, transcribe, "
                "audio-start, audio-chunk, audio-stop and ping"
            )

    def _check_format(self, tx: _Transcription, data: dict[str, Any]) -> None:
        """A chunk that says its format must say the one ``audio-start`` declared."""
        if not any(name in data for name in ("rate", "width", "channels")):
            return
        fmt = WyomingAudioFormat.from_data("audio-chunk", data)
        if fmt != tx.converter.format:
            started = tx.converter.format
            raise ProtocolError(
                f"audio-chunk of {fmt.rate} Hz, {fmt.width} byte(s), {fmt.channels} channel(s) "
                f"after an audio-start of {started.rate} Hz, {started.width} byte(s), "
                f"{started.channels} channel(s)",
                close_code=1003,
            )

    def _feed(self, tx: _Transcription, data: bytes) -> None:
        session = tx.session
        before = session.audio_received_s
        try:
            tx.driver.feed_audio(data)
        finally:
            self.host.metrics.audio_received_s.inc(max(0.0, session.audio_received_s - before))
        if session.audio_received_s > self.host.config.max_session_s:
            self.request_stop(self._too_long())

    # -- a transcription -----------------------------------------------------------------------
    def _open(self, fmt: WyomingAudioFormat) -> None:
        """Admit and start a transcription. Raises ``_Refused`` or ``ProtocolError``."""
        host = self.host
        if not host.ready:
            state = "draining" if host.draining else "not_ready"
            host.metrics.sessions_refused.inc(1, state)
            raise _Refused(state, f"the server is not ready ({state}); retry later")
        full = host.full_reason()
        if full is not None:
            host.metrics.sessions_refused.inc(1, full.reason)
            raise _Refused(full.reason, full.message)
        engine = host.pipeline.engine
        converter = AudioConverter(fmt)
        session_id = secrets.token_hex(6)
        session = Session(
            session_id,
            audio_format=AudioFormat(converter.sample_rate_hz, converter.encoding),
            streaming=host.streaming,
            vad=host.vad,
            multilingual=engine.dims.is_multilingual,
            frame_voicing=host.pipeline.frame_voicing,
        )
        language = self._language or session.language
        self._language = None  # a transcribe applies to the transcription that follows it
        try:
            # A voice command ends a turn, as the voice-agent APIs' streams do: their finals.
            session.configure(
                dataclasses.replace(
                    session.settings, language=language, finals=host.streaming.agent_finals
                )
            )
        except ProtocolError as exc:
            raise ProtocolError(str(exc), close_code=1008) from None
        driver = StreamDriver(
            session, host.pipeline, max_pending_messages=host.config.max_pending_messages
        )
        tx = _Transcription(
            session_id=session_id,
            driver=driver,
            stream=TranscriptStream(session.language),
            converter=converter,
            started_at=self.loop.time(),
            log=logging.LoggerAdapter(logger, {"session_id": session_id}),
        )
        tx.sender = asyncio.create_task(self._send(tx), name=f"wyoming-send-{session_id}")
        self._tx = tx
        host.track(self)
        host.metrics.sessions_total.inc()
        driver.send(Started(language=session.language))
        tx.log.info(
            "transcription started on connection %s: %d Hz, %d byte(s), %d channel(s), language %s",
            self.connection_id,
            fmt.rate,
            fmt.width,
            fmt.channels,
            session.language,
        )

    async def _send(self, tx: _Transcription) -> None:
        """The transcription's events, in order, as Wyoming events."""
        outbox = tx.driver.outbox
        while True:
            message = await outbox.get()
            try:
                for event in tx.stream.render(message):
                    await self._write(event)
            finally:
                outbox.task_done()

    async def _drain(self, tx: _Transcription) -> None:
        """Wait (bounded) until the transcription's events are sent."""
        assert tx.sender is not None
        joined = asyncio.ensure_future(tx.driver.outbox.join())
        try:
            done, _ = await asyncio.wait(
                {joined, tx.sender},
                timeout=self.host.config.close_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:
                tx.log.warning("client did not take its last events in time")
        finally:
            joined.cancel()

    async def _finish(self, tx: _Transcription) -> None:
        """The transcription is over (sent, abandoned or failed): stop its tasks, uncount it."""
        self._tx = None
        if tx.sender is not None:
            tx.sender.cancel()
            await asyncio.wait({tx.sender})
        await tx.driver.close()
        await self.host.untrack(self)
        tx.log.info(
            "transcription ended: %.1f s of audio, %.1f s, %d word(s)",
            tx.session.audio_received_s,
            self.loop.time() - tx.started_at,
            len(tx.stream.text.split()),
        )

    # -- output --------------------------------------------------------------------------------
    def _error_message(self, code: str, message: str) -> ErrorMessage:
        received = self._tx.session.audio_received_s if self._tx is not None else 0.0
        return ErrorMessage(code, message, True, received)

    async def _tell(self, event: Event, *, code: str | None = None) -> None:
        """Send a reply: behind the open transcription's events, or now."""
        if code is not None:
            self.host.metrics.errors.inc(1, code)
        if self._tx is not None:
            self._tx.driver.send(Reply(event=event))
        else:
            await self._write_soon(event)

    async def _fail(self, exc: StreamError) -> None:
        """Tell the client why the connection closes (after what it was owed)."""
        self.log.info("closing on client error %s: %s", exc.code, exc)
        tx = self._tx
        if tx is None:
            self.host.metrics.errors.inc(1, exc.code)
            with contextlib.suppress(ConnectionError):
                await self._write_soon(error_event(exc.code, str(exc)))
            return
        tx.driver.send(self._error_message(exc.code, str(exc)))
        await tx.driver.close()  # the close comes next: no more events from the session
        await self._drain(tx)

    async def _write(self, event: Event) -> None:
        self.writer.write(encode_event(event))
        await self.writer.drain()

    async def _write_soon(self, event: Event) -> None:
        """``_write``, bounded: a client that does not read is dropped."""
        try:
            await asyncio.wait_for(self._write(event), self.host.config.close_timeout_s)
        except asyncio.TimeoutError:
            self.abort()
            raise ConnectionError("the client does not read") from None

    async def _close(self) -> None:
        """Close after what was written is sent, or drop the connection after the close
        timeout (a client that does not read)."""
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), self.host.config.close_timeout_s)
        except (asyncio.TimeoutError, ConnectionError):
            self.abort()


class WyomingServer:
    """The Wyoming listener: accepts connections and serves each as a ``WyomingConnection``
    on ``host``'s pipeline."""

    def __init__(self, host: WyomingHost, config: WyomingConfig) -> None:
        if config.port is None:
            raise ValueError("WyomingConfig.port is None: Wyoming is not to be served")
        self.host = host
        self.config = config
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._connections: set[WyomingConnection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._info: Event | None = None
        self._zeroconf: Any = None  # zeroconf.asyncio.AsyncZeroconf while advertised

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the Wyoming server was not started")
        return self._port

    @property
    def loopback(self) -> bool:
        """Whether only this machine can connect."""
        return is_loopback(self.config.host)

    async def start(self) -> None:
        """Listen. Raises ``OSError`` when the address is taken."""
        self._server = await asyncio.start_server(self._accept, self.config.host, self.config.port)
        self._port = int(next(iter(self._server.sockets)).getsockname()[1])
        where = f"tcp://{self.config.host}:{self._port}"
        if self.loopback:
            logger.info(
                "Wyoming (Home Assistant) on %s: loopback only; --wyoming-host names an "
                "address others can reach (Wyoming has no authentication)",
                where,
            )
        else:
            logger.warning(
                "Wyoming (Home Assistant) on %s: anyone who can reach this address can "
                "transcribe, as Wyoming has no authentication%s",
                where,
                " (--api-key does not apply to it)" if self.host.config.api_key else "",
            )
        if self.config.zeroconf and not self.loopback:
            await self._advertise()

    def close(self) -> None:
        """Stop listening; each connection finishes its transcription, then closes."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.request_stop(SHUTDOWN)

    async def wait_closed(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the connections to finish, then drop the rest."""
        self.close()
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            if late:
                logger.warning(
                    "%d Wyoming connection(s) did not finish within %.0f s; dropping them",
                    len(late),
                    timeout_s,
                )
                for conn in list(self._connections):
                    conn.abort()
                await asyncio.wait(late)
        if self._server is not None:
            await self._server.wait_closed()
        if self._zeroconf is not None:
            await self._zeroconf.async_close()  # unregisters the service
            self._zeroconf = None

    def info(self) -> Event:
        """The ``info`` event for the loaded model (built once the model is there)."""
        if self._info is None:
            engine = self.host.pipeline.engine
            self._info = info_event(engine.name, model_languages(engine.dims.is_multilingual))
        return self._info

    def _describe(self) -> Event:
        if not self.host.pipeline.ready:
            raise _Refused("not_ready", "the model is still loading; describe again shortly")
        return self.info()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closing:
            writer.transport.abort()
            return
        conn = WyomingConnection(self.host, self.config, reader, writer, info=self._describe)
        self._connections.add(conn)
        self._tasks.add(task)
        try:
            await conn.run()
        except Exception:
            # The catch-all: a bug ends this connection only, and is logged.
            conn.log.error("Wyoming connection failed", exc_info=True)
            self.host.metrics.errors.inc(1, "internal")
            conn.abort()
        finally:
            self._connections.discard(conn)
            self._tasks.discard(task)

    async def _advertise(self) -> None:
        """Announce the service over mDNS when the zeroconf package is installed."""
        try:
            from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf
        except ImportError:
            logger.info(
                "zeroconf is not installed: Home Assistant will not discover this server; add "
                "it by host and port, or pip install 'wyoming[zeroconf]'"
            )
            return
        address = advertised_address(self.config.host)
        if address is None:
            logger.info("not advertising over mDNS: no IPv4 address for %s", self.config.host)
            return
        name = f"{PROGRAM_NAME}-{socket.gethostname()}"[:63]
        service = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(address)],
            port=self.port,
        )
        zeroconf = AsyncZeroconf()
        try:
            await zeroconf.async_register_service(service)
        except OSError as exc:
            # Multicast may be unavailable (containers without host networking).
            logger.warning("could not advertise over mDNS: %s", exc)
            await zeroconf.async_close()
            return
        self._zeroconf = zeroconf
        logger.info("advertised %s at %s:%d over mDNS", service.name, address, self.port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def advertised_address(host: str) -> str | None:
    """The IPv4 address to announce for a server listening on ``host``: itself when it is
    one, else the address this machine reaches the mDNS group from."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None and address.version == 4 and not address.is_unspecified:
        return str(address)
    if address is not None and address.version == 6 and not address.is_unspecified:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("224.0.0.251", 5353))  # UDP: picks a route, sends nothing
        except OSError:
            return None
        return str(probe.getsockname()[0])


def model_languages(multilingual: bool) -> list[str]:
    """The languages the loaded model transcribes, as Whisper's codes."""
    if not multilingual:
        return ["en"]
    # The tokenizer's table, read once the model is loaded: the app imports no engine.
    from server.engine.lightning import module

    return sorted(module("tokenizer").LANGUAGES)
