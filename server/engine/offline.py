"""Offline transcription of a whole file, in-process: the accuracy reference for streaming.

Whisper's long-form loop (``server.core.long_form``): 30 s windows at full audio context,
decoding with timestamps (greedy, or beam search with ``DecodeOptions.beam_size``), each window
conditioned on the text before it. With more than one temperature, a window whose decode looks
wrong (it loops, compresses too well, or its average log-probability is below
``logprob_threshold``) is decoded again at the next temperature, by sampling ``best_of``
candidates: Whisper's temperature fallback (``Engine.transcribe_window``). Silence is not
retried.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from server.core.engine_api import DecodeOptions
from server.core.long_form import FALLBACK_TEMPERATURES, LongForm, Transcript
from server.engine.engine import Engine, EngineConfig


def transcribe_audio(
    engine: Engine,
    audio: npt.NDArray[np.float32],
    options: DecodeOptions | None = None,
    temperatures: Sequence[float] = (0.0,),
) -> Transcript:
    """Transcribe 16 kHz mono audio of any length with full 30 s contexts; more than one
    of ``temperatures`` turns the fallback on."""
    loop = LongForm(audio, options or DecodeOptions(word_timestamps=False), tuple(temperatures))
    while (job := loop.next_window()) is not None:
        loop.take(*engine.transcribe_window(job.audio, job.request, job.temperatures))
    return loop.transcript()


def transcribe_file(
    path: str | Path,
    *,
    model: str = "tiny.en",
    language: str | None = "en",
    task: str = "transcribe",
    word_timestamps: bool = False,
    beam_size: int = 5,
    temperatures: Sequence[float] = FALLBACK_TEMPERATURES,
) -> Transcript:
    """Load the model, read the file (wav/flac/mp3/ogg) and transcribe it; with
    ``word_timestamps``, the transcript's words carry times (for subtitles)."""
    from server.protocol.audio import read_audio_file

    engine = Engine.load(EngineConfig(model=model))
    if not engine.dims.is_multilingual:
        language = "en"
    audio = read_audio_file(path)
    options = DecodeOptions(
        language=language, task=task, word_timestamps=word_timestamps, beam_size=beam_size
    )
    return transcribe_audio(engine, audio, options, temperatures)
