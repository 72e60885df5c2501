"""The decode desk: one decode in flight, the next when the planner says so, refreshed while
it waits, replaced by the closing decode, and the background searches beside it."""

from __future__ import annotations

from server.config import StreamingConfig
from server.core.planner import Load
from tests.core_doubles import SR, decoded, feed, quiet_stack


def never(utt: object) -> None:
    raise AssertionError("no speculation was held")


def test_one_decode_in_flight_and_the_next_after_its_result() -> None:
    audio, windows, desk, results = quiet_stack()
    windows.open(0)
    feed(audio, 0.5)
    job = desk.next_job(Load(), never)
    assert job is not None and job.start_s == 0.0 and job.urgent  # the first words wait on it
    feed(audio, 1.0)
    assert desk.next_job(Load(), never) is None  # in flight
    assert desk.take(job) is job and desk.in_flight is None
    assert desk.take(job) is None  # taken once
    results.fold(job, decoded(job, ("hello", 0.1, 0.4)))
    again = desk.next_job(Load(), never)
    assert again is not None and again.audio_s == 1.5


def test_a_waiting_job_grows_to_the_present_but_never_past_the_cap() -> None:
    c = StreamingConfig(max_window_s=4.0, crowded_max_window_s=2.0, clause_cut_s=4.0)
    audio, windows, desk, _ = quiet_stack(c)
    windows.open(0)
    feed(audio, 1.0)
    job = desk.next_job(Load(), never)
    assert job is not None
    feed(audio, 2.0)
    fresh = desk.refresh(job, Load())
    assert fresh.audio_s == 3.0 and desk.in_flight is fresh
    feed(audio, 3.0)
    assert desk.refresh(fresh, Load()).audio_s == 4.0
    assert desk.refresh(job, Load()) is job  # not the job in flight any more


def test_a_closed_utterance_gets_its_closing_decode_at_once() -> None:
    audio, windows, desk, _ = quiet_stack()
    windows.open(0)
    feed(audio, 2.0)
    windows.close_open(round(1.8 * SR), reopen=False)
    job = desk.next_job(Load(min_hop_s=5.0), never)  # the hop never holds a closing decode
    assert job is not None and job.closing and job.urgent and job.audio_s == 1.8


def test_per_utterance_the_closing_decode_replaces_a_redecode_in_flight() -> None:
    audio, windows, desk, results = quiet_stack(StreamingConfig().with_finals("utterance"))
    windows.open(0)
    feed(audio, 1.0)
    first = desk.next_job(Load(), never)
    assert first is not None
    desk.take(first)
    results.fold(first, decoded(first, ("so", 0.1, 0.3)))
    feed(audio, 1.0)
    redecode = desk.next_job(Load(), never)
    assert redecode is not None and not redecode.closing
    windows.close_open(round(1.9 * SR), reopen=False)
    closing = desk.supersede(Load(), never)
    assert closing is not None and closing.closing and desk.in_flight is closing
    assert desk.counts["supersede"] == 1


def test_word_by_word_a_redecode_in_flight_is_not_replaced() -> None:
    audio, windows, desk, _ = quiet_stack(StreamingConfig(finals="words"))
    windows.open(0)
    feed(audio, 1.0)
    job = desk.next_job(Load(), never)
    windows.close_open(round(0.9 * SR), reopen=False)
    assert desk.supersede(Load(), never) is None and desk.in_flight is job


def test_a_search_is_stale_once_its_utterance_ended() -> None:
    audio, windows, desk, _ = quiet_stack(StreamingConfig().with_finals("utterance"))
    windows.open(0)
    windows.utterances[0].language = "en"
    feed(audio, 7.0)
    search = desk.next_search(Load())
    assert search is not None and not search.closing and search.request.options.beam_size == 5
    assert desk.next_search(Load()) is None  # one at a time
    assert not desk.search_stale
    windows.close_open(round(6.9 * SR), reopen=False)
    assert desk.search_stale
    assert desk.take_search(search) and not desk.take_search(search)


def test_no_search_past_the_comfortable_estimate() -> None:
    audio, windows, desk, _ = quiet_stack(StreamingConfig().with_finals("utterance"))
    windows.open(0)
    feed(audio, 7.0)
    assert desk.next_search(Load(past_comfort=True)) is None
