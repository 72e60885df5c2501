"""The latency benchmark's metric code on scripted timelines: no server, no model."""

from __future__ import annotations

import json

import pytest

from bench.latency_metrics import (
    Observation,
    RefWord,
    SendLog,
    align,
    flicker,
    join_word_pieces,
    p50_p95_ms,
    percentile,
    stream_metrics,
    utterance_ends_at,
)


def sends_every(frame_s: float, frames: int, start_wall: float = 100.0) -> SendLog:
    """Frames sent exactly on time: frame k (ending at (k+1)*frame_s) at start + its end."""
    log = SendLog()
    for k in range(frames):
        log.sent(frame_s, start_wall + (k + 1) * frame_s)
    return log


def ref(*spec: tuple[str, float, float]) -> list[RefWord]:
    return [RefWord(w, s, e) for w, s, e in spec]


def obs(wall: float, final: str = "", tentative: str = "") -> Observation:
    return Observation(wall, tuple(final.split()), tuple(tentative.split()))


def test_send_log_maps_stream_time_to_the_frame_that_carried_it() -> None:
    log = sends_every(0.1, 20)
    assert log.sent_at(0.05) == pytest.approx(100.1)
    assert log.sent_at(0.1) == pytest.approx(100.1)  # the end of frame 0 is in frame 0
    assert log.sent_at(0.11) == pytest.approx(100.2)
    assert log.sent_at(99.0) == pytest.approx(102.0)  # past the end: the last frame
    assert log.audio_sent_by(100.55) == pytest.approx(0.5)
    assert log.audio_sent_by(99.0) == 0.0


def test_align_matches_by_sequence_not_position() -> None:
    # One word dropped early and one inserted: later words still pair with their own.
    reference = ["He", "hoped", "there", "would", "be", "stew"]
    hypothesis = ["he", "there", "uh", "would", "be", "stew."]
    assert align(reference, hypothesis) == {0: 0, 2: 1, 3: 3, 4: 4, 5: 5}


def test_align_keeps_frequent_words_in_long_texts() -> None:
    # difflib's autojunk would drop "the" (over 1% of a 200+ word text) from matching.
    reference = ["the", "cat"] * 150
    assert len(align(reference, list(reference))) == 300


def test_word_pieces_join_the_word_before_them() -> None:
    pieces = ref(
        (" He", 0.0, 0.3), (" ate", 0.3, 0.5), (",", 0.5, 0.6), (" flower", 0.6, 0.9),
        ("-fatened", 0.9, 1.2), (" sauce", 1.2, 1.5), (".", 1.5, 1.5),
    )  # fmt: skip
    assert [(w.word, w.start_s, w.end_s) for w in join_word_pieces(pieces)] == [
        (" He", 0.0, 0.3),
        (" ate,", 0.3, 0.6),
        (" flower-fatened", 0.6, 1.2),
        (" sauce.", 1.2, 1.5),
    ]
    # A word with no letters or digits left after joining can never be matched: dropped.
    assert join_word_pieces(ref(("...", 0.0, 0.1), (" oh", 0.1, 0.2))) == ref((" oh", 0.1, 0.2))


def test_utterances_end_where_the_voice_activity_detector_ended_speech() -> None:
    words = ref(
        ("a", 0.0, 0.3), ("b", 0.4, 0.7), ("c", 2.0, 2.2), ("d", 2.3, 2.5), ("e", 8.0, 8.3)
    )  # fmt: skip
    # Speech ended 0.2 s after "b" and "d" (the trailing pad) and after "e"; at 5.0 s no word
    # was timed within 0.8 s before: the alignment has none there, so no utterance ends.
    assert utterance_ends_at(words, [0.9, 2.7, 5.0, 8.5]) == [1, 3, 4]
    # The gap between "b" and "c" is no end when the detector heard speech go on through it
    # (an alignment that left a hole in the words).
    assert utterance_ends_at(words, [2.7, 8.5]) == [3, 4]
    assert utterance_ends_at(words, []) == []
    assert utterance_ends_at([], [1.0]) == []
    # Two speech ends after the same word: it ends one utterance.
    assert utterance_ends_at(words, [2.6, 2.9]) == [3]


def test_stream_metrics_on_a_scripted_timeline() -> None:
    # Speech "hello world" 0.5-1.4 s, pause, "good bye" 3.0-3.8 s; frames of 0.1 s sent on
    # time from wall 100.0, so the audio at stream time t left at 100 + ceil(t/0.1)*0.1.
    words = ref(
        ("Hello", 0.5, 0.9), ("world", 1.0, 1.4), ("good", 3.0, 3.3), ("bye.", 3.4, 3.8)
    )  # fmt: skip
    timeline = [
        obs(101.2, tentative="hello"),  # 0.7 s after onset was sent (100.5)
        obs(101.6, tentative="hello word"),  # "word" shown for "world": a wrong word
        obs(102.0, tentative="hello world"),  # flicker: "word" changed
        obs(102.2, final="Hello world."),  # finalised 0.8 s after 1.4 s was sent (101.4)
        obs(103.6, final="Hello world.", tentative="good"),
        obs(104.5, final="Hello world. Good bye."),  # 0.7 s after 3.8 s was sent (103.8)
    ]
    # The server's detector ended speech 0.2 s after each utterance (its trailing pad).
    m = stream_metrics(words, timeline, sends_every(0.1, 45), speech_ends_s=[1.6, 4.0])
    assert m.ttft_s == pytest.approx(0.7)
    # first shown: hello 101.2-100.9, world 102.0-101.4, good 103.6-103.3, bye 104.5-103.8
    assert m.first_seen_s == pytest.approx((0.3, 0.6, 0.3, 0.7))
    assert m.finalised_s == pytest.approx((1.3, 0.8, 1.2, 0.7))
    assert m.end_of_speech_to_final_s == pytest.approx((0.8, 0.7))
    assert (m.words_reference, m.words_seen, m.words_finalised) == (4, 4, 4)
    # It heard the pause as part of one utterance: one turn, at its end.
    one = stream_metrics(words, timeline, sends_every(0.1, 45), speech_ends_s=[4.0])
    assert one.end_of_speech_to_final_s == pytest.approx((0.7,))
    assert (m.flicker_changed, m.flicker_shown) == (1, 1 + 2 + 2 + 1)


