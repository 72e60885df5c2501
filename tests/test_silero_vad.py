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
from server.turns.silero_vad import (
    FRAME_SAMPLES,
    SileroModel,
    SileroVad,
    SileroVadConfig,
    silero_segmenter,
)

SECOND = SAMPLE_RATE_HZ
MS = SAMPLE_RATE_HZ // 1000
CLIP = "librispeech_test-clean/1089-134691-0000.wav"  # speech begins about 0.6 s in
CLIP_FROM_START = "ljspeech/LJ001-0002.wav"  # speech from the first sample
SECOND_CLIP = "librispeech_test-clean/1089-134686-0001.wav"


@pytest.fixture(scope="module")
def model() -> SileroModel:
    return SileroModel()


def _load(name: str) -> npt.NDArray[np.float32]:
    found = find_speech_dir()
    if found is None:
        pytest.skip("real speech recordings (shared/speech) not found")
    return load_clip(Path(found) / name)


def _silence(seconds: float) -> npt.NDArray[np.float32]:
    return np.zeros(round(seconds * SECOND), dtype=np.float32)


def _energy_bounds(clip: npt.NDArray[np.float32]) -> tuple[int, int]:
    """First and last sample of the 10 ms frames within 30 dB of the loudest one: a crude,
    independent reference for where the speech is."""
    frames = clip[: clip.size - clip.size % (10 * MS)].reshape(-1, 10 * MS)
    db = 10 * np.log10((frames.astype(np.float64) ** 2).mean(axis=1) + 1e-12)
    loud = np.flatnonzero(db > db.max() - 30)
    return int(loud[0]) * 10 * MS, (int(loud[-1]) + 1) * 10 * MS


def _segmenter(model: SileroModel, config: VadConfig | None = None) -> VadSegmenter:
    return silero_segmenter(config or VadConfig(), model, SileroVadConfig())


def _run(
    model: SileroModel, samples: npt.NDArray[np.float32], config: VadConfig | None = None
) -> list[VadEvent]:
    vad = _segmenter(model, config)
    events = vad.receive(samples) + vad.flush()
    assert vad.samples_processed == samples.size
    assert not vad.in_speech
    # Starts and ends alternate, do not overlap and lie inside the stream.
    last = 0
    for i, event in enumerate(events):
        assert isinstance(event, SpeechStarted if i % 2 == 0 else SpeechEnded), events
        sample = event.start_sample if isinstance(event, SpeechStarted) else event.end_sample
        assert last <= sample <= samples.size, events
        last = sample
    assert len(events) % 2 == 0
    return events


def _segments(events: list[VadEvent]) -> list[tuple[int, int]]:
    starts = [e.start_sample for e in events if isinstance(e, SpeechStarted)]
    ends = [e.end_sample for e in events if isinstance(e, SpeechEnded)]
    return list(zip(starts, ends, strict=True))


# --- the frame model ----------------------------------------------------------------------------


def test_probabilities_match_the_reference_wrapper_frame_for_frame(model: SileroModel) -> None:
    """pipecat's SileroOnnxModel, the wrapper every Pipecat agent runs, on the same file: the
    same state and 64-sample context carried, so the same probabilities."""
    from pipecat.audio.vad.silero import SileroOnnxModel

    reference = SileroOnnxModel(str(model.path))  # type: ignore[no-untyped-call]
    ours = SileroVad(model)
    clip = np.concatenate([_silence(0.5), _load(CLIP)])
    frames = clip[: clip.size - clip.size % FRAME_SAMPLES].reshape(-1, FRAME_SAMPLES)
    got = np.array([ours.probability(f) for f in frames])
    want = np.array([float(reference(f, SAMPLE_RATE_HZ)[0][0]) for f in frames])
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got.max() > 0.9 and got[:10].max() < 0.1  # speech, and the silence before it


def test_the_state_carries_across_frames_and_reset_forgets_it(model: SileroModel) -> None:
    clip = _load(CLIP)
    frame = clip[SECOND : SECOND + FRAME_SAMPLES]
    vad = SileroVad(model)
    fresh = vad.probability(frame)
    for pos in range(0, SECOND, FRAME_SAMPLES):
        vad.probability(clip[pos : pos + FRAME_SAMPLES])
    assert abs(vad.probability(frame) - fresh) > 1e-3  # after a second of speech: not the same
    vad.reset()
    assert vad.probability(frame) == pytest.approx(fresh, abs=1e-6)


