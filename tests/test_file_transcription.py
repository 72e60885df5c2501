"""A recording transcribed window by window on the decode lanes
(server/decode/file_transcription.py), with the scripted engine: one background call per 30 s
window, the segments of each yielded as it is decoded, the transcript whole at the end; a
recording cut into parts decoded side by side, its text still in order."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from server.config import PipelineConfig
from server.core.engine_api import DecodeOptions
from server.core.long_form import LongForm, join_transcripts, split_recording
from server.decode.file_transcription import transcribe_on_lanes, transcribe_parts
from server.decode.pipeline import Pipeline
from server.protocol.errors import DecodeError
from server.protocol.formats import SAMPLE_RATE_HZ
from tests.helpers import ScriptedEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_each_window_is_one_lane_call_and_yields_its_segments() -> None:
    engine = ScriptedEngine()
    pipeline = Pipeline(PipelineConfig(batch_wait_ms=0.0))
    await pipeline.start(lambda: engine)
    engine.batches.clear()
    try:
        audio = np.zeros(70 * SAMPLE_RATE_HZ, dtype=np.float32)
        recording = LongForm(audio, DecodeOptions(word_timestamps=False), prompt=(1005,))
        pieces = [segments async for segments in transcribe_on_lanes(pipeline, recording)]
    finally:
        await pipeline.close()
    assert engine.batches == [[30.0], [30.0], [10.0]]
    assert [[s.span.text for s in segments] for segments in pieces] == [
        ["".join(f" w{k}" for k in range(60))],
        ["".join(f" w{k}" for k in range(60))],
        ["".join(f" w{k}" for k in range(20))],
    ]
    transcript = recording.transcript()
    assert [(s.start_s, s.end_s) for s in transcript.spans] == [(0, 30), (30, 60), (60, 70)]
    assert len(transcript.text.split()) == 140


async def test_parts_decoded_side_by_side_come_back_in_order() -> None:
    engine = ScriptedEngine()
    pipeline = Pipeline(PipelineConfig(batch_wait_ms=0.0))
    await pipeline.start(lambda: engine)
    engine.batches.clear()
    engine.entered.clear()
    engine.release.clear()  # the first part's window holds the lane until both are queued
    try:
        audio = np.zeros(50 * SAMPLE_RATE_HZ, dtype=np.float32)
        whole = LongForm(audio, DecodeOptions(word_timestamps=False))
        parts = split_recording(whole, 2)
        pieces: list[list[str]] = []

        async def collect() -> None:
            async for segments in transcribe_parts(pipeline, parts):
                pieces.append([s.span.text for s in segments])

        collecting = asyncio.ensure_future(collect())
        await asyncio.to_thread(engine.entered.wait, 30)
        assert pipeline.background_queued == 2  # both parts asked for a lane at once
        engine.release.set()
        await asyncio.wait_for(collecting, 30)
    finally:
        engine.release.set()
        await pipeline.close()
    # One lane here: the parts take turns on it, and each yields its own window.
    assert len(engine.batches) == 2 and all(
        b == [pytest.approx(25.0, abs=2)] for b in engine.batches
    )
    assert [len(p[0].split()) for p in pieces] == [
        int(parts[0].duration_s / 0.5),
        int(parts[1].duration_s / 0.5),
    ]
    spans = join_transcripts([p.transcript() for p in parts]).spans
    assert spans[1].start_s == pytest.approx(parts[1].start_s)


async def test_a_failing_part_fails_the_recording() -> None:
    engine = ScriptedEngine(fail_when=lambda w: w.request.audio_s < 25.0)
    pipeline = Pipeline(PipelineConfig(batch_wait_ms=0.0))
    await pipeline.start(lambda: engine)
    try:
        audio = np.zeros(50 * SAMPLE_RATE_HZ, dtype=np.float32)
        parts = split_recording(LongForm(audio, DecodeOptions(word_timestamps=False)), 2)
        with pytest.raises(DecodeError):
            async for _ in transcribe_parts(pipeline, parts):
                pass
    finally:
        await pipeline.close()
