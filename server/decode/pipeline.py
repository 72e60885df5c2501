"""The stages between a client's frames and its text: ingest, features, decode.

    ingest (one task per connection, app.py)       frames -> Session -> DecodeJob
      -> features (ThreadPoolExecutor, NumPy)      job.audio -> log-mel Window
      -> scheduler (asyncio task, bounded heap)    stalest windows first, urgent ahead, batched
      -> decode lanes (a thread; child processes)  Engine.decode_windows(batch), one per lane
      -> back on the loop (call_soon_threadsafe)   Session.receive_result -> messages

``Pipeline`` is shared by all connections: it owns the engine, the feature threads, the
scheduler and the decode lanes (``server.decode.lanes``): this process's decode thread, and one
child process per further lane, so that each core decodes a batch of its own.
Each connection's ``StreamDriver`` (``server.decode.stream_driver``) takes its session's next job,
sends it through the pipeline and folds the result back into the session.

Back-pressure and bounds: a session has at most one job in flight, the scheduler's queue holds
at most ``PipelineConfig.max_queued_windows`` windows (``enqueue`` waits for a free slot), and
a connection's outbox holds at most ``max_pending_messages`` messages (more means the client
does not read; the driver reports ``DriverOutcome.OVERFLOW`` and the connection drops it).

The event loop never waits on MLX: it only waits on futures the lanes settle through
``loop.call_soon_threadsafe``. A lane whose process dies costs no audio: its windows go back
to the queue for another lane, and a new child replaces it. Nothing sleeps to poll; shutdown
(``Pipeline.close``) is awaited.

Capacity: every engine call the lanes make for clients is timed into ``Pipeline.capacity``
(``server.decode.capacity``), which the app asks how many streams to admit. ``start`` seeds it
with a few timed calls on windows of a recording shipped for it (``server.decode.calibration``),
so the estimate exists before the first client. The same model sets how many windows a call
takes (``CapacityModel.batch_size``: the batch that brings words to their final soonest) and
the least audio a stream gathers between decodes.

Files: ``background`` runs engine calls that are no stream's window (the 30 s windows of an
uploaded file, ``server.decode.file_transcription``) after the streams: one takes a lane only
while no stream's window waits, and never the last lane free for the streams while any is open.
They are not timed into the capacity model: they cost what a file costs, not a stream.

Order: the stalest window first, where a window a listener waits on (``DecodeJob.urgent``: an
utterance's first words, which set the time to first token, and closing decodes, which set
when a turn's final arrives) counts as ``PipelineConfig.urgent_head_start_ms`` older than it
is. It goes before the routine re-decodes of any stream queued less than that before it, and
after older ones: a routine window is passed only by urgent windows made within the head start
after it, so its wait grows by that at most and no stream starves behind another's urgent ones.

Interruption: a call on a lane that nobody waits for any more (every window of its batch
abandoned: a closing decode replaced the stream's re-decode, a stale search was dropped, the
client left; a file upload whose client left) is stopped at the engine's next token step
(``ProcessLane.interrupt``), so the lane is free for the window a listener waits on.

Late binding: a window waits in the queue as a claim on a lane; when a lane takes it, its
session extends it to the audio that arrived meanwhile (``Session.refresh_job``) and only then
are its features final. A stream that waited for a lane is decoded up to the present.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import heapq
import itertools
import logging
import operator
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from server.config import PipelineConfig
from server.core.engine_api import (
    DecodeInterrupted,
    DecodeRequest,
    DecodeResult,
    SpeechEngine,
    Window,
)
from server.core.session import DecodeJob
from server.core.speakers import EmbedJob, SpeakerEmbedder
from server.core.turns import TurnJob, TurnScorer
from server.core.vad import FrameVoicing
from server.decode.calibration import speech_windows
from server.decode.capacity import CapacityModel
from server.decode.lanes import EngineCall, LaneLost, ProcessLane, ThreadLane
from server.decode.lanes import settle_future as _settle
from server.metrics import Metrics
from server.protocol.errors import DecodeError

logger = logging.getLogger("server.decode.pipeline")

Float32Array = npt.NDArray[np.float32]
T = TypeVar("T")


# --------------------------------------------------------------------------- pipeline


Refresh = Callable[[DecodeJob], DecodeJob]
# What the job's stream holds beyond it that arrived ahead of real time, asked at dispatch
# (``StreamDriver.catch_up_s``; ``CapacityModel.observe``: catch-up is backlog, not cost).
CatchUp = Callable[[DecodeJob], float]


@dataclass(eq=False)
class _QueuedJob:
    """A session's job in the scheduler: queued for a lane, then on one until it settles."""

    job: DecodeJob
    window: Window
    future: asyncio.Future[DecodeResult]
    queued_at: float  # loop.time() when it entered the queue
    refresh: Refresh | None = None  # the job over the newest audio, asked at dispatch
    catch_up: CatchUp | None = None  # None: the stream keeps up
    queued: bool = True  # still in the heap
    lost_lanes: int = 0  # lanes that died while decoding it
    slot: _LaneSlot | None = None  # the lane that took it, until its batch returns


_Outcome = DecodeResult | Exception


