"""The pipeline with a test-double engine: batching, stalest-first order with urgent windows
ahead, fault isolation.

``ScriptedEngine`` (tests/helpers.py) decodes instantly and deterministically; clearing its
``release`` event holds the decode worker inside an engine call, so windows can be queued
behind it and the next batch's make-up observed exactly, with no timing involved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import multiprocessing
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from bench.corpus import load_clip
from server.config import PipelineConfig, StreamingConfig
from server.core.engine_api import DecodeOptions, DecodeRequest, DecodeResult, Window
from server.core.session import DecodeJob, Session
from server.core.speakers import EmbedJob
from server.decode.calibration import speech_windows
from server.decode.pipeline import Pipeline
from server.decode.stream_driver import DriverOutcome, StreamDriver
from server.protocol.errors import DecodeError
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import ErrorMessage, FinalMessage, ServerMessage
from tests.helpers import (
    GatedEngine,
    GatedSpeakerEncoder,
    ScriptedEngine,
    pcm_frames,
    scripted_engine,
)

# Fixtures run on the session's loop (asyncio_default_fixture_loop_scope); so must the tests,
# or the pipeline a fixture started would post its results to a loop that is not running.
pytestmark = pytest.mark.asyncio(loop_scope="session")

WAIT_S = 30.0  # generous: only a bug makes any of these waits long
LANE_WAIT_S = 60.0  # a child lane starts an interpreter: seconds on a loaded machine


def make_job(
    audio_s: float, created_at: float, session_id: str = "s", *, urgent: bool = False
) -> DecodeJob:
    return DecodeJob(
        session_id=session_id,
        job_id=0,
        audio=np.zeros(round(audio_s * SAMPLE_RATE_HZ), dtype=np.float32),
        start_s=0.0,
        request=DecodeRequest(audio_s, DecodeOptions()),
        closing=False,
        created_at=created_at,
        urgent=urgent,
    )


async def hold_worker(pipeline: Pipeline, engine: ScriptedEngine) -> asyncio.Future[DecodeResult]:
    """Start a decode and return once the worker is held inside the engine call."""
    engine.release.clear()
    engine.entered.clear()
    first = asyncio.ensure_future(pipeline.decode(make_job(0.5, created_at=0.0, session_id="gate")))
    entered = await asyncio.to_thread(engine.entered.wait, WAIT_S)
    assert entered, "the decode worker never called the engine"
    return first


async def queue_jobs(
    pipeline: Pipeline, jobs: list[DecodeJob]
) -> list[asyncio.Future[DecodeResult]]:
    return [await pipeline.enqueue(job, await pipeline.features(job)) for job in jobs]


@pytest_asyncio.fixture
async def scripted() -> AsyncIterator[tuple[Pipeline, ScriptedEngine]]:
    engine = ScriptedEngine(fail_when=lambda w: w.request.audio_s == 1.5)
    pipeline = Pipeline(PipelineConfig(max_batch_size=8, batch_wait_ms=0.0))
    await pipeline.start(lambda: engine)
    engine.batches.clear()  # the capacity calibration's calls; the tests count their own
    try:
        yield pipeline, engine
    finally:
        engine.release.set()
        await pipeline.close()


async def test_windows_from_many_sessions_are_decoded_in_one_batch(
    scripted: tuple[Pipeline, ScriptedEngine],
) -> None:
    pipeline, engine = scripted
    gate = await hold_worker(pipeline, engine)
    jobs = [make_job(1.0 + i, created_at=1.0 + i, session_id=f"s{i}") for i in range(4)]
    futures = await queue_jobs(pipeline, jobs)
    assert pipeline.queued == 4
    engine.release.set()
    await asyncio.wait_for(gate, WAIT_S)
    results = await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
    assert [len(r.words) for r in results] == [2, 4, 6, 8]  # one word per half second
    assert engine.batches == [[0.5], [1.0, 2.0, 3.0, 4.0]]
    assert pipeline.metrics.batch_size.count == 2
    assert pipeline.metrics.batch_size.cumulative()[0] == (1.0, 1)  # one batch of size 1 ...
    assert pipeline.metrics.batch_size.sum == 5  # ... and one of 4
    assert pipeline.queued == 0


async def test_stalest_window_is_served_first(scripted: tuple[Pipeline, ScriptedEngine]) -> None:
    pipeline, engine = scripted
    pipeline.config = PipelineConfig(max_batch_size=2, batch_wait_ms=0.0)
    gate = await hold_worker(pipeline, engine)
    # Queued in an order that is not their age: audio_s names the age rank (1.0 is oldest).
    jobs = [
        make_job(4.0, created_at=40.0, session_id="d"),
        make_job(2.0, created_at=20.0, session_id="b"),
        make_job(3.0, created_at=30.0, session_id="c"),
        make_job(1.0, created_at=10.0, session_id="a"),
    ]
    futures = await queue_jobs(pipeline, jobs)
    engine.release.set()
    await asyncio.wait_for(asyncio.gather(gate, *futures), WAIT_S)
    assert engine.batches == [[0.5], [1.0, 2.0], [3.0, 4.0]]


async def test_an_urgent_window_goes_before_routine_ones_queued_within_its_head_start(
    scripted: tuple[Pipeline, ScriptedEngine],
) -> None:
    pipeline, engine = scripted
    pipeline.config = PipelineConfig(max_batch_size=1, batch_wait_ms=0.0, urgent_head_start_ms=500)
    gate = await hold_worker(pipeline, engine)
    # audio_s names each window; created_at in seconds. The urgent window (a closing decode
    # or an utterance's first words) is the newest and queued last.
    jobs = [
        make_job(1.0, created_at=9.0, session_id="old"),  # 0.7 s before it: beyond its head start
        make_job(2.0, created_at=9.8, session_id="a"),
        make_job(3.0, created_at=9.9, session_id="b"),
        make_job(4.0, created_at=10.0, session_id="c"),
        make_job(5.0, created_at=10.2, session_id="closing", urgent=True),
    ]
    futures = await queue_jobs(pipeline, jobs)
    engine.release.set()
    await asyncio.wait_for(asyncio.gather(gate, *futures), WAIT_S)
    assert engine.batches == [[0.5], [1.0], [5.0], [2.0], [3.0], [4.0]]


async def test_a_routine_window_is_not_starved_by_a_steady_stream_of_urgent_ones() -> None:
    """Other streams' utterances keep starting and ending, so an urgent window is always
    queued when the lane frees (one made every 100 ms), while one stream's routine re-decode
    waits: the urgent windows made within the head start after it go first, then it does."""
    gate, entered = multiprocessing.Semaphore(0), multiprocessing.Semaphore(0)
    engine = GatedEngine(gate, entered)
    config = PipelineConfig(max_batch_size=1, batch_wait_ms=0.0, urgent_head_start_ms=500)
    pipeline = Pipeline(config)
    await pipeline.start(lambda: engine, warmup=False)
    try:
        futures = [asyncio.ensure_future(pipeline.decode(make_job(0.5, 0.0, "gate")))]
        await entered_calls(entered, 1)
        # audio_s names each window: 9.0 the routine one, 1.0 + k / 100 the k-th urgent one.
        routine_at = 10.0
        [routine] = await queue_jobs(pipeline, [make_job(9.0, routine_at, "routine")])
        for k in range(20):
            urgent = make_job(1.0 + k / 100, routine_at + 0.05 + k / 10, f"u{k}", urgent=True)
            futures += await queue_jobs(pipeline, [urgent])
            gate.release()  # the call on the lane returns and the next window takes the lane
            await entered_calls(entered, 1)
            if routine.done():
                break
        for _ in futures:
            gate.release()
        await asyncio.wait_for(asyncio.gather(routine, *futures), WAIT_S)
        served = [batch[0] for batch in engine.batches[1:]]
        # 0.05-0.45 s after it: five urgent windows went first, and none made later.
        assert served[:7] == [1.0, 1.01, 1.02, 1.03, 1.04, 9.0, 1.05], served
    finally:
        for _ in range(8):  # whatever a failed test left waiting
            gate.release()
        await pipeline.close()


async def test_a_sessions_first_words_and_closing_decodes_are_urgent_its_re_decodes_not(
    speech_dir: Path,
) -> None:
    clip = load_clip(speech_dir / "librispeech_test-clean/1089-134691-0001.wav")
    audio = np.concatenate([clip, np.zeros(SAMPLE_RATE_HZ, np.float32)])
    engine = ScriptedEngine()
    session = Session("s")
    jobs: list[DecodeJob] = []
    for frame in pcm_frames(audio):
        session.feed_audio(frame)
        job = session.next_job()
        if job is not None:
            result = engine.decode_windows([engine_window(job)])[0]
            session.receive_result(job, result)
            jobs.append(job)
    # Closing decodes started in a pause (speculative) are closing decodes too: urgent. The
    # utterance's last one closed it.
    assert all(job.urgent and job.closing for job in jobs if job.speculative)
    assert jobs[-1].urgent and jobs[-1].closing
    jobs = [job for job in jobs if not job.speculative]
    marks = [(job.urgent, job.closing) for job in jobs]
    # The scripted engine hears a word per half second: the decodes under half a second of
    # audio show none, and the utterance's next decode is still the one its first word
    # waits on.
    shown = next(k for k, job in enumerate(jobs) if job.audio_s >= ScriptedEngine.WORD_S)
    assert all(urgent for urgent, _ in marks[: shown + 1]), marks
    assert not any(urgent for urgent, _ in marks[shown + 1 :]), marks


def engine_window(job: DecodeJob) -> Window:
    """The scripted engine's window of ``job``: its audio stands in for the log-mel."""
    return Window(job.audio, job.request)


