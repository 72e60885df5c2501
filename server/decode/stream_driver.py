"""One stream's way through the pipeline: its session's jobs out, results and events back.

``StreamDriver`` belongs to one connection. It takes the session's next job, sends it through
the shared ``Pipeline`` (with a lane to spare, the session's background searches too), folds
the result back into the session and queues the session's events in a bounded outbox for the
connection to send; an adapter's own events (``AdapterEvent``) join that queue in order, so
they keep their place among the session's.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

from server.core.engine_api import DecodeResult
from server.core.planner import Load
from server.core.session import DecodeJob, Session, SessionEvent, StreamSettings, TurnJob
from server.core.speakers import EmbedJob
from server.decode.pipeline import Pipeline
from server.protocol.messages import ErrorMessage, ServerMessage

logger = logging.getLogger("server.decode.stream_driver")


@dataclass(frozen=True)
class AdapterEvent:
    """Base of an API adapter's own events (a reply to a client's request), which travel
    through the outbox to the adapter's ``render`` with the session's events."""

    audio_received_s: float = 0.0


Outgoing = SessionEvent | AdapterEvent


class DriverOutcome(enum.Enum):
    """How a stream's driver finished (``StreamDriver.outcome``)."""

    DONE = "done"  # the session emitted ``done``: every word is final
    OVERFLOW = "overflow"  # the outbox was full: the client does not read its messages


