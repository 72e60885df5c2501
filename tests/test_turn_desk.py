"""The turn desk: the turn events among the session's events, the audio kept for the turn
model, and the decisions applied."""

from __future__ import annotations

from server.core.emitter import Settled
from server.core.turn_desk import TurnDesk
from server.core.turns import TurnConfig, TurnEvent
from server.protocol.messages import SpeechStartedMessage
from tests.core_doubles import SR, feed, quiet_stack


def desk_with(events: list[object]) -> tuple[TurnDesk, list[str]]:
    audio, windows, _, _ = quiet_stack()
    ended: list[str] = []
    desk = TurnDesk(
        "t",
        audio,
        windows,
        take=lambda: [events.pop(0)] if events else [],  # type: ignore[list-item]
        end_speech_at_pause=lambda: ended.append("ended"),
    )
    return desk, ended


def test_without_turns_the_events_pass_as_they_are() -> None:
    desk, _ = desk_with([SpeechStartedMessage(0.1, 0.2)])
    assert [type(e).__name__ for e in desk.drain()] == ["SpeechStartedMessage"]
    assert desk.next_job() is None and desk.keep_from() is None


def test_each_turn_event_follows_the_event_that_made_it() -> None:
    desk, _ = desk_with([SpeechStartedMessage(0.1, 0.2)])
    desk.configure(TurnConfig())
    out = desk.drain()
    assert [type(e).__name__ for e in out] == ["SpeechStartedMessage", "TurnEvent"]


def test_a_decided_turn_with_nothing_left_to_decode_ends_at_once() -> None:
    desk, _ = desk_with([SpeechStartedMessage(0.1, 0.2), Settled(1.0)])
    desk.configure(TurnConfig())
    desk.drain()
    desk.decide("manual")
    desk.end_if_final()
    [end] = [e for e in desk.drain() if isinstance(e, TurnEvent)]
    assert str(end.kind) == "EndOfTurn" and end.trigger == "manual"


def test_the_buffer_keeps_an_open_turns_last_seconds() -> None:
    desk, _ = desk_with([SpeechStartedMessage(1.0, 1.1)])
    desk.configure(TurnConfig())
    desk.drain()
    feed(desk.audio, 12.0)
    assert desk.keep_from() == round(4.0 * SR)  # the last 8 s of 12
    desk.decide("timeout")
    assert desk.keep_from() is None  # decided: the model needs nothing more
