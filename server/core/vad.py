"""Voice activity segmentation: 16 kHz samples in, speech start/end events out (webrtcvad, or
Silero through ``server.turns.silero_vad``).

Offsets are sample indices in the session's 16 kHz stream (sample 0 is the first sample the
segmenter received), so the caller can cut its own audio buffer with them directly.

An utterance opens when at least ``speech_start_ms`` of the frames in the last
``speech_start_window_ms`` are voiced (hysteresis against clicks and breaths), and closes after
``speech_end_silence_ms`` of consecutive unvoiced frames (``short_speech_end_silence_ms`` while
the speech so far is shorter than ``short_speech_s``: a short phrase and a pause are more
often the start of a sentence than all of it). Both ends are widened by
``speech_pad_ms`` so word onsets and trailing consonants are not clipped.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import webrtcvad

from server.config import VadConfig
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("server.core.vad")

# A fresh webrtcvad calls the first ~70-120 ms after digital silence speech, even for faint
# noise (measured on webrtcvad-wheels 2.0.14: 3-4 frames of 30 ms at every aggressiveness).
# Its verdicts only count once this much non-silent audio has gone through it.
_WARMUP_MS = 150


@dataclass(frozen=True)
class SpeechStarted:
    """Speech began; ``start_sample`` already includes the leading pad."""

    start_sample: int


@dataclass(frozen=True)
class SpeechEnded:
    """Speech ended; ``end_sample`` (exclusive) includes the trailing pad."""

    end_sample: int


VadEvent = SpeechStarted | SpeechEnded
# One frame's verdict: 16-bit mono PCM at 16 kHz in, voiced or not out. webrtcvad's by default;
# the core's recorded-case tests replay the verdicts of a real run with no audio.
FrameClassifier = Callable[[bytes], bool]


class WebrtcVoicing:
    """webrtcvad's verdict on each 10, 20 or 30 ms frame (``VadConfig.frame_ms``), or a
    recorded classifier's. Its verdicts count only after ``_WARMUP_MS`` of non-silent audio."""

    def __init__(self, config: VadConfig, classifier: FrameClassifier | None = None) -> None:
        if classifier is None:
            vad = webrtcvad.Vad(config.aggressiveness)

            def classifier(frame: bytes) -> bool:
                return bool(vad.is_speech(frame, SAMPLE_RATE_HZ))

        self._classify = classifier
        self.frame_samples = config.frame_ms * SAMPLE_RATE_HZ // 1000
        self._warmup_frames = math.ceil(_WARMUP_MS / config.frame_ms)

    def voiced(self, frame: npt.NDArray[np.float32], in_speech: bool) -> tuple[bool, bool]:
        """(the verdict, whether it counts yet). webrtcvad accepts only 10, 20 or 30 ms frames
        of 16-bit mono PCM at 8, 16, 32 or 48 kHz; VadConfig limits frame_ms to those and
        ingest resamples to 16 kHz."""
        pcm = pcm_s16le_bytes(frame)
        heard = self._classify(pcm)
        if self._warmup_frames:
            if pcm.count(0) != len(pcm):
                self._warmup_frames -= 1
            return heard, False
        return heard, True


class FrameVoicing(Protocol):
    """One stream's verdict on each frame of its audio: webrtcvad's (``WebrtcVoicing``) or
    Silero's (``server.turns.silero_vad.SileroVoicing``)."""

    @property
    def frame_samples(self) -> int:
        """The frame the detector takes, in 16 kHz samples."""
        ...

    def voiced(self, frame: npt.NDArray[np.float32], in_speech: bool) -> tuple[bool, bool]:
        """Whether ``frame`` is speech (``in_speech``: an utterance is open, for a detector
        with hysteresis), and whether that verdict counts yet (a detector that must hear
        audio before it can be trusted says False until then)."""
        ...