async def test_a_failing_window_fails_only_its_own_job(
    scripted: tuple[Pipeline, ScriptedEngine],
) -> None:
    pipeline, engine = scripted
    gate = await hold_worker(pipeline, engine)
    jobs = [
        make_job(1.0, created_at=1.0, session_id="ok1"),
        make_job(1.5, created_at=2.0, session_id="bad"),  # fail_when: audio_s == 1.5
        make_job(2.0, created_at=3.0, session_id="ok2"),
    ]
    futures = await queue_jobs(pipeline, jobs)
    engine.release.set()
    await asyncio.wait_for(gate, WAIT_S)
    outcomes = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), WAIT_S)
    assert isinstance(outcomes[0], DecodeResult)
    assert isinstance(outcomes[1], DecodeError)
    assert isinstance(outcomes[2], DecodeResult)
    # The batch failed as a whole, then each window was decoded alone to find the bad one.
    assert engine.batches[1:] == [[1.0, 1.5, 2.0], [1.0], [1.5], [2.0]]
    # The worker goes on serving.
    after = await asyncio.wait_for(pipeline.decode(make_job(1.0, created_at=5.0)), WAIT_S)
    assert len(after.words) == 2


async def test_a_cancelled_window_leaves_the_queue(
    scripted: tuple[Pipeline, ScriptedEngine],
) -> None:
    pipeline, engine = scripted
    gate = await hold_worker(pipeline, engine)
    [queued] = await queue_jobs(pipeline, [make_job(2.0, created_at=1.0)])
    assert pipeline.queued == 1
    queued.cancel()
    await asyncio.sleep(0)  # done callbacks run on the next loop iteration
    assert pipeline.queued == 0
    engine.release.set()
    await asyncio.wait_for(gate, WAIT_S)
    after = await asyncio.wait_for(pipeline.decode(make_job(3.0, created_at=2.0)), WAIT_S)
    assert len(after.words) == 6
    assert engine.batches == [[0.5], [3.0]]  # the cancelled window was never decoded


# Engine calls whose cost is mostly the call's: two streams' windows in one call (60 ms) come
# back sooner than in turns (a round of 110 ms), so the scheduler batches them.
BATCHING_COSTS = {"call_cost_s": 0.05, "window_cost_s": 0.005}


async def test_a_window_arriving_within_the_batch_wait_joins_the_batch() -> None:
    engine = ScriptedEngine(**BATCHING_COSTS)
    # A long wait and a batch of two: the first window waits for company, the second fills
    # the batch, which then goes at once (the test does not take batch_wait_ms).
    pipeline = Pipeline(PipelineConfig(max_batch_size=2, batch_wait_ms=1000.0))
    await pipeline.start(lambda: engine)
    engine.batches.clear()  # the capacity calibration's calls
    pipeline.add_stream()
    pipeline.add_stream()
    try:
        assert pipeline.capacity.batch_size(2) == 2
        [first] = await queue_jobs(pipeline, [make_job(1.0, created_at=1.0)])
        for _ in range(3):
            await asyncio.sleep(0)  # let the scheduler pick up the first window and wait
        [second] = await queue_jobs(pipeline, [make_job(2.0, created_at=2.0)])
        await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        assert engine.batches == [[1.0, 2.0]]
    finally:
        await pipeline.close()


