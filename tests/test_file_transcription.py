"""A recording transcribed window by window on the decode lanes
(server/decode/file_transcription.py), with the scripted engine: one background call per 30 s
window, the segments of each yielded as it is decoded, the transcript whole at the end."""

from __future__ import annotations

import numpy as np
import pytest

from server.config import PipelineConfig
from server.core.engine_api import DecodeOptions
from server.core.long_form import LongForm
from server.decode.file_transcription import transcribe_on_lanes
from server.decode.pipeline import Pipeline
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
