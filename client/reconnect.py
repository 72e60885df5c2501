"""One audio source over as many sessions as it takes: reconnect, resume, one timeline.

A server that shuts down finishes its sessions (finals, ``done``, close 1001); a full one
refuses with ``server_full`` and close 1013; one that is loading or draining answers the
handshake with HTTP 503; a connection may also just drop. ``stream_with_reconnect`` then
connects again with exponential backoff and jitter (behind a load balancer, that lands on
another instance) and goes on with the source's audio where the last session's final words
end, less ``SEAM_WORDS`` of them.

Why the overlap: a session finished mid-speech is cut mid-word. Its server had all the audio
(``done.audio_received_s`` counts it) but could not make out the cut word, and the timing of
the last word it did make out runs to the cut. So the next session hears the last final
words again, and the cut word whole; the words it repeats at the seam are dropped from its
first final, the way the server drops them after its own window cuts. No word is lost, and
none comes twice.

Each new session counts stream time from 0 and segment ids from 0; the messages handed to
``on_message`` and the merged result are shifted onto the source's own timeline, with
segment ids numbered on, so captions and subtitles run on as if it were one session.

A first connection is retried only when the server is there and busy (HTTP 503, 1013):
"connection refused" at the start is a wrong URL or a stopped server, and says so at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from client.sources import AudioSource
from client.stream import (
    ConnectError,
    StreamFailed,
    StreamResult,
    StreamStats,
    stream_audio,
)
from client.timeline import RESUME_BEFORE_SEAM_S, drop_seam_repeat, shift_message
from server.protocol.formats import AudioFormat
from server.protocol.messages import (
    DoneMessage,
    FinalMessage,
    ReadyMessage,
    ServerMessage,
    WordInfo,
)

logger = logging.getLogger("client.reconnect")

# docs/protocol.md, close codes: going away (shutdown, after done), internal error, busy;
# 1006 is a connection lost without a close frame.
RETRY_CLOSE_CODES = frozenset({1001, 1006, 1011, 1013})
RETRY_HTTP_STATUSES = frozenset({502, 503, 504})  # a balancer's, or a server loading/draining
_PUMP_CHUNKS = 50  # chunks read ahead of the sessions: 5 s of 100 ms chunks
# Final words the next session hears again. The server keeps two at its own window cuts
# (StreamingConfig.cut_carry_words: the fewest word errors at cuts in bench-accuracy).
SEAM_WORDS = 2
# Wire times are rounded to milliseconds: resume this much early rather than skip audio.
_RESUME_SLACK_S = 0.001


@dataclass(frozen=True)
class RetryPolicy:
    """When and how often to connect again."""

    max_retries: int = 5  # failed attempts in a row before giving up; 0: never reconnect
    backoff_first_s: float = 0.5  # wait before the first retry; doubles with each failure
    backoff_max_s: float = 10.0
    jitter: float = 0.2  # each wait is scaled by a random factor in [1 - jitter, 1 + jitter]
    # A refusal's Retry-After (a full server's 503) is waited out instead of the backoff, up
    # to this long: the server knows when a seat may free; a bad hint must not stall us.
    retry_after_max_s: float = 60.0
    # Audio kept for a resend in a new session: since the seam words (a cap for long
    # speech without a final; past it, the oldest is dropped with a warning).
    max_replay_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0; got {self.max_retries}")
        if not 0 < self.backoff_first_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_first_s <= backoff_max_s")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1); got {self.jitter}")
        if self.max_replay_s <= 0:
            raise ValueError(f"max_replay_s must be > 0; got {self.max_replay_s}")
        if self.retry_after_max_s < 0:
            raise ValueError(f"retry_after_max_s must be >= 0; got {self.retry_after_max_s}")

    def backoff_s(
        self, failures: int, rng: random.Random, *, retry_after_s: float | None = None
    ) -> float:
        """The wait before the next attempt, after ``failures`` (>= 1) in a row: the
        server's ``retry_after_s`` when it gave one (capped at ``retry_after_max_s``), else
        the doubling backoff. Either is jittered, so the clients one full server refused
        do not all come back in the same instant."""
        if retry_after_s is not None:
            base = min(self.retry_after_max_s, retry_after_s)
        else:
            base = min(self.backoff_max_s, self.backoff_first_s * 2.0 ** (failures - 1))
        return base * rng.uniform(1 - self.jitter, 1 + self.jitter)


@dataclass(frozen=True)
class ResumedStream:
    """A source streamed over one or more sessions."""

    result: StreamResult  # merged onto the source's timeline
    sessions: tuple[StreamResult, ...]  # each session as its server reported it

    @property
    def text(self) -> str:
        """The finals' text of every session, joined with single spaces."""
        return self.result.text