async def test_streams_a_lane_keeps_up_with_one_by_one_are_not_batched() -> None:
    """Calls that cost by the window, cheap enough for one lane: each window gets a call of
    its own, and none waits for company (a window in a batch waits for the whole batch)."""
    engine = ScriptedEngine(window_cost_s=0.01)
    pipeline = Pipeline(PipelineConfig(max_batch_size=4, batch_wait_ms=1000.0))
    await pipeline.start(lambda: engine)
    for _ in range(3):
        pipeline.add_stream()
    try:
        assert pipeline.capacity.batch_size(3) == 1
        engine.batches.clear()
        jobs = [make_job(1.0 + i, created_at=1.0 + i, session_id=f"s{i}") for i in range(3)]
        # Features first: the held call is timed into the capacity model, and a hold that
        # lasted while a loaded machine computed them (0.5 s under make test) made it batch.
        windows = [await pipeline.features(job) for job in jobs]
        gate = await hold_worker(pipeline, engine)
        futures = [await pipeline.enqueue(job, w) for job, w in zip(jobs, windows, strict=True)]
        engine.release.set()
        await asyncio.wait_for(asyncio.gather(gate, *futures), 0.5)  # far less than the wait
        assert engine.batches == [[0.5], [1.0], [2.0], [3.0]]
    finally:
        await pipeline.close()


async def test_the_only_stream_never_waits_for_company() -> None:
    engine = ScriptedEngine()
    pipeline = Pipeline(PipelineConfig(max_batch_size=4, batch_wait_ms=1000.0))
    await pipeline.start(lambda: engine)
    engine.batches.clear()
    pipeline.add_stream()
    try:
        [only] = await queue_jobs(pipeline, [make_job(1.0, created_at=1.0)])
        await asyncio.wait_for(only, 0.5)  # far less than the batch wait
        assert engine.batches == [[1.0]]
    finally:
        await pipeline.close()


async def test_the_hop_grows_with_the_streams_open() -> None:
    engine = ScriptedEngine(call_cost_s=0.05, window_cost_s=0.1)
    pipeline = Pipeline(PipelineConfig(max_batch_size=8))
    await pipeline.start(lambda: engine)
    try:
        hops = []
        crowded = []
        for _ in range(4):
            pipeline.add_stream()
            hops.append(pipeline.stream_hop_s())
            crowded.append(pipeline.crowded)
        assert hops == sorted(hops) and hops[0] > 0
        assert crowded == [False, True, True, True]  # one lane: a second stream shares it
        # One stream's round is one call on one window, over the planned utilization.
        assert hops[0] == pytest.approx(
            (0.05 + 0.1) / pipeline.config.capacity_utilization, rel=0.5
        )
    finally:
        await pipeline.close()


@pytest.mark.parametrize(("streams", "beam_size"), [(1, 5), (2, 5), (3, 1)])
async def test_a_closing_beam_search_runs_greedy_past_the_capacity_estimate(
    streams: int, beam_size: int
) -> None:
    """One lane, the estimate pinned at two streams: a window asked as a beam search is
    searched while the streams open fit the estimate, and decoded greedy past it, as the lane
    takes it; a greedy window stays greedy. The metrics count both."""
    engine = ScriptedEngine()
    pipeline = Pipeline(PipelineConfig(max_batch_size=1, batch_wait_ms=0.0))
    await pipeline.start(lambda: engine)
    for estimate in pipeline.capacity.estimates:
        estimate.set_bounds(2, 2, "test")
    engine.beam_sizes.clear()
    for _ in range(streams):
        pipeline.add_stream()
    try:
        closing = dataclasses.replace(
            make_job(2.0, created_at=1.0),
            closing=True,
            request=DecodeRequest(2.0, DecodeOptions(beam_size=5)),
        )
        routine = make_job(2.0, created_at=2.0)
        futures = await queue_jobs(pipeline, [closing, routine])
        await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
        assert engine.beam_sizes == [[beam_size], [1]]
        assert pipeline.past_comfort == (beam_size == 1)
        metrics = pipeline.metrics
        assert (metrics.beam_searches.value(), metrics.beam_searches_made_greedy.value()) == (
            (1, 0) if beam_size > 1 else (0, 1)
        )
    finally:
        await pipeline.close()


async def test_close_fails_queued_windows_and_ends_the_worker(
    scripted: tuple[Pipeline, ScriptedEngine],
) -> None:
    pipeline, engine = scripted
    gate = await hold_worker(pipeline, engine)
    [queued] = await queue_jobs(pipeline, [make_job(2.0, created_at=1.0)])
    closing = asyncio.ensure_future(pipeline.close())
    await asyncio.sleep(0)
    engine.release.set()  # the worker finishes its call, then the thread ends
    await asyncio.wait_for(closing, WAIT_S)
    for future in (gate, queued):
        with pytest.raises(DecodeError, match="shutting down"):
            await future
    assert not pipeline.ready


# --------------------------------------------------------------------------- speakers


def embed_job(audio: np.ndarray, k: int) -> EmbedJob:
    starts = tuple(range(0, 3 * 6400, 6400))  # three 1.6 s windows, 0.4 s apart
    return EmbedJob(f"s{k}", k, audio[k * 8000 : k * 8000 + 38_400], 0, starts)


async def test_speaker_jobs_that_wait_go_through_the_encoder_in_one_batch(
    speech_dir: Path,
) -> None:
    """While the encoder works on one stream's windows, three more streams' jobs wait; they
    go through it together, and each gets the vectors it would have got alone."""
    audio = load_clip(speech_dir / "misc_en/jfk.wav")
    encoder = GatedSpeakerEncoder()
    pipeline = Pipeline(PipelineConfig())
    pipeline.speakers = encoder
    try:
        encoder.release.clear()
        jobs = [embed_job(audio, k) for k in range(4)]
        first = asyncio.ensure_future(pipeline.embed(jobs[0]))
        await asyncio.to_thread(encoder.entered.wait, WAIT_S)
        rest = [asyncio.ensure_future(pipeline.embed(job)) for job in jobs[1:]]
        await asyncio.sleep(0)  # every job is in before the gate opens
        encoder.release.set()
        vectors = await asyncio.wait_for(asyncio.gather(first, *rest), WAIT_S)
    finally:
        encoder.release.set()
        await pipeline.close()
    assert encoder.batches == [1, 3]
    for job, got in zip(jobs, vectors, strict=True):
        alone = encoder.encoder.embed_windows(job.audio, list(job.starts))
        np.testing.assert_allclose(got, alone, atol=1e-5)


async def test_close_fails_the_speaker_jobs_in_the_encoder_and_waiting(
    speech_dir: Path,
) -> None:
    audio = load_clip(speech_dir / "misc_en/jfk.wav")
    encoder = GatedSpeakerEncoder()
    pipeline = Pipeline(PipelineConfig())
    pipeline.speakers = encoder
    encoder.release.clear()
    try:
        running = asyncio.ensure_future(pipeline.embed(embed_job(audio, 0)))
        await asyncio.to_thread(encoder.entered.wait, WAIT_S)
        waiting = asyncio.ensure_future(pipeline.embed(embed_job(audio, 1)))
        await asyncio.sleep(0)
        await asyncio.wait_for(pipeline.close(), WAIT_S)
    finally:
        encoder.release.set()
    for future in (running, waiting):
        with pytest.raises(RuntimeError, match="shutting down"):
            await future
    with pytest.raises(RuntimeError, match="shutting down"):
        await pipeline.embed(embed_job(audio, 2))