@dataclass(eq=False)
class _BackgroundCall:
    """An engine call that is no stream's window (a window of an uploaded file)."""

    fn: EngineCall[Any]
    future: asyncio.Future[Any]
    lost_lanes: int = 0


@dataclass(frozen=True)
class _BatchRun:
    """What a lane did with one batch."""

    outcomes: list[_Outcome]  # one per window: its result or its error
    elapsed_s: float  # wall time in the engine, retries included
    whole: bool  # one engine call decoded every window: elapsed_s is that call's cost


@dataclass(eq=False)
class _LaneSlot:
    """A lane and what the scheduler knows about it."""

    lane: ThreadLane | ProcessLane
    index: int
    busy: bool = False
    # What the lane runs now: a batch of windows or a background call (for ``interrupt``).
    running: list[_QueuedJob] | _BackgroundCall | None = None
    free_at: float = 0.0  # loop.time() when its last call returned
    reviving: bool = False  # a dead process lane being replaced


# Startup calibration of the capacity model, in multiples of the typical window: each of
# ``_CALIBRATION_BATCH`` windows of the speech alone, the first twice as long alone, and the
# same windows as one batch. The batch is timed against its own windows alone because that is
# what the scheduler weighs (``CapacityModel.batch_size``), and the windows differ: on a
# CPU a batch of two can cost more than its two windows alone (it decodes as long as its
# longer row, and each row's step costs what it does alone). Timed against other windows,
# a batch looked cheaper than it is, and the scheduler batched pairs of streams whose
# finals then waited for both. The two lengths tell per-audio-second costs from per-window
# ones.
_CALIBRATION_BATCH = 2
_CALIBRATION_LONG = 2.0
# Each shape is timed this many times and the cheapest kept: the speech decodes to the same
# tokens each time, so what varies is only what timing adds (a core another process held, a
# first call's allocations at a new size: tiny.en on a 2-core CPU took 0.37 s for its first
# 4 s window of speech after warmup, 0.25 s for the next), never less than the call costs.
_CALIBRATION_REPEATS = 2
# What each calibration shape cost, per loaded engine object. A program that starts servers one
# after another on one engine in one process (an application that embeds the server, the tests,
# the benchmarks) times it once: the same engine on the same CPU costs what it cost a minute
# ago, and the live fit follows the clients' calls either way. Keyed by the shape: its windows,
# how many windows its batch is spread over, their audio seconds, and the clock it was timed on.
_CalibrationShape = tuple[tuple[int, ...], int, float, bool]
_CALIBRATED: weakref.WeakKeyDictionary[SpeechEngine, dict[_CalibrationShape, float]] = (
    weakref.WeakKeyDictionary()
)
# A window in flight on lanes that died this many times fails instead of going round again:
# it may be what kills them.
_MAX_LOST_LANES = 2
# The speaker encoder's largest batch: a burst (a file sent at --pace 0) is cut into batches so
# that other streams' windows are not held behind it for long.
MAX_EMBED_BATCH_WINDOWS = 64
_REVIVE_BACKOFF_S = (1.0, 5.0, 30.0)  # between attempts to replace a dead process lane


