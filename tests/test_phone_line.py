"""The benchmarks' telephone line: its band, its rate, its G.711 encoder (the encoder is also
checked against the server's decoder in ``test_g711.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.phone_line import (
    PHONE_RATE_HZ,
    SOURCE_RATE_HZ,
    band_pass,
    g711_encode,
    phone_line,
)
from server.protocol import g711


def tone(hz: float, seconds: float = 1.0, rate: int = SOURCE_RATE_HZ) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def rms(x: np.ndarray) -> float:
    middle = x[len(x) // 4 : 3 * len(x) // 4]  # away from the filter's edges
    return float(np.sqrt(np.mean(middle.astype(np.float64) ** 2)))


@pytest.mark.parametrize(("hz", "kept"), [(100, False), (1000, True), (3000, True), (3900, False)])
def test_the_band_is_300_to_3400_hz(hz: float, kept: bool) -> None:
    x = tone(hz)
    ratio = rms(band_pass(x)) / rms(x)
    if kept:
        assert ratio == pytest.approx(1.0, abs=0.02)
    else:
        assert ratio < 0.01  # 40 dB down at least


def test_the_line_is_8k_g711_of_the_same_length_and_time_base() -> None:
    x = tone(1000, seconds=2.0)
    line = phone_line(x)
    assert len(line) == 2 * PHONE_RATE_HZ  # one byte a sample at 8 kHz
    decoded = g711.decode(line, "mulaw")
    expected = tone(1000, seconds=2.0, rate=PHONE_RATE_HZ)
    # In phase with the source: no delay from the filter or the resampler.
    assert float(np.corrcoef(decoded[4000:12000], expected[4000:12000])[0, 1]) > 0.99


def test_the_encoder_clips_at_full_scale_and_refuses_other_laws() -> None:
    loud = np.array([2.0, -2.0], np.float64)
    assert g711_encode(loud, "mulaw") == bytes([0x80, 0x00])  # +-32124, mu-law's ends
    assert g711_encode(loud, "alaw") == bytes([0xAA, 0x2A])  # +-32256, A-law's ends
    with pytest.raises(ValueError, match="mulaw or alaw"):
        g711_encode(loud, "g722")
