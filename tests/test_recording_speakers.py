"""Speaker labels for a whole recording's words (server/core/recording_speakers.py), with the
real encoder on real voices (two shared readers, ``tests.helpers.two_readers``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.corpus import load_clip
from server.config import VadConfig
from server.core.recording_speakers import RecordingSpeakers
from server.core.speakers import SpeakerConfig, SpeakerLabel
from server.protocol.formats import SAMPLE_RATE_HZ
from server.speakers.encoder import SpeakerEncoder
from tests.helpers import FIRST_READER, two_readers


@pytest.fixture(scope="module")
def encoder() -> SpeakerEncoder:
    return SpeakerEncoder.load()


def words_over(start_s: float, end_s: float) -> list[tuple[float, float]]:
    """A word every 0.4 s (0.3 s long) from ``start_s`` to ``end_s``: stand-ins for Whisper's
    word times, which these tests do not need to be right."""
    return [(t, t + 0.3) for t in np.arange(start_s, end_s - 0.3, 0.4)]


def label(
    audio: np.ndarray, words: list[tuple[float, float]], encoder: SpeakerEncoder
) -> tuple[list[SpeakerLabel | None], int]:
    recording = RecordingSpeakers(audio, words, vad=VadConfig(), config=SpeakerConfig(enabled=True))
    jobs = 0
    while (job := recording.next_job()) is not None:
        jobs += 1
        recording.receive(job, encoder.embed_windows(job.audio, list(job.starts)))
    assert jobs > 1  # windows came in several jobs, as the speech was found
    return recording.labels, recording.speakers


@pytest.mark.parametrize("gap_s", [1.0, 0.0])
def test_two_readers_words_get_their_readers_speaker(
    speech_dir: Path, encoder: SpeakerEncoder, gap_s: float
) -> None:
    """With a pause between them, and back to back (one utterance for the VAD: only a change
    point splits it): the first reader's words are speaker 0, the second's speaker 1, except
    within a second of the seam, where a change point may land."""
    talk = two_readers(speech_dir, gap_s=gap_s)
    words = words_over(0.6, talk.audio.size / SAMPLE_RATE_HZ - 1.0)
    labels, speakers = label(talk.audio, words, encoder)
    assert speakers == 2
    scored = [
        (w, lab)
        for w, lab in zip(words, labels, strict=True)
        if abs((w[0] + w[1]) / 2 - talk.boundary_s) > 1.0
    ]
    wrong = [
        (w, lab)
        for w, lab in scored
        if lab is None or lab.speaker != (0 if w[1] <= talk.boundary_s else 1)
    ]
    assert len(wrong) <= len(scored) // 20, wrong  # 95% of words, issue #33's target
    assert all(lab is not None and 0 <= lab.confidence <= 1 for _, lab in scored)


def test_one_reader_is_one_speaker(speech_dir: Path, encoder: SpeakerEncoder) -> None:
    clip = load_clip(speech_dir / FIRST_READER)
    more = load_clip(speech_dir / FIRST_READER.replace("0002", "0003"))  # the same reader
    pause = np.zeros(SAMPLE_RATE_HZ, np.float32)
    audio = np.concatenate([pause, clip, pause, more, pause])
    words = words_over(1.0, audio.size / SAMPLE_RATE_HZ - 1.0)
    labels, speakers = label(audio, words, encoder)
    assert speakers == 1 and {lab.speaker for lab in labels if lab is not None} == {0}


def test_a_recording_without_speech_labels_nothing_and_jobs_go_one_at_a_time(
    speech_dir: Path, encoder: SpeakerEncoder
) -> None:
    silent = RecordingSpeakers(
        np.zeros(5 * SAMPLE_RATE_HZ, np.float32),
        [(1.0, 1.5)],
        vad=VadConfig(),
        config=SpeakerConfig(enabled=True),
    )
    assert silent.next_job() is None and silent.labels == [None]
    talk = two_readers(speech_dir)
    recording = RecordingSpeakers(
        talk.audio, [(1.0, 1.3)], vad=VadConfig(), config=SpeakerConfig(enabled=True)
    )
    job = recording.next_job()
    assert job is not None
    with pytest.raises(RuntimeError, match="not received"):
        recording.next_job()
    recording.receive(job, None)  # a failed encoder call: nothing learnt, nothing lost
    with pytest.raises(ValueError, match="not the one"):
        recording.receive(job, None)
