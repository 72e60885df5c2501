"""Stream one audio source to a Whisperwire server and collect what comes back.

``stream_audio`` connects, waits for ``ready``, sends the source's chunks (paced in real time
times ``pace``) while it receives messages concurrently, sends ``end`` when the audio is over
and returns after ``done``. It is plain asyncio with no process-wide state, so a test can call
it in-process against a server on ``127.0.0.1:PORT``.

Latency is measured against the wall time each chunk was sent: ``LatencyTracker`` maps a
stream time (``start``/``end`` in server messages) back to the moment the chunk holding that
audio left the client.

Errors, all with a one-line message for the user::

    WhisperwireError (server.protocol.errors)
    └── ClientError
        ├── ConnectError   no connection: refused, bad URL, handshake refused (HTTP status)
        └── StreamFailed   the stream broke: fatal ``error``, abnormal close, no ``done``
"""

from __future__ import annotations

import asyncio
import bisect
import email.utils
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
)

from client.sources import AudioSource
from server.protocol.errors import ProtocolError, WhisperwireError
from server.protocol.messages import (
    DoneMessage,
    EndMessage,
    ErrorMessage,
    FinalMessage,
    PartialMessage,
    ReadyMessage,
    ServerMessage,
    SpeechStartedMessage,
    parse_server_message,
)

logger = logging.getLogger("client.stream")
_T = TypeVar("_T")

DEFAULT_URL = "ws://127.0.0.1:8765/v1/stream"
_TIME_EPSILON_S = 1e-6

# Close codes the protocol uses, for messages that say more than a number.
_CLOSE_REASONS = {
    1000: "normal",
    1001: "going away",
    1003: "unsupported data",
    1006: "connection lost",
    1008: "policy violation",
    1009: "frame too large",
    1011: "internal server error",
    1013: "server busy, try again later",
}


class ClientError(WhisperwireError):
    """The client could not stream; the message is one line for the user."""


