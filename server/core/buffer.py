"""A growable sample buffer addressed by absolute stream sample offsets (pure)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Float32Array = npt.NDArray[np.float32]


class SampleBuffer:
    """Holds samples [origin, end) of a stream; appends amortised O(1), old audio trimmed.

    Appending a 20 ms frame to a 15 s window by concatenation would copy the whole window
    every frame; capacity doubling copies each sample a bounded number of times.
    """

    def __init__(self, capacity: int = 16_000 * 8) -> None:
        self._data = np.zeros(capacity, dtype=np.float32)
        self._origin = 0  # stream offset of _data[0]
        self._length = 0

    @property
    def start(self) -> int:
        return self._origin

    @property
    def end(self) -> int:
        return self._origin + self._length

    def append(self, samples: Float32Array) -> None:
        n = int(samples.shape[0])
        if self._length + n > self._data.shape[0]:
            grown = np.zeros(max(self._data.shape[0] * 2, self._length + n), dtype=np.float32)
            grown[: self._length] = self._data[: self._length]
            self._data = grown
        self._data[self._length : self._length + n] = samples
        self._length += n

    def slice(self, start: int, end: int) -> Float32Array:
        """A copy of samples [start, end); the range must lie inside the buffer."""
        if start < self._origin or end > self.end or start > end:
            raise IndexError(
                f"samples [{start}, {end}) outside buffer [{self._origin}, {self.end})"
            )
        return self._data[start - self._origin : end - self._origin].copy()

    def trim(self, before: int) -> None:
        """Forget samples before stream offset ``before``."""
        drop = min(max(0, before - self._origin), self._length)
        if drop == 0:
            return
        keep = self._length - drop
        self._data[:keep] = self._data[drop : self._length]
        self._origin += drop
        self._length = keep