# --------------------------------------------------------------------------- StreamDriver


def drain(driver: StreamDriver) -> list[ServerMessage]:
    messages: list[ServerMessage] = []
    while not driver.outbox.empty():
        messages.append(driver.outbox.get_nowait())
    return messages


async def test_a_decode_failure_reaches_only_the_affected_client(speech_dir: Path) -> None:
    clip = load_clip(speech_dir / "librispeech_test-clean/1089-134691-0001.wav")
    quiet = clip * (0.5 / float(np.max(np.abs(clip))))
    loud = clip * (0.99 / float(np.max(np.abs(clip))))
    # The engine fails any batch holding a window louder than 0.9: only the loud client's.
    engine = ScriptedEngine(
        fail_when=lambda w: float(np.max(np.abs(w.mel), initial=0.0)) > 0.9, **BATCHING_COSTS
    )
    pipeline = Pipeline(PipelineConfig(max_batch_size=8, batch_wait_ms=5.0))
    await pipeline.start(lambda: engine)
    engine.batches.clear()  # the capacity calibration's calls
    try:
        drivers = {
            name: StreamDriver(Session(name), pipeline, max_pending_messages=10_000)
            for name in ("quiet1", "loud", "quiet2")
        }
        audio = {"quiet1": quiet, "loud": loud, "quiet2": quiet}
        for name, driver in drivers.items():
            for frame in pcm_frames(audio[name]):
                driver.feed_audio(frame)
        for driver in drivers.values():
            driver.end()
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(d.outcome for d in drivers.values())), WAIT_S
        )
        assert outcomes == [DriverOutcome.DONE] * 3
        messages = {name: drain(d) for name, d in drivers.items()}
    finally:
        await pipeline.close()
    for name in ("quiet1", "quiet2"):
        assert not [m for m in messages[name] if isinstance(m, ErrorMessage)]
        text = " ".join(m.text for m in messages[name] if isinstance(m, FinalMessage))
        assert text.startswith("w0 w1 w2"), text
    errors = [m for m in messages["loud"] if isinstance(m, ErrorMessage)]
    assert errors and {e.code for e in errors} == {"decode_failed"}
    assert not any(e.fatal for e in errors)
    assert max(len(b) for b in engine.batches) > 1  # the sessions did share batches


async def test_streams_whose_turns_interleave_are_gathered_into_one_batch(
    speech_dir: Path,
) -> None:
    """Four streams at 1x, their frames arriving out of phase, with a decode cost that makes
    the scheduler's hop longer than a session's own cadence: each batch being gathered
    offers a seat to every stream, so the windows ride together instead of in turns."""
    clip = load_clip(speech_dir / "ljspeech/long/LJ001-0001_to_0032.concat.wav")[
        : 8 * SAMPLE_RATE_HZ
    ]
    engine = ScriptedEngine(call_cost_s=0.3, window_cost_s=0.1)
    pipeline = Pipeline(PipelineConfig(max_batch_size=8))
    await pipeline.start(lambda: engine)
    engine.batches.clear()
    frame_s = 0.1
    try:
        drivers = [
            StreamDriver(Session(f"s{i}"), pipeline, max_pending_messages=10_000) for i in range(4)
        ]
        assert pipeline.stream_hop_s() > 0.3  # longer than min_new_audio_ms: 300 ms

        async def feed(driver: StreamDriver, phase_s: float) -> None:
            await asyncio.sleep(phase_s)
            for frame in pcm_frames(clip, frame_s):
                driver.feed_audio(frame)
                await asyncio.sleep(frame_s)
            driver.end()

        await asyncio.gather(*(feed(d, frame_s * i / 4) for i, d in enumerate(drivers)))
        outcomes = await asyncio.wait_for(asyncio.gather(*(d.outcome for d in drivers)), WAIT_S)
    finally:
        await pipeline.close()
    assert outcomes == [DriverOutcome.DONE] * 4
    sizes = [len(b) for b in engine.batches]
    # Out of phase by 25 ms a frame apart, the streams would take turns in pairs at best.
    assert sum(sizes) / len(sizes) >= 3.0, sizes


async def test_a_window_that_waited_for_a_lane_is_decoded_up_to_the_newest_audio(
    speech_dir: Path,
) -> None:
    """Late binding: a stream's window queued behind a busy lane is taken up to the audio that
    arrived while it waited, not up to when it was queued."""
    clip = load_clip(speech_dir / "ljspeech/long/LJ001-0001_to_0032.concat.wav")
    frames = pcm_frames(clip[: 3 * SAMPLE_RATE_HZ])
    engine = ScriptedEngine()
    pipeline = Pipeline(PipelineConfig(batch_wait_ms=0.0))
    await pipeline.start(lambda: engine)
    engine.batches.clear()  # the capacity calibration's calls
    try:
        gate = await hold_worker(pipeline, engine)
        driver = StreamDriver(Session("late"), pipeline, max_pending_messages=10_000)
        sent = 0
        while not pipeline.queued:
            assert sent < len(frames), "no window was queued"
            driver.feed_audio(frames[sent])
            sent += 1
            await asyncio.sleep(0.01)  # the features thread
        [(_, _, request)] = pipeline._heap
        queued_s = request.job.audio_s
        window_start_s = request.job.start_s
        for frame in frames[sent:]:
            driver.feed_audio(frame)
        engine.release.set()
        await asyncio.wait_for(gate, WAIT_S)
        driver.end()
        assert await asyncio.wait_for(driver.outcome, WAIT_S) == DriverOutcome.DONE
    finally:
        await pipeline.close()
    decoded_s = engine.batches[1][0]
    # Up to the end of the audio: every frame was in before the lane took the window (the
    # features thread may queue it a frame after the one that made it due: not counted on).
    assert queued_s < 1.0 and decoded_s == pytest.approx(len(frames) * 0.1 - window_start_s)
    words = [w for m in drain(driver) if isinstance(m, FinalMessage) for w in m.text.split()]
    assert words == [f"w{k}" for k in range(len(words))] and len(words) >= 5, words


async def test_a_client_that_does_not_read_overflows_its_outbox() -> None:
    engine = ScriptedEngine()
    pipeline = Pipeline()
    await pipeline.start(lambda: engine)
    try:
        driver = StreamDriver(Session("slow"), pipeline, max_pending_messages=2)
        for _ in range(3):
            driver.send(ErrorMessage("invalid_message", "not JSON", False, 0.0))
        assert driver.outcome.done()
        assert driver.outcome.result() is DriverOutcome.OVERFLOW
        assert driver.outbox.qsize() == 2  # bounded: nothing more was queued
    finally:
        await pipeline.close()