class ConnectError(ClientError):
    """No WebSocket session: connection refused, bad URL, or the handshake was refused.

    ``status`` is the HTTP status of a refused handshake (503: full, not ready or draining),
    None when no HTTP answer came; ``retry_after_s`` the wait its ``Retry-After`` asked for.
    """

    def __init__(
        self, message: str, *, status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class StreamFailed(ClientError):
    """The session broke before ``done``.

    ``error`` is the server's fatal ``error`` message when there was one; ``close_code`` the
    WebSocket close code when the connection closed.
    """

    def __init__(
        self, message: str, *, error: ErrorMessage | None = None, close_code: int | None = None
    ) -> None:
        super().__init__(message)
        self.error = error
        self.close_code = close_code


@dataclass(frozen=True)
class StreamStats:
    """Timing of one stream, measured on the client's clock."""

    audio_s: float  # seconds of audio sent
    wall_s: float  # from the start of the audio (stream time 0) to ``done`` received
    ttft_s: float | None  # first speech sent -> first partial/final with a word; None: no words
    final_latencies_s: tuple[float, ...]  # per final with text: arrival - send of its last audio

    @property
    def real_time_factor(self) -> float | None:
        """Wall time over audio time: below 1 is faster than real time. None without audio."""
        return self.wall_s / self.audio_s if self.audio_s > 0 else None


@dataclass(frozen=True)
class StreamResult:
    """Everything a finished stream produced."""

    ready: ReadyMessage
    finals: tuple[FinalMessage, ...]
    done: DoneMessage
    stats: StreamStats

    @property
    def text(self) -> str:
        """The finals' text joined with single spaces."""
        return " ".join(t for t in (f.text.strip() for f in self.finals) if t)


class LatencyTracker:
    """Maps stream time to the wall time its audio was sent, and derives the stream's stats.

    Pure bookkeeping: the caller passes wall times in, so tests can script them.
    """

    def __init__(self) -> None:
        self._chunk_ends_s: list[float] = []  # stream time at the end of each chunk sent
        self._sent_wall: list[float] = []  # wall time each chunk was sent
        self._speech_start_s: float | None = None
        self._first_word_wall: float | None = None
        self._first_word_start_s: float | None = None
        self._final_latencies: list[float] = []
        self._start_wall: float | None = None

    @property
    def audio_sent_s(self) -> float:
        """Seconds of audio sent so far."""
        return self._chunk_ends_s[-1] if self._chunk_ends_s else 0.0

    def started(self, wall: float) -> None:
        """Record when the stream's audio began (stream time 0), before any pacing wait."""
        if self._start_wall is None:
            self._start_wall = wall

    def audio_sent(self, duration_s: float, wall: float) -> None:
        """Record a chunk of ``duration_s`` seconds sent at ``wall``."""
        self.started(wall)
        self._chunk_ends_s.append(self.audio_sent_s + duration_s)
        self._sent_wall.append(wall)

    def sent_at(self, stream_s: float) -> float | None:
        """Wall time the chunk holding the audio at ``stream_s`` was sent (None: nothing sent).

        Times past the audio sent map to the last chunk.
        """
        if not self._sent_wall:
            return None
        # The tolerance absorbs float drift in the summed chunk ends (ten 0.1 s chunks add up
        # to 0.9999999999999999); wire times are rounded to milliseconds anyway.
        i = bisect.bisect_left(self._chunk_ends_s, stream_s - _TIME_EPSILON_S)
        return self._sent_wall[min(i, len(self._sent_wall) - 1)]

    def message_received(self, message: ServerMessage, wall: float) -> None:
        """Account for a server message that arrived at ``wall``."""
        if isinstance(message, SpeechStartedMessage) and self._speech_start_s is None:
            self._speech_start_s = message.start
        elif isinstance(message, (PartialMessage, FinalMessage)) and message.text.strip():
            if self._first_word_wall is None:
                self._first_word_wall = wall
                self._first_word_start_s = message.start
            if isinstance(message, FinalMessage):
                sent = self.sent_at(message.end)
                if sent is not None:
                    self._final_latencies.append(wall - sent)

    def stats(self, end_wall: float) -> StreamStats:
        """The stats of the stream so far, with ``end_wall`` as the end of the session."""
        ttft: float | None = None
        if self._first_word_wall is not None:
            # Without a speech_started (a server may omit it), the first words' start is the
            # best guess of when speech began.
            speech_s = self._speech_start_s
            if speech_s is None:
                speech_s = self._first_word_start_s
            sent = self.sent_at(speech_s if speech_s is not None else 0.0)
            if sent is not None:
                ttft = self._first_word_wall - sent
        start = self._start_wall
        return StreamStats(
            audio_s=self.audio_sent_s,
            wall_s=end_wall - start if start is not None else 0.0,
            ttft_s=ttft,
            final_latencies_s=tuple(self._final_latencies),
        )


def build_stream_url(
    url: str,
    *,
    sample_rate_hz: int,
    encoding: str,
    language: str | None = None,
    task: str | None = None,
    finals: str | None = None,
) -> str:
    """``url`` with the stream's query parameters set (other parameters are kept)."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    query["sample_rate"] = str(sample_rate_hz)
    query["encoding"] = encoding
    if language is not None:
        query["language"] = language
    if task is not None:
        query["task"] = task
    if finals is not None:
        query["finals"] = finals
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


async def stream_audio(
    url: str,
    source: AudioSource,
    *,
    pace: float = 1.0,
    token: str | None = None,
    language: str | None = None,
    task: str | None = None,
    finals: str | None = None,
    on_message: Callable[[ServerMessage], None] | None = None,
    open_timeout_s: float = 10.0,
    ready_timeout_s: float = 30.0,
    done_timeout_s: float = 60.0,
    clock: Callable[[], float] = time.perf_counter,
) -> StreamResult:
    """Stream ``source`` to the server at ``url`` and return the finals, ``done`` and stats.

    Args:
        url: the stream endpoint, e.g. ``ws://127.0.0.1:8765/v1/stream``; ``sample_rate``,
            ``encoding``, ``language``, ``task`` and ``finals`` are added to its query.
        source: the audio; its ``audio_format`` is announced to the server.
        pace: chunk i is sent no earlier than ``pace`` times its end in stream time after
            the first: 1.0 is real time, 0.5 twice as fast, 0 as fast as the server takes
            it. Live sources are never paced.
        token: API key, sent as ``Authorization: Bearer``.
        language: a language code, ``"auto"`` to detect; None leaves the server's default.
        task: ``"transcribe"`` or ``"translate"``; None leaves the server's default.
        finals: ``"words"`` (final as decodes agree) or ``"utterance"`` (an utterance's words
            final together when it ends, beam-searched); None leaves the server's default.
        on_message: called with every server message as it arrives, ``ready`` included.
        open_timeout_s: for the TCP and WebSocket handshakes.
        ready_timeout_s: for the server's ``ready``.
        done_timeout_s: from sending ``end`` to receiving ``done``.
        clock: wall clock in seconds used for the stats.

    Raises:
        ConnectError: no session could be opened.
        StreamFailed: the session broke before ``done``.
    """
    if pace < 0:
        raise ValueError(f"pace must be >= 0; got {pace}")
    fmt = source.audio_format
    full_url = build_stream_url(
        url,
        sample_rate_hz=fmt.sample_rate_hz,
        encoding=fmt.encoding,
        language=language,
        task=task,
        finals=finals,
    )
    headers = {"Authorization": f"Bearer {token}"} if token else None
    ws = await _connect(url, full_url, headers, open_timeout_s)
    async with ws:
        run = _StreamRun(ws, source, pace=pace, on_message=on_message, clock=clock)
        return await run.run(ready_timeout_s=ready_timeout_s, done_timeout_s=done_timeout_s)


def retry_after_s(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delay-seconds or an HTTP date); None
    when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


async def _connect(
    shown_url: str, full_url: str, headers: dict[str, str] | None, open_timeout_s: float
) -> ClientConnection:
    try:
        # Audio barely compresses; per-message deflate would only cost the server CPU.
        return await connect(
            full_url, additional_headers=headers, open_timeout=open_timeout_s, compression=None
        )
    except ConnectionRefusedError as exc:
        raise ConnectError(
            f"cannot connect to {shown_url}: is whisperwire-server running?"
        ) from exc
    except InvalidURI as exc:
        raise ConnectError(f"invalid URL {shown_url!r}: {exc}") from exc
    except InvalidStatus as exc:
        status = exc.response.status_code
        body = exc.response.body.decode("utf-8", "replace").strip().splitlines()
        detail = f": {body[0][:200]}" if body else ""
        raise ConnectError(
            f"{shown_url} refused the connection: HTTP {status}{detail}",
            status=status,
            retry_after_s=retry_after_s(exc.response.headers.get("Retry-After")),
        ) from exc
    except (TimeoutError, asyncio.TimeoutError) as exc:  # distinct classes before 3.11
        raise ConnectError(f"cannot connect to {shown_url}: timed out") from exc
    except (OSError, InvalidHandshake) as exc:
        raise ConnectError(f"cannot connect to {shown_url}: {exc}") from exc


class _StreamRun:
    """One connected stream: the sender and the receiver, and what they share."""

    def __init__(
        self,
        ws: ClientConnection,
        source: AudioSource,
        *,
        pace: float,
        on_message: Callable[[ServerMessage], None] | None,
        clock: Callable[[], float],
    ) -> None:
        self._ws = ws
        self._source = source
        self._pace = 0.0 if source.live else pace
        self._on_message = on_message
        self._clock = clock
        self._tracker = LatencyTracker()
        self._finals: list[FinalMessage] = []

    async def run(self, *, ready_timeout_s: float, done_timeout_s: float) -> StreamResult:
        ready = await self._wait_ready(ready_timeout_s)
        receiver = asyncio.create_task(self._receive(), name="whisperwire-receive")
        sender = asyncio.create_task(self._send(), name="whisperwire-send")
        try:
            await asyncio.wait({receiver, sender}, return_when=asyncio.FIRST_COMPLETED)
            if not receiver.done():
                # The sender finished first: either all audio and "end" went out, or sending
                # failed. If the connection closed, the receiver knows why; let it tell.
                exc = sender.exception()
                if exc is not None and not isinstance(exc, ConnectionClosed):
                    raise exc
                try:
                    await asyncio.wait_for(asyncio.shield(receiver), done_timeout_s)
                except asyncio.TimeoutError:
                    raise StreamFailed(
                        f"no 'done' from the server {done_timeout_s:g} s after 'end'"
                    ) from None
            done = receiver.result()  # raises StreamFailed when the receiver did
        finally:
            await _cancel(sender)
            await _cancel(receiver)
        end_wall = self._clock()
        return StreamResult(
            ready=ready,
            finals=tuple(self._finals),
            done=done,
            stats=self._tracker.stats(end_wall),
        )

    async def _wait_ready(self, timeout_s: float) -> ReadyMessage:
        try:
            raw = await asyncio.wait_for(self._ws.recv(), timeout_s)
        except asyncio.TimeoutError:
            raise StreamFailed(f"no 'ready' from the server within {timeout_s:g} s") from None
        except ConnectionClosed as exc:
            raise self._closed_error(exc, before="'ready'") from exc
        message = self._parse(raw)
        self._deliver(message)
        if isinstance(message, ErrorMessage):
            # A full server says why in an error before it closes with 1013.
            raise StreamFailed(
                f"server error {message.code}: {message.message}",
                error=message,
                close_code=await self._close_code(),
            )
        if not isinstance(message, ReadyMessage):
            raise StreamFailed(f"expected 'ready' first, got {type(message).__name__}")
        fmt = self._source.audio_format
        if (message.sample_rate, message.encoding) != (fmt.sample_rate_hz, fmt.encoding):
            raise StreamFailed(
                f"server expects {message.sample_rate} Hz {message.encoding}, "
                f"but the source is {fmt.sample_rate_hz} Hz {fmt.encoding}"
            )
        logger.info("session %s with model %s", message.session_id, message.model)
        return message

    async def _send(self) -> None:
        fmt = self._source.audio_format
        bytes_per_s = fmt.bytes_per_sample * fmt.sample_rate_hz
        start_wall: float | None = None
        stream_s = 0.0
        async for chunk in self._source.chunks():
            if start_wall is None:
                start_wall = self._clock()
                self._tracker.started(start_wall)
            duration_s = len(chunk) / bytes_per_s
            stream_s += duration_s
            if self._pace > 0:
                # Like a microphone: a chunk exists only once its last sample was recorded.
                delay = start_wall + self._pace * stream_s - self._clock()
                if delay > 0:
                    await asyncio.sleep(delay)
            await self._ws.send(chunk)
            self._tracker.audio_sent(duration_s, self._clock())
        await self._ws.send(EndMessage().to_json())
        logger.debug("sent %.3f s of audio and 'end'", stream_s)

    async def _receive(self) -> DoneMessage:
        try:
            async for raw in self._ws:
                message = self._parse(raw)
                self._deliver(message)
                if isinstance(message, FinalMessage):
                    self._finals.append(message)
                elif isinstance(message, ErrorMessage):
                    if message.fatal:
                        raise StreamFailed(
                            f"server error {message.code}: {message.message}",
                            error=message,
                            close_code=await self._close_code(),
                        )
                    else:
                        logger.warning("server error %s: %s", message.code, message.message)
                elif isinstance(message, DoneMessage):
                    return message
        except ConnectionClosed as exc:
            raise self._closed_error(exc, before="'done'") from exc
        raise self._closed_error(None, before="'done'")

    def _parse(self, raw: str | bytes) -> ServerMessage:
        if isinstance(raw, bytes):
            raise StreamFailed("the server sent a binary frame; this is not a Whisperwire server?")
        try:
            return parse_server_message(raw)
        except ProtocolError as exc:
            raise StreamFailed(f"unexpected message from the server: {exc}") from exc

    def _deliver(self, message: ServerMessage) -> None:
        self._tracker.message_received(message, self._clock())
        if self._on_message is not None:
            self._on_message(message)

    def _closed_error(self, exc: ConnectionClosed | None, *, before: str) -> StreamFailed:
        code = reason = None
        if exc is not None and exc.rcvd is not None:
            code, reason = exc.rcvd.code, exc.rcvd.reason
        elif self._ws.close_code is not None:
            code, reason = self._ws.close_code, self._ws.close_reason
        if code is None:
            # 1006: what RFC 6455 reports for a connection that ended without a close frame.
            return StreamFailed(f"the connection was lost before {before}", close_code=1006)
        meaning = _CLOSE_REASONS.get(code)
        what = f"code {code} {meaning}" if meaning else f"code {code}"
        what += f": {reason}" if reason else ""
        return StreamFailed(
            f"the server closed the connection ({what}) before {before}", close_code=code
        )

    async def _close_code(self) -> int | None:
        # After a fatal error the server closes; wait briefly to report its code.
        try:
            await asyncio.wait_for(self._ws.wait_closed(), 2.0)
        except asyncio.TimeoutError:
            return None
        return self._ws.close_code


async def _cancel(task: asyncio.Task[_T]) -> None:
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        # Mark the outcome as retrieved: run() has already reported whichever failure came
        # first, and a second one from the other task is a consequence of it.
        task.exception()