class Pipeline:
    """Features, batching scheduler and decode lanes, shared by every connection.

    Life cycle: ``await start(load_engine)`` (loads and warms the model on every lane), then
    any number of ``decode`` calls, then ``await close()``.
    """

    def __init__(
        self, config: PipelineConfig | None = None, *, metrics: Metrics | None = None
    ) -> None:
        self.config = config or PipelineConfig()
        self.metrics = metrics or Metrics()
        self.capacity = CapacityModel(
            hop_s=self.config.capacity_hop_s,
            utilization=self.config.capacity_utilization,
            admission_utilization=self.config.admission_utilization,
            comfort_utilization=self.config.comfort_utilization,
            max_batch_size=self.config.max_batch_size,
        )
        self._engine: SpeechEngine | None = None
        self._load_engine: Callable[[], SpeechEngine] | None = None
        self._lanes: list[_LaneSlot] = []
        self._features_pool = ThreadPoolExecutor(
            max_workers=self.config.feature_workers, thread_name_prefix="whisperwire-features"
        )
        # The speaker encoder, when the server labels speakers (``--speakers``). Its windows run
        # in a thread of their own, every stream's waiting windows in one batch (``embed``):
        # in the feature threads, four streams' jobs one by one held up the decodes' features.
        self.speakers: SpeakerEmbedder | None = None
        self._speakers_pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="whisperwire-speakers"
        )
        # The turn model (Smart Turn), when streams ask for conversational turns: one call per
        # pause, tens of milliseconds, in a thread of its own beside the decode lanes.
        self.turn_model: TurnScorer | None = None
        # Makes each stream's voice activity detector where it is not webrtcvad (Silero's,
        # whose network all streams share: ``--vad silero``); None: webrtcvad.
        self.frame_voicing: Callable[[], FrameVoicing] | None = None
        self._turns_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whisperwire-turns")
        self._embed_waiting: list[tuple[EmbedJob, asyncio.Future[Float32Array]]] = []
        self._embed_batch: list[asyncio.Future[Float32Array]] = []  # the batch in the thread
        self._embedding: asyncio.Task[None] | None = None
        # (job.created_at less an urgent job's head start, sequence, request): the stalest
        # window is at the top.
        self._heap: list[tuple[float, int, _QueuedJob]] = []
        self._sequence = itertools.count()
        self._slots = asyncio.Semaphore(self.config.max_queued_windows)
        self._changed = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None
        self._in_flight: set[_QueuedJob] = set()
        self._runs: set[asyncio.Task[None]] = set()  # batches on lanes, and lane revivals
        self._streams = 0  # open streams: add_stream / remove_stream
        # Streams to offer a seat in a batch being gathered (StreamDriver._advance), and
        # whether one is being gathered now: then no stream waits for the scheduler's hop.
        self._joiners: set[Callable[[], None]] = set()
        self._gathering = False
        self._background: collections.deque[_BackgroundCall] = collections.deque()
        self._background_running = 0
        self._closed = False

    # -- life cycle ------------------------------------------------------------------------
    async def start(
        self, load_engine: Callable[[], SpeechEngine], *, warmup: bool = True
    ) -> SpeechEngine:
        """Load the engine on every lane (``PipelineConfig.decode_lanes``: this process's
        decode thread, and child processes for the others), warm each up, seed the capacity
        model, and start scheduling.

        Raises whatever ``load_engine`` raises in this process (``ModelError`` for a model
        that cannot be loaded; ``ValueError`` if it does not pickle and more than one lane is
        asked for); a child that fails to start is logged and replaced in the background
        while the others serve. Call ``close`` afterwards either way. Without ``warmup`` the
        capacity model waits for the clients' first calls.
        """
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        self._load_engine = load_engine
        home = ThreadLane()
        self._lanes = [_LaneSlot(home, 0)]
        others = [
            ProcessLane(f"whisperwire-lane-{i}", self._child_ended)
            for i in range(1, self.config.decode_lanes)
        ]
        self._lanes += [_LaneSlot(lane, i) for i, lane in enumerate(others, start=1)]
        # The children load while this process does: a second lane costs little startup time.
        children = asyncio.gather(
            *(lane.load(load_engine) for lane in others), return_exceptions=True
        )
        try:
            engine = await home.load(load_engine)
        finally:
            outcomes = await children  # every child answered (or died) before we go on
        failed: list[_LaneSlot] = []
        for slot, outcome in zip(self._lanes[1:], outcomes, strict=True):
            if isinstance(outcome, ValueError):
                raise outcome  # a load_engine that does not pickle: no child ever will
            if isinstance(outcome, BaseException):
                # This process loaded the same model: the child ran out of something (memory,
                # processes). Serve on fewer lanes and keep trying to bring it up.
                logger.error("lane %s did not start: %s", slot.lane.name, outcome)
                failed.append(slot)
        if warmup:
            live = [slot.lane for slot in self._lanes if slot.lane.alive]
            spent = await asyncio.gather(
                *(lane.call(operator.methodcaller("warmup")) for lane in live)
            )
            logger.info("warmed up %s on %d lane(s) in %.2f s", engine.name, len(spent), max(spent))
            await self._calibrate(home, engine)
        self._engine = engine
        self._update_lanes()
        self._scheduler = asyncio.create_task(self._schedule(), name="whisperwire-scheduler")
        for slot in failed:
            self._lane_lost(slot)
        self.metrics.ready.set(1)
        return engine

    @property
    def ready(self) -> bool:
        """True once the engine is loaded and warmed up, until ``close``."""
        return self._engine is not None and not self._closed

    @property
    def engine(self) -> SpeechEngine:
        """The engine of this process's lane (features, text, model shape)."""
        if self._engine is None:
            raise RuntimeError("the pipeline has no engine yet; await start() first")
        return self._engine

    @property
    def lanes(self) -> int:
        """Lanes able to decode now (a dead process lane does not count while replaced)."""
        return sum(slot.lane.alive for slot in self._lanes)

    @property
    def process_lanes(self) -> list[ProcessLane]:
        """The child-process lanes (tests kill one to see the pipeline carry on)."""
        return [s.lane for s in self._lanes if isinstance(s.lane, ProcessLane)]

    @property
    def streams(self) -> int:
        """Streams with a driver on this pipeline right now."""
        return self._streams

    def offer_seats(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever a batch starts being gathered, until ``withdraw``: a stream
        with a window ready by its own cadence joins the batch then rather than starting
        its own later (four windows in one call cost 2.6 of one alone). Also when a lane
        comes free of a batch nobody waited for (interrupted): a stream may want it."""
        self._joiners.add(wake)

    def withdraw(self, wake: Callable[[], None]) -> None:
        self._joiners.discard(wake)

    def add_stream(self) -> None:
        """A stream started feeding this pipeline (``StreamDriver`` calls it)."""
        self._streams += 1

    def remove_stream(self) -> None:
        """A stream ended; every ``add_stream`` is matched by one of these."""
        self._streams -= 1

    def stream_hop_s(self) -> float:
        """The least new audio a stream gathers before its next decode, from the measured
        decode cost of a round of every open stream (``CapacityModel.stream_hop_s``): at light load
        below every session's own cadence, so each decodes as soon as its policy asks; as
        streams are added, longer hops and fuller batches keep the lanes within
        ``capacity_utilization`` and every stream's lag bounded."""
        if self._gathering:
            return 0.0
        return self.capacity.stream_hop_s(self._streams)

    @property
    def spare_lane(self) -> bool:
        """A lane is idle and no other stream needs it: fewer streams than lanes, so a
        stream may start a second decode beside the one it has in flight."""
        return self._streams < self.lanes and bool(self._idle_lanes())

    @property
    def crowded(self) -> bool:
        """More streams than lanes: each lane decodes several streams' windows in turn."""
        return self._streams > self.lanes

    @property
    def past_comfort(self) -> bool:
        """More streams open than the comfortable estimate carries (and than lanes:
        ``CapacityModel.comfortable_streams``): the lanes have no time to spare, though the
        streams may all be admitted. A closing decode asked as a beam search then runs
        greedy: a beam of 5 costs 1.5-1.9 greedy calls (bench-beam), lane time the other
        streams' decodes need. Within the estimate it runs as asked: the streams then read
        nearly as well as each alone, and better than with greedy closings, for finals a
        few tenths of a second later. The sessions also commit with less settled context
        then (``StreamingConfig.utterance_busy_settled_context_s``)."""
        streams = self._streams
        return streams > self.lanes and streams > self.capacity.comfortable_streams(streams)

    @property
    def queued(self) -> int:
        """Windows waiting for a lane."""
        return len(self._heap)

    async def release_memory(self) -> None:
        """Give back what a burst of sessions took (batch-sized caches, freed heap) on every
        lane; run it when no session is open. Queued behind any decode already on a lane."""
        if self._closed or self._engine is None:
            return
        live = [slot.lane for slot in self._lanes if slot.lane.alive]
        results = await asyncio.gather(
            *(lane.call(operator.methodcaller("release_memory")) for lane in live),
            return_exceptions=True,
        )
        for lane, result in zip(live, results, strict=True):
            if isinstance(result, Exception):
                logger.warning("lane %s could not release memory: %s", lane.name, result)

    async def close(self) -> None:
        """Stop scheduling, fail what is still queued or in flight, and stop every lane."""
        if self._closed:
            return
        self._closed = True
        self.metrics.ready.set(0)
        # Before anything is awaited: a lane's result arriving meanwhile would be delivered.
        # A lane finishes the call it is in (its result is dropped), then stops.
        if self._scheduler is not None:
            self._scheduler.cancel()
        for task in self._runs:
            task.cancel()
        for call in self._background:
            _settle(call.future, None, DecodeError("the server is shutting down"))
        self._background.clear()
        stranded = [r for _, _, r in self._heap] + list(self._in_flight)
        self._heap.clear()
        self._in_flight.clear()
        for request in stranded:
            request.queued = False
            _settle(request.future, None, DecodeError("the server is shutting down"))
        self.metrics.queue_depth.set(0)
        pending = set(self._runs) | ({self._scheduler} if self._scheduler else set())
        if pending:
            await asyncio.wait(pending)
        await asyncio.gather(*(slot.lane.stop() for slot in self._lanes))
        # Nothing is queued on the pool any more: every caller awaited its features.
        self._features_pool.shutdown(wait=False, cancel_futures=True)
        if self._embedding is not None:
            self._embedding.cancel()
            await asyncio.wait({self._embedding})
        for future in [*self._embed_batch, *(f for _, f in self._embed_waiting)]:
            if not future.done():
                future.set_exception(RuntimeError("the server is shutting down"))
        self._embed_waiting.clear()
        self._speakers_pool.shutdown(wait=False, cancel_futures=True)
        self._turns_pool.shutdown(wait=False, cancel_futures=True)

    async def _calibrate(self, lane: ThreadLane, engine: SpeechEngine) -> None:
        """Time a few engine calls on speech windows into the capacity model (after warmup:
        first-call costs would inflate them). The lanes are alike; one is timed, unless this
        process timed ``engine`` before (``_CALIBRATED``). Unless an operator set them
        (``--capacity``), the seeds' own figures bound the estimates
        (``CapacityModel.bound_by_calibration``)."""
        self._update_lanes()  # the seeds' estimate is of every lane that started
        window_s = self.capacity.typical_window_s
        size = min(_CALIBRATION_BATCH, self.config.max_batch_size)
        timed = _CALIBRATED.setdefault(engine, {})

        async def seed(picks: tuple[int, ...], spread: int, audio_s: float) -> float | None:
            shape = (picks, spread, audio_s, self.config.calibrate_on_cpu_time)
            cost_s = timed.get(shape)
            if cost_s is None:
                cost_s = await self._time_shape(lane, picks, spread, audio_s)
            if cost_s is not None:
                timed[shape] = cost_s
                self.capacity.seed([audio_s] * len(picks), cost_s)
            return cost_s

        before = len(timed)
        alone = [await seed((k,), size, window_s) for k in range(size)]
        await seed((0,), 1, window_s * _CALIBRATION_LONG)
        if size > 1:
            together = await seed(tuple(range(size)), size, window_s)
            each = [s for s in alone if s is not None]
            if together is not None and len(each) == size:
                self.capacity.seed_batch(each, together)
        self.capacity.bound_by_calibration()
        if before and len(timed) == before:
            logger.info("capacity model: %s calibrated earlier in this process", engine.name)
        logger.info("capacity model: %s", self.capacity.explain(limit=1 << 16))

    async def _time_shape(
        self, lane: ThreadLane, picks: tuple[int, ...], spread: int, audio_s: float
    ) -> float | None:
        """One calibration shape (``_calibration_run``) timed ``_CALIBRATION_REPEATS`` times:
        its cheapest cost, None where a run failed."""
        call = functools.partial(
            _calibration_run,
            picks=picks,
            spread=spread,
            audio_s=audio_s,
            cpu_time=self.config.calibrate_on_cpu_time,
        )
        runs = [await lane.call(call) for _ in range(_CALIBRATION_REPEATS)]
        if not all(run.whole for run in runs):
            logger.warning(
                "calibration call of %d window(s) failed; the capacity estimate waits for "
                "the clients' calls",
                len(picks),
            )
            return None
        return min(run.elapsed_s for run in runs)

    def _update_lanes(self) -> None:
        lanes = self.lanes
        self.capacity.lanes = max(1, lanes)
        self.metrics.decode_lanes.set(lanes)

    # -- stages ----------------------------------------------------------------------------
    async def features(self, job: DecodeJob) -> Window:
        """Stage 2: the job's log-mel, computed in the feature thread pool."""
        engine = self.engine
        loop = asyncio.get_running_loop()
        mel = await loop.run_in_executor(self._features_pool, engine.features, job.audio)
        return Window(mel, job.request)

    def prepare_turn_model(self) -> None:
        """A stream asks for turns: load the turn model in its thread now, if it is not."""
        model = self.turn_model
        if model is not None and not self._closed:
            self._turns_pool.submit(model.load)

    async def score_turn(self, job: TurnJob) -> float:
        """The turn model's probability that ``job``'s pause ends the turn. Raises
        RuntimeError when the server has no turn model or is shutting down, and what the model
        raises."""
        model = self.turn_model
        if model is None:
            raise RuntimeError("this server has no turn model")
        if self._closed:
            raise RuntimeError("the server is shutting down")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._turns_pool, model.score, job.audio)

    async def embed(self, job: EmbedJob) -> Float32Array:
        """A speaker job's d-vectors. Jobs that wait while the encoder is busy go through it
        together, in one batch (at most ``MAX_EMBED_BATCH_WINDOWS`` windows, and at least one
        job), in the speakers' thread. Raises RuntimeError when the server has no speaker
        encoder or is shutting down, and what the encoder raises."""
        if self.speakers is None:
            raise RuntimeError("this server has no speaker encoder (--speakers)")
        if self._closed:
            raise RuntimeError("the server is shutting down")
        future: asyncio.Future[Float32Array] = asyncio.get_running_loop().create_future()
        self._embed_waiting.append((job, future))
        if self._embedding is None or self._embedding.done():
            self._embedding = asyncio.create_task(
                self._embed_batches(self.speakers), name="whisperwire-speakers"
            )
        return await future

    async def _embed_batches(self, speakers: SpeakerEmbedder) -> None:
        loop = asyncio.get_running_loop()
        while self._embed_waiting:
            waiting = [(j, f) for j, f in self._embed_waiting if not f.done()]  # not cancelled
            batch: list[tuple[EmbedJob, asyncio.Future[Float32Array]]] = []
            windows = 0
            for job, future in waiting:
                if batch and windows + len(job.starts) > MAX_EMBED_BATCH_WINDOWS:
                    break
                batch.append((job, future))
                windows += len(job.starts)
            self._embed_waiting = waiting[len(batch) :]
            if not batch:
                continue
            self._embed_batch = [future for _, future in batch]
            pieces = [(job.audio, list(job.starts)) for job, _ in batch]
            try:
                vectors = await loop.run_in_executor(
                    self._speakers_pool, speakers.embed_many, pieces
                )
            except (ArithmeticError, ValueError, MemoryError, RuntimeError) as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, vectors, strict=True):
                if not future.done():
                    future.set_result(result)

    async def enqueue(
        self,
        job: DecodeJob,
        window: Window,
        *,
        refresh: Refresh | None = None,
        catch_up: CatchUp | None = None,
    ) -> asyncio.Future[DecodeResult]:
        """Stage 3: queue a window for the lanes; waits while the queue is full.

        Returns the future of its result. Cancelling that future takes the window out of the
        queue if it is still waiting. ``refresh``: asked for the job again when a lane takes
        it (``Session.refresh_job``); a job it extends gets its features again. ``catch_up``:
        asked then too, for the capacity model (``CapacityModel.observe``).
        """
        if self._closed or self._engine is None:
            raise RuntimeError("the pipeline is not running")
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[DecodeResult] = loop.create_future()
        request = _QueuedJob(job, window, future, loop.time(), refresh, catch_up)
        future.add_done_callback(functools.partial(self._forget, request))
        self._push(request)
        return future

    async def decode(
        self, job: DecodeJob, *, refresh: Refresh | None = None, catch_up: CatchUp | None = None
    ) -> DecodeResult:
        """Features, then queue, then the batched decode; raises ``DecodeError`` on failure.
        ``refresh``, ``catch_up``: see ``enqueue``."""
        window = await self.features(job)
        future = await self.enqueue(job, window, refresh=refresh, catch_up=catch_up)
        return await future

    async def background(self, fn: EngineCall[T]) -> T:
        """Run an engine call that is no stream's window (a window of an uploaded file) on
        a lane, after the streams: it takes a lane only while no stream's window is waiting,
        and while streams are open it leaves them one lane of their own (when there are two
        or more). Raises ``DecodeError`` when it fails; cancelling the await takes it out of
        the queue."""
        if self._closed or self._engine is None:
            raise RuntimeError("the pipeline is not running")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._background.append(_BackgroundCall(fn, future))
        self._changed.set()
        return await future

    @property
    def background_queued(self) -> int:
        """Background calls waiting for a lane, and on one."""
        return len(self._background) + self._background_running

    @property
    def background_lanes(self) -> int:
        """Lanes background calls may use now: all while no stream is open, else all but
        one (at least one)."""
        return self.lanes if self._streams == 0 else max(1, self.lanes - 1)

    # -- scheduling ------------------------------------------------------------------------
    def _push(self, request: _QueuedJob) -> None:
        key = request.job.created_at
        if request.job.urgent:
            key -= self.config.urgent_head_start_ms / 1000.0
        heapq.heappush(self._heap, (key, next(self._sequence), request))
        request.queued = True
        self.metrics.queue_depth.set(len(self._heap))
        self._changed.set()

    def _forget(self, request: _QueuedJob, future: asyncio.Future[DecodeResult]) -> None:
        # A cancelled request (its client left, a closing decode replaced it) gives its queue
        # slot back, or its lane once nobody waits for any window of the batch on it.
        if not future.cancelled():
            return
        if request.queued:
            self._heap = [entry for entry in self._heap if entry[2] is not request]
            heapq.heapify(self._heap)
            request.queued = False
            self._slots.release()
            self.metrics.queue_depth.set(len(self._heap))
        elif request.slot is not None:
            self._interrupt_if_abandoned(request.slot)

    def _interrupt_if_abandoned(self, slot: _LaneSlot) -> None:
        running = slot.running
        if isinstance(running, list):
            abandoned = all(r.future.done() for r in running)
        else:
            abandoned = running is not None and running.future.done()
        if abandoned:
            slot.lane.interrupt()
            slot.running = None  # asked once
            self.metrics.decodes_interrupted.inc()

    def _take_batch(self, limit: int) -> list[_QueuedJob]:
        batch: list[_QueuedJob] = []
        while self._heap and len(batch) < limit:
            request = heapq.heappop(self._heap)[2]
            request.queued = False
            self._slots.release()
            batch.append(request)
        self.metrics.queue_depth.set(len(self._heap))
        return batch

    def _idle_lanes(self) -> list[_LaneSlot]:
        return [s for s in self._lanes if not s.busy and s.lane.alive]

    async def _wait_change(self, timeout_s: float | None = None) -> bool:
        """Wait for a window or a free lane; False when ``timeout_s`` passed first."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        wait_s = self.config.batch_wait_ms / 1000.0
        while True:
            while not (self._idle_lanes() and (self._heap or self._background_due())):
                await self._wait_change()
            if not self._heap:
                self._start_background()
                continue
            idle = self._idle_lanes()
            slot = idle[0]  # this process's lane first: a lone stream pays no pipe
            # Windows arriving within batch_wait_ms of the oldest waiting one join its batch.
            # The wait also runs from the moment the lane became free: the sessions it just
            # served are about to queue their next windows (a result, then features), and
            # without it streams that take turns would never share a batch.
            oldest = min(r.queued_at for _, _, r in self._heap)
            deadline = max(oldest, slot.free_at) + wait_s
            # While another lane is idle too, a batch takes its share of the streams and
            # leaves the rest to that lane: two batches side by side finish sooner than
            # one of both. Nobody else to wait for once every stream not in flight elsewhere
            # has its window queued.
            limit = min(self.config.max_batch_size, self.capacity.batch_size(self._streams))
            if len(idle) > 1:
                limit = min(limit, -(-max(1, self._streams) // self.lanes))
            company = min(limit, max(1, self._streams - len(self._in_flight)))
            if len(self._heap) < company:
                self._gathering = True
                for wake in list(self._joiners):
                    loop.call_soon(wake)
            try:
                while len(self._heap) < company:
                    remaining = deadline - loop.time()
                    if remaining <= 0 or not await self._wait_change(remaining):
                        break
            finally:
                self._gathering = False
            if slot.busy or not slot.lane.alive:
                continue  # it died while we gathered
            batch = self._take_batch(limit)
            if not batch:
                continue
            slot.busy = True
            slot.running = batch
            for request in batch:
                request.slot = slot
            self._in_flight.update(batch)
            task = asyncio.create_task(self._run(slot, batch), name=f"whisperwire-{slot.index}")
            self._runs.add(task)
            task.add_done_callback(self._runs.discard)

    def _background_due(self) -> bool:
        """A background call is waiting and may take a lane now (while streams are open,
        all but one lane, so a stream's window never waits behind a whole file)."""
        while self._background and self._background[0].future.done():
            self._background.popleft()  # cancelled by its caller
        return bool(self._background) and self._background_running < self.background_lanes

    def _start_background(self) -> None:
        # The last idle lane: a child process's, leaving this process's lane (no pipe to
        # cross) to the streams.
        slot = self._idle_lanes()[-1]
        call = self._background.popleft()
        slot.busy = True
        slot.running = call
        call.future.add_done_callback(functools.partial(self._background_abandoned, slot, call))
        self._background_running += 1
        task = asyncio.create_task(self._run_background(slot, call), name="whisperwire-file")
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)

    def _background_abandoned(
        self, slot: _LaneSlot, call: _BackgroundCall, future: asyncio.Future[Any]
    ) -> None:
        if future.cancelled() and slot.running is call:
            self._interrupt_if_abandoned(slot)

    async def _run_background(self, slot: _LaneSlot, call: _BackgroundCall) -> None:
        loop = asyncio.get_running_loop()
        try:
            result = await slot.lane.call(call.fn)
        except LaneLost as exc:
            self._lane_lost(slot)
            call.lost_lanes += 1
            if call.lost_lanes >= _MAX_LOST_LANES:
                _settle(call.future, None, exc)
            else:
                self._background.appendleft(call)
        except asyncio.CancelledError:
            _settle(call.future, None, DecodeError("the server is shutting down"))
            raise
        except Exception as exc:
            _settle(call.future, None, _as_decode_error(exc))
        else:
            _settle(call.future, result, None)
        finally:
            self._background_running -= 1
            slot.busy = False
            slot.running = None
            slot.free_at = loop.time()
            self._changed.set()

    async def _refresh(self, batch: list[_QueuedJob]) -> None:
        """Bring each job of a batch a lane is about to take up to its stream's newest audio
        (late binding): a window that waited in the queue is decoded up to now, not up to
        when it was queued. Only the extended ones pay for their features again."""
        stale = []
        for request in batch:
            if request.refresh is not None and not request.future.done():
                fresh = request.refresh(request.job)
                if fresh is not request.job:
                    request.job = fresh
                    stale.append(request)
        if stale:
            windows = await asyncio.gather(*(self.features(r.job) for r in stale))
            for request, window in zip(stale, windows, strict=True):
                request.window = window

    async def _run(self, slot: _LaneSlot, batch: list[_QueuedJob]) -> None:
        """One batch on one lane, and its results back to their sessions."""
        loop = asyncio.get_running_loop()
        windows = [r.window for r in batch]
        catch_up_s = [0.0] * len(batch)
        try:
            await self._refresh(batch)
            windows = [self._affordable(r.window) for r in batch]
            catch_up_s = [r.catch_up(r.job) if r.catch_up else 0.0 for r in batch]
            if all(r.future.done() for r in batch):
                # Abandoned while its features were refreshed: not worth a lane.
                run = _BatchRun([DecodeInterrupted("abandoned")] * len(batch), 0.0, whole=False)
            else:
                run = await slot.lane.call(functools.partial(_decode_batch, windows=windows))
        except LaneLost as exc:
            logger.error("%s; its %d window(s) go to another lane", exc, len(batch))
            slot.busy = False
            slot.running = None
            for request in batch:
                request.slot = None
            self._in_flight.difference_update(batch)
            self._lane_lost(slot)
            for request in batch:
                request.lost_lanes += 1
                if request.lost_lanes >= _MAX_LOST_LANES:
                    _settle(request.future, None, exc)
                elif not request.future.done():
                    await self._slots.acquire()
                    self._push(request)
            return
        except Exception as exc:
            # _decode_batch catches engine errors itself; this is a bug in the lane
            # plumbing. Fail this batch, keep the scheduler alive for everyone else.
            logger.error("decode lane call failed", exc_info=True)
            run = _BatchRun([exc] * len(batch), 0.0, whole=False)
        finally:
            slot.free_at = loop.time()
            self._changed.set()
        slot.busy = False
        slot.running = None
        for request in batch:
            request.slot = None
        self._in_flight.difference_update(batch)
        audio_s = [w.request.audio_s for w in windows]
        self.metrics.observe_batch(len(batch), run.elapsed_s, sum(audio_s))
        if logger.isEnabledFor(logging.DEBUG):  # the join is work every call would pay
            logger.debug(
                "lane %d: %d window(s) of %s s in %.0f ms, %d stream(s) open, %d queued",
                slot.index,
                len(batch),
                "+".join(f"{s:.1f}" for s in audio_s),
                run.elapsed_s * 1000,
                self._streams,
                len(self._heap),
            )
        searched = any(w.request.options.searches for w in windows)
        if run.whole and not searched:
            # A failed batch's time (the failure, then each window alone) is not what a
            # batch of this size costs; nor is a beam-searched closing decode's, which runs
            # only while the lanes have room for it (not ``past_comfort``).
            fitted = self.capacity.observe(audio_s, run.elapsed_s, catch_up_s)
            if not fitted:
                self.metrics.capacity_catch_up_calls.inc()
        for request, outcome in zip(batch, run.outcomes, strict=True):
            if isinstance(outcome, Exception):
                _settle(request.future, None, outcome)
            else:
                _settle(request.future, outcome, None)
        if all(isinstance(outcome, DecodeInterrupted) for outcome in run.outcomes):
            # Nobody waited for this batch: the stream that dropped it may want the lane
            # now (a closing decode for the spare lane), and no result of its own will
            # come to say so.
            loop.call_soon(self._offer_lane)

    def _offer_lane(self) -> None:
        for wake in list(self._joiners):
            wake()

    def _affordable(self, window: Window) -> Window:
        """``window`` as the lanes can afford it now: a beam search made greedy
        ``past_comfort``. Decided when a lane takes the window, with the load of then."""
        options = window.request.options
        if options.beam_size == 1:
            return window
        if not self.past_comfort:
            self.metrics.beam_searches.inc()
            return window
        self.metrics.beam_searches_made_greedy.inc()
        greedy = dataclasses.replace(options, beam_size=1)
        return dataclasses.replace(
            window, request=dataclasses.replace(window.request, options=greedy)
        )

    def _child_ended(self, lane: ProcessLane) -> None:
        """A child lane ended on its own; the call it ran, if any, fails in ``_run``."""
        for slot in self._lanes:
            if slot.lane is lane:
                self._lane_lost(slot)

    def _lane_lost(self, slot: _LaneSlot) -> None:
        self._update_lanes()
        if slot.reviving or self._closed or self._load_engine is None:
            return
        slot.reviving = True
        task = asyncio.create_task(self._revive(slot), name=f"whisperwire-revive-{slot.index}")
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)

    async def _revive(self, slot: _LaneSlot) -> None:
        """Replace a dead process lane with a new child, retrying with a growing pause."""
        assert self._load_engine is not None
        attempt = 0
        try:
            while not self._closed:
                await asyncio.sleep(_REVIVE_BACKOFF_S[min(attempt, len(_REVIVE_BACKOFF_S) - 1)])
                attempt += 1
                dead, lane = slot.lane, ProcessLane(slot.lane.name, self._child_ended)
                slot.lane = lane  # from now on close() stops this one
                await dead.stop()
                try:
                    await lane.load(self._load_engine)
                    await lane.call(operator.methodcaller("warmup"))
                except Exception as exc:
                    logger.error("lane %s could not be replaced: %s", lane.name, exc)
                    continue
                slot.busy = False
                logger.info("lane %s replaced (pid %s)", lane.name, lane.pid)
                self._update_lanes()
                self._changed.set()
                return
        finally:
            slot.reviving = False