# --------------------------------------------------------------------------- capacity


class WindowRecordingEngine(ScriptedEngine):
    """The scripted engine, recording the "mel" (the audio itself) of every window of every
    call, and costing ``first_call_s`` more on the first call of each batch shape."""

    def __init__(self, first_call_s: float = 0.0) -> None:
        super().__init__(call_cost_s=0.05, window_cost_s=0.02)
        self.first_call_s = first_call_s
        self.audio: list[list[np.ndarray]] = []

    def decode_windows(self, windows: list[Window]) -> list[DecodeResult]:
        shape = [w.request.audio_s for w in windows]
        if shape not in self.batches and self.first_call_s > 0:
            time.sleep(self.first_call_s)  # a new size's first allocations
        self.audio.append([w.mel for w in windows])
        return super().decode_windows(windows)


async def test_start_seeds_the_capacity_model_with_timed_calls_on_speech() -> None:
    engine = WindowRecordingEngine()
    pipeline = Pipeline(PipelineConfig(max_batch_size=8))
    await pipeline.start(lambda: engine)
    try:
        typical = pipeline.capacity.typical_window_s
        # Two windows alone, the first twice as long alone, and the two as one batch, each
        # twice, after the warm-up.
        assert engine.warmups == 1
        shapes = [[typical], [typical], [2 * typical], [typical] * 2]
        assert engine.batches == [shape for shape in shapes for _ in range(2)]
        # Each window is a slice of the shipped speech; the batch holds the very windows
        # timed alone, different ones.
        pair = speech_windows(2, typical)
        [long] = speech_windows(1, 2 * typical)
        expected = [[pair[0]], [pair[1]], [long], pair]
        for audio, windows in zip(engine.audio[::2], expected, strict=True):
            assert len(audio) == len(windows) and all(map(np.array_equal, audio, windows))
        assert not np.array_equal(pair[0], pair[1])
        fit = pipeline.capacity.fit
        assert fit is not None
        assert fit.batch_s(1, typical) == pytest.approx(0.07, abs=0.02)
        assert fit.batch_s(2, 2 * typical) == pytest.approx(0.09, abs=0.02)
        # The pair cost 0.09 s against 0.14 s alone: batches pay here.
        assert pipeline.capacity.batch_ratio == pytest.approx(0.09 / 0.14, rel=0.25)
        assert pipeline.capacity.planned_batch_size == 8
        assert pipeline.metrics.batch_size.count == 0  # the seeds are not client traffic
    finally:
        await pipeline.close()


async def test_streams_are_batched_only_where_the_calibrations_pair_paid() -> None:
    """Four streams' windows queued at once on one lane. A GPU-like engine (a call costs
    0.05 s, a window 0.005 s more) takes them together; a CPU-like one (0.05 s a window,
    whatever it shares its call with) has its calibration find the pair no cheaper than
    its two windows alone, and takes them one call each."""
    sizes = {}
    for name, engine in (
        ("gpu", ScriptedEngine(call_cost_s=0.05, window_cost_s=0.005)),
        ("cpu", ScriptedEngine(window_cost_s=0.05)),
    ):
        pipeline = Pipeline(PipelineConfig(max_batch_size=8))
        await pipeline.start(lambda: engine)  # noqa: B023 (awaited within the iteration)
        try:
            ratio = pipeline.capacity.batch_ratio
            assert ratio is not None
            engine.batches.clear()
            for _ in range(4):
                pipeline.add_stream()
            jobs = [
                pipeline.decode(make_job(2.0, created_at=1.0, session_id=f"s{k}")) for k in range(4)
            ]
            await asyncio.wait_for(asyncio.gather(*jobs), WAIT_S)
            sizes[name] = (ratio, pipeline.capacity.planned_batch_size)
            sizes[name + " calls"] = [len(batch) for batch in engine.batches]
        finally:
            await pipeline.close()
    gpu_ratio, gpu_planned = sizes["gpu"]  # 0.06 s against 0.11 s
    assert gpu_ratio < 0.7 and gpu_planned == 8 and max(sizes["gpu calls"]) > 1, sizes
    cpu_ratio, cpu_planned = sizes["cpu"]  # 0.1 s against 0.1 s
    assert 0.9 < cpu_ratio < 1.2 and cpu_planned == 1 and sizes["cpu calls"] == [1] * 4, sizes


async def test_the_calibration_keeps_the_cheaper_run_of_each_shape() -> None:
    engine = WindowRecordingEngine(first_call_s=0.3)
    pipeline = Pipeline(PipelineConfig(max_batch_size=8))
    await pipeline.start(lambda: engine)
    try:
        fit = pipeline.capacity.fit
        assert fit is not None
        typical = pipeline.capacity.typical_window_s
        # What the second runs cost (0.05 s + 0.02 s a window), not the first's 0.3 s more.
        assert fit.batch_s(1, typical) == pytest.approx(0.07, abs=0.02)
        assert fit.batch_s(2, 2 * typical) == pytest.approx(0.09, abs=0.02)
    finally:
        await pipeline.close()


async def test_an_engine_this_process_calibrated_is_not_timed_again() -> None:
    engine = WindowRecordingEngine()
    fits = []
    for _ in range(2):
        pipeline = Pipeline(PipelineConfig(max_batch_size=8))
        await pipeline.start(lambda: engine)
        try:
            fits.append((pipeline.capacity.fit, pipeline.capacity.batch_ratio))
        finally:
            await pipeline.close()
    # The second start warmed the engine up and decoded nothing else; its model is the first's.
    assert engine.warmups == 2 and len(engine.batches) == 8
    assert fits[0] == fits[1] and fits[0][0] is not None
    other = WindowRecordingEngine()  # another engine object is timed
    pipeline = Pipeline(PipelineConfig(max_batch_size=8))
    await pipeline.start(lambda: other)
    await pipeline.close()
    assert len(other.batches) == 8


