"""Pipecat's own speech-to-text services against a real server on loopback, each unchanged but
for its base URL: ``DeepgramSTTService`` streams over ``/v1/listen`` (WebSocket),
``DeepgramFluxSTTService`` over ``/v2/listen`` (turns), and ``OpenAISTTService`` posts each
utterance its VAD cut out to ``/v1/audio/transcriptions``.

They are driven as a Pipecat bot drives them: a pipeline of Pipecat's Silero VAD processor,
the service and a sink (Pipecat's own ``QueuedFrameProcessor`` from ``pipecat.tests.utils``,
which its ``run_test`` uses), fed input audio frames at a transport's pace. Real model, real
speech (the ``server_url`` fixture).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from deepgram.listen.v1.types import ListenV1Results
from openai.types.audio import Transcription
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.deepgram.flux.stt import DeepgramFluxSTTService
from pipecat.services.deepgram.stt import DeepgramSTTService
from pipecat.services.openai.stt import OpenAISTTService
from pipecat.services.stt_service import STTService
from pipecat.tests.utils import QueuedFrameProcessor
from pipecat.workers.runner import WorkerRunner

from bench.corpus import ManifestRow, load_clip, wer
from server.protocol.formats import SAMPLE_RATE_HZ
from tests.helpers import pcm_frames

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop

WAIT_S = 120.0  # a bound for waits on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35  # as tests/test_app.py: one short clip, a word or two wrong is allowed
CLIP = "ljspeech/LJ001-0004.wav"
FRAME_S = 0.02  # what Pipecat's transports deliver
TRAILING_SILENCE_S = 1.5  # for both VADs (Silero's stop_secs 0.2, the server's 0.5-1 s) to end


def http_base(ws_base: str) -> str:
    return "http" + ws_base.removeprefix("ws")


def reference(manifest: list[ManifestRow], file: str) -> str:
    return next(row.transcript for row in manifest if row.file == file)


class FinalizeAnsweredDeepgramSTT(DeepgramSTTService):
    """Pipecat's Deepgram service, unchanged but for noting when the server has answered the
    last ``Finalize`` (Pipecat sends one at each stop of its VAD) with a ``from_finalize``
    result. A bot's pipeline goes on while the room does; ending it sends ``CloseStream`` and
    drops what comes after, so the test ends it once the last turn is answered."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.finalizes_sent = 0
        self.finalize_answered = asyncio.Event()
        self.finalize_answered.set()  # none asked for yet

    def request_finalize(self) -> None:
        self.finalizes_sent += 1
        self.finalize_answered.clear()
        super().request_finalize()

    async def _on_message(self, message: Any) -> None:
        await super()._on_message(message)  # its frames are pushed before the test may end
        if isinstance(message, ListenV1Results) and message.from_finalize:
            self.finalize_answered.set()


async def run_bot(
    stt: STTService, audio: np.ndarray, until: asyncio.Event | None = None
) -> tuple[list[Frame], list[Frame]]:
    """Runs ``VAD -> stt -> sink`` on ``audio`` (16 kHz float) as a transport would feed it,
    then ends the pipeline (once ``until`` is set, if given). Returns the frames that reached
    the sink (downstream) and the pipeline's start (upstream: errors, VAD events)."""
    up: asyncio.Queue[Frame] = asyncio.Queue()
    down: asyncio.Queue[Frame] = asyncio.Queue()
    pipeline = Pipeline(
        [
            QueuedFrameProcessor(queue=up, queue_direction=FrameDirection.UPSTREAM),
            VADProcessor(vad_analyzer=SileroVADAnalyzer()),
            stt,
            QueuedFrameProcessor(queue=down, queue_direction=FrameDirection.DOWNSTREAM),
        ]
    )
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(audio_in_sample_rate=SAMPLE_RATE_HZ),
        cancel_on_idle_timeout=False,
    )
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(_worker: PipelineWorker, _frame: Frame) -> None:
        started.set()

    async def feed() -> None:
        await started.wait()  # processors drop frames that come before the StartFrame
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for k, chunk in enumerate(pcm_frames(audio, FRAME_S)):
            frame = InputAudioRawFrame(audio=chunk, sample_rate=SAMPLE_RATE_HZ, num_channels=1)
            await worker.queue_frame(frame)
            await asyncio.sleep(max(0.0, t0 + (k + 1) * FRAME_S - loop.time()))
        if until is not None:
            await until.wait()
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.wait_for(asyncio.gather(runner.run(), feed()), WAIT_S)

    def drained(queue: asyncio.Queue[Frame]) -> list[Frame]:
        return [queue.get_nowait() for _ in range(queue.qsize())]

    return drained(down), drained(up)


