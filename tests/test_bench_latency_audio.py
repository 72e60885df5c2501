"""The latency benchmarks' audio helpers on real speech and the real webrtcvad."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.corpus import load_clip
from bench.latency_audio import speech_ends_s
from server.config import VadConfig
from server.protocol.formats import SAMPLE_RATE_HZ

CLIP = "ljspeech/LJ001-0004.wav"  # one sentence read without a pause of 0.5 s


def test_speech_ends_where_the_servers_detector_ends_it(speech_dir: Path) -> None:
    clip = load_clip(speech_dir / CLIP)
    clip_s = clip.shape[0] / SAMPLE_RATE_HZ
    pause = np.zeros(round(1.5 * SAMPLE_RATE_HZ), np.float32)
    tail = np.zeros(SAMPLE_RATE_HZ, np.float32)
    ends = speech_ends_s(np.concatenate([clip, pause, clip, tail]))
    # Two turns, each ended within half a second of its sentence's end (its trailing pad).
    assert len(ends) == 2, ends
    assert ends[0] == pytest.approx(clip_s, abs=0.5)
    assert ends[1] == pytest.approx(2 * clip_s + 1.5, abs=0.5)
    # A pause shorter than the endpoint does not end the turn.
    short = np.zeros(round(0.3 * SAMPLE_RATE_HZ), np.float32)
    assert len(speech_ends_s(np.concatenate([clip, short, clip, tail]))) == 1
    # Another detector setting is honoured: a longer endpoint than the pause, one turn.
    long_end = VadConfig(speech_end_silence_ms=2000, short_speech_end_silence_ms=2000)
    assert len(speech_ends_s(np.concatenate([clip, pause, clip, tail]), long_end)) == 1
