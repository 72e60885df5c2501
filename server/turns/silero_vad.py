"""Silero VAD v5 (MIT) on onnxruntime: a speech probability per 32 ms frame, and a segmenter
that turns those into the same ``SpeechStarted``/``SpeechEnded`` events as server/core/vad.py's
webrtcvad ``VadSegmenter``, with the same public surface, so a session can take either.

The network is recurrent: each call takes 512 new samples at 16 kHz, the last 64 samples of
the previous call (its context) and a (2, 1, 128) state, and returns the probability and the
next state. A stream's state and context live on its own ``SileroVad``; the loaded network
(``SileroModel``) holds none and is shared by every stream.

The segmenter reads ``VadConfig``'s durations (start hysteresis, end silence, short-speech
silence, pad) in 32 ms frames instead of webrtcvad's 10-30 ms ones; ``aggressiveness`` and
``frame_ms`` are webrtcvad's and mean nothing here: ``SileroVadConfig.threshold`` takes their
place.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from server.config import VadConfig
from server.core.vad import SpeechEnded, SpeechStarted, VadEvent
from server.protocol.formats import SAMPLE_RATE_HZ
from server.turns.onnx import SILERO_VAD_FILE, cpu_session, resolve_model

logger = logging.getLogger("server.turns.silero_vad")

FRAME_SAMPLES = 512  # Silero v5 at 16 kHz takes exactly 512 new samples a call
FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE_HZ  # 32
CONTEXT_SAMPLES = 64  # ... after the last 64 samples of the call before
_STATE_SHAPE = (2, 1, 128)

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SileroVadConfig:
    """The Silero model file and when its probabilities count as speech."""

    model_path: Path | None = None  # None: silero_vad.onnx in the pipecat-ai wheel
    threshold: float = 0.5  # a frame at this speech probability or above is speech
    # Inside speech a frame counts as silence only below threshold - negative_margin:
    # probabilities dip between syllables, and Silero's own get_speech_timestamps uses 0.15.
    negative_margin: float = 0.15
    # onnxruntime intra-op threads; one is plenty: a frame costs about 0.25 ms of CPU, under
    # 1% of a core per stream (bench/vad_compare.py).
    threads: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be in (0, 1); got {self.threshold}")
        if not 0 <= self.negative_margin < self.threshold:
            raise ValueError("need 0 <= negative_margin < threshold")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1; got {self.threads}")


class SileroModel:
    """The loaded Silero network. Stateless: any number of streams share one (onnxruntime
    sessions may be run from several threads at once)."""

    def __init__(self, config: SileroVadConfig | None = None) -> None:
        self.config = config or SileroVadConfig()
        self.path = resolve_model(self.config.model_path, SILERO_VAD_FILE)
        self._session = cpu_session(self.path, threads=self.config.threads)
        self._sr = np.array(SAMPLE_RATE_HZ, dtype=np.int64)

    def run(
        self, window: Float32Array, state: Float32Array
    ) -> tuple[float, npt.NDArray[np.float32]]:
        """One step: ``window`` is context + frame (576 samples), ``state`` (2, 1, 128).
        Returns the speech probability and the next state."""
        probability, new_state = self._session.run(
            ["output", "stateN"], {"input": window[None], "state": state, "sr": self._sr}
        )
        return float(np.asarray(probability).reshape(-1)[0]), np.asarray(new_state, np.float32)


class SileroVad:
    """One stream's frame scorer: its recurrent state and context, carried frame to frame."""

    def __init__(self, model: SileroModel) -> None:
        self._model = model
        self.reset()

    def reset(self) -> None:
        """Forget the stream so far (state and context back to zeros)."""
        self._state = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._window = np.zeros(CONTEXT_SAMPLES + FRAME_SAMPLES, dtype=np.float32)

    def probability(self, frame: Float32Array) -> float:
        """P(speech) of the next 512 samples (32 ms at 16 kHz) of the stream."""
        if frame.shape != (FRAME_SAMPLES,):
            raise ValueError(f"expected {FRAME_SAMPLES} mono samples; got shape {frame.shape}")
        self._window[CONTEXT_SAMPLES:] = frame
        p, self._state = self._model.run(self._window, self._state)
        self._window[:CONTEXT_SAMPLES] = self._window[-CONTEXT_SAMPLES:]
        return p


