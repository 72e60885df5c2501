"""Speaker labels for the words of a whole recording (Deepgram's pre-recorded
``diarize=true``); pure, as ``SpeakerTracker`` is: no I/O, no model.

A recording is labelled as it would be if it were streamed: the session's VAD runs over it
``FEED_SAMPLES`` at a time, the same ``SpeakerTracker`` plans windows over the speech found so
far, and each word is labelled (at its middle) as soon as the tracker can label a word ending
where it ends (``covered``), in the order a stream's finals would ask. So a file and the same
audio streamed get the same speakers, and the figures of ``bench/speakers.py`` hold for both.

The caller runs the encoder: ``next_job`` hands out the windows, ``receive`` takes their
vectors back, and ``labels`` holds every word's speaker once ``next_job`` says None.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from server.config import VadConfig
from server.core.speakers import EmbedJob, SpeakerConfig, SpeakerLabel, SpeakerTracker
from server.core.vad import SpeechEnded, SpeechStarted, VadSegmenter
from server.protocol.formats import SAMPLE_RATE_HZ

Float32Array = npt.NDArray[np.float32]
# The audio the VAD takes at a time: a stream's frames are 20-100 ms; the tracker plans a
# window every 400 ms (SpeakerConfig.hop_ms), so feeding less than that changes nothing.
FEED_SAMPLES = 3_200  # 200 ms


class RecordingSpeakers:
    """The speakers of one recording's words (``word_times``: start and end in seconds)."""

    def __init__(
        self,
        audio: Float32Array,
        word_times: Sequence[tuple[float, float]],
        *,
        vad: VadConfig,
        config: SpeakerConfig,
        request_id: str = "recording",
    ) -> None:
        self._audio = audio
        self._tracker = SpeakerTracker(config)
        self._vad = VadSegmenter(vad)
        self._request_id = request_id
        self._words = [
            (round(start * SAMPLE_RATE_HZ), round(end * SAMPLE_RATE_HZ))
            for start, end in word_times
        ]
        self._labels: list[SpeakerLabel | None] = [None] * len(self._words)
        self._labelled = 0  # words labelled so far, in order
        self._fed = 0
        self._flushed = False
        self._in_flight: EmbedJob | None = None
        self._next_id = 0

    @property
    def speakers(self) -> int:
        """Speakers found so far."""
        return self._tracker.speakers

    @property
    def labels(self) -> list[SpeakerLabel | None]:
        """Each word's speaker (None for a word labelled with no speech heard at all); complete
        once ``next_job`` returned None."""
        return list(self._labels)

    def next_job(self) -> EmbedJob | None:
        """The next windows for the speaker encoder; None when every word is labelled. Raises
        ``RuntimeError`` while a job is out (``receive`` it first)."""
        if self._in_flight is not None:
            raise RuntimeError("the previous job's vectors were not received")
        while True:
            planned = self._tracker.plan(self._fed)
            if planned is not None:
                start, end, starts = planned
                job = EmbedJob(
                    session_id=self._request_id,
                    job_id=self._next_id,
                    audio=self._audio[start:end],
                    start=start,
                    starts=tuple(s - start for s in starts),
                )
                self._next_id += 1
                self._in_flight = job
                return job
            if self._flushed:
                self._label_words(everything=True)
                return None
            self._feed()
            self._label_words(everything=False)

    def receive(self, job: EmbedJob, vectors: Float32Array | None) -> None:
        """The encoder's vectors for ``job``'s windows, in order; None: it failed (the words
        take what is known)."""
        if job is not self._in_flight:
            raise ValueError(f"job {job.job_id} is not the one handed out")
        self._in_flight = None
        self._tracker.receive([job.start + s for s in job.starts], vectors)
        self._label_words(everything=False)

    def _feed(self) -> None:
        if self._fed >= self._audio.size:
            events = self._vad.flush()
            self._flushed = True
        else:
            chunk = self._audio[self._fed : self._fed + FEED_SAMPLES]
            self._fed += chunk.size
            events = self._vad.receive(chunk)
        for event in events:
            if isinstance(event, SpeechStarted):
                self._tracker.open_utterance(event.start_sample)
            elif isinstance(event, SpeechEnded):
                self._tracker.close_utterance(event.end_sample)

    def _label_words(self, *, everything: bool) -> None:
        """Label the next words in order while the tracker can (all of them at the end)."""
        while self._labelled < len(self._words):
            start, end = self._words[self._labelled]
            if not everything and (end > self._fed or not self._tracker.covered(end)):
                return
            self._labels[self._labelled] = self._tracker.label((start + end) // 2)
            self._labelled += 1
