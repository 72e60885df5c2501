from __future__ import annotations

import numpy as np
import pytest

from bench.phone_line import g711_encode
from server.protocol import g711


@pytest.mark.parametrize(
    ("law", "code", "value"),
    [
        ("mulaw", 0xFF, 0),
        ("mulaw", 0x7F, 0),
        ("mulaw", 0x00, -32124),
        ("mulaw", 0x80, 32124),
        ("mulaw", 0xFE, 8),  # the smallest non-zero step: 8 at 16 bits (2 at 14 bits, x4)
        ("mulaw", 0x7E, -8),
        ("mulaw", 0xF0, 120),  # segment 0's last code (steps of 8)
        ("mulaw", 0xEF, 132),  # segment 1's first (steps of 16)
        ("mulaw", 0xDF, 396),  # segment 2's first (steps of 32)
        ("alaw", 0xD5, 8),
        ("alaw", 0x55, -8),
        ("alaw", 0xAA, 32256),
        ("alaw", 0x2A, -32256),
        ("alaw", 0xC5, 264),  # segment 1's first code
    ],
)
def test_table_holds_the_standards_values(law: str, code: int, value: int) -> None:
    assert int(g711.linear_table(law)[code]) == value


@pytest.mark.parametrize("law", g711.LAWS)
def test_tables_are_odd_and_monotonic_within_each_sign(law: str) -> None:
    table = g711.linear_table(law).astype(np.int32)
    # Each law has one sign bit: the code with it flipped is the same magnitude, negated.
    np.testing.assert_array_equal(table[np.arange(256) ^ 0x80], -table)
    positive = np.sort(table[table > 0])
    assert positive.size == 127 if law == "mulaw" else 128  # mu-law has +0 and -0
    assert np.unique(positive).size == positive.size


@pytest.mark.parametrize("law", g711.LAWS)
def test_independent_encoder_gives_every_code_back(law: str) -> None:
    table = g711.linear_table(law)
    codes = np.frombuffer(g711_encode(table.astype(np.float64) / 32768.0, law), np.uint8)
    expected = np.arange(256, dtype=np.uint8)
    if law == "mulaw":
        expected[0x7F] = 0xFF  # -0 is 0, which the encoder writes as +0
    np.testing.assert_array_equal(codes, expected)


@pytest.mark.parametrize("law", g711.LAWS)
def test_encode_then_decode_stays_within_half_a_step(law: str) -> None:
    x = np.linspace(-0.98, 0.98, 100_001).astype(np.float32)
    y = g711.decode(g711_encode(x, law), law)
    assert y.dtype == np.float32
    # G.711's steps grow with the magnitude: 1/16 of the value at most, 16/32768 near zero.
    bound = np.maximum(np.abs(x) / 16, 16 / 32768)
    assert (np.abs(y - x) <= bound).all()


def test_decode_scales_like_s16le() -> None:
    data = bytes([0x00, 0xFF, 0x80])
    np.testing.assert_array_equal(
        g711.decode(data, "mulaw"), np.array([-32124, 0, 32124], np.float32) / 32768
    )


def test_unknown_law_is_refused_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="mulaw, alaw"):
        g711.decode(b"\x00", "ulaw")