def retryable(exc: ConnectError | StreamFailed, *, connected_before: bool) -> bool:
    """Whether connecting again can help: the server is busy, going away or was lost.

    ``connected_before``: a session was open earlier in this stream, so a refused connection
    is a restarting server rather than a wrong URL.
    """
    if isinstance(exc, ConnectError):
        if exc.status is not None:
            return exc.status in RETRY_HTTP_STATUSES
        return connected_before  # refused, timed out, unreachable
    if exc.error is not None and exc.error.code in ("server_full", "limit", "internal"):
        return True
    return exc.close_code in RETRY_CLOSE_CODES


class ReplayBuffer:
    """The source's audio since the last point a server is known to have transcribed.

    Chunks are read once from the source (by a pump task, so a session cancelled mid-read
    never cancels the source itself) and kept until a final or ``done`` covers them, so a
    new session can be sent what the last one may not have transcribed.
    """

    def __init__(self, source: AudioSource, max_replay_s: float) -> None:
        self.source = source
        fmt = source.audio_format
        self._bytes_per_s = fmt.bytes_per_sample * fmt.sample_rate_hz
        self._sample_bytes = fmt.bytes_per_sample
        self._max_kept_bytes = int(max_replay_s * self._bytes_per_s)
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=_PUMP_CHUNKS)
        self._kept: deque[bytes] = deque()
        self._kept_start = 0  # byte offset in the source of the first kept chunk
        self._read = 0  # bytes taken from the pump so far
        self._exhausted = False  # the pump delivered the source's end
        self._overflow_warned = False
        self._error: Exception | None = None
        self._pump: asyncio.Task[None] | None = None

    @property
    def audio_format(self) -> AudioFormat:
        """The source's format."""
        return self.source.audio_format

    @property
    def finished(self) -> bool:
        """The source has ended and everything it produced was handed to a session."""
        return self._exhausted

    @property
    def read_bytes(self) -> int:
        """Bytes of the source handed to sessions so far."""
        return self._read

    def seconds(self, offset_bytes: int) -> float:
        """A byte offset of the source as seconds."""
        return offset_bytes / self._bytes_per_s

    def offset(self, seconds: float) -> int:
        """Seconds of the source as a byte offset on a sample boundary, rounded down."""
        samples = int(max(0.0, seconds) * self._bytes_per_s) // self._sample_bytes
        return min(samples * self._sample_bytes, self._read)

    @property
    def error(self) -> Exception | None:
        """What the source raised, once it has ended by failing."""
        return self._error

    def start(self) -> None:
        """Start reading the source."""
        self._pump = asyncio.create_task(self._run_pump(), name="whisperwire-source")

    async def close(self) -> None:
        """Stop reading the source; returns once the reader has stopped."""
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.wait({self._pump})

    def covered(self, offset_bytes: int) -> None:
        """A server transcribed everything before ``offset_bytes``: forget it."""
        while self._kept and self._kept_start + len(self._kept[0]) <= offset_bytes:
            self._kept_start += len(self._kept.popleft())

    def session_source(self, start_bytes: int) -> AudioSource:
        """An ``AudioSource`` for one session: the kept audio from ``start_bytes``, then
        what the source produces next."""
        return _SessionSource(self, start_bytes)

    async def chunks_from(self, start_bytes: int) -> AsyncIterator[bytes]:
        """What a session sends: kept audio from ``start_bytes``, then new chunks."""
        position = self._kept_start
        for chunk in list(self._kept):
            end = position + len(chunk)
            if end > start_bytes:
                yield chunk[max(0, start_bytes - position) :]
            position = end
        while not self._exhausted:
            new = await self._queue.get()
            if new is None:
                self._exhausted = True
                return
            self._keep(new)
            yield new

    def _keep(self, chunk: bytes) -> None:
        self._kept.append(chunk)
        self._read += len(chunk)
        while self._read - self._kept_start > self._max_kept_bytes and len(self._kept) > 1:
            self._kept_start += len(self._kept.popleft())
            if not self._overflow_warned:
                self._overflow_warned = True
                logger.warning(
                    "no final for over %.0f s: audio before that cannot be resent after a "
                    "lost connection",
                    self._max_kept_bytes / self._bytes_per_s,
                )

    async def _run_pump(self) -> None:
        try:
            async for chunk in self.source.chunks():
                await self._queue.put(chunk)
        except Exception as exc:  # relayed: stream_with_reconnect raises it once sent
            self._error = exc
        # The end marker, after a failure too, so that the session waiting for audio ends.
        await self._queue.put(None)