def test_a_frame_must_be_512_samples(model: SileroModel) -> None:
    vad = SileroVad(model)
    for bad in (np.zeros(480, np.float32), np.zeros((1, 512), np.float32)):
        with pytest.raises(ValueError, match="512"):
            vad.probability(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 0.0}, "threshold"),
        ({"threshold": 1.0}, "threshold"),
        ({"threshold": 0.3, "negative_margin": 0.3}, "negative_margin"),
        ({"negative_margin": -0.1}, "negative_margin"),
        ({"threads": 0}, "threads"),
    ],
)
def test_config_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SileroVadConfig(**kwargs)  # type: ignore[arg-type]


# --- the segmenter: no speech ------------------------------------------------------------------


def test_digital_silence_gives_no_events(model: SileroModel) -> None:
    assert _run(model, _silence(5.0)) == []


@pytest.mark.parametrize("level", [0.001, 0.003, 0.01])
def test_low_white_noise_gives_no_events(model: SileroModel, level: float) -> None:
    rng = np.random.default_rng(round(level * 1000))
    noise = (rng.standard_normal(5 * SECOND) * level).astype(np.float32)
    assert _run(model, np.concatenate([_silence(1.0), noise])) == []


# --- the segmenter: real speech ----------------------------------------------------------------


@pytest.mark.parametrize("name", [CLIP, SECOND_CLIP])
def test_padded_clip_gives_one_segment(model: SileroModel, name: str) -> None:
    config = VadConfig()
    clip = _load(name)
    onset, offset = _energy_bounds(clip)
    stream = np.concatenate([_silence(1.0), clip, _silence(1.5)])
    events = _run(model, stream, config)
    assert len(events) == 2, events
    start, end = _segments(events)[0]
    pad = config.speech_pad_ms * MS
    # The onset found (start + pad) is within 100 ms of where the speech begins, and with the
    # pad nothing of it is cut off; the end keeps the last of the speech.
    assert abs(start + pad - (SECOND + onset)) <= 100 * MS, (start, SECOND + onset)
    assert start <= SECOND + onset
    assert SECOND + offset <= end < stream.size


def test_speech_from_the_first_sample_starts_at_zero(model: SileroModel) -> None:
    events = _run(model, np.concatenate([_load(CLIP_FROM_START), _silence(1.0)]))
    assert events[0] == SpeechStarted(0)
    assert len(events) == 2


def test_two_clips_give_two_segments_around_their_speech(model: SileroModel) -> None:
    """Each segment's onset (its start less the pad) is within 100 ms of its clip's speech
    (energy bounds), the second one's too, heard with the state the first left; with its
    pads the segment holds all of the speech but a trailing murmur near the bounds' 30 dB
    floor (to within 50 ms), and its last speech frame is at most 150 ms after the speech
    (Silero's probability decays over a frame or three after the last sound)."""
    first, second = _load(CLIP), _load(SECOND_CLIP)
    stream = np.concatenate([_silence(1.0), first, _silence(1.5), second, _silence(1.0)])
    segments = _segments(_run(model, stream))
    assert len(segments) == 2, segments
    pad = VadConfig().speech_pad_ms * MS
    starts = (SECOND, SECOND + first.size + round(1.5 * SECOND))
    for (start, end), clip, at in zip(segments, (first, second), starts, strict=True):
        onset, offset = _energy_bounds(clip)
        assert abs(start + pad - (at + onset)) <= 100 * MS, (segments, at + onset)
        assert start <= at + onset
        assert at + offset - 50 * MS <= end <= at + offset + pad + 150 * MS, (segments, offset)


def test_random_chunk_sizes_give_identical_events(model: SileroModel) -> None:
    stream = np.concatenate([_silence(0.5), _load(CLIP), _silence(1.5), _load(SECOND_CLIP)])
    stream = stream[:-1234]  # end inside speech and inside a frame
    whole = _run(model, stream)
    assert len(whole) == 4
    rng = random.Random(4)
    for _ in range(2):
        vad = _segmenter(model)
        events: list[VadEvent] = []
        pos = 0
        while pos < stream.size:
            size = rng.randint(1, 5000)
            events += vad.receive(stream[pos : pos + size])
            pos += size
        events += vad.flush()
        assert events == whole


def test_streams_sharing_one_model_do_not_share_state(model: SileroModel) -> None:
    a = np.concatenate([_silence(0.7), _load(CLIP), _silence(1.5)])
    b = np.concatenate([_load(SECOND_CLIP), _silence(2.0)])
    alone_a, alone_b = _run(model, a), _run(model, b)
    va, vb = _segmenter(model), _segmenter(model)
    got_a: list[VadEvent] = []
    got_b: list[VadEvent] = []
    for pos in range(0, max(a.size, b.size), 800):  # interleaved, 50 ms at a time
        got_a += va.receive(a[pos : pos + 800])
        got_b += vb.receive(b[pos : pos + 800])
    assert got_a + va.flush() == alone_a
    assert got_b + vb.flush() == alone_b


