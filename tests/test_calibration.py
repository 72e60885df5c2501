"""The speech the startup calibration decodes: a real recording, shipped, sliced into windows."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import tomllib

from server.core.engine_api import DecodeRequest, Window
from server.decode.calibration import SPEECH_FILE, calibration_speech, speech_windows
from server.decode.capacity import CapacityModel
from server.protocol.formats import SAMPLE_RATE_HZ

if TYPE_CHECKING:
    from server.engine.engine import Engine

ROOT = Path(__file__).parent.parent
# The typical window before any client's, which the calibration's shapes are multiples of.
WINDOW_S = CapacityModel(
    hop_s=1.0, utilization=1.0, admission_utilization=1.0, comfort_utilization=1.0, max_batch_size=1
).default_window_s
FRAME = 480  # 30 ms


def test_the_recording_holds_the_longest_calibration_window_and_stays_small() -> None:
    speech = calibration_speech()
    assert speech.dtype == np.float32
    assert 2 * WINDOW_S <= speech.size / SAMPLE_RATE_HZ <= 12.0  # the 8 s window fits
    assert (ROOT / "server" / "decode" / SPEECH_FILE).stat().st_size <= 400_000
    assert 0.1 < float(np.max(np.abs(speech))) < 1.0  # a level speech has, not clipped


def test_every_calibration_window_is_mostly_voice() -> None:
    # Faint noise, which the calibration decoded before, has an RMS of 0.01 and no frame
    # over 0.02; a reader's pauses are short.
    for window in [*speech_windows(4, WINDOW_S), *speech_windows(1, 2 * WINDOW_S)]:
        frames = window[: window.size // FRAME * FRAME].reshape(-1, FRAME)
        rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
        assert float(np.sqrt(np.mean(window.astype(np.float64) ** 2))) > 0.05
        assert float(np.mean(rms > 0.02)) >= 0.6


def test_a_batch_holds_different_speech_in_each_window_spread_over_the_recording() -> None:
    speech = calibration_speech()
    length = round(WINDOW_S * SAMPLE_RATE_HZ)
    windows = speech_windows(4, WINDOW_S)
    assert [w.size for w in windows] == [length] * 4
    assert np.array_equal(windows[0], speech[:length])
    assert np.array_equal(windows[-1], speech[-length:])
    assert not any(np.array_equal(a, b) for i, a in enumerate(windows) for b in windows[i + 1 :])
    [alone] = speech_windows(1, 2 * WINDOW_S)
    assert np.array_equal(alone, speech[: 2 * length])


def test_a_window_longer_than_the_recording_is_refused() -> None:
    with pytest.raises(ValueError, match="the calibration recording"):
        speech_windows(1, 13.0)
    with pytest.raises(ValueError, match="count >= 1"):
        speech_windows(0, WINDOW_S)


def test_the_recording_ships_with_the_package() -> None:
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    shipped = f"server/decode/{SPEECH_FILE}"
    assert any(
        fnmatch.fnmatch(shipped, f"{package.replace('.', '/')}/{pattern}")
        for package, patterns in package_data.items()
        for pattern in patterns
    ), package_data


def test_the_model_hears_the_words_read_in_every_calibration_window(engine: Engine) -> None:
    windows = [*speech_windows(4, WINDOW_S), *speech_windows(1, 2 * WINDOW_S)]
    results = engine.decode_windows(
        [Window(engine.features(w), DecodeRequest(w.size / SAMPLE_RATE_HZ)) for w in windows]
    )
    for result in results:
        assert len(result.text.split()) >= 8, result.text  # a reader says 2-3 words a second
    # LJ001-0004: "by a similar process produced the block books, which were the immediate
    # predecessors of the true printed book"
    assert "block books" in results[-1].text and "predecessors" in results[-1].text