async def test_admission_has_its_own_budget_and_the_cadence_keeps_the_utilization() -> None:
    """Two pipelines alike but for ``admission_utilization``: the stricter admits fewer
    streams, and both ask the streams they carry to gather audio at the cadence that plans
    the lanes ``capacity_utilization`` busy."""
    pipelines = []
    for admission_utilization in (0.8, 0.2):
        engine = ScriptedEngine(call_cost_s=0.05, window_cost_s=0.1)
        config = PipelineConfig(
            capacity_utilization=0.8,
            admission_utilization=admission_utilization,
            comfort_utilization=0.2,
        )
        pipeline = Pipeline(config)
        await pipeline.start(lambda: engine)  # noqa: B023 (awaited within the iteration)
        pipelines.append(pipeline)
    try:
        loose, strict = (p.capacity for p in pipelines)
        # A 4 s window costs 0.15 s: one fits a 0.2 s round, seven a 0.8 s one.
        assert strict.admission_budget_s == pytest.approx(0.2)
        assert strict.streams(limit=32) == 1 < loose.streams(limit=32)
        for pipeline in pipelines:
            capacity = pipeline.capacity
            fit = capacity.fit
            assert fit is not None
            for n in range(1, 5):
                pipeline.add_stream()
                round_s = fit.round_s(n, capacity.typical_window_s, capacity.batch_size(n))
                assert pipeline.stream_hop_s() == pytest.approx(round_s / 0.8), n
    finally:
        for pipeline in pipelines:
            await pipeline.close()


async def test_without_warmup_the_estimate_waits_for_the_clients() -> None:
    engine = ScriptedEngine()
    pipeline = Pipeline()
    await pipeline.start(lambda: engine, warmup=False)
    try:
        assert engine.batches == []
        assert pipeline.capacity.fit is None
        assert pipeline.capacity.streams(limit=7) == 7
    finally:
        await pipeline.close()


async def test_decoded_batches_feed_the_capacity_model_and_failed_ones_do_not(
    scripted: tuple[Pipeline, ScriptedEngine],
) -> None:
    pipeline, _ = scripted
    capacity = pipeline.capacity
    assert capacity.typical_window_s == capacity.default_window_s  # seeds do not count
    for audio_s in (1.0, 3.0):
        await asyncio.wait_for(pipeline.decode(make_job(audio_s, created_at=audio_s)), WAIT_S)
    assert capacity.typical_window_s == 2.0
    with pytest.raises(DecodeError):  # fail_when: audio_s == 1.5
        await asyncio.wait_for(pipeline.decode(make_job(1.5, created_at=5.0)), WAIT_S)
    assert capacity.typical_window_s == 2.0  # its window was not measured


# --------------------------------------------------------------------------- lanes


@pytest_asyncio.fixture
async def two_lanes() -> AsyncIterator[tuple[Pipeline, Any, Any]]:
    """A pipeline with this process's lane and one child-process lane, both running a
    ``GatedEngine``: yields the pipeline, its gate (release it once per call to let
    through) and the semaphore each call releases as it enters the engine."""
    context = multiprocessing.get_context("spawn")
    gate, entered = context.Semaphore(0), context.Semaphore(0)
    pipeline = Pipeline(PipelineConfig(decode_lanes=2, batch_wait_ms=0.0))
    await asyncio.wait_for(
        pipeline.start(functools.partial(GatedEngine, gate, entered), warmup=False), LANE_WAIT_S
    )
    try:
        yield pipeline, gate, entered
    finally:
        for _ in range(8):  # whatever a failed test left waiting
            gate.release()
        await pipeline.close()


async def entered_calls(entered: Any, n: int) -> None:
    for _ in range(n):
        assert await asyncio.to_thread(entered.acquire, True, LANE_WAIT_S), "no call entered"


async def test_two_lanes_decode_two_streams_at_once(
    two_lanes: tuple[Pipeline, Any, Any],
) -> None:
    pipeline, gate, entered = two_lanes
    assert pipeline.lanes == 2 and pipeline.metrics.decode_lanes.value == 2
    pipeline.add_stream()
    pipeline.add_stream()
    jobs = [make_job(1.0, created_at=1.0, session_id="a"), make_job(2.0, 2.0, "b")]
    futures = await queue_jobs(pipeline, jobs)
    # Both calls are inside an engine at the same time: one on each lane. A single lane
    # would hold both windows in one call, or the second one back until the first returns.
    await entered_calls(entered, 2)
    assert pipeline.queued == 0
    gate.release()
    gate.release()
    results = await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
    assert [r.text for r in results] == [" w0 w1", " w0 w1 w2 w3"]
    assert pipeline.metrics.batch_size.count == 2  # two calls of one window each
    assert pipeline.capacity.lanes == 2


async def test_a_lane_that_dies_loses_no_window_and_is_replaced(
    two_lanes: tuple[Pipeline, Any, Any],
) -> None:
    pipeline, gate, entered = two_lanes
    pipeline.add_stream()
    pipeline.add_stream()
    jobs = [make_job(1.0, created_at=1.0, session_id="a"), make_job(2.0, 2.0, "b")]
    futures = await queue_jobs(pipeline, jobs)
    await entered_calls(entered, 2)
    (child,) = pipeline.process_lanes
    child.kill()
    # The dead lane's window goes back to the queue and waits for the live lane.
    async with asyncio.timeout(LANE_WAIT_S):
        while pipeline.lanes != 1 or pipeline.queued != 1:
            await asyncio.sleep(0.01)
    assert pipeline.metrics.decode_lanes.value == 1
    assert pipeline.capacity.lanes == 1
    gate.release()  # "a" finishes; then "b" runs on a live lane
    gate.release()
    results = await asyncio.wait_for(asyncio.gather(*futures), LANE_WAIT_S)
    assert [r.text for r in results] == [" w0 w1", " w0 w1 w2 w3"]
    await entered_calls(entered, 1)  # "b" entering the lane that decoded it
    async with asyncio.timeout(LANE_WAIT_S):
        while pipeline.lanes != 2:
            await asyncio.sleep(0.05)
    (replacement,) = pipeline.process_lanes
    assert replacement is not child and replacement.alive
    # The new child decodes: hold this process's lane, and the next stream's window goes there.
    first = await queue_jobs(pipeline, [make_job(0.5, created_at=3.0, session_id="a")])
    await entered_calls(entered, 1)
    second = await queue_jobs(pipeline, [make_job(1.0, created_at=4.0, session_id="b")])
    await entered_calls(entered, 1)
    gate.release()
    gate.release()
    done = await asyncio.wait_for(asyncio.gather(*first, *second), WAIT_S)
    assert [r.text for r in done] == [" w0", " w0 w1"]


def engine_only_here() -> ScriptedEngine:
    """Loads in this process, fails in a child lane (as a child out of memory would)."""
    if multiprocessing.parent_process() is not None:
        raise MemoryError("no memory for a second model")
    return ScriptedEngine()


async def test_a_child_lane_that_cannot_start_leaves_the_others_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pipeline = Pipeline(PipelineConfig(decode_lanes=2, batch_wait_ms=0.0))
    try:
        await asyncio.wait_for(pipeline.start(engine_only_here), LANE_WAIT_S)
        assert pipeline.ready
        assert pipeline.lanes == 1 and pipeline.capacity.lanes == 1
        assert "did not start: no memory for a second model" in caplog.text
        result = await asyncio.wait_for(pipeline.decode(make_job(1.0, created_at=1.0)), WAIT_S)
        assert result.text == " w0 w1"
    finally:
        await pipeline.close()


