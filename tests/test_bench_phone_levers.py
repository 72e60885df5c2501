"""bench.phone_levers: each front-end lever changes only what it names."""

from __future__ import annotations

import numpy as np

from bench import phone_levers
from bench.phone_line import PHONE_BAND_HZ
from server.engine import features
from server.protocol.formats import SAMPLE_RATE_HZ


def _centres_hz(n_mels: int = 80) -> np.ndarray:
    filters = features.mel_filters(n_mels)
    hz = np.arange(filters.shape[1]) * SAMPLE_RATE_HZ / features.N_FFT
    return np.asarray((filters * hz).sum(axis=1) / filters.sum(axis=1))


def test_the_empty_bands_lie_outside_the_telephone_band() -> None:
    empty = phone_levers.empty_bands()
    centres = _centres_hz()
    low, high = PHONE_BAND_HZ
    assert empty.any() and not empty.all()
    assert ((centres[empty] < low) | (centres[empty] > high)).all()
    assert not (phone_levers.in_bands() & empty).any()


def test_fill_floor_raises_only_the_empty_bands_of_the_frames_with_audio() -> None:
    log_spec = np.full((10, 80), -9.0, dtype=np.float32)
    log_spec[0, 40] = 0.0  # the peak
    out = phone_levers.fill_floor(6.0)(log_spec, 8)
    empty = phone_levers.empty_bands()
    assert (out[:8, empty] == -6.0).all()
    np.testing.assert_array_equal(out[:8, ~empty], log_spec[:8, ~empty])
    np.testing.assert_array_equal(out[8:], log_spec[8:])  # the padding's frames


def test_the_tilt_rises_through_the_band_and_leaves_the_rest() -> None:
    log_spec = np.zeros((4, 80), dtype=np.float32)
    out = phone_levers.tilt(6.0)(log_spec, 4)[0]
    centres = _centres_hz()
    assert (out[centres <= 1000.0] == 0).all() and (out[centres > PHONE_BAND_HZ[1]] == 0).all()
    inside = out[(centres > 1000.0) & (centres <= PHONE_BAND_HZ[1])]
    assert (np.diff(inside) > 0).all() and 0.5 < inside.max() <= 0.6  # 6 dB: 0.6 decade


def test_the_floor_lies_the_range_below_the_peak() -> None:
    audio = np.zeros(16000, dtype=np.float32)
    audio[:4000] = np.random.default_rng(0).standard_normal(4000).astype(np.float32) * 0.1
    log_spec = features.log10_mel(audio)
    for decades in (8.0, 6.0):
        scaled = features.scale_log_mel(log_spec, decades)
        # Whisper's scaling: (log10 + 4) / 4, floored ``decades`` below the peak.
        assert scaled.max() == np.float32((log_spec.max() + 4.0) / 4.0)
        assert scaled.min() == np.float32((log_spec.max() - decades + 4.0) / 4.0)
