from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from bench.corpus import find_speech_dir, load_clip
from server.config import VadConfig
from server.core.vad import SpeechEnded, SpeechStarted, VadEvent, VadSegmenter
from server.protocol.formats import SAMPLE_RATE_HZ

SECOND = SAMPLE_RATE_HZ
MS = SAMPLE_RATE_HZ // 1000
CLIP = "librispeech_test-clean/1089-134691-0000.wav"  # speech begins about 0.6 s in
CLIP_FROM_START = "ljspeech/LJ001-0002.wav"  # speech from the first sample
SECOND_CLIP = "librispeech_test-clean/1089-134686-0001.wav"


def _speech_dir() -> Path:
    found = find_speech_dir()
    if found is None:
        pytest.skip("real speech recordings (shared/speech) not found")
    return found


def _load(name: str) -> npt.NDArray[np.float32]:
    return load_clip(_speech_dir() / name)


def _energy_bounds(clip: npt.NDArray[np.float32]) -> tuple[int, int]:
    """First and last sample of the 10 ms frames within 30 dB of the loudest one.

    An independent, crude reference for where the speech is, to check the VAD against.
    """
    frames = clip[: clip.size - clip.size % (10 * MS)].reshape(-1, 10 * MS)
    db = 10 * np.log10((frames.astype(np.float64) ** 2).mean(axis=1) + 1e-12)
    loud = np.flatnonzero(db > db.max() - 30)
    return int(loud[0]) * 10 * MS, (int(loud[-1]) + 1) * 10 * MS


def _silence(seconds: float) -> npt.NDArray[np.float32]:
    return np.zeros(round(seconds * SECOND), dtype=np.float32)


def _run(
    samples: npt.NDArray[np.float32], config: VadConfig | None = None, chunk: int | None = None
) -> list[VadEvent]:
    vad = VadSegmenter(config or VadConfig())
    events: list[VadEvent] = []
    step = chunk or max(samples.size, 1)
    for pos in range(0, samples.size, step):
        events += vad.receive(samples[pos : pos + step])
    events += vad.flush()
    assert vad.samples_processed == samples.size
    assert not vad.in_speech
    _check_well_formed(events, samples.size)
    return events


def _check_well_formed(events: list[VadEvent], total: int) -> None:
    """Starts and ends alternate, segments do not overlap, and all lie inside the stream."""
    last = 0
    for i, event in enumerate(events):
        if i % 2 == 0:
            assert isinstance(event, SpeechStarted), events
            assert last <= event.start_sample, events
            last = event.start_sample
        else:
            assert isinstance(event, SpeechEnded), events
            assert last < event.end_sample <= total, events
            last = event.end_sample
    assert len(events) % 2 == 0


def _segments(events: list[VadEvent]) -> list[tuple[int, int]]:
    starts = [e.start_sample for e in events if isinstance(e, SpeechStarted)]
    ends = [e.end_sample for e in events if isinstance(e, SpeechEnded)]
    return list(zip(starts, ends, strict=True))


# --- no speech -----------------------------------------------------------------------------------


def test_digital_silence_gives_no_events() -> None:
    assert _run(_silence(5.0)) == []


@pytest.mark.parametrize("aggressiveness", [0, 1, 2, 3])
@pytest.mark.parametrize("level", [0.001, 0.003, 0.01])
def test_low_white_noise_gives_no_events(aggressiveness: int, level: float) -> None:
    rng = np.random.default_rng(aggressiveness)
    noise = (rng.standard_normal(5 * SECOND) * level).astype(np.float32)
    assert _run(noise, VadConfig(aggressiveness=aggressiveness)) == []


@pytest.mark.parametrize("frame_ms", [10, 20, 30])
def test_noise_after_silence_is_not_taken_for_speech(frame_ms: int) -> None:
    # webrtcvad calls the first frames after digital silence speech; the warm-up hides that.
    rng = np.random.default_rng(frame_ms)
    noise = (rng.standard_normal(3 * SECOND) * 0.003).astype(np.float32)
    assert _run(np.concatenate([_silence(1.0), noise]), VadConfig(frame_ms=frame_ms)) == []


# --- real speech --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [CLIP, CLIP_FROM_START])
@pytest.mark.parametrize("frame_ms", [10, 20, 30])
def test_padded_clip_gives_one_segment(name: str, frame_ms: int) -> None:
    config = VadConfig(frame_ms=frame_ms)
    clip = _load(name)
    onset, offset = _energy_bounds(clip)
    # 1.5 s after: both clips are short speech, which needs 1 s of silence to end.
    stream = np.concatenate([_silence(1.0), clip, _silence(1.5)])
    events = _run(stream, config)
    assert len(events) == 2, events
    start, end = _segments(events)[0]
    pad = config.speech_pad_ms * MS
    # The onset the VAD found (start + pad) is within 100 ms of where the speech begins...
    assert abs(start + pad - (SECOND + onset)) <= 100 * MS, (start, SECOND + onset)
    assert start <= SECOND + onset  # ...and with the pad, nothing of it is cut off.
    assert SECOND + offset <= end < stream.size