async def test_a_lane_that_dies_while_idle_is_replaced(
    two_lanes: tuple[Pipeline, Any, Any],
) -> None:
    pipeline, _, _ = two_lanes
    (child,) = pipeline.process_lanes
    child.kill()  # no call is running: only the process's exit can tell
    async with asyncio.timeout(LANE_WAIT_S):
        while pipeline.process_lanes[0] is child or pipeline.lanes != 2:
            await asyncio.sleep(0.05)
    assert pipeline.process_lanes[0].alive


# --------------------------------------------------------------------------- file calls


def file_call(audio_s: float) -> functools.partial[tuple[DecodeResult, float]]:
    """An uploaded file's window, as file_transcription.py sends it: one background call."""
    audio = np.zeros(round(audio_s * SAMPLE_RATE_HZ), dtype=np.float32)
    request = DecodeRequest(audio_s, DecodeOptions())
    return functools.partial(_transcribe_window, audio=audio, request=request)


def _transcribe_window(
    engine: Any,
    audio: np.ndarray,
    request: DecodeRequest,  # type: ignore[type-arg]
) -> tuple[DecodeResult, float]:
    result: tuple[DecodeResult, float] = engine.transcribe_window(audio, request, (0.0,))
    return result


async def test_a_streams_window_goes_before_a_file_window_that_waited_longer(
    scripted: tuple[Pipeline, ScriptedEngine],
) -> None:
    pipeline, engine = scripted
    first = await hold_worker(pipeline, engine)
    upload = asyncio.ensure_future(pipeline.background(file_call(30.0)))
    await asyncio.sleep(0.05)  # the file's window queued first
    (live,) = await queue_jobs(pipeline, [make_job(2.0, created_at=1.0)])
    engine.release.set()
    await asyncio.wait_for(asyncio.gather(first, live, upload), WAIT_S)
    assert engine.batches == [[0.5], [2.0], [30.0]]
    result, temperature = upload.result()
    assert temperature == 0.0 and result.text.split()[:2] == ["w0", "w1"]


async def test_a_cancelled_file_call_is_never_decoded(
    scripted: tuple[Pipeline, ScriptedEngine],
) -> None:
    pipeline, engine = scripted
    first = await hold_worker(pipeline, engine)
    upload = asyncio.ensure_future(pipeline.background(file_call(30.0)))
    await asyncio.sleep(0.05)
    assert pipeline.background_queued == 1
    upload.cancel()
    engine.release.set()
    await asyncio.wait_for(first, WAIT_S)
    (after,) = await queue_jobs(pipeline, [make_job(1.0, created_at=2.0)])
    await asyncio.wait_for(after, WAIT_S)
    assert engine.batches == [[0.5], [1.0]]
    assert pipeline.background_queued == 0


async def test_a_file_call_still_queued_at_close_fails() -> None:
    engine = ScriptedEngine()
    pipeline = Pipeline(PipelineConfig(batch_wait_ms=0.0))
    await pipeline.start(lambda: engine)
    first = await hold_worker(pipeline, engine)
    upload = asyncio.ensure_future(pipeline.background(file_call(30.0)))
    await asyncio.sleep(0.05)
    engine.release.set()
    await pipeline.close()
    with pytest.raises(DecodeError, match="shutting down"):
        await upload
    first.cancel()


async def test_the_calibration_on_cpu_time_leaves_out_the_time_a_lane_waited_off_its_core() -> None:
    """The scripted engine's cost is a sleep: time off the CPU, as a lane spends waiting for a
    core another process holds. Timed on the wall (the default, and a GPU's), each window
    costs more than the round budget: one stream, floor and ceiling (such a calibration used
    to stop the server: a ceiling of 0). Timed on CPU time (``calibrate_on_cpu_time``, the
    CPU backend's), the wait is not what a stream costs."""
    bounds: dict[bool, tuple[int | None, int | None]] = {}
    for cpu_time in (False, True):
        engine = ScriptedEngine(window_cost_s=0.85)  # over a 0.7 s admission round budget
        config = PipelineConfig(
            max_batch_size=1, calibrate_on_cpu_time=cpu_time, admission_utilization=0.7
        )
        pipeline = Pipeline(config)
        await pipeline.start(lambda: engine)  # noqa: B023 (awaited within the iteration)
        try:
            # The calibration's calls without batches: a window, and one twice as long, twice each.
            assert len(engine.batches) == 4
            admission = pipeline.capacity.admission
            bounds[cpu_time] = (admission.floor, admission.ceiling)
        finally:
            await pipeline.close()
    assert bounds[False] == (1, 1)
    ceiling = bounds[True][1]
    assert ceiling is not None and ceiling >= 10, bounds  # a scripted window costs ~no CPU


async def test_a_batch_nobody_awaits_is_interrupted_and_its_lane_takes_the_next_window(
    two_lanes: tuple[Pipeline, Any, Any],
) -> None:
    """Four streams on two lanes: two batches of two windows, held in the engine. A batch
    with one window still awaited runs on; once neither is, its lane stops the call (the
    engine checks between steps) and takes the next window without a gate pass."""
    pipeline, gate, entered = two_lanes
    for _ in range(4):
        pipeline.add_stream()
    jobs = [make_job(1.0 + k / 2, created_at=1.0 + k, session_id=f"s{k}") for k in range(4)]
    windows = [await pipeline.features(job) for job in jobs]
    # Queued with no await that yields between them: the scheduler finds all four.
    futures = [await pipeline.enqueue(job, w) for job, w in zip(jobs, windows, strict=True)]
    await entered_calls(entered, 2)
    assert pipeline.queued == 0 and pipeline.metrics.batch_size.count == 0
    first, second = futures[:2], futures[2:]
    first[0].cancel()
    await asyncio.sleep(0.2)
    assert pipeline.metrics.decodes_interrupted.value() == 0
    first[1].cancel()
    (late,) = await queue_jobs(pipeline, [make_job(3.0, created_at=5.0, session_id="s4")])
    await entered_calls(entered, 1)  # on the interrupted batch's lane, the other still held
    assert pipeline.metrics.decodes_interrupted.value() == 1
    gate.release()
    gate.release()
    results = await asyncio.wait_for(asyncio.gather(*second, late), WAIT_S)
    assert [r.text.split()[-1] for r in results] == ["w3", "w4", "w5"]


def check_one_final_of_every_word(driver: StreamDriver) -> None:
    """The utterance came out as one final with every word once and in order, and the whole
    utterance's (the scripted engine hears a word per half second of its window)."""
    finals = [m for m in drain(driver) if isinstance(m, FinalMessage)]
    words = " ".join(m.text for m in finals).split()
    assert len(finals) == 1 and words == [f"w{k}" for k in range(len(words))], finals
    assert len(words) >= 5


