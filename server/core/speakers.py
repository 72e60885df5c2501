"""Who is speaking: online speaker assignment for one stream (pure; no I/O, no model).

The session's VAD finds utterances; this module plans 1.6 s windows over them (the length
the speaker encoder was trained on, one every ``hop_ms``), takes their d-vectors back
(``receive``) and labels stretches of the stream with speakers as it goes:

- Each utterance starts a segment. A segment's speaker is decided once its windows span
  ``decide_after_s`` (or another segment follows it, or its utterance ends): the mean of its
  windows against every speaker's centroid; the closest one at ``threshold`` or more, else a
  new speaker (at most ``max_speakers``; past that, the closest). Decided labels never
  change: they went out on finals.
- Inside an utterance, a window whose d-vector falls below ``change_threshold`` against the
  segment's mean, followed by ``change_windows - 1`` more such windows, is a change of
  speaker with no pause: a new segment starts where the first of them is mostly the new
  voice (half a window in, less half a hop).
- Every window of a decided segment joins its speaker's centroid.

A word can be labelled once the windows reaching ``label_delay`` past its end are in (no
change point found later can fall before it) and its segment is decided, or its utterance
has closed and all its windows are in (``covered``). The encoder itself is behind
``SpeakerEmbedder``; the session hands its jobs to whoever runs it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("server.core.speakers")

Float32Array = npt.NDArray[np.float32]
WINDOW_SAMPLES = 25_600  # 1.6 s: the speaker encoder's partial utterance (160 mel frames)
EMBEDDING_SIZE = 256


@dataclass(frozen=True)
class SpeakerConfig:
    """Speaker labels on finals and words (``--speakers``). The thresholds are cosine
    similarities of resemblyzer d-vectors, measured by ``bench/speakers.py --calibrate``
    on the shared recordings (bench/README.md has the figures)."""

    enabled: bool = False  # sessions get labels unless they opt out; off: none may ask
    # A segment whose mean is below this against every centroid is a new speaker.
    threshold: float = 0.72
    # A window below this against its segment's mean is a candidate change of speaker.
    change_threshold: float = 0.6
    # A window of a decided segment closer by this much to another speaker's centroid than to
    # its own speaker's is a candidate change too (a known voice coming back).
    change_margin: float = 0.1
    change_windows: int = 2  # consecutive candidate windows that make a change
    min_change_segment_s: float = 2.0  # a segment this long at least before it can change
    hop_ms: int = 400  # between window starts
    max_speakers: int = 8  # per session; past it a new voice joins the closest speaker
    # How far past a word's end the windows must reach before it is labelled (its utterance's
    # end does too). None: the least for which no change point found later can fall before
    # the word (``SpeakerTracker.label_delay``: 600 ms at a 400 ms hop); more only waits.
    label_delay_ms: int | None = None
    # Speech a segment's windows must span before its speaker is decided (a shorter utterance
    # is decided at its end): one 1.6 s window alone is too noisy a voice print...
    decide_after_s: float = 3.0
    # ... unless the windows so far (``decide_early_windows`` at least) are this close to one
    # known speaker and this much closer to it than to any other (a voice heard before,
    # recognised sooner). None: off. bench/speakers.py at 0.75 / 0.1: the p95 wait 2.6 -> 2.0 s
    # of audio and DER unchanged on the calibration set (seed 1), but 3 speakers' DER 12.2 ->
    # 14.9% (13.1% at 0.8) on the scored one (seed 0): two windows too often take a new voice
    # for a known one.
    decide_early_windows: int = 2
    decide_early_threshold: float | None = None
    decide_early_margin: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1 or not 0 < self.change_threshold < 1:
            raise ValueError("threshold and change_threshold must be in (0, 1)")
        if self.change_windows < 1:
            raise ValueError(f"change_windows must be >= 1; got {self.change_windows}")
        if self.min_change_segment_s < 0:
            raise ValueError("min_change_segment_s must be >= 0")
        if not 50 <= self.hop_ms <= WINDOW_SAMPLES * 1000 // SAMPLE_RATE_HZ:
            raise ValueError(f"hop_ms must be in [50, 1600]; got {self.hop_ms}")
        if not 1 <= self.max_speakers <= 64:
            raise ValueError(f"max_speakers must be in [1, 64]; got {self.max_speakers}")
        if self.label_delay_ms is not None and self.label_delay_ms < 0:
            raise ValueError("label_delay_ms must be >= 0 or None")
        if self.decide_after_s < 0:
            raise ValueError("decide_after_s must be >= 0")
        if self.decide_early_windows < 1:
            raise ValueError(f"decide_early_windows must be >= 1; got {self.decide_early_windows}")
        early = self.decide_early_threshold
        if (early is not None and not 0 < early <= 1) or self.decide_early_margin < 0:
            raise ValueError("decide_early_threshold must be in (0, 1], decide_early_margin >= 0")


class SpeakerEmbedder(Protocol):
    """The speaker encoder as the pipeline runs it (``server.speakers.encoder``): one
    L2-normalised d-vector per ``WINDOW_SAMPLES`` window of ``audio`` starting at each of
    ``starts`` (zero-padded past its end). Called from worker threads."""

    def embed_windows(self, audio: Float32Array, starts: list[int]) -> Float32Array: ...

    def embed_many(self, pieces: Sequence[tuple[Float32Array, list[int]]]) -> list[Float32Array]:
        """``embed_windows`` of each (audio, starts) piece, in one batch."""
        ...


@dataclass(frozen=True)
class EmbedJob:
    """Windows of one utterance for the speaker encoder: ``audio`` is the stream from sample
    ``start``; ``starts`` are the windows' offsets into it."""

    session_id: str
    job_id: int
    audio: Float32Array
    start: int
    starts: tuple[int, ...]


