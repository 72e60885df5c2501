"""ITU-T G.711 (mu-law and A-law) decoding by table lookup.

Telephone audio (Twilio, Vonage, Asterisk, SIP trunks) arrives as G.711: one byte per sample,
8 kHz, companded on a logarithmic scale. Each of the 256 byte values stands for one 16-bit
linear value, so decoding is a lookup in a 256-entry table built once from the standard's
formula (``audioop``, which did this before, left the standard library in Python 3.13).

The tables give the 16-bit values that G.711 implementations conventionally produce (the 14-bit
mu-law and 13-bit A-law magnitudes shifted up to 16 bits): mu-law 0xFF is 0 and 0x00 is
-32124; A-law 0xD5 is +8 and 0x55 is -8.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import numpy.typing as npt

MULAW = "mulaw"
ALAW = "alaw"
LAWS = (MULAW, ALAW)
_MULAW_BIAS = 0x84  # 132: the offset mu-law adds before taking the segment, removed on decode
_ALAW_TOGGLE = 0x55  # A-law inverts the even bits of every byte on the line
_S16_SCALE = 32768.0


def _mulaw_linear(code: int) -> int:
    """G.711 mu-law: the byte is sent inverted; sign, 3-bit segment, 4-bit step."""
    u = ~code & 0xFF
    segment = (u >> 4) & 0x07
    step = u & 0x0F
    magnitude = (((step << 3) + _MULAW_BIAS) << segment) - _MULAW_BIAS
    return -magnitude if u & 0x80 else magnitude


def _alaw_linear(code: int) -> int:
    """G.711 A-law: even bits toggled; sign bit set means positive; segment 0 is linear."""
    a = code ^ _ALAW_TOGGLE
    segment = (a >> 4) & 0x07
    step = a & 0x0F
    # Segment 0 is linear (no implied leading bit); the others carry one and double per step.
    magnitude = (step << 4) + 8 if segment == 0 else ((step << 4) + 0x108) << (segment - 1)
    return magnitude if a & 0x80 else -magnitude


@cache
def linear_table(law: str) -> npt.NDArray[np.int16]:
    """The 16-bit linear value of each of the 256 codes of ``law`` (``mulaw`` or ``alaw``).

    Raises:
        ValueError: ``law`` is not one of ``LAWS``.
    """
    if law == MULAW:
        values = [_mulaw_linear(code) for code in range(256)]
    elif law == ALAW:
        values = [_alaw_linear(code) for code in range(256)]
    else:
        raise ValueError(f"G.711 law must be one of {', '.join(LAWS)}; got {law!r}")
    table = np.array(values, dtype=np.int16)
    table.setflags(write=False)
    return table


@cache
def _float_table(law: str) -> npt.NDArray[np.float32]:
    table = (linear_table(law).astype(np.float32) / np.float32(_S16_SCALE)).astype(np.float32)
    table.setflags(write=False)
    return table


def decode(data: bytes, law: str) -> npt.NDArray[np.float32]:
    """G.711 bytes as float32 samples in [-1, 1], on the same scale as decoded s16le.

    Raises:
        ValueError: ``law`` is not one of ``LAWS``.
    """
    return _float_table(law)[np.frombuffer(data, dtype=np.uint8)]