class VadSegmenter:
    """Frames a 16 kHz float32 stream for a voice activity detector (webrtcvad unless
    ``voicing`` names another) and turns its verdicts into utterances.

    Feed any number of samples at a time with ``receive``; incomplete frames wait for the next
    call. Events come out in stream order, a ``SpeechStarted`` always followed by exactly one
    ``SpeechEnded`` before the next ``SpeechStarted``.
    """

    def __init__(
        self,
        config: VadConfig,
        classifier: FrameClassifier | None = None,
        *,
        voicing: FrameVoicing | None = None,
    ) -> None:
        self._voicing = voicing or WebrtcVoicing(config, classifier)
        self._frame_len = self._voicing.frame_samples
        frame_ms = self._frame_len * 1000 / SAMPLE_RATE_HZ
        # Durations become whole frames, rounded up so a threshold is never undercut.
        self._start_frames = math.ceil(config.speech_start_ms / frame_ms)
        window_frames = max(math.ceil(config.speech_start_window_ms / frame_ms), self._start_frames)
        self._end_frames = math.ceil(config.speech_end_silence_ms / frame_ms)
        self._short_end_frames = max(
            self._end_frames, math.ceil(config.short_speech_end_silence_ms / frame_ms)
        )
        self._short_speech = round(config.short_speech_s * SAMPLE_RATE_HZ)
        self._pad = config.speech_pad_ms * SAMPLE_RATE_HZ // 1000
        self._voiced_run_start: int | None = None  # first frame of the current raw-voiced run
        self._pending = np.zeros(0, dtype=np.float32)
        self._processed = 0  # real (not zero-padded) samples that went through the VAD
        # (frame start sample, voiced) for the start-hysteresis window, outside speech only.
        self._window: collections.deque[tuple[int, bool]] = collections.deque(maxlen=window_frames)
        self._in_speech = False
        self._silent_frames = 0
        self._last_voiced_end = 0
        self._last_end = 0  # end_sample of the previous utterance; the next one may not overlap
        self._onset = 0  # first voiced sample of the open utterance
        # [start, end) sample runs of voiced frames (after warm-up), oldest first, kept from
        # ``forget_before``'s sample on: how much speech lies between two points of the stream.
        self._voiced: collections.deque[list[int]] = collections.deque()

    @property
    def in_speech(self) -> bool:
        """Whether an utterance is open (a ``SpeechStarted`` without its ``SpeechEnded``)."""
        return self._in_speech

    @property
    def tentative_end(self) -> int | None:
        """Where the open utterance ends if the silence heard now lasts to the endpoint (the
        ``end_sample`` its ``SpeechEnded`` would carry), once that silence has covered the
        trailing pad; None in speech, outside an utterance, or before then. A decode of the
        utterance up to here can start before the endpoint (the speculative closing decode)."""
        if not self._in_speech or self._silent_frames == 0:
            return None
        end = self._last_voiced_end + self._pad
        return end if self._processed >= end else None

    @property
    def samples_processed(self) -> int:
        """Samples that have been through the VAD; buffered partial frames do not count."""
        return self._processed

    def voiced_s(self, start_sample: int, end_sample: int) -> float:
        """Seconds of voiced frames between two samples of the stream (those still kept)."""
        total = 0
        for run_start, run_end in self._voiced:
            total += max(0, min(run_end, end_sample) - max(run_start, start_sample))
        return total / SAMPLE_RATE_HZ

    def forget_before(self, sample: int) -> None:
        """Drop the record of voiced frames that end before ``sample``."""
        while self._voiced and self._voiced[0][1] <= sample:
            self._voiced.popleft()

    def receive(self, samples: npt.NDArray[np.float32]) -> list[VadEvent]:
        """Add 16 kHz mono samples and return the events that complete frames produced."""
        if samples.ndim != 1:
            raise ValueError(f"expected mono samples (1-D); got shape {samples.shape}")
        if self._pending.size:
            buffered = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        else:
            buffered = samples.astype(np.float32, copy=False)
        whole = buffered.size - buffered.size % self._frame_len
        self._pending = buffered[whole:].copy()
        return self._process(buffered[:whole], whole)

    def flush(self, *, at_pause: bool = False) -> list[VadEvent]:
        """Process the buffered partial frame and close an open utterance at the stream's end;
        with ``at_pause``, where its ``tentative_end`` says when the stream ends in a silence
        that covered the pad (as the endpoint would have, so a decode begun there holds).

        The partial frame is zero-padded to a whole frame for webrtcvad, but only its real
        samples count. The segmenter can keep receiving afterwards; frames then start at the
        flush point.
        """
        events: list[VadEvent] = []
        if self._pending.size:
            real = self._pending.size
            frame = np.zeros(self._frame_len, dtype=np.float32)
            frame[:real] = self._pending
            self._pending = np.zeros(0, dtype=np.float32)
            events = self._process(frame, real)
        if self._in_speech:
            # The speaker may still be talking: keep everything up to the end of the stream.
            end = self.tentative_end if at_pause else None
            events.append(self._end(self._processed if end is None else end))
        self._window.clear()
        return events

    def _process(self, samples: npt.NDArray[np.float32], real: int) -> list[VadEvent]:
        """Run whole frames through the detector; only the first ``real`` samples are audio."""
        events: list[VadEvent] = []
        for offset in range(0, samples.size, self._frame_len):
            start = self._processed
            frame = samples[offset : offset + self._frame_len]
            heard, counts = self._voicing.voiced(frame, self._in_speech)
            self._processed += min(self._frame_len, real - offset)
            if heard:
                if self._voiced_run_start is None:
                    self._voiced_run_start = start
            else:
                self._voiced_run_start = None
            voiced = heard and counts
            if voiced:
                if self._voiced and self._voiced[-1][1] == start:
                    self._voiced[-1][1] = self._processed
                else:
                    self._voiced.append([start, self._processed])
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
            # Only differs after a warm-up: speech from the first sample keeps its onset.
            onset = min(onset, self._voiced_run_start)
        start_sample = max(onset - self._pad, 0, self._last_end)
        self._onset = onset
        self._in_speech = True
        self._silent_frames = 0
        self._last_voiced_end = self._processed  # this frame is voiced: it tipped the count
        self._window.clear()
        logger.debug("speech started at sample %d (onset %d)", start_sample, onset)
        return SpeechStarted(start_sample)

    def _end(self, end_sample: int) -> SpeechEnded:
        self._in_speech = False
        self._silent_frames = 0
        self._last_end = end_sample
        logger.debug("speech ended at sample %d", end_sample)
        return SpeechEnded(end_sample)
