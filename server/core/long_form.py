"""Whisper's long-form loop as steps, with no engine in it: what to decode next, and what a
window's result adds to the transcript.

30 s windows at full audio context, each conditioned on the text before it, the next window
starting at the last complete text span. The caller decodes each window as it likes: in this
thread (``server.engine.offline.transcribe_audio``), or on the server's decode lanes between
the live streams' windows (``server.decode.file_transcription``). A window is decoded with
Whisper's temperature fallback (``SpeechEngine.transcribe_window``): at the first of
``temperatures`` whose result ``needs_fallback`` does not flag.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from server.core.engine_api import (
    DecodeOptions,
    DecodeRequest,
    DecodeResult,
    StopReason,
    TextSpan,
    WordTiming,
)
from server.protocol.formats import SAMPLE_RATE_HZ

Float32Array = npt.NDArray[np.float32]

WINDOW_SAMPLES = 30 * SAMPLE_RATE_HZ  # Whisper's window: 480000
HOP_SAMPLES = 160  # one mel frame
PROMPT_TOKENS = 223  # Whisper conditions on at most half of the 448-token text context
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # Whisper's transcribe() defaults
# Text decoded above this temperature is no context for the next window (Whisper's rule).
PROMPT_RESET_TEMPERATURE = 0.5
# A recording decoded in parts side by side is cut at the quietest 30 ms in the 2 s before
# each even point.
PAUSE_SEARCH_SAMPLES = 2 * SAMPLE_RATE_HZ
PAUSE_FRAME_SAMPLES = 480


def needs_fallback(result: DecodeResult, options: DecodeOptions) -> bool:
    """Whether a window's decode is to be tried again at a higher temperature."""
    if result.stop_reason is StopReason.NO_SPEECH:
        return False
    if result.stop_reason in (StopReason.COMPRESSION, StopReason.REPETITION):
        return True
    return result.avg_logprob < options.logprob_threshold


def check_temperatures(temperatures: tuple[float, ...]) -> None:
    """Raise ``ValueError`` unless ``temperatures`` is a non-empty rising sequence."""
    if not temperatures or list(temperatures) != sorted(temperatures):
        raise ValueError(f"temperatures must be a non-empty rising sequence; got {temperatures}")


@dataclass(frozen=True)
class Segment:
    """A text span of the transcript, with how its window was decoded (OpenAI's verbose
    segments carry these)."""

    span: TextSpan  # times in seconds from the start of the audio
    seek_s: float  # where its window started
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


@dataclass(frozen=True)
class Transcript:
    text: str
    spans: tuple[TextSpan, ...]  # times in seconds from the start of the audio
    language: str | None
    words: tuple[WordTiming, ...] = ()  # likewise; empty unless word_timestamps was asked for
    segments: tuple[Segment, ...] = ()  # the spans with their windows' decode figures


@dataclass(frozen=True)
class WindowJob:
    """The next window to decode: its audio (at most 30 s) and request."""

    audio: Float32Array
    request: DecodeRequest
    temperatures: tuple[float, ...]


