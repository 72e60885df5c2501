"""Conversational turns, decided apart from the words: the tracker on scripted events."""

from __future__ import annotations

import pytest

from server.core.emitter import Settled
from server.core.turns import TurnConfig, TurnKind, TurnTracker
from server.protocol.messages import (
    FinalMessage,
    PartialMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    WordInfo,
)


def final(text: str, start: float, end: float, segment: int = 0) -> FinalMessage:
    words = tuple(WordInfo(w, start, end, 0.9) for w in text.split())
    return FinalMessage(segment, text, start, end, words, end, 0.0)


def kinds(events: list[object]) -> list[str]:
    return [str(getattr(e, "kind", "")) for e in events]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"eot_threshold": 0.4},
        {"eot_threshold": 0.95},
        {"eager_eot_threshold": 0.2},
        {"eager_eot_threshold": 0.8, "eot_threshold": 0.7},
        {"eot_timeout_ms": 100},
        {"eot_timeout_ms": 20_000},
    ],
)
def test_thresholds_outside_fluxs_ranges_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TurnConfig(**kwargs)  # type: ignore[arg-type]


def test_a_turn_starts_with_speech_updates_with_its_words_and_ends_when_decided_and_final() -> None:
    turns = TurnTracker(TurnConfig())
    events = turns.observe(SpeechStartedMessage(0.5, 0.6), 0.6)
    assert kinds(events) == ["StartOfTurn"] and events[0].turn_index == 0
    events = turns.observe(PartialMessage(0, "hello there", 0.6, 1.4, 1.5, 0.0), 1.5)
    assert kinds(events) == ["Update"] and events[0].transcript == "hello there"
    assert turns.observe(PartialMessage(0, "hello there", 0.6, 1.4, 1.6, 0.0), 1.6) == []
    assert turns.pause_due(round(1.6 * 16000))
    assert turns.scored(0.2, 1.8) == []  # not complete: the turn goes on
    assert turns.deciding
    turns.observe(final("Hello there.", 0.6, 1.4), 2.0)
    assert turns.settled(2.0) == []  # the utterance is final, the turn is not over
    turns.observe(SpeechStartedMessage(2.4, 2.5), 2.5)
    turns.observe(final("How are you?", 2.5, 3.2, 1), 3.6)
    assert turns.scored(0.92, 3.5) == []
    [end] = turns.settled(3.7)
    assert end.kind is TurnKind.END and end.trigger == "model"
    assert end.transcript == "Hello there. How are you?" and end.end_of_turn_confidence == 0.92
    assert (end.start_s, end.end_s) == (0.5, 3.2) and not turns.open
    [start] = turns.observe(SpeechStartedMessage(5.0, 5.1), 5.1)
    assert start.kind is TurnKind.START and start.turn_index == 1


def test_an_eager_end_is_announced_and_taken_back_when_speech_goes_on() -> None:
    turns = TurnTracker(TurnConfig(eager_eot_threshold=0.4))
    turns.observe(SpeechStartedMessage(0.0, 0.1), 0.1)
    turns.observe(final("I want to", 0.1, 0.9), 1.2)
    assert kinds(turns.scored(0.5, 1.2)) == ["EagerEndOfTurn"]
    assert turns.deciding
    assert kinds(turns.observe(SpeechStartedMessage(1.6, 1.7), 1.7)) == ["TurnResumed"]
    turns.observe(final("book a table.", 1.7, 2.6, 1), 3.0)
    events = turns.scored(0.8, 3.0)  # eager and complete at once
    assert kinds(events) == ["EagerEndOfTurn"]
    [end] = turns.settled(3.1)
    assert end.transcript == "I want to book a table."


def test_a_model_end_that_speech_overtook_leaves_the_turn_open() -> None:
    turns = TurnTracker(TurnConfig())
    turns.observe(SpeechStartedMessage(0.0, 0.1), 0.1)
    turns.scored(0.9, 1.0)
    turns.observe(SpeechStartedMessage(1.2, 1.3), 1.3)  # before its words were final
    assert turns.deciding and turns.settled(1.5) == []


def test_a_timeout_or_a_manual_end_names_its_trigger() -> None:
    for trigger in ("timeout", "manual"):
        turns = TurnTracker(TurnConfig())
        turns.observe(SpeechStartedMessage(0.0, 0.1), 0.1)
        turns.observe(final("Well.", 0.1, 0.5), 0.8)
        turns.decide(trigger)
        [end] = turns.settled(6.0)
        assert end.trigger == trigger and end.transcript == "Well."


def test_settled_without_a_turn_says_nothing() -> None:
    assert TurnTracker(TurnConfig()).observe(Settled(1.0), 1.0) == []


def test_a_model_end_that_a_silence_past_the_timeout_confirmed_stands_when_speech_comes() -> None:
    """The model ended the turn, its last final is late (a decoder behind), and the speaker
    spoke again only after a silence longer than ``eot_timeout_ms``: that speech starts the
    next turn, once this one has ended with its own words."""
    turns = TurnTracker(TurnConfig(eot_timeout_ms=2000))
    turns.observe(SpeechStartedMessage(0.0, 0.1), 0.1)
    assert turns.scored(0.9, 1.2) == []
    turns.observe(SpeechEndedMessage(1.0, 1.3), 1.3)
    assert turns.observe(SpeechStartedMessage(3.5, 3.6), 3.6) == []  # 2.5 s later
    assert not turns.deciding  # not taken back
    assert turns.observe(PartialMessage(1, "and then", 3.5, 4.0, 4.1, 0.0), 4.1) == []
    turns.observe(final("Book it.", 0.1, 0.9), 4.3)
    [end, start] = turns.settled(4.3)
    assert (end.kind, end.trigger, end.transcript) == (TurnKind.END, "model", "Book it.")
    assert start.kind is TurnKind.START and (start.turn_index, start.start_s) == (1, 3.5)
    [update] = turns.observe(final("And then?", 3.5, 4.0, 1), 4.6)
    assert update.kind is TurnKind.UPDATE and update.transcript == "And then?"


def test_speech_within_the_timeout_after_a_model_end_still_resumes_the_turn() -> None:
    turns = TurnTracker(TurnConfig(eot_timeout_ms=2000))
    turns.observe(SpeechStartedMessage(0.0, 0.1), 0.1)
    turns.scored(0.9, 1.2)
    turns.observe(SpeechEndedMessage(1.0, 1.3), 1.3)
    turns.observe(SpeechStartedMessage(1.8, 1.9), 1.9)
    assert turns.deciding


def test_speech_after_a_manual_end_waits_for_the_ended_turns_words_then_opens_the_next() -> None:
    turns = TurnTracker(TurnConfig())
    turns.observe(SpeechStartedMessage(0.0, 0.1), 0.1)
    turns.decide("manual")
    turns.observe(SpeechStartedMessage(1.5, 1.6), 1.6)  # before "Stop." is final
    turns.observe(final("Stop.", 0.1, 0.6), 1.8)
    # Its words are final (no Settled seen yet): the next turn's first final ends it.
    [end, start, update] = turns.observe(final("Go on.", 1.5, 2.0, 1), 2.4)
    assert (end.trigger, end.transcript) == ("manual", "Stop.")
    assert start.kind is TurnKind.START and start.start_s == 1.5
    assert update.transcript == "Go on." and turns.settled(2.6) == []  # undecided
