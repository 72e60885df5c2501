"""One utterance's window state and its own small operations."""

from __future__ import annotations

from server.core.jobs import basis_of
from tests.core_doubles import SR, commit, job, spoken, utterance


def test_the_basis_is_the_window_start_and_its_forced_prefix() -> None:
    utt = utterance(window_start_s=2.0)
    commit(utt, spoken(("a", 2.1, 2.3), ("b", 2.4, 2.6)))
    assert utt.basis == (round(2.0 * SR), 2)
    assert basis_of(job(2.0, 5.0, prefix=(100, 101))) == utt.basis


def test_only_carried_until_a_word_of_the_window_is_final() -> None:
    utt = utterance()
    commit(utt, spoken(("a", 0.1, 0.3)), carried=True)
    assert utt.only_carried
    commit(utt, spoken(("b", 0.4, 0.6)))
    assert not utt.only_carried


def test_dropping_the_carried_prefix_decodes_the_window_again_from_its_start() -> None:
    utt = utterance(window_start_s=4.0, heard_to_s=7.0)
    commit(utt, spoken(("a", 4.1, 4.3)), carried=True)
    utt.tentative = spoken(("b", 4.4, 4.6))
    utt.decoded_to = round(7.0 * SR)
    utt.drop_carried_prefix()
    assert utt.committed == [] and utt.committed_tokens == [] and utt.tentative == []
    assert utt.decoded_to == utt.heard_to == utt.window_start


def test_carrying_words_again_restores_them_as_the_forced_prefix() -> None:
    utt = utterance()
    carried = spoken(("a", 0.1, 0.3), ("b", 0.4, 0.6))
    utt.carry(carried)
    assert utt.committed == carried and utt.committed_tokens == [100, 101]
    assert utt.prompted_tokens == 2