def test_two_clips_give_two_segments() -> None:
    first, second = _load(CLIP), _load(SECOND_CLIP)
    stream = np.concatenate([_silence(1.0), first, _silence(1.5), second, _silence(1.0)])
    segments = _segments(_run(stream))
    assert len(segments) == 2, segments
    boundary = SECOND + first.size
    assert segments[0][1] <= boundary + 500 * MS
    assert segments[1][0] >= boundary
    assert segments[1][1] >= boundary + 1.5 * SECOND + _energy_bounds(second)[1]


def test_speech_from_the_first_sample_starts_at_zero() -> None:
    events = _run(np.concatenate([_load(CLIP_FROM_START), _silence(1.0)]))
    assert events[0] == SpeechStarted(0)
    assert len(events) == 2


def test_start_is_clamped_to_the_previous_end() -> None:
    # A 400 ms pad around a 700 ms pause would make the second segment begin before the first
    # one ends; the start is moved up to that end instead.
    # Short speech would wait out the pause (``short_speech_s``); this is about the pad.
    config = VadConfig(speech_pad_ms=400, short_speech_s=0.0)
    clip = _load(CLIP_FROM_START)
    stream = np.concatenate([_silence(1.0), clip, _silence(0.7), clip, _silence(1.0)])
    segments = _segments(_run(stream, config))
    assert len(segments) == 2, segments
    assert segments[1][0] == segments[0][1]


def test_random_chunk_sizes_give_identical_events() -> None:
    stream = np.concatenate([_silence(0.5), _load(CLIP), _silence(1.5), _load(SECOND_CLIP)])
    stream = stream[:-1234]  # end inside speech and inside a frame
    whole = _run(stream)
    assert len(whole) == 4
    rng = random.Random(4)
    for _ in range(3):
        vad = VadSegmenter(VadConfig())
        events: list[VadEvent] = []
        pos = 0
        while pos < stream.size:
            size = rng.randint(1, 5000)
            events += vad.receive(stream[pos : pos + size])
            pos += size
        events += vad.flush()
        assert events == whole


def test_flush_closes_open_speech_at_the_end_of_the_stream() -> None:
    clip = _load(CLIP)
    _, offset = _energy_bounds(clip)
    stream = np.concatenate([_silence(1.0), clip[: offset - 300 * MS]])
    stream = stream[: stream.size - stream.size % (30 * MS) + 100]  # leave a partial frame
    vad = VadSegmenter(VadConfig())
    events = vad.receive(stream)
    assert [type(e) for e in events] == [SpeechStarted]
    assert vad.in_speech
    assert vad.samples_processed == stream.size - 100
    assert vad.flush() == [SpeechEnded(stream.size)]
    assert vad.samples_processed == stream.size
    assert not vad.in_speech
    assert vad.flush() == []


def test_flush_at_a_pause_that_covered_the_pad_ends_speech_where_the_endpoint_would() -> None:
    """A client that ends the stream 0.3 s after the last word: ``at_pause``, the utterance ends
    where 0.5 s of silence would have ended it, so the closing decode begun in that silence
    holds."""
    clip = _load(CLIP)
    endpointed = [
        e for e in _run(np.concatenate([clip, _silence(1.0)])) if isinstance(e, SpeechEnded)
    ]
    vad = VadSegmenter(VadConfig())
    vad.receive(np.concatenate([clip, _silence(0.3)]))
    assert vad.in_speech and vad.tentative_end == endpointed[-1].end_sample
    kept = VadSegmenter(VadConfig())
    kept.receive(np.concatenate([clip, _silence(0.3)]))
    assert vad.flush(at_pause=True) == [endpointed[-1]]
    assert vad.samples_processed > endpointed[-1].end_sample
    assert kept.flush() == [SpeechEnded(kept.samples_processed)]  # without: all of it


def test_segmenter_keeps_working_after_flush() -> None:
    clip = _load(CLIP)
    vad = VadSegmenter(VadConfig())
    first = vad.receive(np.concatenate([_silence(1.0), clip[:-777]])) + vad.flush()
    offset = vad.samples_processed
    second = vad.receive(np.concatenate([_silence(1.0), clip, _silence(1.0)])) + vad.flush()
    assert len(first) == len(second) == 2
    assert isinstance(second[0], SpeechStarted)
    assert second[0].start_sample > offset + 0.5 * SECOND


PHRASE_THEN_BREATH = "librispeech_test-other/3080-5032-0004.wav"  # "Well, | the best on't is ..."


def test_a_short_phrase_and_a_breath_stay_one_utterance() -> None:
    """The reader says "Well," and pauses about half a second: as an utterance of its own
    the word had no context, and tiny.en heard "war."."""
    stream = np.concatenate([_load(PHRASE_THEN_BREATH), _silence(1.5)])
    assert len(_segments(_run(stream))) == 1
    assert len(_segments(_run(stream, VadConfig(short_speech_s=0.0)))) == 2