def _as_decode_error(exc: Exception) -> DecodeError:
    if isinstance(exc, DecodeError):
        return exc
    error = DecodeError(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _decode_batch(engine: SpeechEngine, windows: list[Window]) -> _BatchRun:
    """Runs on a lane. One outcome per window: a result or the error."""
    started = time.perf_counter()
    outcomes: list[_Outcome]
    try:
        results = engine.decode_windows(windows)
        if len(results) != len(windows):
            raise DecodeError(f"engine returned {len(results)} results for {len(windows)} windows")
        return _BatchRun(list(results), time.perf_counter() - started, whole=True)
    except DecodeInterrupted as exc:
        return _BatchRun([exc] * len(windows), time.perf_counter() - started, whole=False)
    except Exception as exc:
        # Any engine failure, not only DecodeError: a bug triggered by one window must fail
        # that window's job, not the worker and not the other sessions in the batch.
        logger.warning("decode of a batch of %d failed: %s", len(windows), exc, exc_info=True)
        if len(windows) == 1:
            outcomes = [_as_decode_error(exc)]
        else:
            outcomes = [_decode_alone(engine, w) for w in windows]
    return _BatchRun(outcomes, time.perf_counter() - started, whole=False)


def _calibration_run(
    engine: SpeechEngine,
    picks: tuple[int, ...],
    spread: int,
    audio_s: float,
    *,
    cpu_time: bool = False,
) -> _BatchRun:
    """Runs on a lane: one timed call on the ``picks`` of ``spread`` windows of ``audio_s``
    spread over the calibration speech (``server.decode.calibration.speech_windows``; the
    features are computed before the clock starts). ``cpu_time``: the call's cost is this
    process's CPU time when that is less than the wall time (the lane waited for a core
    another process held: measured on 2 cores busy with two other processes, 4 s windows
    took 2-3 times their wall time alone, their CPU time no more than alone;
    ``PipelineConfig.calibrate_on_cpu_time``)."""
    windows = speech_windows(spread, audio_s)
    batch = [Window(engine.features(windows[k]), DecodeRequest(audio_s)) for k in picks]
    cpu_started = time.process_time()
    run = _decode_batch(engine, batch)
    if not cpu_time:
        return run
    return dataclasses.replace(run, elapsed_s=min(run.elapsed_s, time.process_time() - cpu_started))


def _decode_alone(engine: SpeechEngine, window: Window) -> _Outcome:
    try:
        results = engine.decode_windows([window])
        if len(results) != 1:
            raise DecodeError(f"engine returned {len(results)} results for 1 window")
        return results[0]
    except Exception as exc:  # isolated to this window; see _decode_batch
        logger.warning("decode of one window failed: %s", exc)
        return _as_decode_error(exc)
