"""Online speaker assignment (server/core/speakers.py) with the real encoder on real voices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.corpus import load_clip
from server.core.speakers import WINDOW_SAMPLES, SpeakerConfig, SpeakerTracker
from server.speakers.encoder import SpeakerEncoder

READER_A = "librispeech_test-other/367-130732-0002.wav"  # 11.3 s
READER_A2 = "librispeech_test-other/367-130732-0003.wav"  # 15.0 s
READER_B = "ljspeech/LJ001-0003.wav"  # 9.7 s


@pytest.fixture(scope="module")
def encoder() -> SpeakerEncoder:
    return SpeakerEncoder.load()


def run(tracker: SpeakerTracker, audio: np.ndarray, encoder: SpeakerEncoder) -> None:
    while (plan := tracker.plan(audio.size)) is not None:
        start, end, starts = plan
        tracker.receive(
            starts, encoder.embed_windows(audio[start:end], [s - start for s in starts])
        )


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="threshold"):
        SpeakerConfig(threshold=1.5)
    with pytest.raises(ValueError, match="hop_ms"):
        SpeakerConfig(hop_ms=2000)
    with pytest.raises(ValueError, match="max_speakers"):
        SpeakerConfig(max_speakers=0)


def test_windows_cover_an_utterance_and_its_tail() -> None:
    tracker = SpeakerTracker(SpeakerConfig(hop_ms=400))
    tracker.open_utterance(0)
    assert tracker.plan(WINDOW_SAMPLES - 1) is None
    assert tracker.plan(WINDOW_SAMPLES) == (0, WINDOW_SAMPLES, [0])
    tracker.close_utterance(42_000)
    _, end, starts = tracker.plan(48_000) or (0, 0, [])
    # Windows every 6400 samples while they fit, then one ending at the utterance's end
    # (more than half a hop was left unheard).
    assert starts == [6400, 12_800, 42_000 - WINDOW_SAMPLES]
    assert end == 42_000 and tracker.plan(48_000) is None and tracker.all_planned


def test_a_short_utterance_gets_one_window() -> None:
    tracker = SpeakerTracker(SpeakerConfig())
    tracker.open_utterance(1000)
    tracker.close_utterance(9000)
    assert tracker.plan(20_000) == (1000, 9000, [1000])


def test_two_readers_get_two_speakers_and_one_reader_keeps_one(
    speech_dir: Path, encoder: SpeakerEncoder
) -> None:
    gap = np.zeros(8000, np.float32)
    a, b, a2 = (load_clip(speech_dir / f) for f in (READER_A, READER_B, READER_A2))
    audio = np.concatenate([a, gap, b, gap, a2])
    tracker = SpeakerTracker(SpeakerConfig())
    bounds = []
    at = 0
    for clip in (a, b, a2):
        tracker.open_utterance(at)
        tracker.close_utterance(at + clip.size)
        bounds.append((at, at + clip.size))
        at += clip.size + gap.size
    run(tracker, audio, encoder)
    labels = [tracker.label((s + e) // 2) for s, e in bounds]
    assert all(label is not None for label in labels)
    speakers = [label.speaker for label in labels if label is not None]
    assert speakers == [0, 1, 0], labels
    assert tracker.speakers == 2


def test_a_change_without_a_pause_splits_the_utterance(
    speech_dir: Path, encoder: SpeakerEncoder
) -> None:
    """Two readers back to back in one VAD utterance: words on either side get their own."""
    a, b = load_clip(speech_dir / READER_A), load_clip(speech_dir / READER_B)
    audio = np.concatenate([a, b])
    tracker = SpeakerTracker(SpeakerConfig())
    tracker.open_utterance(0)
    # The first reader is labelled while the utterance goes on (as a final asks).
    run_to = a.size
    while (plan := tracker.plan(run_to)) is not None:
        start, end, starts = plan
        tracker.receive(
            starts, encoder.embed_windows(audio[start:end], [s - start for s in starts])
        )
    assert tracker.covered(a.size // 2)
    first = tracker.label(a.size // 2)
    tracker.close_utterance(audio.size)
    run(tracker, audio, encoder)
    second = tracker.label(a.size + b.size // 2)
    assert first is not None and second is not None
    assert (first.speaker, second.speaker) == (0, 1)
    # The change is placed within a window's length of where the voices meet.
    change_labels = [
        tracker.label(s) for s in range(a.size - WINDOW_SAMPLES, a.size + WINDOW_SAMPLES, 1600)
    ]
    flips = [k for k in range(1, len(change_labels)) if change_labels[k] != change_labels[k - 1]]
    assert flips, "no change found around the meeting point"


def test_max_speakers_bounds_the_speakers(speech_dir: Path, encoder: SpeakerEncoder) -> None:
    a, b = load_clip(speech_dir / READER_A), load_clip(speech_dir / READER_B)
    tracker = SpeakerTracker(SpeakerConfig(max_speakers=1))
    tracker.open_utterance(0)
    tracker.close_utterance(a.size)
    tracker.open_utterance(a.size)
    tracker.close_utterance(a.size + b.size)
    run(tracker, np.concatenate([a, b]), encoder)
    assert tracker.label(a.size // 2) is not None
    label = tracker.label(a.size + b.size // 2)
    assert label is not None and label.speaker == 0 and tracker.speakers == 1


def test_words_wait_until_their_windows_are_in(speech_dir: Path, encoder: SpeakerEncoder) -> None:
    a = load_clip(speech_dir / READER_A)
    tracker = SpeakerTracker(SpeakerConfig(label_delay_ms=1000))
    tracker.open_utterance(0)
    assert not tracker.covered(8000)
    run(tracker, a[:32_000], encoder)  # 2 s: one window, too little to decide
    assert not tracker.covered(8000)
    run(tracker, a, encoder)
    assert tracker.covered(8000)


def test_an_utterance_closed_before_its_windows_were_planned_is_not_covered() -> None:
    """A stream at full speed closes its next utterance while the encoder is busy with the
    one before: none of its windows planned yet, its words must wait for them (they were
    labelled at once with the last speaker, confidence 0)."""
    tracker = SpeakerTracker(SpeakerConfig())
    tracker.open_utterance(0)
    tracker.close_utterance(48_000)
    assert not tracker.covered(40_000)  # nothing planned: nothing heard
    planned = tracker.plan(48_000)
    assert planned is not None and tracker.plan(48_000) is None
    assert not tracker.covered(40_000)  # planned, not received
    _, _, starts = planned
    tracker.receive(starts, None)
    assert tracker.covered(40_000)


def test_a_word_in_the_pause_before_an_open_utterance_goes_to_the_nearer_one(
    speech_dir: Path, encoder: SpeakerEncoder
) -> None:
    """Whisper stretches the last word of a turn through the pause after it: its middle
    lies in the gap, nearer the first reader's end than the second's start. While the second
    utterance is still open it must not win for being open (it did: S2 got the word)."""
    a = load_clip(speech_dir / READER_A)
    b = load_clip(speech_dir / READER_B)
    gap = np.zeros(16_000, np.float32)
    audio = np.concatenate([a, gap, b])
    tracker = SpeakerTracker(SpeakerConfig())
    tracker.open_utterance(0)
    tracker.close_utterance(a.size)
    tracker.open_utterance(a.size + gap.size)  # still open: the second reader goes on
    run(tracker, audio, encoder)
    assert tracker.label(a.size + gap.size // 4).speaker == 0  # type: ignore[union-attr]
    assert tracker.label(a.size + gap.size + 16_000).speaker == 1  # type: ignore[union-attr]


def test_the_label_delay_is_the_least_no_later_change_can_precede() -> None:
    """Half a window less half a hop (a change is placed that far into the first window
    that sounds like someone else); half a window when the tail window alone can change."""
    assert SpeakerTracker(SpeakerConfig()).label_delay == 9_600  # 600 ms at a 400 ms hop
    assert SpeakerTracker(SpeakerConfig(hop_ms=200)).label_delay == 11_200
    assert SpeakerTracker(SpeakerConfig(change_windows=1)).label_delay == WINDOW_SAMPLES // 2
    assert SpeakerTracker(SpeakerConfig(label_delay_ms=1000)).label_delay == 16_000


def test_a_label_given_as_soon_as_covered_is_the_one_given_at_the_end(
    speech_dir: Path, encoder: SpeakerEncoder
) -> None:
    """Two readers back to back in one utterance, labelled 0.2 s at a time as soon as the
    tracker lets a word ending there be labelled: once all windows are in, every stretch
    still has the label it got (no change point found later fell before it)."""
    a, b = load_clip(speech_dir / READER_A), load_clip(speech_dir / READER_B)
    audio = np.concatenate([a, b])
    tracker = SpeakerTracker(SpeakerConfig())
    tracker.open_utterance(0)
    given: dict[int, int] = {}
    piece = 3_200
    for fed in range(piece, audio.size + 1, piece):
        while (plan := tracker.plan(fed)) is not None:
            start, end, starts = plan
            tracker.receive(
                starts, encoder.embed_windows(audio[start:end], [s - start for s in starts])
            )
        at = len(given) * piece
        while at + piece <= fed and tracker.covered(at + piece):
            label = tracker.label(at + piece // 2)
            assert label is not None
            given[at] = label.speaker
            at += piece
    tracker.close_utterance(audio.size)
    run(tracker, audio, encoder)
    again = {at: tracker.label(at + piece // 2) for at in given}
    assert {at: label.speaker for at, label in again.items() if label} == given
    assert set(given.values()) == {0, 1}  # the change was found while labelling went on


def test_a_known_voice_is_decided_sooner_than_a_new_one(
    speech_dir: Path, encoder: SpeakerEncoder
) -> None:
    """The first words of an utterance wait for ``decide_after_s`` of its speech, unless
    (``decide_early_threshold``) its windows so far are clearly a speaker heard before."""
    a, a2, b = (load_clip(speech_dir / f) for f in (READER_A, READER_A2, READER_B))
    gap = np.zeros(8000, np.float32)
    config = SpeakerConfig(decide_early_threshold=0.75)  # off by default
    waited = {}
    for name, second in (("same reader", a2), ("new reader", b)):
        audio = np.concatenate([a, gap, second])
        tracker = SpeakerTracker(config)
        tracker.open_utterance(0)
        tracker.close_utterance(a.size)
        run(tracker, audio[: a.size], encoder)
        assert tracker.label(a.size // 2) is not None
        tracker.open_utterance(a.size + gap.size)
        run_to = a.size + gap.size
        while not tracker.covered(a.size + gap.size + 8000):  # a word 0.5 s in
            run_to += 1600
            while (plan := tracker.plan(run_to)) is not None:
                start, end, starts = plan
                tracker.receive(
                    starts, encoder.embed_windows(audio[start:end], [s - start for s in starts])
                )
        waited[name] = (run_to - a.size - gap.size) / 16_000
        label = tracker.label(a.size + gap.size + 8000)
        assert label is not None and label.speaker == (0 if name == "same reader" else 1)
    assert waited["same reader"] < config.decide_after_s <= waited["new reader"], waited


def test_a_segment_is_decided_once_heard_long_enough_not_when_a_word_first_asks(
    speech_dir: Path, encoder: SpeakerEncoder
) -> None:
    """The decision is made from the windows of the first ``decide_after_s`` of a segment,
    with nobody asking: a loaded server's finals, which ask later, get the same speakers as a
    quiet one's."""
    config = SpeakerConfig()
    a, b = load_clip(speech_dir / READER_A), load_clip(speech_dir / READER_B)
    gap = np.zeros(8000, np.float32)
    audio = np.concatenate([a, gap, b])
    tracker = SpeakerTracker(config)
    tracker.open_utterance(0)
    decided_at: list[float] = []
    for fed in range(1600, audio.size + 1, 1600):
        if a.size + 1600 <= fed < a.size + 3200:
            tracker.close_utterance(a.size)
            tracker.open_utterance(a.size + gap.size)
        while (plan := tracker.plan(fed)) is not None:
            start, end, starts = plan
            tracker.receive(
                starts, encoder.embed_windows(audio[start:end], [s - start for s in starts])
            )
        if tracker.speakers > len(decided_at):
            decided_at.append(fed / 16_000)
    first_b = (a.size + gap.size) / 16_000
    # Each reader's voice was decided after decide_after_s of its speech, within a hop or two.
    assert decided_at[0] == pytest.approx(config.decide_after_s, abs=0.5)
    assert decided_at[1] - first_b == pytest.approx(config.decide_after_s, abs=0.5)
    labels = [tracker.label(a.size // 2), tracker.label(a.size + gap.size + b.size // 2)]
    assert [label.speaker for label in labels if label] == [0, 1]
