"""A telephone line in numpy: what a call does to speech before it reaches the server.

``phone_line`` band-limits 16 kHz speech to the telephone band (300-3400 Hz), resamples it to
8 kHz and companding-encodes it with G.711 (mu-law or A-law), as a PSTN or SIP leg carries it;
the same channel as ``sox IN.wav -r 8000 -e u-law T.wav sinc 300-3400``. ``g711_encode`` is the
encoder: the server only decodes G.711, so the encoder lives here, written from ITU-T G.711's
segment rule (not from the server's tables), for the benchmarks and as an independent check
of the server's decoder in the tests.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt
import soxr

Float32Array = npt.NDArray[np.float32]

SOURCE_RATE_HZ = 16_000
PHONE_RATE_HZ = 8_000
PHONE_BAND_HZ = (300.0, 3400.0)
_BAND_TAPS = 1023  # odd, so the filter has a whole-sample delay to take off again
_KAISER_BETA = 8.6  # about 90 dB of stop-band rejection
_MULAW_CLIP = 32635  # the largest magnitude mu-law codes before its bias is added
_MULAW_BIAS = 0x84


@lru_cache(maxsize=4)
def band_pass_taps(rate_hz: int = SOURCE_RATE_HZ) -> Float32Array:
    """A linear-phase windowed-sinc band-pass over ``PHONE_BAND_HZ`` at ``rate_hz``."""
    low, high = (f / rate_hz for f in PHONE_BAND_HZ)
    n = np.arange(_BAND_TAPS) - (_BAND_TAPS - 1) / 2
    ideal = 2 * high * np.sinc(2 * high * n) - 2 * low * np.sinc(2 * low * n)
    taps = np.asarray(ideal * np.kaiser(_BAND_TAPS, _KAISER_BETA), dtype=np.float32)
    taps.setflags(write=False)
    return taps


def band_pass(audio: Float32Array, rate_hz: int = SOURCE_RATE_HZ) -> Float32Array:
    """``audio`` through the telephone band, same length and time base (no delay)."""
    filtered = np.convolve(audio, band_pass_taps(rate_hz), mode="same")
    return np.asarray(filtered, dtype=np.float32)


def g711_encode(audio: npt.NDArray[np.floating[Any]], law: str) -> bytes:
    """Float samples in [-1, 1] as G.711 bytes (``mulaw`` or ``alaw``), one per sample.

    The linear value is the 16-bit one (``audio * 32768``); each code is the segment (the
    position of the magnitude's leading bit) and the four bits after the leading bit.
    """
    pcm = np.clip(np.round(np.asarray(audio, dtype=np.float64) * 32768.0), -32768, 32767)
    pcm = pcm.astype(np.int32)
    if law == "mulaw":
        sign = np.where(pcm < 0, 0x80, 0x00)
        magnitude = np.minimum(np.abs(pcm), _MULAW_CLIP) + _MULAW_BIAS
        segment = _leading_bit(magnitude) - 7  # magnitude >= 0x84, so segment >= 0
        step = (magnitude >> (segment + 3)) & 0x0F
        code = ~(sign | (segment << 4) | step) & 0xFF  # mu-law sends every bit inverted
    elif law == "alaw":
        sign = np.where(pcm >= 0, 0x80, 0x00)  # A-law's sign bit is set for positive values
        magnitude = np.where(pcm >= 0, pcm, -pcm - 1)  # negatives sit one step lower
        segment = np.maximum(_leading_bit(np.maximum(magnitude, 1)) - 7, 0)
        step = (magnitude >> np.where(segment == 0, 4, segment + 3)) & 0x0F
        code = (sign | (segment << 4) | step) ^ 0x55  # A-law toggles the even bits
    else:
        raise ValueError(f"law must be mulaw or alaw; got {law!r}")
    return np.asarray(code, dtype=np.uint8).tobytes()


def _leading_bit(values: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    """The index of each (positive) value's highest set bit."""
    return np.asarray(np.floor(np.log2(values)), dtype=np.int32)


def phone_line(audio: Float32Array, law: str = "mulaw") -> bytes:
    """16 kHz speech as a telephone line carries it: 300-3400 Hz, 8 kHz, G.711 bytes."""
    narrow = band_pass(np.asarray(audio, dtype=np.float32))
    at_8k = np.asarray(
        soxr.resample(narrow, SOURCE_RATE_HZ, PHONE_RATE_HZ, quality="VHQ"), dtype=np.float32
    )
    return g711_encode(at_8k, law)