class SileroSegmenter:
    """Frames a 16 kHz float32 stream for Silero and turns its probabilities into utterances:
    the same events, offsets and methods as ``server.core.vad.VadSegmenter``.

    An utterance opens when at least ``speech_start_ms`` of the frames in the last
    ``speech_start_window_ms`` are speech, and closes after ``speech_end_silence_ms`` of
    consecutive silent frames (``short_speech_end_silence_ms`` while the speech so far is
    shorter than ``short_speech_s``); both ends are widened by ``speech_pad_ms``. Unlike
    webrtcvad, Silero needs no warm-up: it calls nothing speech on digital silence.
    """

    def __init__(self, config: VadConfig, silero: SileroVadConfig, model: SileroModel) -> None:
        self._vad = SileroVad(model)
        self._on = silero.threshold
        self._off = silero.threshold - silero.negative_margin
        # Durations become whole frames, rounded up so a threshold is never undercut.
        self._start_frames = math.ceil(config.speech_start_ms / FRAME_MS)
        window_frames = max(math.ceil(config.speech_start_window_ms / FRAME_MS), self._start_frames)
        self._end_frames = math.ceil(config.speech_end_silence_ms / FRAME_MS)
        self._short_end_frames = max(
            self._end_frames, math.ceil(config.short_speech_end_silence_ms / FRAME_MS)
        )
        self._short_speech = round(config.short_speech_s * SAMPLE_RATE_HZ)
        self._pad = config.speech_pad_ms * SAMPLE_RATE_HZ // 1000
        self._voiced_run_start: int | None = None
        self._pending = np.zeros(0, dtype=np.float32)
        self._processed = 0
        self._window: collections.deque[tuple[int, bool]] = collections.deque(maxlen=window_frames)
        self._in_speech = False
        self._silent_frames = 0
        self._last_voiced_end = 0
        self._last_end = 0
        self._onset = 0
        self._voiced: collections.deque[list[int]] = collections.deque()

    @property
    def in_speech(self) -> bool:
        """Whether an utterance is open (a ``SpeechStarted`` without its ``SpeechEnded``)."""
        return self._in_speech

    @property
    def tentative_end(self) -> int | None:
        """As ``VadSegmenter.tentative_end``: where the open utterance ends if the silence heard
        now lasts to the endpoint, once that silence has covered the pad; else None."""
        if not self._in_speech or self._silent_frames == 0:
            return None
        end = self._last_voiced_end + self._pad
        return end if self._processed >= end else None

    @property
    def samples_processed(self) -> int:
        """Samples that have been through the model; buffered partial frames do not count."""
        return self._processed

    def voiced_s(self, start_sample: int, end_sample: int) -> float:
        """Seconds of speech frames between two samples of the stream (those still kept)."""
        total = 0
        for run_start, run_end in self._voiced:
            total += max(0, min(run_end, end_sample) - max(run_start, start_sample))
        return total / SAMPLE_RATE_HZ

    def forget_before(self, sample: int) -> None:
        """Drop the record of speech frames that end before ``sample``."""
        while self._voiced and self._voiced[0][1] <= sample:
            self._voiced.popleft()

    def receive(self, samples: Float32Array) -> list[VadEvent]:
        """Add 16 kHz mono samples and return the events that complete frames produced."""
        if samples.ndim != 1:
            raise ValueError(f"expected mono samples (1-D); got shape {samples.shape}")
        if self._pending.size:
            buffered = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        else:
            buffered = samples.astype(np.float32, copy=False)
        whole = buffered.size - buffered.size % FRAME_SAMPLES
        self._pending = buffered[whole:].copy()
        return self._process(buffered[:whole], whole)

    def flush(self, *, at_pause: bool = False) -> list[VadEvent]:
        """As ``VadSegmenter.flush``: score the buffered partial frame (zero-padded; only its
        real samples count) and close an open utterance at the stream's end, or with
        ``at_pause`` at its ``tentative_end`` when the stream ends in a silence that covered
        the pad."""
        events: list[VadEvent] = []
        if self._pending.size:
            real = self._pending.size
            frame = np.zeros(FRAME_SAMPLES, dtype=np.float32)
            frame[:real] = self._pending
            self._pending = np.zeros(0, dtype=np.float32)
            events = self._process(frame, real)
        if self._in_speech:
            end = self.tentative_end if at_pause else None
            events.append(self._end(self._processed if end is None else end))
        self._window.clear()
        return events

    def _process(self, samples: Float32Array, real: int) -> list[VadEvent]:
        """Score whole frames; only the first ``real`` samples are audio."""
        events: list[VadEvent] = []
        for offset in range(0, samples.size, FRAME_SAMPLES):
            start = self._processed
            p = self._vad.probability(samples[offset : offset + FRAME_SAMPLES])
            self._processed += min(FRAME_SAMPLES, real - offset)
            voiced = p >= (self._off if self._in_speech else self._on)
            if voiced:
                if self._voiced_run_start is None:
                    self._voiced_run_start = start
                if self._voiced and self._voiced[-1][1] == start:
                    self._voiced[-1][1] = self._processed
                else:
                    self._voiced.append([start, self._processed])
            else:
                self._voiced_run_start = None
            event = self._step(start, voiced)
            if event is not None:
                events.append(event)
        return events

    def _step(self, frame_start: int, voiced: bool) -> VadEvent | None:
        if self._in_speech:
            if voiced:
                self._silent_frames = 0
                self._last_voiced_end = self._processed
                return None
            self._silent_frames += 1
            short = self._last_voiced_end - self._onset < self._short_speech
            if self._silent_frames >= (self._short_end_frames if short else self._end_frames):
                return self._end(min(self._last_voiced_end + self._pad, self._processed))
            return None
        self._window.append((frame_start, voiced))
        if sum(v for _, v in self._window) < self._start_frames:
            return None
        onset = next(start for start, v in self._window if v)
        if self._voiced_run_start is not None:
            onset = min(onset, self._voiced_run_start)
        start_sample = max(onset - self._pad, 0, self._last_end)
        self._onset = onset
        self._in_speech = True
        self._silent_frames = 0
        self._last_voiced_end = self._processed
        self._window.clear()
        logger.debug("speech started at sample %d (onset %d)", start_sample, onset)
        return SpeechStarted(start_sample)

    def _end(self, end_sample: int) -> SpeechEnded:
        self._in_speech = False
        self._silent_frames = 0
        self._last_end = end_sample
        logger.debug("speech ended at sample %d", end_sample)
        return SpeechEnded(end_sample)