def _end_after_silence_ms(stream: npt.NDArray[np.float32], config: VadConfig) -> float:
    """Fed 10 ms at a time: how long after the last voiced audio the segment ended."""
    vad = VadSegmenter(config)
    for pos in range(0, stream.size, 10 * MS):
        for event in vad.receive(stream[pos : pos + 10 * MS]):
            if isinstance(event, SpeechEnded):
                return (vad.samples_processed - (event.end_sample - config.speech_pad_ms * MS)) / MS
    raise AssertionError("speech never ended")


def test_a_short_utterance_alone_ends_after_the_longer_silence() -> None:
    word = _load(PHRASE_THEN_BREATH)[: round(1.1 * SECOND)]  # "Well,"
    stream = np.concatenate([_silence(1.0), word, _silence(2.0)])
    config = VadConfig()
    waited = _end_after_silence_ms(stream, config)
    assert config.short_speech_end_silence_ms <= waited <= config.short_speech_end_silence_ms + 60
    long_speech = np.concatenate([_silence(1.0), _load(SECOND_CLIP), _silence(2.0)])
    waited = _end_after_silence_ms(long_speech, config)
    assert config.speech_end_silence_ms <= waited <= config.speech_end_silence_ms + 60


# --- configuration and input checks -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aggressiveness": 4}, "aggressiveness must be 0, 1, 2 or 3"),
        ({"frame_ms": 25}, "frame_ms must be 10, 20 or 30"),
        ({"speech_start_ms": 0}, "speech_start_ms"),
        ({"speech_start_ms": 200, "speech_start_window_ms": 150}, "speech_start_window_ms"),
        ({"speech_end_silence_ms": 10}, "at least one frame"),
        ({"speech_pad_ms": -1}, "speech_pad_ms"),
        ({"short_speech_s": -1.0}, "short_speech_s"),
        ({"short_speech_end_silence_ms": -1}, "short_speech_end_silence_ms"),
    ],
)
def test_config_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VadConfig(**kwargs)


def test_receive_rejects_multichannel_input() -> None:
    with pytest.raises(ValueError, match="1-D"):
        VadSegmenter(VadConfig()).receive(np.zeros((100, 2), dtype=np.float32))


def test_the_tentative_end_is_where_the_endpoint_then_ends_the_utterance() -> None:
    samples = np.concatenate([_load(CLIP), _silence(1.5)])
    vad = VadSegmenter(VadConfig())
    seen: list[int] = []  # tentative ends, as 10 ms chunks arrive
    ended: list[SpeechEnded] = []
    for pos in range(0, samples.size, 10 * MS):
        for event in vad.receive(samples[pos : pos + 10 * MS]):
            if isinstance(event, SpeechEnded):
                ended.append(event)
        if vad.tentative_end is not None and not ended:
            seen.append(vad.tentative_end)
            # Only once the silence has covered the pad: the audio up to it is all there.
            assert vad.samples_processed >= vad.tentative_end
    assert ended and seen
    assert seen[-1] == ended[0].end_sample
    # It was known a while before the endpoint (500 ms of silence, less the 200 ms pad).
    assert seen.count(seen[-1]) * 10 * MS >= 250 * MS
    assert vad.tentative_end is None  # outside an utterance


def test_the_tentative_end_comes_as_soon_as_the_silence_covers_the_pad() -> None:
    vad = VadSegmenter(VadConfig())  # 200 ms pad, 30 ms frames
    samples = np.concatenate([_load(CLIP), _silence(1.0)])
    first: int | None = None
    for pos in range(0, samples.size, 10 * MS):
        vad.receive(samples[pos : pos + 10 * MS])
        if vad.tentative_end is not None and first is None:
            first = vad.tentative_end
            # Not a frame later than the audio up to it was all there.
            assert 0 <= vad.samples_processed - first < 30 * MS
        elif vad.tentative_end is None and vad.in_speech:
            first = None  # speech came back: the next pause gives a new one
    assert first is not None


def test_voiced_seconds_count_speech_and_not_silence() -> None:
    clip = _load(CLIP)
    samples = np.concatenate([_silence(2.0), clip, _silence(2.0)])
    vad = VadSegmenter(VadConfig())
    vad.receive(samples)
    start, end = _energy_bounds(clip)
    assert vad.voiced_s(0, 2 * SECOND) == 0.0
    assert vad.voiced_s(samples.size - 2 * SECOND, samples.size) == 0.0
    speech_s = (end - start) / SECOND
    # Read speech: most of it voiced, never more than the span.
    assert 0.6 * speech_s <= vad.voiced_s(2 * SECOND + start, 2 * SECOND + end) <= speech_s
    middle = 2 * SECOND + (start + end) // 2
    assert vad.voiced_s(0, middle) + vad.voiced_s(middle, samples.size) == pytest.approx(
        vad.voiced_s(0, samples.size)
    )
    after = vad.voiced_s(middle, samples.size)
    vad.forget_before(2 * SECOND)  # nothing voiced ends before the speech
    assert vad.voiced_s(0, samples.size) == pytest.approx(after + vad.voiced_s(0, middle))
    vad.forget_before(samples.size)
    assert vad.voiced_s(0, samples.size) == 0.0