@dataclass(frozen=True)
class SpeakerLabel:
    speaker: int  # 0, 1, ... in order of appearance
    confidence: float  # cosine of the segment's mean to the speaker's centroid, in [0, 1]


@dataclass
class _Segment:
    start: int
    speaker: int | None = None
    confidence: float = 0.0
    total: Float32Array = field(default_factory=lambda: np.zeros(EMBEDDING_SIZE, np.float32))
    count: int = 0

    def mean(self) -> Float32Array:
        return _unit(self.total)


@dataclass
class _Utterance:
    start: int
    end: int | None = None
    next_start: int = 0  # the next window to plan
    planned_to: int = 0  # the end of the last window planned
    planning_done: bool = False  # closed, and every window of it planned
    planned: int = 0  # windows handed out
    received: int = 0  # windows whose vectors came back (or failed)
    embedded_to: int = 0  # the end of the last window received
    segments: list[_Segment] = field(default_factory=list)
    doubtful: list[tuple[int, Float32Array]] = field(default_factory=list)  # change candidates

    @property
    def finished(self) -> bool:
        # Closed, every window planned (a stream's audio may close an utterance while the
        # encoder is busy with an earlier one: none of its windows is planned yet), and heard.
        return self.end is not None and self.planning_done and self.received == self.planned


