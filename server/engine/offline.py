"""Offline transcription of a whole file, in-process: the accuracy reference for streaming.

Whisper's long-form loop: 30 s windows at full audio context, decoding with timestamps
(greedy, or beam search with ``DecodeOptions.beam_size``), each window conditioned on the text
before it, and the next window starting at the last complete text span. With more than one
temperature, a window whose decode looks wrong (it loops, compresses too well, or its average
log-probability is below ``logprob_threshold``) is decoded again at the next temperature, by
sampling ``best_of`` candidates: Whisper's temperature fallback. Silence is not retried.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from server.core.engine_api import (
    DecodeOptions,
    DecodeRequest,
    DecodeResult,
    StopReason,
    TextSpan,
    Window,
    WordTiming,
)
from server.engine.engine import Engine, EngineConfig
from server.engine.features import N_FRAMES, N_SAMPLES
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("server.engine.offline")

PROMPT_TOKENS = 223  # Whisper conditions on at most half of the 448-token text context
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # Whisper's transcribe() defaults
# Text decoded above this temperature is no context for the next window (Whisper's rule).
PROMPT_RESET_TEMPERATURE = 0.5


def needs_fallback(result: DecodeResult, options: DecodeOptions) -> bool:
    """Whether a window's decode is to be tried again at a higher temperature."""
    if result.stop_reason is StopReason.NO_SPEECH:
        return False
    if result.stop_reason in (StopReason.COMPRESSION, StopReason.REPETITION):
        return True
    return result.avg_logprob < options.logprob_threshold


def decode_with_fallback(
    engine: Engine, window: Window, temperatures: Sequence[float]
) -> tuple[DecodeResult, float]:
    """The window decoded at the first temperature whose result needs no fallback (else at
    the last one), and that temperature. The window is encoded once for all of them."""
    options = window.request.options
    feats = engine.encode([window.mel])
    result: DecodeResult | None = None
    for t in temperatures:
        opts = replace(options, temperature=t, beam_size=1 if t > 0 else options.beam_size)
        result = engine.decode_encoded([replace(window.request, options=opts)], feats)[0]
        if not needs_fallback(result, opts):
            return result, t
        logger.debug(
            "window at temperature %.1f: %s, avg logprob %.2f",
            t,
            result.stop_reason,
            result.avg_logprob,
        )
    assert result is not None
    return result, temperatures[-1]


@dataclass(frozen=True)
class Transcript:
    text: str
    spans: tuple[TextSpan, ...]  # times in seconds from the start of the audio
    language: str | None
    words: tuple[WordTiming, ...] = ()  # likewise; empty unless word_timestamps was asked for


def transcribe_audio(
    engine: Engine,
    audio: npt.NDArray[np.float32],
    options: DecodeOptions | None = None,
    temperatures: Sequence[float] = (0.0,),
) -> Transcript:
    """Transcribe 16 kHz mono audio of any length with full 30 s contexts; more than one
    of ``temperatures`` turns the fallback on."""
    if not temperatures or list(temperatures) != sorted(temperatures):
        raise ValueError(f"temperatures must be a non-empty rising sequence; got {temperatures}")
    options = options or DecodeOptions(word_timestamps=False)
    seek = 0
    spans: list[TextSpan] = []
    words: list[WordTiming] = []
    context: list[int] = []
    language = options.language
    hop = N_SAMPLES // N_FRAMES
    while seek < audio.shape[0]:
        chunk = audio[seek : seek + N_SAMPLES]
        if chunk.shape[0] < hop:  # less than one mel frame of audio is left
            break
        mel = engine.features(chunk, N_FRAMES)
        request = DecodeRequest(
            chunk.shape[0] / SAMPLE_RATE_HZ, options, prompt=tuple(context[-PROMPT_TOKENS:])
        )
        result, temperature = decode_with_fallback(engine, Window(mel, request), temperatures)
        language = result.language
        offset_s = seek / SAMPLE_RATE_HZ
        advance = chunk.shape[0]
        if result.is_speech and result.spans:
            done = [s for s in result.spans if s.end_s >= 0]
            tail = [s for s in result.spans if s.end_s < 0]
            if tail and done and chunk.shape[0] == N_SAMPLES:
                # The last text span runs past the window: decode it again in the next one.
                advance = round(done[-1].end_s * SAMPLE_RATE_HZ)
                keep = done
            else:
                keep = list(result.spans)
            for s in keep:
                end = s.end_s if s.end_s >= 0 else chunk.shape[0] / SAMPLE_RATE_HZ
                spans.append(TextSpan(offset_s + s.start_s, offset_s + end, s.text, s.tokens))
                context.extend(s.tokens)
            if temperature > PROMPT_RESET_TEMPERATURE:
                context.clear()
            limit_s = advance / SAMPLE_RATE_HZ
            for w in result.words:
                # The unfinished last text span's words come again from the next window.
                if advance < chunk.shape[0] and w.start_s >= limit_s - 0.01:
                    continue
                words.append(
                    WordTiming(
                        w.word, w.tokens, offset_s + w.start_s, offset_s + w.end_s, w.probability
                    )
                )
        seek += max(advance, hop)
    text = "".join(s.text for s in spans).strip()
    return Transcript(text, tuple(spans), language, tuple(words))


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