def test_flush_closes_open_speech_at_the_end_of_the_stream(model: SileroModel) -> None:
    clip = _load(CLIP)
    _, offset = _energy_bounds(clip)
    stream = np.concatenate([_silence(1.0), clip[: offset - 300 * MS]])
    stream = stream[: stream.size - stream.size % FRAME_SAMPLES + 100]  # a partial frame
    vad = _segmenter(model)
    events = vad.receive(stream)
    assert [type(e) for e in events] == [SpeechStarted]
    assert vad.in_speech
    assert vad.samples_processed == stream.size - 100
    assert vad.flush() == [SpeechEnded(stream.size)]
    assert vad.samples_processed == stream.size
    assert vad.flush() == []


def test_flush_at_a_pause_ends_speech_where_the_endpoint_would(model: SileroModel) -> None:
    clip = _load(CLIP)
    endpointed = [
        e for e in _run(model, np.concatenate([clip, _silence(1.0)])) if isinstance(e, SpeechEnded)
    ]
    vad = _segmenter(model)
    vad.receive(np.concatenate([clip, _silence(0.3)]))
    assert vad.in_speech and vad.tentative_end == endpointed[-1].end_sample
    assert vad.flush(at_pause=True) == [endpointed[-1]]


def test_segmenter_keeps_working_after_flush(model: SileroModel) -> None:
    clip = _load(CLIP)
    vad = _segmenter(model)
    first = vad.receive(np.concatenate([_silence(1.0), clip[:-777]])) + vad.flush()
    offset = vad.samples_processed
    second = vad.receive(np.concatenate([_silence(1.0), clip, _silence(1.0)])) + vad.flush()
    assert len(first) == len(second) == 2
    assert isinstance(second[0], SpeechStarted)
    assert second[0].start_sample > offset + 0.5 * SECOND


def test_the_endpoint_waits_the_configured_silence(model: SileroModel) -> None:
    """Fed 10 ms at a time, speech ends the configured silence after the last speech frame
    (to within a 32 ms frame), the longer one for a short utterance."""
    config = VadConfig()
    for stream, silence_ms in (
        (np.concatenate([_silence(1.0), _load(SECOND_CLIP), _silence(2.0)]), 500),
        (np.concatenate([_silence(1.0), _load(CLIP)[: round(1.6 * SECOND)], _silence(2.0)]), 1000),
    ):
        vad = _segmenter(model, config)
        waited: float | None = None
        for pos in range(0, stream.size, 10 * MS):
            for event in vad.receive(stream[pos : pos + 10 * MS]):
                if isinstance(event, SpeechEnded) and waited is None:
                    last_speech = event.end_sample - config.speech_pad_ms * MS
                    waited = (vad.samples_processed - last_speech) / MS
        assert waited is not None
        assert silence_ms <= waited <= silence_ms + 64, (silence_ms, waited)


def test_voiced_seconds(model: SileroModel) -> None:
    clips = [_load(f"librispeech_test-other/2609-156975-000{n}.wav") for n in (7, 2, 5)]
    join = _silence(0.45)
    samples = np.concatenate([_silence(1.0), clips[0], join, clips[1], join, clips[2]])
    samples = np.concatenate([samples, _silence(1.0)])
    vad = _segmenter(model)
    came_back: list[int] = []
    pending: int | None = None
    for pos in range(0, samples.size, 10 * MS):
        vad.receive(samples[pos : pos + 10 * MS])
        if vad.tentative_end is not None:
            pending = vad.tentative_end
        elif pending is not None and vad.in_speech:
            came_back.append(pending)
            pending = None
    assert vad.voiced_s(0, SECOND) == 0.0
    speech_s = (samples.size - 2 * SECOND) / SECOND
    assert 0.5 * speech_s <= vad.voiced_s(0, samples.size) <= speech_s
    assert len(came_back) >= 2  # the pauses speech went on after
    vad.forget_before(samples.size)
    assert vad.voiced_s(0, samples.size) == 0.0


def test_receive_rejects_multichannel_input(model: SileroModel) -> None:
    with pytest.raises(ValueError, match="1-D"):
        _segmenter(model).receive(np.zeros((100, 2), dtype=np.float32))
