"""The streamer's pure bookkeeping: ``LatencyTracker`` fed scripted wall times and messages."""

from __future__ import annotations

import pytest

from client.render import format_stats
from client.stream import LatencyTracker
from server.protocol.messages import FinalMessage, PartialMessage, SpeechStartedMessage


def test_latency_tracker_and_stats_report() -> None:
    tracker = LatencyTracker()
    tracker.started(100.0)
    # Ten 100 ms chunks, each sent when its last sample "was recorded" (real-time pacing).
    for i in range(10):
        tracker.audio_sent(0.1, 100.0 + 0.1 * (i + 1))
    assert tracker.sent_at(0.0) == pytest.approx(100.1)
    assert tracker.sent_at(0.35) == pytest.approx(100.4)
    assert tracker.sent_at(99.0) == pytest.approx(101.0)
    tracker.message_received(SpeechStartedMessage(0.3, 0.5), 100.55)  # audio at 0.3 sent 100.3
    tracker.message_received(PartialMessage(0, "  ", 0.3, 0.5, 0.6), 100.6)  # no word yet
    tracker.message_received(PartialMessage(0, " hi", 0.3, 0.6, 0.7), 100.9)
    tracker.message_received(FinalMessage(0, " hi there", 0.3, 0.8, (), 1.0), 101.2)
    tracker.message_received(FinalMessage(1, "", 0.9, 1.0, (), 1.0), 101.3)  # empty: no latency
    stats = tracker.stats(end_wall=101.5)
    assert stats.audio_s == pytest.approx(1.0)
    assert stats.wall_s == pytest.approx(1.5)
    assert stats.real_time_factor == pytest.approx(1.5)
    assert stats.ttft_s == pytest.approx(100.9 - 100.3)
    assert stats.final_latencies_s == pytest.approx((101.2 - 100.8,))
    report = format_stats(stats)
    assert "real-time factor 1.50" in report
    assert "time to first token: 0.60 s" in report
    assert "final latency over 1 final(s): median 0.40 s" in report