def test_a_word_is_not_seen_before_its_audio_was_sent() -> None:
    # "the" is spoken at 0.2 s and again at 5.0 s; an early partial's single "the" must be
    # the first one, not the later one.
    words = ref(("the", 0.2, 0.4), ("cat", 0.5, 0.8), ("the", 5.0, 5.2), ("end", 5.3, 5.6))
    timeline = [obs(101.0, tentative="the"), obs(106.0, final="the cat the end")]
    m = stream_metrics(words, timeline, sends_every(0.1, 60), speech_ends_s=[0.6, 5.8])
    assert m.first_seen_s[0] == pytest.approx(101.0 - 100.4)
    assert m.words_seen == 4
    assert m.first_seen_s[2] == pytest.approx(106.0 - 105.2)


def test_dropped_and_never_final_words() -> None:
    # The recogniser never finalises "world" and drops the utterance's last word "bye":
    # end of speech to final falls back to the last finalised word of the utterance.
    words = ref(("hello", 0.0, 0.4), ("world", 0.5, 0.9), ("bye", 1.0, 1.3))
    timeline = [obs(101.0, tentative="hello world"), obs(102.0, final="hello")]
    m = stream_metrics(words, timeline, sends_every(0.1, 20), speech_ends_s=[1.5])
    assert m.words_finalised == 1
    assert m.words_seen == 2
    assert m.finalised_s == pytest.approx((102.0 - 100.4,))
    assert m.end_of_speech_to_final_s == pytest.approx((102.0 - 101.3,))


def test_no_words_shown() -> None:
    m = stream_metrics(ref(("a", 0.0, 0.2)), [], sends_every(0.1, 5), speech_ends_s=[0.4])
    assert m.ttft_s is None
    assert m.first_seen_s == () and m.finalised_s == ()
    assert m.flicker_rate == 0.0


def test_flicker_counts_changed_words_not_finalisation() -> None:
    timeline = [
        obs(1, tentative="a b"),
        obs(2, tentative="a c d"),  # "b" changed
        obs(3, final="a c", tentative="d e"),  # moved to final unchanged: no flicker
        obs(4, final="a c", tentative="x"),  # "d" and "e" taken back
    ]
    assert flicker(timeline) == (3, 2 + 3 + 2 + 1)


def test_percentiles() -> None:
    samples = [0.1 * k for k in range(1, 21)]
    assert percentile(samples, 0.5) == pytest.approx(1.1)  # nearest rank of 19 * 0.5 -> 10
    assert percentile(samples, 0.95) == pytest.approx(1.9)
    assert p50_p95_ms(samples) == {"p50_ms": 1050.0, "p95_ms": 1900.0, "n": 20}
    assert p50_p95_ms([]) == {"p50_ms": None, "p95_ms": None, "n": 0}


def test_adapters_build_the_same_view_from_each_protocol() -> None:
    from bench.peer_whisperlive import PeerConfig, WhisperLiveAdapter
    from bench.replay import WhisperwireAdapter

    ours = WhisperwireAdapter("ws://x")
    assert ours.receive(json.dumps({"type": "ready"})) is None
    assert ours.receive(json.dumps({"type": "partial", "text": " And so"})) == ((), ("And", "so"))
    view = ours.receive(json.dumps({"type": "final", "text": " And so, my."}))
    assert view == (("And", "so,", "my."), ())
    assert ours.final_text() == "And so, my."

    peer = WhisperLiveAdapter("ws://x", PeerConfig(model_path="/m"))

    def seg(start: float, end: float, text: str, completed: bool) -> dict[str, object]:
        return {"start": f"{start:.3f}", "end": f"{end:.3f}", "text": text, "completed": completed}

    def segments(*segs: dict[str, object]) -> str:
        return json.dumps({"uid": "u", "segments": list(segs)})

    assert peer.receive(segments(seg(0, 1, " And so", False))) == ((), ("And", "so"))
    # The server repeats completed segments in every message; they are kept once.
    first = segments(seg(0, 2, " And so, my.", True), seg(2, 3, " fellow", False))
    assert peer.receive(first) == (("And", "so,", "my."), ("fellow",))
    assert peer.receive(first) == (("And", "so,", "my."), ("fellow",))
    # A completed segment starting before the last kept one ended is a re-send, not new text.
    overlap = segments(seg(1, 2.5, " so my", True), seg(2.5, 3, " fellow", False))
    assert peer.receive(overlap) == (("And", "so,", "my."), ("fellow",))
    assert peer.final_text() == "And so, my. fellow"
    assert peer.completed_text() == "And so, my."
