"""What a session sends, in order: segment ids, partials that changed, finals held for labels."""

from __future__ import annotations

from server.core.emitter import Clock, Emitter, Settled
from server.protocol.messages import DoneMessage, FinalMessage, PartialMessage
from tests.core_doubles import spoken

CLOCK = Clock(audio_received_s=2.0, lag_s=0.1)
EN = ("en", 0.97)


def test_a_partial_that_repeats_the_last_one_is_not_sent_again() -> None:
    emit = Emitter()
    words = spoken(("hello", 0.1, 0.4))
    emit.partial(words, 0.0, CLOCK, EN, provisional=False)
    emit.partial(words, 0.0, CLOCK, EN, provisional=False)
    emit.partial([], 0.0, CLOCK, EN, provisional=False)  # cleared: that is a change
    sent = emit.take(None, all_heard=True)
    assert [e.text for e in sent if isinstance(e, PartialMessage)] == ["hello", ""]


def test_finals_number_segments_and_the_partial_after_belongs_to_the_next() -> None:
    emit = Emitter()
    emit.partial(spoken(("hi", 0.1, 0.3)), 0.0, CLOCK, EN, provisional=False)
    emit.final(spoken(("hi", 0.1, 0.3)), CLOCK, EN, labelled=False)
    emit.final([], CLOCK, EN, labelled=False)  # no text: nothing sent, no id used
    emit.partial(spoken(("there", 0.5, 0.8)), 0.5, CLOCK, EN, provisional=False)
    sent = emit.take(None, all_heard=True)
    ids = [
        (type(e).__name__, e.segment_id)
        for e in sent
        if isinstance(e, FinalMessage | PartialMessage)
    ]
    assert ids == [("PartialMessage", 0), ("FinalMessage", 0), ("PartialMessage", 1)]
    final = next(e for e in sent if isinstance(e, FinalMessage))
    assert (final.language, final.language_probability, final.lag_s) == ("en", 0.97, 0.1)


def test_clearing_a_shown_partial_sends_an_empty_one_once() -> None:
    emit = Emitter()
    emit.clear_partial(1.0, 2.0)  # nothing shown: nothing to clear
    emit.partial(spoken(("so", 0.1, 0.3)), 0.0, CLOCK, EN, provisional=False)
    emit.clear_partial(1.0, 2.0)
    sent = emit.take(None, all_heard=True)
    assert [e.text for e in sent if isinstance(e, PartialMessage)] == ["so", ""]


class _Tracker:
    """A speaker tracker double: labels known up to ``covered_to`` samples."""

    def __init__(self, covered_to: int) -> None:
        self.covered_to = covered_to

    def covered(self, sample: int) -> bool:
        return sample <= self.covered_to

    def label(self, sample: int) -> None:
        return None


def test_a_final_waits_for_its_speakers_and_so_does_everything_after_it() -> None:
    emit = Emitter()
    emit.final(spoken(("hi", 0.1, 0.3)), CLOCK, EN, labelled=True)
    emit.add(Settled(2.0))
    tracker = _Tracker(covered_to=100)
    assert emit.take(tracker, all_heard=False) == []  # type: ignore[arg-type]
    assert emit.waiting_for_labels
    tracker.covered_to = 16_000
    sent = emit.take(tracker, all_heard=False)  # type: ignore[arg-type]
    assert [type(e).__name__ for e in sent] == ["FinalMessage", "Settled"]


def test_done_accounts_for_every_speech_sample() -> None:
    emit = Emitter()
    emit.account.speech = 32_000
    emit.account.transcribed = 24_000
    emit.account.failed = 8_000
    emit.done(audio_received_s=3.0, received_samples=48_000)
    [done] = emit.take(None, all_heard=True)
    assert isinstance(done, DoneMessage)
    assert (done.speech_s, done.transcribed_s, done.failed_s, done.non_speech_s) == (
        2.0,
        1.5,
        0.5,
        1.0,
    )