def with_trailing_silence(clip: np.ndarray) -> np.ndarray:
    silence = np.zeros(int(TRAILING_SILENCE_S * SAMPLE_RATE_HZ), np.float32)
    return np.concatenate([clip, silence])


async def test_pipecats_deepgram_service_streams_speech_with_only_its_base_url_changed(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """``DeepgramSTTService`` with Pipecat's defaults (``nova-3-general``, ``interim_results``,
    ``punctuate``, ``smart_format=false``, ``numerals=false``, ``diarize=false``, ...): interim
    and final transcripts while the clip plays, a ``Finalize`` at each stop of Pipecat's VAD,
    each answered."""
    stt = FinalizeAnsweredDeepgramSTT(api_key="unused", base_url=server_url)
    audio = with_trailing_silence(load_clip(speech_dir / CLIP))
    down, up = await run_bot(stt, audio, until=stt.finalize_answered)
    errors = [f for f in up + down if isinstance(f, ErrorFrame)]
    assert not errors, [e.error for e in errors]
    assert any(isinstance(f, VADUserStartedSpeakingFrame) for f in down)
    assert any(isinstance(f, VADUserStoppedSpeakingFrame) for f in down)
    assert stt.finalizes_sent >= 1 and stt.finalize_answered.is_set()
    assert any(isinstance(f, InterimTranscriptionFrame) for f in down)
    finals = [f for f in down if isinstance(f, TranscriptionFrame)]
    assert finals and all(isinstance(f.result, ListenV1Results) for f in finals)
    assert all(f.result.is_final for f in finals)
    text = " ".join(f.text for f in finals)
    assert wer(reference(manifest, CLIP), text) <= MAX_WER_CLIP, text


async def test_pipecats_openai_service_transcribes_each_utterance_by_the_rest_api(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """``OpenAISTTService`` (a ``SegmentedSTTService``: Pipecat buffers each utterance its VAD
    hears and posts it as a WAV, ``model=gpt-transcribe``, ``language=en``): one final
    transcript per segment; the pipeline's end waits for the last one, as Pipecat's does."""
    stt = OpenAISTTService(api_key="unused", base_url=http_base(server_url) + "/v1")
    audio = with_trailing_silence(load_clip(speech_dir / CLIP))
    down, up = await run_bot(stt, audio)
    errors = [f for f in up + down if isinstance(f, ErrorFrame)]
    assert not errors, [e.error for e in errors]
    segments = sum(isinstance(f, VADUserStoppedSpeakingFrame) for f in down)
    finals = [f for f in down if isinstance(f, TranscriptionFrame)]
    assert 1 <= len(finals) <= segments, (len(finals), segments)
    assert all(isinstance(f.result, Transcription) and f.finalized for f in finals)
    text = " ".join(f.text for f in finals)
    assert wer(reference(manifest, CLIP), text) <= MAX_WER_CLIP, text


class TurnEndedFluxSTT(DeepgramFluxSTTService):
    """Pipecat's Deepgram Flux service, unchanged but for noting each ``EndOfTurn`` it handled:
    the test ends the bot's pipeline once the turn it spoke has ended."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.turn_ended = asyncio.Event()

    async def _handle_end_of_turn(self, transcript: str, data: dict[str, Any]) -> None:
        await super()._handle_end_of_turn(transcript, data)
        self.turn_ended.set()


async def test_pipecats_deepgram_flux_service_gets_the_turn_with_only_its_url_changed(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """``DeepgramFluxSTTService(url="ws://HOST:PORT/v2/listen")`` with its defaults: the turn a
    sentence read aloud makes ends with a final transcription frame of it."""
    clip = "ljspeech/LJ001-0005.wav"  # ends a sentence
    stt = TurnEndedFluxSTT(api_key="unused", url=f"{server_url}/v2/listen")
    audio = np.concatenate(
        [load_clip(speech_dir / clip), np.zeros(int(2.5 * SAMPLE_RATE_HZ), np.float32)]
    )
    down, up = await run_bot(stt, audio, until=stt.turn_ended)
    assert not [f for f in up + down if isinstance(f, ErrorFrame)]
    finals = [f.text for f in down if isinstance(f, TranscriptionFrame)]
    assert finals
    assert wer(reference(manifest, clip), " ".join(finals)) <= MAX_WER_CLIP, finals