class SpeakerTracker:
    """The speakers of one stream so far; the session feeds it VAD boundaries and vectors."""

    def __init__(self, config: SpeakerConfig) -> None:
        self.config = config
        self._hop = config.hop_ms * SAMPLE_RATE_HZ // 1000
        self.label_delay = self._label_delay(config)
        self._utterances: list[_Utterance] = []
        self._centroids: list[Float32Array] = []  # sums of unit vectors, one per speaker

    @property
    def speakers(self) -> int:
        return len(self._centroids)

    def _label_delay(self, config: SpeakerConfig) -> int:
        """Samples past a word's end the windows must reach before it is labelled.

        A change point is placed half a window less half a hop after the start of the first
        window that sounds like someone else (``_change``). With no such window pending, the
        next one starts a hop after the last one heard, so a change found later falls at
        least ``WINDOW/2 - hop/2`` before the end of what was heard -- after any word that
        ends that far back (600 ms at a 400 ms hop). With ``change_windows`` 1 the tail
        window alone can make a change, and it may start only half a hop after the last
        regular one: half a window then."""
        if config.label_delay_ms is not None:
            return config.label_delay_ms * SAMPLE_RATE_HZ // 1000
        if config.change_windows == 1:
            return WINDOW_SAMPLES // 2
        return WINDOW_SAMPLES // 2 - self._hop // 2

    # -- the VAD's boundaries ----------------------------------------------------------------
    def open_utterance(self, start: int) -> None:
        self.close_utterance(start)
        utt = _Utterance(start, next_start=start, planned_to=start, embedded_to=start)
        utt.segments.append(_Segment(start))
        self._utterances.append(utt)

    def close_utterance(self, end: int) -> None:
        if self._utterances and self._utterances[-1].end is None:
            utt = self._utterances[-1]
            utt.end = max(end, utt.start)

    # -- windows -----------------------------------------------------------------------------
    def plan(self, available_end: int) -> tuple[int, int, list[int]] | None:
        """The next windows to embed, as (audio start, audio end, window starts in stream
        samples), all of one utterance: those whose audio is in (``available_end``), and at the
        end of an utterance one more so that its last stretch is heard. None: nothing due."""
        for utt in self._utterances:
            starts = self._due(utt, available_end)
            if starts:
                utt.planned += len(starts)
                stop = min(starts[-1] + WINDOW_SAMPLES, utt.end or available_end)
                return starts[0], stop, starts
        return None

    def _due(self, utt: _Utterance, available_end: int) -> list[int]:
        if utt.planning_done:
            return []
        starts: list[int] = []
        end = utt.end if utt.end is not None else available_end
        while utt.next_start + WINDOW_SAMPLES <= end:
            starts.append(utt.next_start)
            utt.planned_to = utt.next_start + WINDOW_SAMPLES
            utt.next_start += self._hop
        if utt.end is not None:
            utt.planning_done = True
            # The tail the regular windows did not reach: one window ending at the
            # utterance's end (a short utterance's only window, zero-padded past it).
            first = utt.planned == 0 and not starts
            if utt.end > utt.start and (first or utt.end - utt.planned_to > self._hop // 2):
                starts.append(max(utt.start, utt.end - WINDOW_SAMPLES))
        return starts

    def receive(self, starts: list[int], vectors: Float32Array | None) -> None:
        """The vectors of planned windows (in order); None when the encoder failed for them
        (they count as heard, with nothing learnt)."""
        for k, start in enumerate(starts):
            utt = self._utterance_at(start)
            if utt is None:
                continue
            utt.received += 1
            utt.embedded_to = max(utt.embedded_to, start + WINDOW_SAMPLES)
            if vectors is not None:
                self._add_window(utt, start, _unit(vectors[k]))
        for utt in self._utterances:
            if utt.finished:
                self._flush_doubtful(utt)
            self._decide_heard(utt)

    def _decide_heard(self, utt: _Utterance) -> None:
        """Decide the speaker of each segment heard long enough (``decide_after_s``, a
        clearly known voice, a change after it, its utterance's end) as its windows come in,
        not when a word first asks: what is decided then does not depend on when the finals
        came (on a loaded server, later, from more windows), so one stream is labelled the
        same at any speed."""
        for seg in utt.segments:
            if seg.speaker is None and seg.count and self._heard_enough(utt, seg):
                self._decide(seg)

    def _heard_enough(self, utt: _Utterance, seg: _Segment) -> bool:
        spanned = (seg.count - 1) * self._hop + WINDOW_SAMPLES
        return (
            seg is not utt.segments[-1]
            or utt.finished
            or spanned >= self.config.decide_after_s * SAMPLE_RATE_HZ
            or self._known_voice(seg)
        )

    def _add_window(self, utt: _Utterance, start: int, vector: Float32Array) -> None:
        c = self.config
        seg = utt.segments[-1]
        if start < seg.start - self._hop:
            return  # a tail window reaching back before a change point: it mixes two voices
        long_enough = (start - seg.start) >= c.min_change_segment_s * SAMPLE_RATE_HZ
        if seg.count and long_enough and self._differs(seg, vector):
            utt.doubtful.append((start, vector))
            if len(utt.doubtful) >= c.change_windows:
                self._change(utt)
            return
        self._flush_doubtful(utt)
        self._join(seg, vector)

    def _differs(self, seg: _Segment, vector: Float32Array) -> bool:
        """Whether ``vector`` sounds like someone other than ``seg``'s speaker."""
        c = self.config
        if seg.speaker is None:
            return float(vector @ seg.mean()) < c.change_threshold
        scores = [float(vector @ _unit(centroid)) for centroid in self._centroids]
        own = scores[seg.speaker]
        others = [x for k, x in enumerate(scores) if k != seg.speaker]
        return own < c.change_threshold or (bool(others) and max(others) - own >= c.change_margin)

    def _flush_doubtful(self, utt: _Utterance) -> None:
        """Candidate windows that were not followed by enough others: the same voice."""
        for _, vector in utt.doubtful:
            self._join(utt.segments[-1], vector)
        utt.doubtful = []

    def _change(self, utt: _Utterance) -> None:
        first = utt.doubtful[0][0]
        at = first + WINDOW_SAMPLES // 2 - self._hop // 2
        seg = _Segment(max(at, utt.segments[-1].start + 1))
        utt.segments.append(seg)
        logger.debug("speaker change at sample %d", seg.start)
        for _, vector in utt.doubtful:
            self._join(seg, vector)
        utt.doubtful = []

    def _join(self, seg: _Segment, vector: Float32Array) -> None:
        seg.total += vector
        seg.count += 1
        if seg.speaker is not None:
            self._centroids[seg.speaker] += vector

    # -- labels ------------------------------------------------------------------------------
    def covered(self, sample: int) -> bool:
        """Whether a word ending at ``sample`` can be labelled now."""
        utt = self._utterance_at(sample) or self._nearest(sample)
        if utt is None:
            return True  # no speech tracked at all: nothing to wait for
        if utt.finished:
            return True
        reach = sample + self.label_delay
        if utt.end is not None:
            reach = min(reach, utt.end)
        if utt.embedded_to < reach or utt.doubtful:
            return False
        seg = self._segment_at(utt, sample)
        return seg.speaker is not None or seg is not utt.segments[-1]

    def _known_voice(self, seg: _Segment) -> bool:
        """Whether ``seg``'s windows so far are decisively one known speaker's
        (``decide_early_*``): its speaker can be decided before ``decide_after_s``."""
        c = self.config
        if c.decide_early_threshold is None:
            return False
        if seg.count < c.decide_early_windows or not self._centroids:
            return False
        mean = seg.mean()
        scores = sorted(
            (float(mean @ _unit(centroid)) for centroid in self._centroids), reverse=True
        )
        runner_up = scores[1] if len(scores) > 1 else -1.0
        return (
            scores[0] >= c.decide_early_threshold and scores[0] - runner_up >= c.decide_early_margin
        )

    @staticmethod
    def _segment_at(utt: _Utterance, sample: int) -> _Segment:
        seg = utt.segments[0]
        for candidate in utt.segments:
            if candidate.start <= sample:
                seg = candidate
        return seg

    def label(self, sample: int) -> SpeakerLabel | None:
        """The speaker at ``sample`` (a word's middle), deciding its segment's speaker if
        nobody asked before. None when no window of speech has been heard at all."""
        utt = self._utterance_at(sample) or self._nearest(sample)
        if utt is None:
            return None
        seg = self._segment_at(utt, sample)
        if seg.speaker is None:
            if not seg.count:
                seg = next((s for s in reversed(utt.segments) if s.count), seg)
            if not seg.count:
                return self._fallback()
            self._decide(seg)
        assert seg.speaker is not None
        return SpeakerLabel(seg.speaker, seg.confidence)

    def _decide(self, seg: _Segment) -> None:
        mean = seg.mean()
        scores = [float(mean @ _unit(c)) for c in self._centroids]
        best = int(np.argmax(scores)) if scores else -1
        if scores and (
            scores[best] >= self.config.threshold or len(scores) >= self.config.max_speakers
        ):
            seg.speaker, seg.confidence = best, max(0.0, scores[best])
            self._centroids[best] += seg.total
        else:
            seg.speaker, seg.confidence = len(self._centroids), 1.0
            self._centroids.append(seg.total.copy())
            logger.debug("speaker %d opened (best match %.3f)", seg.speaker, max(scores, default=0))

    def _fallback(self) -> SpeakerLabel | None:
        """A stretch with no window of its own: the last decided speaker's."""
        for utt in reversed(self._utterances):
            for seg in reversed(utt.segments):
                if seg.speaker is not None:
                    return SpeakerLabel(seg.speaker, 0.0)
        return None

    def _utterance_at(self, sample: int) -> _Utterance | None:
        for utt in reversed(self._utterances):
            if utt.start <= sample and (utt.end is None or sample < utt.end):
                return utt
        return None

    def _nearest(self, sample: int) -> _Utterance | None:
        """The utterance closest to ``sample``: word times are estimates and may stray out of
        the VAD's bounds."""
        if not self._utterances:
            return None

        def distance(u: _Utterance) -> int:
            # An open utterance reaches on to the stream's end: a word before it is as far
            # from it as from its start (Whisper stretches an utterance's last word through
            # the pause after it, so its middle often lies in the gap before the next one).
            if sample < u.start:
                return u.start - sample
            return 0 if u.end is None else max(0, sample - u.end)

        return min(self._utterances, key=distance)

    @property
    def all_planned(self) -> bool:
        """Every utterance is closed and all its windows were handed out."""
        return all(utt.planning_done for utt in self._utterances)

    # -- memory ------------------------------------------------------------------------------
    def keep_from(self) -> int | None:
        """The earliest stream sample a window still to plan needs (the session keeps its
        audio that far back); None: none."""
        for utt in self._utterances:
            if not utt.planning_done:
                # The tail window may reach back a window's length from the end.
                return max(utt.start, utt.next_start - WINDOW_SAMPLES)
        return None

    def forget_before(self, sample: int) -> None:
        """Drop utterances that ended before ``sample`` and are finished (their labels were
        given); the speakers' centroids stay."""
        while (
            len(self._utterances) > 1
            and self._utterances[0].finished
            and self._utterances[0].end is not None
            and self._utterances[0].end <= sample
        ):
            self._utterances.pop(0)


def _unit(v: Float32Array) -> Float32Array:
    norm = float(np.linalg.norm(v))
    return (v / norm).astype(np.float32) if norm > 0 else v.astype(np.float32)