@dataclass
class LongForm:
    """One recording's way through the long-form loop: ``next_window``, decode it,
    ``take`` the result; again until ``next_window`` says None."""

    audio: Float32Array
    options: DecodeOptions
    temperatures: tuple[float, ...] = (0.0,)
    prompt: tuple[int, ...] = ()  # text before the audio (the user's prompt), as context
    start_s: float = 0.0  # where ``audio`` begins in the recording (a part of it): times add it
    seek: int = 0
    language: str | None = None
    _context: list[int] = field(default_factory=list)
    _segments: list[Segment] = field(default_factory=list)
    _words: list[WordTiming] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_temperatures(self.temperatures)
        self.language = self.options.language
        self._context = list(self.prompt)

    @property
    def duration_s(self) -> float:
        return float(self.audio.shape[0] / SAMPLE_RATE_HZ)

    def next_window(self) -> WindowJob | None:
        """The window to decode next, or None when the audio is done."""
        chunk = self.audio[self.seek : self.seek + WINDOW_SAMPLES]
        if chunk.shape[0] < HOP_SAMPLES:  # less than one mel frame of audio is left
            return None
        request = DecodeRequest(
            chunk.shape[0] / SAMPLE_RATE_HZ,
            self.options,
            prompt=tuple(self._context[-PROMPT_TOKENS:]),
        )
        return WindowJob(chunk, request, self.temperatures)

    def take(self, result: DecodeResult, temperature: float) -> list[Segment]:
        """Fold the decode of ``next_window()`` in; returns the segments it added."""
        chunk_samples = min(WINDOW_SAMPLES, self.audio.shape[0] - self.seek)
        self.language = result.language
        if self.options.language is None and result.language is not None:
            # Whisper detects the language once, on the first window, and keeps it.
            self.options = replace(self.options, language=result.language)
        offset_s = self.start_s + self.seek / SAMPLE_RATE_HZ
        advance = chunk_samples
        added: list[Segment] = []
        if result.is_speech and result.spans:
            done = [s for s in result.spans if s.end_s >= 0]
            tail = [s for s in result.spans if s.end_s < 0]
            keep = list(result.spans)
            if tail and done and chunk_samples == WINDOW_SAMPLES:
                # The last text span runs past the window: decode it again in the next one.
                advance = round(done[-1].end_s * SAMPLE_RATE_HZ)
                keep = done
            for s in keep:
                end = s.end_s if s.end_s >= 0 else chunk_samples / SAMPLE_RATE_HZ
                span = TextSpan(offset_s + s.start_s, offset_s + end, s.text, s.tokens)
                added.append(
                    Segment(
                        span,
                        offset_s,
                        temperature,
                        result.avg_logprob,
                        result.compression_ratio,
                        result.no_speech_prob,
                    )
                )
                self._context.extend(s.tokens)
            if temperature > PROMPT_RESET_TEMPERATURE:
                self._context.clear()
            limit_s = advance / SAMPLE_RATE_HZ
            for w in result.words:
                # The unfinished last text span's words come again from the next window.
                if advance < chunk_samples and w.start_s >= limit_s - 0.01:
                    continue
                self._words.append(
                    WordTiming(
                        w.word, w.tokens, offset_s + w.start_s, offset_s + w.end_s, w.probability
                    )
                )
        self._segments.extend(added)
        self.seek += max(advance, HOP_SAMPLES)
        return added

    def transcript(self) -> Transcript:
        spans = tuple(s.span for s in self._segments)
        text = "".join(s.text for s in spans).strip()
        words = tuple(join_word_pieces(self._words))
        return Transcript(text, spans, self.language, words, tuple(self._segments))


def pause_cuts(audio: Float32Array, parts: int) -> list[int]:
    """Where to cut ``audio`` into ``parts`` pieces of about equal length that can be decoded
    side by side: each cut in the quietest 30 ms of the ``PAUSE_SEARCH_S`` before its even
    point, so no word is cut in two. Sample offsets, rising, without 0 and the end."""
    total = int(audio.shape[0])
    cuts: list[int] = []
    for k in range(1, parts):
        high = total * k // parts
        low = max(cuts[-1] if cuts else 0, high - PAUSE_SEARCH_SAMPLES)
        frames = (high - low) // PAUSE_FRAME_SAMPLES
        if frames < 1:
            cuts.append(high)
            continue
        pieces = audio[low : low + frames * PAUSE_FRAME_SAMPLES].reshape(frames, -1)
        quietest = int(np.argmin(np.square(pieces).mean(axis=1)))
        cuts.append(low + quietest * PAUSE_FRAME_SAMPLES + PAUSE_FRAME_SAMPLES // 2)
    return cuts


def split_recording(recording: LongForm, parts: int) -> list[LongForm]:
    """``recording`` as ``parts`` recordings cut at pauses, each conditioned on the prompt
    alone (the text before a cut is not known when its part starts), their times in the
    whole's. One part: the recording itself."""
    if parts <= 1:
        return [recording]
    bounds = [0, *pause_cuts(recording.audio, parts), int(recording.audio.shape[0])]
    return [
        LongForm(
            recording.audio[a:b],
            recording.options,
            recording.temperatures,
            prompt=recording.prompt,
            start_s=recording.start_s + a / SAMPLE_RATE_HZ,
        )
        for a, b in itertools.pairwise(bounds)
    ]


def join_transcripts(parts: list[Transcript]) -> Transcript:
    """The transcripts of a recording's parts, in order, as one."""
    return Transcript(
        " ".join(t.text for t in parts if t.text),
        tuple(s for t in parts for s in t.spans),
        next((t.language for t in parts if t.language is not None), None),
        tuple(w for t in parts for w in t.words),
        tuple(s for t in parts for s in t.segments),
    )


def join_word_pieces(words: list[WordTiming]) -> list[WordTiming]:
    """Whisper's word timings as the words of the text: a piece without a leading space
    (punctuation, the rest of a hyphenated word) belongs to the word before it."""
    out: list[WordTiming] = []
    pieces = 1
    for w in words:
        if out and not w.word.startswith(" "):
            last = out[-1]
            probability = (last.probability * pieces + w.probability) / (pieces + 1)
            pieces += 1
            out[-1] = WordTiming(
                last.word + w.word,
                last.tokens + w.tokens,
                last.start_s,
                max(last.end_s, w.end_s),
                probability,
            )
        else:
            out.append(w)
            pieces = 1
    return out
