"""The telephony benchmark's pure parts: pooling and the paired bootstrap. No model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.telephony import paired_bootstrap, pooled


def rows(errors: list[int], words: int = 20, latency: float | None = None) -> list[dict[str, Any]]:
    return [
        {"file": f"c{k}", "ref_words": words, "errors": e}
        | ({"final_latencies_s": [latency]} if latency is not None else {})
        for k, e in enumerate(errors)
    ]


def test_pooled_wer_is_over_all_words() -> None:
    figures = pooled(rows([1, 3, 0, 4], latency=0.8))
    assert (figures["errors"], figures["ref_words"], figures["wer"]) == (8, 80, 0.1)
    assert figures["final_latency_p95_s"] == pytest.approx(0.8)
    assert "final_latency_p95_s" not in pooled(rows([1]))  # offline rows have no latency


def test_the_bootstrap_brackets_a_consistent_gain_below_zero() -> None:
    base = rows([3, 4, 2, 5, 3, 4, 3, 2])
    better = rows([2, 3, 1, 4, 2, 3, 2, 1])  # one error fewer on every clip: -5 points
    low, high = paired_bootstrap(base, better)
    assert low == high == pytest.approx(-5.0)
    mixed = rows([4, 2, 5, 1, 3, 5, 2, 4])  # as many clips better as worse
    low, high = paired_bootstrap(base, mixed)
    assert low < 0 < high


def test_simulate_feeds_a_phone_line_at_its_own_rate_and_pace() -> None:
    """``simulate``'s ``wire``: the same audio as 16 kHz s16le bytes gives the same stream
    as without it; as 8 kHz mu-law it lasts as long and is heard by the session."""
    from bench.phone_line import phone_line
    from bench.simulate import simulate
    from server.protocol.audio import pcm_s16le_bytes
    from server.protocol.formats import AudioFormat
    from tests.helpers import ScriptedEngine

    t = np.arange(3 * 16_000) / 16_000
    audio = (0.3 * np.sin(2 * np.pi * 440 * t) * (t > 0.5)).astype(np.float32)
    engine: Any = ScriptedEngine()
    plain = simulate(engine, audio, decode_cost_s=lambda job: 0.1)
    same = simulate(
        engine, audio, decode_cost_s=lambda job: 0.1, wire=(AudioFormat(), pcm_s16le_bytes(audio))
    )
    assert same.text == plain.text and same.audio_s == plain.audio_s == 3.0
    assert [e.at_s for e in same.events] == [e.at_s for e in plain.events]
    line = simulate(
        engine,
        audio,
        decode_cost_s=lambda job: 0.1,
        wire=(AudioFormat(8000, "mulaw"), phone_line(audio)),
    )
    assert line.audio_s == 3.0 and line.text  # the tone is heard as speech through the line
