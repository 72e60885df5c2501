"""Speaker labels for a transcribed recording's words, off the event loop.

``RecordingSpeakers`` (the core) runs the VAD and the tracker over the recording and plans the
encoder's windows; here they are embedded one job after another in a worker thread: the VAD
of an hour of audio, and its encoder windows (about 2% of the audio's duration on a shared
2-core CPU, bench/README.md), would otherwise hold the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from server.config import VadConfig
from server.core.engine_api import WordTiming
from server.core.recording_speakers import RecordingSpeakers
from server.core.speakers import SpeakerConfig, SpeakerEmbedder, SpeakerLabel

logger = logging.getLogger("server.decode.file_speakers")

Float32Array = npt.NDArray[np.float32]


def label_words(
    audio: Float32Array,
    words: Sequence[WordTiming],
    embedder: SpeakerEmbedder,
    *,
    vad: VadConfig,
    config: SpeakerConfig,
) -> list[SpeakerLabel | None]:
    """Each word's speaker (in the calling thread: it blocks for the encoder's time)."""
    recording = RecordingSpeakers(
        audio, [(w.start_s, w.end_s) for w in words], vad=vad, config=config
    )
    while (job := recording.next_job()) is not None:
        vectors: Float32Array | None
        try:
            vectors = embedder.embed_windows(job.audio, list(job.starts))
        except (ArithmeticError, ValueError, MemoryError) as exc:
            # The encoder failed on this audio: the words take what is known already.
            logger.warning("speaker embedding of job %d failed: %s", job.job_id, exc)
            vectors = None
        recording.receive(job, vectors)
    logger.debug("%d word(s), %d speaker(s)", len(words), recording.speakers)
    return recording.labels


async def label_words_in_thread(
    audio: Float32Array,
    words: Sequence[WordTiming],
    embedder: SpeakerEmbedder,
    *,
    vad: VadConfig,
    config: SpeakerConfig,
) -> list[SpeakerLabel | None]:
    """``label_words`` in the loop's default executor."""
    call = functools.partial(label_words, audio, words, embedder, vad=vad, config=config)
    return await asyncio.get_running_loop().run_in_executor(None, call)
