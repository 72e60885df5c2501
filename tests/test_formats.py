"""The protocol's audio formats: what ``AudioFormat`` accepts and refuses."""

from __future__ import annotations

import pytest

from server.protocol.formats import ENCODINGS, MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ, AudioFormat


def test_the_default_is_whisper_input() -> None:
    fmt = AudioFormat()
    assert (fmt.sample_rate_hz, fmt.encoding, fmt.bytes_per_sample) == (16_000, "pcm_s16le", 2)
    assert AudioFormat(encoding="pcm_f32le").bytes_per_sample == 4
    # G.711, telephone audio: one byte per sample, at any rate the protocol allows.
    assert AudioFormat(8_000, "mulaw").bytes_per_sample == 1
    assert AudioFormat(16_000, "alaw").bytes_per_sample == 1


@pytest.mark.parametrize("rate", [MIN_SAMPLE_RATE_HZ, 44_100, MAX_SAMPLE_RATE_HZ])
def test_rates_within_the_bounds_are_accepted(rate: int) -> None:
    assert AudioFormat(sample_rate_hz=rate).sample_rate_hz == rate


@pytest.mark.parametrize("rate", [0, MIN_SAMPLE_RATE_HZ - 1, MAX_SAMPLE_RATE_HZ + 1])
def test_rates_outside_the_bounds_are_refused(rate: int) -> None:
    with pytest.raises(ValueError, match="between 8000 and 48000 Hz"):
        AudioFormat(sample_rate_hz=rate)


def test_an_unknown_encoding_is_refused_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as info:
        AudioFormat(encoding="mp3")
    assert all(name in str(info.value) for name in ENCODINGS)
