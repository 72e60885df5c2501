"""Background searches: what two searches of one window agree on is held, then cut before."""

from __future__ import annotations

from server.config import StreamingConfig
from server.core.searches import held_cut_point, holdable, rest_after_held, search_due, settle
from server.core.utterance import SearchedWords
from tests.core_doubles import SR, commit, job, spoken, utterance

PER_UTTERANCE = StreamingConfig().with_finals("utterance")  # settled context 1.5 s


def test_a_search_is_due_from_search_s_into_the_utterance_and_every_step_after() -> None:
    c = PER_UTTERANCE  # 6 s, then every 2 s
    utt = utterance()
    assert not search_due(utt, round(5.9 * SR), None, c)
    assert search_due(utt, round(6.0 * SR), None, c)
    utt.searched_to = round(6.0 * SR)
    assert not search_due(utt, round(7.9 * SR), None, c)
    assert search_due(utt, round(8.0 * SR), None, c)
    assert not search_due(utt, round(8.0 * SR), round(7.5 * SR), c)  # in a pause: no


def test_two_searches_of_one_window_agree_on_their_settled_words() -> None:
    c = PER_UTTERANCE
    utt = utterance()
    first = spoken(("the", 0.5, 0.7), ("old", 0.8, 1.1), ("man", 1.2, 1.6), ("said", 5.0, 5.4))
    settle(utt, job(0.0, 6.0), first, c)
    assert utt.search_words is not None and [w.text for w in utt.search_words.words] == [
        " the",
        " old",
        " man",
    ]  # "said" ends within 1.5 s of the audio's end: not settled
    assert utt.agreed is None
    second = spoken(("the", 0.5, 0.7), ("old", 0.8, 1.1), ("men", 1.2, 1.6), ("said", 5.0, 5.4))
    settle(utt, job(0.0, 8.0), second, c)
    assert utt.agreed is not None and [w.text for w in utt.agreed.words] == [" the", " old"]


def test_a_search_of_another_window_agrees_with_nothing() -> None:
    utt = utterance()
    words = spoken(("the", 0.5, 0.7), ("old", 0.8, 1.1))
    settle(utt, job(0.0, 6.0), words, PER_UTTERANCE)
    utt.window_start = round(1.0 * SR)  # a cut moved the window
    settle(utt, job(1.0, 8.0), words, PER_UTTERANCE)
    assert utt.agreed is None


def test_only_more_words_than_a_cut_carries_are_held() -> None:
    utt = utterance()
    two = SearchedWords(utt.basis, round(6.0 * SR), spoken(("a", 0.1, 0.2), ("b", 0.3, 0.4)))
    assert not holdable(utt, two, carry_words=2)
    three = SearchedWords(
        utt.basis, round(6.0 * SR), spoken(("a", 0.1, 0.2), ("b", 0.3, 0.4), ("c", 0.5, 0.6))
    )
    assert holdable(utt, three, carry_words=2)
    utt.window_start = round(0.05 * SR)
    assert not holdable(utt, three, carry_words=2)  # the window moved under them


def test_the_window_is_cut_before_the_held_words_last_seconds() -> None:
    """The closing decode hears the held words of the last ``utterance_search_context_s``
    again, as context for the tail."""
    utt = utterance(heard_to_s=12.0)
    commit(utt, spoken(*[(f"w{k}", k * 1.0, k * 1.0 + 0.5) for k in range(10)]))
    at, carry = held_cut_point(utt, PER_UTTERANCE)  # last word ends 9.5 s: floor 5.5 s
    assert (at, carry) == (round(6.0 * SR), 4)


def test_the_latest_searchs_words_after_the_held_ones_are_kept_for_the_next() -> None:
    basis = (0, 0)
    agreed = SearchedWords(basis, 10, spoken(("a", 0.1, 0.2)))
    latest = SearchedWords(basis, 20, spoken(("a", 0.1, 0.2), ("b", 0.3, 0.4)))
    rest = rest_after_held(latest, agreed, (5, 1))
    assert rest is not None and rest.basis == (5, 1) and [w.text for w in rest.words] == [" b"]
    assert rest_after_held(None, agreed, (5, 1)) is None
