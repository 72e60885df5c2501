"""The audio both servers hear in the latency benchmark, and its reference timeline.

A stream is real speech from ``shared/speech``: a long recording, or English clips joined
with pauses so that speech ends (and finals are due) inside the stream. Every stream ends with
silence for the same reason. The reference word times come from our offline transcription
with word timestamps (30 s windows at full context, as ``server.engine.offline``): they
depend on neither server's streaming, and both servers are measured against the same ones.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from bench.corpus import ManifestRow, read_manifest
from bench.engine import speech_dir
from bench.latency_metrics import RefWord, join_word_pieces
from server.config import VadConfig
from server.core.engine_api import DecodeOptions
from server.core.long_form import LongForm
from server.core.vad import SpeechEnded, VadSegmenter
from server.engine.engine import Engine
from server.engine.offline import transcribe_audio
from server.protocol.audio import read_audio_file
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.latency_audio")

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Aligned:
    """One recording's offline transcription: text (the WER baseline) and word times."""

    text: str
    words: tuple[RefWord, ...]


@dataclass(frozen=True)
class Stream:
    """One stream to replay: audio, reference transcript, offline text and word times."""

    name: str
    audio: Float32Array
    transcript: str  # the source's reference, for WER
    offline_text: str  # offline transcription of the same files, for WER beside streaming
    words: tuple[RefWord, ...]  # reference timeline in stream seconds

    @property
    def seconds(self) -> float:
        return float(self.audio.shape[0] / SAMPLE_RATE_HZ)


def align_recording(engine: Engine, audio: Float32Array) -> Aligned:
    """Offline text and word times of a whole recording in one pass: ``transcribe_audio``'s
    long-form loop (``server.core.long_form``) with word timestamps on. They are computed
    after decoding, so the text is the offline text itself, and one pass instead of two
    halves the alignment time."""
    recording = LongForm(audio, DecodeOptions(word_timestamps=True))
    while (job := recording.next_window()) is not None:
        recording.take(*engine.transcribe_window(job.audio, job.request, job.temperatures))
    transcript = recording.transcript()
    words = [RefWord(w.word, w.start_s, w.end_s) for w in transcript.words]
    return Aligned(transcript.text, tuple(join_word_pieces(words)))


def speech_ends_s(audio: Float32Array, config: VadConfig | None = None) -> list[float]:
    """Where the server's voice activity detector (its default ``VadConfig`` unless given)
    ends speech in ``audio``, in stream seconds, trailing pad included: the turn ends that
    end of speech to final is measured from (``stream_metrics``)."""
    segmenter = VadSegmenter(config or VadConfig())
    step = SAMPLE_RATE_HZ // 10  # the 100 ms frames the benchmarks send
    events = []
    for start in range(0, audio.shape[0], step):
        events += segmenter.receive(audio[start : start + step])
    events += segmenter.flush()
    return [e.end_sample / SAMPLE_RATE_HZ for e in events if isinstance(e, SpeechEnded)]


def check_offline_text(engine: Engine, audio: Float32Array, aligned: Aligned) -> None:
    """Warn when ``align_recording`` no longer gives ``transcribe_audio``'s text (word
    timestamps must not change the decode)."""
    text = transcribe_audio(engine, audio, DecodeOptions(word_timestamps=False)).text
    if text != aligned.text:
        logger.warning("offline text differs from transcribe_audio: %r != %r", aligned.text, text)


def english_clips(min_s: float = 3.0, max_s: float = 12.0) -> list[ManifestRow]:
    """English clips of ``manifest.tsv`` within a duration range, in manifest order."""
    rows = read_manifest(speech_dir() / "manifest.tsv")
    return [r for r in rows if r.language == "en" and min_s < r.seconds < max_s]


def long_recordings() -> list[ManifestRow]:
    """The English recordings of ``manifest_long.tsv``."""
    return [r for r in read_manifest(speech_dir() / "manifest_long.tsv") if r.language == "en"]


class Aligner:
    """Offline alignment of recordings, each file aligned once however many streams use it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._cache: dict[str, tuple[Float32Array, Aligned]] = {}

    def get(self, row: ManifestRow) -> tuple[Float32Array, Aligned]:
        if row.file not in self._cache:
            audio = read_audio_file(speech_dir() / row.file)
            aligned = align_recording(self._engine, audio)
            if not self._cache:
                check_offline_text(self._engine, audio, aligned)
            self._cache[row.file] = (audio, aligned)
            logger.info("aligned %s (%.1f s)", row.file, row.seconds)
        return self._cache[row.file]

    def stream(
        self, name: str, rows: Iterable[ManifestRow], *, pause_s: float, tail_s: float
    ) -> Stream:
        """The rows' audio joined with ``pause_s`` of silence, ``tail_s`` of it at the end."""
        parts: list[Float32Array] = []
        words: list[RefWord] = []
        transcripts: list[str] = []
        offline: list[str] = []
        offset_s = 0.0
        pause = np.zeros(round(pause_s * SAMPLE_RATE_HZ), dtype=np.float32)
        for k, row in enumerate(rows):
            if k:
                parts.append(pause)
                offset_s += pause_s
            audio, aligned = self.get(row)
            parts.append(audio)
            words += [
                replace(w, start_s=w.start_s + offset_s, end_s=w.end_s + offset_s)
                for w in aligned.words
            ]
            transcripts.append(row.transcript)
            offline.append(aligned.text)
            offset_s += audio.shape[0] / SAMPLE_RATE_HZ
        parts.append(np.zeros(round(tail_s * SAMPLE_RATE_HZ), dtype=np.float32))
        return Stream(
            name, np.concatenate(parts), " ".join(transcripts), " ".join(offline), tuple(words)
        )


def plain_stream(name: str, rows: Iterable[ManifestRow], *, pause_s: float) -> Stream:
    """The rows' audio joined with pauses, without reference (for memory, not latency)."""
    pause = np.zeros(round(pause_s * SAMPLE_RATE_HZ), dtype=np.float32)
    parts: list[Float32Array] = []
    for row in rows:
        parts += [read_audio_file(speech_dir() / row.file), pause]
    return Stream(name, np.concatenate(parts), "", "", ())


def clip_rows(total_s: float, *, start: int = 0, step: int = 1) -> list[ManifestRow]:
    """English clips from index ``start`` every ``step``-th (wrapping), until ``total_s``."""
    clips = english_clips()
    out: list[ManifestRow] = []
    k = start
    while sum(r.seconds for r in out) < total_s:
        out.append(clips[k % len(clips)])
        k += step
    return out