class _SessionSource:
    """The ``AudioSource`` one session reads: a view of the ``ReplayBuffer``."""

    def __init__(self, buffer: ReplayBuffer, start_bytes: int) -> None:
        self._buffer = buffer
        self._start_bytes = start_bytes

    @property
    def audio_format(self) -> AudioFormat:
        return self._buffer.audio_format

    @property
    def live(self) -> bool:
        return self._buffer.source.live

    def chunks(self) -> AsyncIterator[bytes]:
        return self._buffer.chunks_from(self._start_bytes)

    def stop(self) -> None:
        self._buffer.source.stop()


async def stream_with_reconnect(
    url: str,
    source: AudioSource,
    *,
    retry: RetryPolicy | None = None,
    pace: float = 1.0,
    token: str | None = None,
    language: str | None = None,
    task: str | None = None,
    finals: str | None = None,
    on_message: Callable[[ServerMessage], None] | None = None,
    on_reconnect: Callable[[str, float], None] | None = None,
    open_timeout_s: float = 10.0,
    ready_timeout_s: float = 30.0,
    done_timeout_s: float = 60.0,
    clock: Callable[[], float] = time.perf_counter,
    rng: random.Random | None = None,
) -> ResumedStream:
    """Stream ``source`` like ``client.stream.stream_audio``, over as many sessions as the
    servers need, and return the merged result.

    ``on_message`` gets every message shifted onto the source's timeline; ``on_reconnect``
    gets why the last attempt ended and the seconds until the next one. The other arguments
    are ``stream_audio``'s.

    Raises:
        ConnectError, StreamFailed: as ``stream_audio``, once the failure is not one a new
            connection can help or ``retry.max_retries`` attempts in a row have failed.
    """
    policy = retry or RetryPolicy()
    chooser = rng or random.Random()
    buffer = ReplayBuffer(source, policy.max_replay_s)
    sessions: list[StreamResult] = []
    received: list[FinalMessage] = []
    started_wall = clock()
    start_bytes = 0  # where the next session starts in the source
    seam: tuple[WordInfo, ...] = ()  # the final words before it, which it hears again
    failures = 0  # attempts in a row that moved the stream on by no audio
    connected = False
    first_offset_s = 0.0  # where the first session with a result began in the source
    buffer.start()
    try:
        while True:
            progress = _Progress(buffer, start_bytes, segments_before=len(received), seam=seam)

            def deliver(message: ServerMessage, progress: _Progress = progress) -> None:
                shifted = progress.receive(message)
                if on_message is not None:
                    on_message(shifted)

            error: ConnectError | StreamFailed
            try:
                result = await stream_audio(
                    url,
                    buffer.session_source(start_bytes),
                    pace=pace,
                    token=token,
                    language=language,
                    task=task,
                    finals=finals,
                    on_message=deliver,
                    open_timeout_s=open_timeout_s,
                    ready_timeout_s=ready_timeout_s,
                    done_timeout_s=done_timeout_s,
                    clock=clock,
                )
            except (ConnectError, StreamFailed) as exc:
                received.extend(progress.finals)  # shown already: they stay in the result
                connected = connected or progress.ready
                if not retryable(exc, connected_before=connected):
                    raise
                error = exc
            else:
                received.extend(progress.finals)
                connected = True
                if not sessions:
                    first_offset_s = progress.offset_s
                sessions.append(result)
                accepted = buffer.offset(
                    progress.offset_s + result.done.audio_received_s - _RESUME_SLACK_S
                )
                if buffer.error is not None:
                    raise buffer.error
                # A server that finished the session before our audio ended (shutdown, 1001)
                # accepted less than was sent: the next session goes on from its last word.
                complete = buffer.finished and accepted >= buffer.read_bytes - _slack_bytes(buffer)
                if complete or policy.max_retries == 0:
                    return _merge(
                        sessions,
                        received,
                        buffer,
                        resumed_from_s=first_offset_s,
                        started_wall=started_wall,
                        end_wall=clock(),
                    )
                error = StreamFailed(
                    f"the server ended the session after {result.done.audio_received_s:.1f} s "
                    "of audio, before the audio ended",
                    close_code=1001,
                )
            next_bytes, seam = progress.resume_bytes(), progress.seam()
            failures = 1 if next_bytes > start_bytes else failures + 1
            if failures > policy.max_retries:
                raise error
            start_bytes = next_bytes
            hint_s = error.retry_after_s if isinstance(error, ConnectError) else None
            delay_s = policy.backoff_s(failures, chooser, retry_after_s=hint_s)
            logger.warning("%s; reconnecting in %.1f s", error, delay_s)
            if on_reconnect is not None:
                on_reconnect(str(error), delay_s)
            await asyncio.sleep(delay_s)
    finally:
        await buffer.close()


