"""A decode folded into the stream: what becomes final, what is shown, where the window is
cut, and decode failures."""

from __future__ import annotations

import dataclasses

from server.config import StreamingConfig
from server.core.planner import Load
from server.protocol.messages import ErrorMessage, FinalMessage, PartialMessage
from tests.core_doubles import SR, decoded, feed, quiet_stack


def never(utt: object) -> None:
    raise AssertionError("no speculation was held")


def test_a_closing_decode_makes_everything_final_and_retires_the_utterance() -> None:
    audio, windows, desk, results = quiet_stack(StreamingConfig(finals="words"))
    windows.open(0)
    feed(audio, 2.0)
    windows.close_open(round(2.0 * SR), reopen=False)
    job = desk.next_job(Load(), never)
    assert job is not None and desk.take(job) is job
    results.fold(job, decoded(job, ("it", 0.2, 0.4), ("ends.", 0.5, 1.4)))
    events = windows.text.emit.take(None, all_heard=True)
    finals = [e for e in events if isinstance(e, FinalMessage)]
    assert [f.text for f in finals] == ["it ends."] and not windows.utterances
    assert windows.counts["final:closing"] == 1


def test_a_redecode_shows_its_words_until_decodes_agree() -> None:
    audio, windows, desk, results = quiet_stack(StreamingConfig(finals="words"))
    windows.open(0)
    feed(audio, 5.0)
    job = desk.next_job(Load(), never)
    assert job is not None
    desk.take(job)
    results.fold(job, decoded(job, ("one", 0.2, 0.5), ("two", 0.6, 0.9)))
    events = windows.text.emit.take(None, all_heard=True)
    assert [type(e) for e in events] == [PartialMessage]
    assert events[0].text == "one two"


def test_three_failures_give_the_utterance_up_and_say_so() -> None:
    audio, windows, desk, results = quiet_stack(StreamingConfig(finals="words"))
    windows.open(0)
    feed(audio, 1.0)
    for _ in range(3):
        job = desk.next_job(Load(), never)
        assert job is not None
        desk.take(job)
        results.fail(job, RuntimeError("lane died"))
        feed(audio, 0.4)
    events = windows.text.emit.take(None, all_heard=True)
    errors = [e for e in events if isinstance(e, ErrorMessage)]
    assert len(errors) == 3 and "lane died" in errors[0].message
    assert windows.text.emit.account.failed > 0
    # The speech after the given-up window goes on in a new utterance.
    assert len(windows.utterances) == 1 and windows.utterances[0].start > 0


def test_a_speculative_closing_decode_that_speech_overtook_counts_as_a_redecode() -> None:
    audio, windows, desk, results = quiet_stack(StreamingConfig(finals="words"))
    windows.open(0)
    feed(audio, 2.0)
    utt = windows.utterances[0]
    utt.speculated_to = 0
    job = desk.next_job(Load(), never)
    assert job is not None
    desk.take(job)
    guess = dataclasses.replace(job, speculative=True, closing=True)
    results.fold(guess, decoded(guess, ("maybe", 0.2, 0.6)))
    # The VAD hears no pause now: the guess was overtaken. Nothing is final, the utterance
    # goes on, and its words are not shown (they end in the pause and would be taken back).
    assert utt.speculation is None and utt.tentative and not utt.committed
    assert windows.utterances[0] is utt
    assert windows.text.emit.take(None, all_heard=True) == []
