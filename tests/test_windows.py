"""A stream's utterances and the moves of their windows: open and close, finals through one
place, cuts at the cap, held search words, the audio the buffer may forget."""

from __future__ import annotations

from server.config import StreamingConfig
from server.core.emitter import Settled
from server.core.utterance import SearchedWords
from server.protocol.messages import FinalMessage
from tests.core_doubles import SR, feed, quiet_stack, spoken


def test_closing_the_open_utterance_counts_its_speech_and_can_open_the_next() -> None:
    audio, windows, _, _ = quiet_stack()
    feed(audio, 3.0)
    windows.open(round(0.5 * SR))
    windows.close_open(round(2.0 * SR), reopen=True)
    assert [u.end for u in windows.utterances] == [round(2.0 * SR), None]
    assert windows.utterances[1].start == round(2.0 * SR)
    assert windows.text.emit.account.speech == round(1.5 * SR)


def test_settled_follows_once_every_closed_utterance_is_finished() -> None:
    audio, windows, _, _ = quiet_stack()
    feed(audio, 2.0)
    windows.open(0)
    windows.close_open(round(1.0 * SR), reopen=False)
    windows.unsettled = True
    windows.settle_if_closed_finished()
    assert windows.text.emit.take(None, all_heard=True) == []
    utt = windows.utterances[0]
    utt.heard_to = utt.end or 0
    windows.finish(utt, decoded=True)
    events = windows.text.emit.take(None, all_heard=True)
    assert isinstance(events[-1], Settled) and not windows.utterances


def test_a_window_at_its_cap_with_nothing_agreed_makes_its_shown_words_final_and_cuts() -> None:
    audio, windows, _, _ = quiet_stack()
    feed(audio, 16.0)
    windows.open(0)
    utt = windows.utterances[0]
    utt.heard_to = round(15.0 * SR)
    shown = spoken(("a", 1.0, 1.4), ("b", 5.0, 5.4), ("c", 14.0, 14.4))
    utt.policy.update(shown, window_start_s=0.0, window_end_s=15.0, closing=False)
    utt.tentative = utt.policy.tentative
    windows.cut_at_cap(utt, round(15.0 * SR))
    finals = [
        e for e in windows.text.emit.take(None, all_heard=True) if isinstance(e, FinalMessage)
    ]
    assert [f.text for f in finals] == ["a b c"]
    assert utt.window_start == round(5.0 * SR) and len(utt.committed) == 2
    assert windows.counts["window_cap"] == 1 and windows.counts["final:window_cap"] == 1


def test_held_search_words_wait_unsent_and_the_window_is_cut_before_their_last_seconds() -> None:
    audio, windows, _, _ = quiet_stack(StreamingConfig().with_finals("utterance"))
    feed(audio, 12.0)
    windows.open(0)
    utt = windows.utterances[0]
    words = spoken(*[(f"w{k}", k * 1.0, k * 1.0 + 0.5) for k in range(10)])
    utt.agreed = SearchedWords(utt.basis, round(11.0 * SR), words)
    windows.hold_agreed(utt)
    assert utt.unsent == words  # final at the utterance's end, with the rest
    assert utt.window_start == round(6.0 * SR) and len(utt.committed) == 4
    assert windows.text.emit.take(None, all_heard=True) == []


def test_the_buffer_keeps_what_the_first_window_needs() -> None:
    audio, windows, _, _ = quiet_stack()
    feed(audio, 10.0)
    windows.open(round(2.0 * SR))
    windows.trim()
    assert audio.buffer.start == round(2.0 * SR)