async def test_a_file_window_whose_client_left_is_stopped_on_its_lane(
    two_lanes: tuple[Pipeline, Any, Any],
) -> None:
    """No stream open: an uploaded file's windows take both lanes, held in the engine. Its
    client leaves (the awaits are cancelled): both lanes stop their calls without a gate
    pass, and a stream's window that comes next is decoded at once."""
    pipeline, gate, entered = two_lanes
    uploads = [asyncio.ensure_future(pipeline.background(file_call(30.0))) for _ in range(2)]
    await entered_calls(entered, 2)
    for upload in uploads:
        upload.cancel()
    await asyncio.wait(uploads)
    # Both calls leave their lanes at their next step (the gate's next poll), not a gate
    # pass later: a pass given sooner could still go to a call between two polls.
    async with asyncio.timeout(WAIT_S):
        while pipeline.background_queued:
            await asyncio.sleep(0.01)
    assert pipeline.metrics.decodes_interrupted.value() == 2
    pipeline.add_stream()
    (window,) = await queue_jobs(pipeline, [make_job(1.0, created_at=1.0)])
    await entered_calls(entered, 1)
    gate.release()
    assert (await asyncio.wait_for(window, WAIT_S)).text == " w0 w1"


async def test_a_closing_decode_takes_the_spare_lane_instead_of_waiting_for_the_one_in_flight(
    two_lanes: tuple[Pipeline, Any, Any], speech_dir: Path
) -> None:
    """One stream on two lanes, per-utterance finals: a re-decode holds the first lane when the
    silence after the speech covers the pad. The closing decode goes to the second lane at
    once, and the stream's finals come from it: two engine calls in all, the first one
    dropped and stopped on its lane (it needs no gate pass; a third call would wait at the
    gate forever)."""
    pipeline, gate, entered = two_lanes
    clip = load_clip(speech_dir / "misc_en/arctic_a0024.wav")
    speech, pause = pcm_frames(clip, 0.03), pcm_frames(np.zeros(SAMPLE_RATE_HZ, np.float32), 0.03)
    driver = StreamDriver(Session("one"), pipeline, max_pending_messages=10_000)
    try:
        fed = 0
        while not await asyncio.to_thread(entered.acquire, True, 0.01):
            assert fed < len(speech), "no decode of the speech started"
            driver.feed_audio(speech[fed])
            fed += 1
        for frame in speech[fed:] + pause[:10]:
            driver.feed_audio(frame)
            await asyncio.sleep(0.001)  # the features thread
        await entered_calls(entered, 1)  # the closing decode, beside the held re-decode
        assert pipeline.metrics.decodes_superseded.value() == 1
        assert pipeline.metrics.decodes_interrupted.value() == 1  # stopped on its lane
        gate.release()  # the closing decode's pass: the re-decode needs none
        for frame in pause[10:]:
            driver.feed_audio(frame)
        driver.end()
        assert await asyncio.wait_for(driver.outcome, LANE_WAIT_S) == DriverOutcome.DONE
    finally:
        await driver.close()
    check_one_final_of_every_word(driver)


async def test_a_search_still_running_when_its_utterance_ends_is_stopped_on_its_lane(
    two_lanes: tuple[Pipeline, Any, Any], speech_dir: Path
) -> None:
    """One stream on two lanes, per-utterance finals, searching from 1 s of speech: the
    stream's re-decode holds one lane and its background search the other as the speaker
    stops. At the endpoint the search is stale (the closing decode hears the whole window):
    its lane stops it without a gate pass, the closing decode starts there at once and
    replaces the re-decode, which its lane stops too. The closing decode's pass is the only
    one the utterance takes."""
    pipeline, gate, entered = two_lanes
    clip = load_clip(speech_dir / "misc_en/arctic_a0024.wav")
    speech, pause = pcm_frames(clip, 0.03), pcm_frames(np.zeros(SAMPLE_RATE_HZ, np.float32), 0.03)
    streaming = StreamingConfig(finals="utterance", utterance_search_s=1.0)
    driver = StreamDriver(
        Session("one", streaming=streaming), pipeline, max_pending_messages=10_000
    )
    try:
        fed = held = 0
        while held < 2:  # the stream's first decode, then its first search
            assert fed < len(speech), f"{held} call(s) of the speech started"
            driver.feed_audio(speech[fed])
            fed += 1
            held += await asyncio.to_thread(entered.acquire, True, 0.01)
        assert pipeline.metrics.beam_searches.value() == 1
        for frame in speech[fed:] + pause:  # to the endpoint, both calls held
            driver.feed_audio(frame)
            await asyncio.sleep(0.001)  # the features thread
        await entered_calls(entered, 1)  # the closing decode, on the search's lane
        assert pipeline.metrics.decodes_superseded.value() == 1
        assert pipeline.metrics.decodes_interrupted.value() == 2  # the search, the re-decode
        gate.release()
        driver.end()
        assert await asyncio.wait_for(driver.outcome, LANE_WAIT_S) == DriverOutcome.DONE
    finally:
        await driver.close()
    check_one_final_of_every_word(driver)


async def test_one_stream_beam_searches_its_open_utterance_on_the_spare_lane(
    speech_dir: Path,
) -> None:
    """One stream on two lanes, per-utterance finals: while the speaker goes on, background
    beam searches of the open window (``Session.next_search_job``) run on the lane the
    stream's own decodes leave idle, and the utterance still ends in one final with every
    word once and in order."""
    pipeline = Pipeline(PipelineConfig(decode_lanes=2, batch_wait_ms=0.0))
    await asyncio.wait_for(pipeline.start(scripted_engine, warmup=False), LANE_WAIT_S)
    clip = load_clip(speech_dir / "librispeech_test-other/3331-159605-0000.wav")
    speech = pcm_frames(np.concatenate([clip, np.zeros(SAMPLE_RATE_HZ, np.float32)]), 0.1)
    driver = StreamDriver(Session("one"), pipeline, max_pending_messages=10_000)
    try:
        for frame in speech:
            driver.feed_audio(frame)
            await asyncio.sleep(0.02)  # the features thread, and the lanes' calls
        driver.end()
        assert await asyncio.wait_for(driver.outcome, LANE_WAIT_S) == DriverOutcome.DONE
    finally:
        await driver.close()
        await pipeline.close()
    # At least two searches of the open window, and the closing decode.
    assert pipeline.metrics.beam_searches.value() >= 3
    finals = [m for m in drain(driver) if isinstance(m, FinalMessage)]
    assert len(finals) == 1, finals
    starts = [w.start for w in finals[0].words]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert finals[0].words[-1].end > clip.shape[0] / SAMPLE_RATE_HZ - 1.5