class StreamDriver:
    """Moves one session's jobs through the pipeline and its messages to a bounded outbox.

    The connection's adapter makes the session's typed calls through it (``feed_audio``,
    ``configure``, ``flush``, ``end``: they raise the session's ``StreamError``), the
    connection sends what appears in ``outbox`` and awaits ``outcome``: it resolves to a
    ``DriverOutcome``, or holds the exception of a bug in the session (the connection then
    closes with 1011). Runs on the event loop; not thread-safe.
    """

    def __init__(
        self, session: Session, pipeline: Pipeline, *, max_pending_messages: int = 512
    ) -> None:
        loop = asyncio.get_running_loop()
        self.session = session
        self.pipeline = pipeline
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue(maxsize=max_pending_messages)
        self.outcome: asyncio.Future[DriverOutcome] = loop.create_future()
        self.log = logging.LoggerAdapter(logger, {"session_id": session.session_id})
        self._decoding: asyncio.Task[None] | None = None
        # Decodes a closing decode replaced, stale searches: cancelled, awaited at close.
        self._dropped: set[asyncio.Task[None]] = set()
        self._searching: asyncio.Task[None] | None = None  # a background beam search
        self._embedding: asyncio.Task[None] | None = None
        self._scoring: asyncio.Task[None] | None = None  # the turn model on a pause
        self._closed = False
        self._overflowed = False
        self._first_audio_at: float | None = None  # time.monotonic() of the first audio
        self._registered = True
        pipeline.add_stream()
        pipeline.offer_seats(self._take_seat)
        if session.settings.turns is not None:
            pipeline.prepare_turn_model()

    # -- input -----------------------------------------------------------------------------
    @property
    def settings(self) -> StreamSettings:
        return self.session.settings

    def feed_audio(self, data: bytes) -> None:
        """``Session.feed_audio``; raises the session's ``StreamError`` for bad audio."""
        try:
            self.session.feed_audio(data)
        finally:
            if self._first_audio_at is None and self.session.audio_received_s > 0:
                self._first_audio_at = time.monotonic()
            self._advance()

    def configure(self, settings: StreamSettings) -> None:
        """``Session.configure``; raises ``ProtocolError``."""
        try:
            self.session.configure(settings)
        finally:
            self._advance()
        if settings.turns is not None:
            # Turns asked for after the stream opened (v1's config): the model loads now, not
            # at the stream's first pause.
            self.pipeline.prepare_turn_model()

    def force_end_turn(self) -> None:
        """``Session.force_end_turn``; raises ``ProtocolError``."""
        try:
            self.session.force_end_turn()
        finally:
            self._advance()

    def flush(self) -> None:
        """``Session.flush``; raises ``ProtocolError`` after the end."""
        try:
            self.session.flush()
        finally:
            self._advance()

    def end(self, *, by_server: bool = False) -> None:
        """Finish the stream: the client's end, or the server's (``by_server``: shutdown,
        drain, limits; ``Session.end``)."""
        if not self.session.ended:
            self.session.end(by_server=by_server)
        self._advance()

    def send(self, message: ServerMessage | AdapterEvent) -> None:
        """Queue a message of the connection's own (``ready``, an ``error``) or an adapter's
        event after the session's pending events, so that it keeps its place among them."""
        self._flush()
        self._put(message)

    async def close(self) -> None:
        """Abandon the stream (the client is gone or the connection is closing): cancel the
        decode in flight and stop producing messages."""
        self._closed = True
        self._unregister()
        running = (self._decoding, self._embedding, self._searching, self._scoring)
        tasks = {t for t in running if t is not None} | self._dropped
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # -- the job loop ----------------------------------------------------------------------
    def _advance(self) -> None:
        if self._closed:
            return
        self._flush()
        spare = self.pipeline.spare_lane
        if self._decoding is None:
            job = self.session.next_job(self._load(min_hop_s=self.pipeline.stream_hop_s()))
            if job is not None:
                self._decoding = asyncio.create_task(
                    self._decode(job), name=f"decode-{self.session.session_id}-{job.job_id}"
                )
            # Asking for a job can emit messages too: finals of a forced cut, or done when
            # only an empty utterance was left.
            self._flush()
        elif spare:
            self._supersede(self._decoding)
        if self._searching is not None and self.session.search_stale:
            self._drop_search(self._searching)
        if self._searching is None and self.pipeline.spare_lane:
            search = self.session.next_search_job(self._load())
            if search is not None:
                self._searching = asyncio.create_task(
                    self._search(search),
                    name=f"search-{self.session.session_id}-{search.job_id}",
                )
        if self._scoring is None:
            turn_job = self.session.next_turn_job()
            if turn_job is not None:
                self._scoring = asyncio.create_task(
                    self._score_turn(turn_job),
                    name=f"turn-{self.session.session_id}-{turn_job.job_id}",
                )
        if self._embedding is None:
            embed_job = self.session.next_speaker_job()
            if embed_job is not None:
                self._embedding = asyncio.create_task(
                    self._embed(embed_job),
                    name=f"speakers-{self.session.session_id}-{embed_job.job_id}",
                )
        if self.session.done:
            self._finish(DriverOutcome.DONE)

    def _supersede(self, decoding: asyncio.Task[None]) -> None:
        """Start the utterance's closing decode on the spare lane at once, if it replaces the
        decode in flight (``Session.supersede_job``). Nobody awaits the dropped decode's
        result, and the pipeline stops it on its lane."""
        job = self.session.supersede_job(self._load())
        if job is None:
            return
        self._abandon(decoding)
        self.pipeline.metrics.decodes_superseded.inc()
        self._decoding = asyncio.create_task(
            self._decode(job), name=f"decode-{self.session.session_id}-{job.job_id}"
        )

    def _drop_search(self, searching: asyncio.Task[None]) -> None:
        """Cancel a background search whose result can no longer count
        (``Session.search_stale``): its lane is interrupted (``Pipeline``) and free for
        the stream's next utterance."""
        self._abandon(searching)
        self._searching = None
        self.session.drop_search()

    def _abandon(self, task: asyncio.Task[None]) -> None:
        """Cancel a decode or search nobody awaits any more (the pipeline stops it on its
        lane); ``close`` still waits for it to finish."""
        task.cancel()
        self._dropped.add(task)
        task.add_done_callback(self._dropped.discard)

    def _refresh_job(self, job: DecodeJob) -> DecodeJob:
        return self.session.refresh_job(job, self._load())

    def _load(self, min_hop_s: float = 0.0) -> Load:
        """The server's load as the session's planner takes it."""
        return Load(
            min_hop_s=min_hop_s,
            crowded=self.pipeline.crowded,
            past_comfort=self.pipeline.past_comfort,
        )

    def catch_up_s(self, job: DecodeJob) -> float:
        """What this stream holds beyond ``job`` that its client sent ahead of real time (a
        file at pace 0, a reconnect's replay): the audio past the window's end, as far as the
        audio received leads the wall clock since the first of it. 0 for a client that sends
        in real time, however far behind the lanes are: that backlog is the lanes' cost."""
        if self._first_audio_at is None:
            return 0.0
        received_s = self.session.audio_received_s
        beyond_s = received_s - (job.start_s + job.audio_s)
        ahead_s = received_s - (time.monotonic() - self._first_audio_at)
        return max(0.0, min(beyond_s, ahead_s))

    def _take_seat(self) -> None:
        """A batch is being gathered: queue a window now if the session has one ready."""
        try:
            self._advance()
        except Exception as exc:
            self._session_failed(exc)

    async def _decode(self, job: DecodeJob) -> None:
        try:
            try:
                result = await self.pipeline.decode(
                    job, refresh=self._refresh_job, catch_up=self.catch_up_s
                )
            except Exception as exc:
                # DecodeError, or anything else the engine raised: this job fails, the
                # session reports it to its client and goes on.
                self.log.warning("decode of job %d failed: %s", job.job_id, exc)
                self.session.receive_failure(job, exc)
            else:
                self.session.receive_result(job, result)
            self._decoding = None
            self._advance()
        except Exception as exc:
            self._decoding = None
            self._session_failed(exc)

    async def _search(self, job: DecodeJob) -> None:
        """A background beam search of the open window on a spare lane
        (``Session.next_search_job``): its result goes back to the session, a failure too."""
        try:
            result: DecodeResult | None = await self.pipeline.decode(job)
        except Exception as exc:
            # Whatever the engine or a lane raised (as in ``_decode``): the search was only a
            # head start, and the stream's own decodes go on without it.
            self.log.info("background search %d failed: %s", job.job_id, exc)
            result = None
        self._searching = None
        try:
            self.session.receive_search(job, result)
            self._advance()
        except Exception as exc:
            self._session_failed(exc)

    async def _score_turn(self, job: TurnJob) -> None:
        """The turn model on a pause (``Session.next_turn_job``), off the event loop; a failure
        leaves the turn to its timeout."""
        try:
            probability: float | None = await self.pipeline.score_turn(job)
        except (RuntimeError, ValueError, MemoryError) as exc:
            self.log.warning("turn model failed on job %d: %s", job.job_id, exc)
            probability = None
        self._scoring = None
        try:
            self.session.receive_turn_score(job, probability)
            self._advance()
        except Exception as exc:
            self._session_failed(exc)

    async def _embed(self, job: EmbedJob) -> None:
        """The speaker encoder over ``job``'s windows, off the event loop (``Pipeline.embed``);
        the session's held finals go out once their words are labelled."""
        try:
            try:
                vectors = await self.pipeline.embed(job)
            except (ArithmeticError, ValueError, MemoryError, RuntimeError) as exc:
                # The encoder failed on this audio: the words take what is known already.
                self.log.warning("speaker embedding of job %d failed: %s", job.job_id, exc)
                vectors = None
            self.session.receive_embeddings(job, vectors)
            self._embedding = None
            self._advance()
        except Exception as exc:
            self._embedding = None
            self._session_failed(exc)

    def _session_failed(self, exc: Exception) -> None:
        """A bug in the session: hand it to the connection, whose catch-all logs it and
        closes with 1011. Other sessions are not affected."""
        if not self.outcome.done():
            self.outcome.set_exception(exc)

    # -- output ----------------------------------------------------------------------------
    def _flush(self) -> None:
        for message in self.session.events_to_send():
            self._put(message)

    def _put(self, message: Outgoing) -> None:
        if self._overflowed:
            return  # the client is being dropped; nothing more is queued for it
        if isinstance(message, ErrorMessage):
            self.pipeline.metrics.errors.inc(1, message.code)
        try:
            self.outbox.put_nowait(message)
        except asyncio.QueueFull:
            self.log.warning(
                "client is not reading: %d messages pending; dropping it", self.outbox.qsize()
            )
            self._overflowed = True
            self._finish(DriverOutcome.OVERFLOW)

    def _unregister(self) -> None:
        if self._registered:
            self._registered = False
            for rule, count in self.session.rule_counts.items():
                self.pipeline.metrics.rules_fired.inc(count, rule)
            self.pipeline.withdraw(self._take_seat)
            self.pipeline.remove_stream()

    def _finish(self, outcome: DriverOutcome) -> None:
        self._unregister()
        if not self.outcome.done():
            self.outcome.set_result(outcome)
