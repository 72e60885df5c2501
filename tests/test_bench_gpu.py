"""bench.gpu's batches: distinct windows of real speech, as many as the largest batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.gpu import BATCH_WINDOW_S, BATCHES, batch_windows
from server.protocol.formats import SAMPLE_RATE_HZ


def test_the_largest_batch_is_distinct_five_second_windows_of_speech(
    speech_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WHISPERWIRE_SPEECH_DIR", str(speech_dir))
    windows = batch_windows(max(BATCHES))
    assert len(windows) == max(BATCHES)
    assert all(len(w) == BATCH_WINDOW_S * SAMPLE_RATE_HZ for w in windows)
    assert len({w.tobytes() for w in windows}) == len(windows)
    # Speech, not silence: each window carries the level of read speech somewhere in it.
    assert all(float(np.abs(w).max()) > 0.05 for w in windows)
