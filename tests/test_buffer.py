from __future__ import annotations

import numpy as np
import pytest

from server.core.buffer import SampleBuffer


def test_append_slice_and_trim_keep_absolute_offsets() -> None:
    buf = SampleBuffer(capacity=4)
    data = np.arange(100, dtype=np.float32)
    for i in range(0, 100, 7):
        buf.append(data[i : i + 7])
    assert (buf.start, buf.end) == (0, 100)
    np.testing.assert_array_equal(buf.slice(10, 20), data[10:20])
    buf.trim(40)
    assert buf.start == 40
    np.testing.assert_array_equal(buf.slice(40, 100), data[40:])
    buf.append(np.arange(100, 110, dtype=np.float32))
    np.testing.assert_array_equal(buf.slice(95, 110), np.arange(95, 110, dtype=np.float32))


def test_slice_outside_the_buffer_is_refused() -> None:
    buf = SampleBuffer()
    buf.append(np.zeros(10, dtype=np.float32))
    buf.trim(5)
    with pytest.raises(IndexError):
        buf.slice(0, 6)
    with pytest.raises(IndexError):
        buf.slice(6, 11)


def test_slice_is_a_copy() -> None:
    buf = SampleBuffer()
    buf.append(np.ones(10, dtype=np.float32))
    part = buf.slice(0, 5)
    part[:] = 7
    assert float(buf.slice(0, 5).sum()) == 5.0