def _slack_bytes(buffer: ReplayBuffer) -> int:
    return buffer.offset(2 * _RESUME_SLACK_S) or buffer.audio_format.bytes_per_sample


class _Progress:
    """One session's messages on the source's timeline, and where the next one starts."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        start_bytes: int,
        *,
        segments_before: int,
        seam: tuple[WordInfo, ...],
    ) -> None:
        self._buffer = buffer
        self._start_bytes = start_bytes
        self.offset_s = buffer.seconds(start_bytes)  # where the session starts in the source
        self.segments_before = segments_before  # finals sent by the sessions before it
        self._seam = seam  # the words before it, which it hears again
        self._seam_pending = bool(seam)  # its first final with words may repeat them
        self.ready = False
        self.finals: list[FinalMessage] = []  # shifted, without the seam's repeat
        self._words: list[WordInfo] = []  # the last final words, shifted

    def receive(self, message: ServerMessage) -> ServerMessage:
        """A message of the session (in its own stream time), as the caller is to see it."""
        if isinstance(message, ReadyMessage):
            self.ready = True
        shifted = shift_message(message, self.offset_s, self.segments_before)
        if isinstance(shifted, FinalMessage):
            if self._seam_pending and shifted.words:
                shifted = drop_seam_repeat(shifted, self._seam, self.offset_s)
                self._seam_pending = False
            self.finals.append(shifted)
            self._words = [*self._words, *shifted.words][-SEAM_WORDS:]
            self._buffer.covered(self.resume_bytes())
        return shifted

    def resume_bytes(self) -> int:
        """Where a next session starts: at the seam words, the last final ones."""
        if not self._words:
            return self._start_bytes
        resume_s = self._words[0].start - RESUME_BEFORE_SEAM_S
        return max(self._start_bytes, self._buffer.offset(resume_s))

    def seam(self) -> tuple[WordInfo, ...]:
        """The words a next session starting at ``resume_bytes`` hears again (this one's
        own seam when it made no word final: it starts where this one did)."""
        return tuple(self._words) if self._words else self._seam


def _merge(
    sessions: list[StreamResult],
    finals: list[FinalMessage],
    buffer: ReplayBuffer,
    *,
    resumed_from_s: float,
    started_wall: float,
    end_wall: float,
) -> ResumedStream:
    """The sessions as one result; ``resumed_from_s``: where the first of them began in the
    source (above 0 after a connection lost before its ``done``)."""
    if len(sessions) == 1 and resumed_from_s == 0:
        return ResumedStream(sessions[0], (sessions[0],))  # one session, from the start
    dones = [s.done for s in sessions]

    def total(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else sum(v for v in values if v)

    done = DoneMessage(
        segments=len(finals),
        audio_received_s=buffer.seconds(buffer.read_bytes),
        speech_s=sum(d.speech_s for d in dones),
        session_s=sum(d.session_s for d in dones),
        non_speech_s=total([d.non_speech_s for d in dones]),
        transcribed_s=total([d.transcribed_s for d in dones]),
        failed_s=total([d.failed_s for d in dones]),
    )
    ttfts = [s.stats.ttft_s for s in sessions if s.stats.ttft_s is not None]
    stats = StreamStats(
        audio_s=buffer.seconds(buffer.read_bytes),
        wall_s=end_wall - started_wall,
        ttft_s=ttfts[0] if ttfts else None,
        final_latencies_s=tuple(x for s in sessions for x in s.stats.final_latencies_s),
    )
    merged = StreamResult(ready=sessions[0].ready, finals=tuple(finals), done=done, stats=stats)
    return ResumedStream(merged, tuple(sessions))
