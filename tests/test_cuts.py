"""The cut rules on scripted windows: no model, no audio."""

from __future__ import annotations

import dataclasses

from server.config import StreamingConfig
from server.core.cuts import (
    cut_point,
    sentence_cut,
    stalled_tail_cut,
    unheard_tail_cut,
)
from tests.core_doubles import (
    SR,
    commit,
    job,
    spoken,
    utterance,
    voiced_everywhere,
    voiced_nowhere,
    w,
)

CONFIG = StreamingConfig()  # cut_carry_words 2, sentence_cut_s 2, clause_cut_s 15


def test_a_cut_carries_the_last_two_spoken_words_from_the_start_of_the_first() -> None:
    utt = utterance(heard_to_s=4.0)
    commit(utt, spoken(("one", 0.5, 0.9), ("two", 1.0, 1.4), ("three", 1.5, 2.0)))
    at, carry = cut_point(utt, utt.heard_to, carry_words=2)
    assert (at, carry) == (round(1.0 * SR), 2)


def test_a_cut_carrying_nothing_goes_at_the_last_words_end_but_not_past_what_was_heard() -> None:
    utt = utterance(heard_to_s=1.8)
    commit(utt, spoken(("one", 0.5, 0.9), ("two", 1.0, 2.0)))
    assert cut_point(utt, utt.heard_to, carry_words=0) == (round(1.8 * SR), 0)


def test_a_word_without_tokens_cannot_be_carried_so_the_cut_goes_after_it() -> None:
    """A carried word is forced as its tokens: one without any (a word a flush cut off) is
    not carried, and the cut falls back to the end of the words."""
    utt = utterance(heard_to_s=4.0)
    words = spoken(("one", 0.5, 0.9), ("two", 1.0, 1.4))
    words.append(dataclasses.replace(w("three", 1.5, 2.0), tokens=()))
    commit(utt, words)
    assert cut_point(utt, utt.heard_to, carry_words=2) == (round(2.0 * SR), 0)


def test_a_sentence_end_past_sentence_cut_s_cuts_the_window_after_it() -> None:
    utt = utterance(heard_to_s=3.5)
    commit(utt, spoken(("it", 0.2, 0.6), ("rained", 0.7, 1.5), ("all.", 1.6, 2.4)))
    cut = sentence_cut(utt, CONFIG, inside_commit=False)
    assert cut is not None and cut.rule == "sentence_cut"
    assert (cut.at, cut.carry) == (round(0.7 * SR), 2)


def test_a_sentence_end_in_a_short_window_does_not_cut() -> None:
    utt = utterance(heard_to_s=2.0)
    commit(utt, spoken(("it", 0.2, 0.6), ("rained.", 0.7, 1.5)))
    assert sentence_cut(utt, CONFIG, inside_commit=False) is None


def test_a_comma_cuts_only_past_clause_cut_s() -> None:
    utt = utterance(heard_to_s=17.0)
    commit(utt, spoken(("then", 5.0, 5.5), ("later,", 6.0, 6.5)))
    assert sentence_cut(utt, CONFIG, inside_commit=False) is None
    commit(utt, spoken(("however,", 15.2, 15.8)))
    cut = sentence_cut(utt, CONFIG, inside_commit=False)
    assert cut is not None and cut.at == round(6.0 * SR)


def test_inside_a_commit_the_cut_follows_its_last_sentence_end() -> None:
    """Per utterance one commit can make many words final: the cut goes after the last
    sentence end among them, and the words after it are carried too."""
    utt = utterance(heard_to_s=20.0)
    words = spoken(("first", 1.0, 1.5), ("part.", 1.6, 2.5), ("and", 3.0, 3.3), ("more", 3.4, 3.8))
    commit(utt, words)
    assert sentence_cut(utt, CONFIG, inside_commit=False) is None
    cut = sentence_cut(utt, CONFIG, inside_commit=True)
    assert cut is not None and cut.rule == "cut_inside_commit"
    assert (cut.at, cut.carry) == (round(1.0 * SR), 4)


def test_a_closing_decode_that_ended_early_leaves_the_rest_to_its_own_window() -> None:
    """Whisper can end a long window's text at a sentence end although speech follows."""
    utt = utterance(heard_to_s=12.0)
    commit(utt, spoken(("so", 1.0, 1.3), ("it", 1.4, 1.6), ("ends.", 1.7, 2.4)))
    utt.end = round(12.0 * SR)
    cut = unheard_tail_cut(utt, CONFIG)
    assert cut is not None and cut.rule == "unheard_tail"
    assert (cut.at, cut.carry) == (round(1.4 * SR), 2)
    utt.end = round(3.0 * SR)  # words up to within a second of the end: nothing unheard
    assert unheard_tail_cut(utt, CONFIG) is None


def test_a_redecode_stalled_at_the_final_words_cuts_only_with_speech_after_them() -> None:
    """Whisper can stop at a forced prefix again and again as the window grows."""
    utt = utterance(heard_to_s=6.0)
    commit(utt, spoken(("he", 0.5, 0.8), ("brag", 0.9, 1.3), ("much", 1.4, 1.9)))
    stalled = job(0.0, 6.0, prefix=tuple(utt.committed_tokens))
    cut = stalled_tail_cut(utt, stalled, [], voiced_everywhere, CONFIG)
    assert cut is not None and cut.rule == "stalled_tail" and cut.at == round(0.9 * SR)
    assert stalled_tail_cut(utt, stalled, [], voiced_nowhere, CONFIG) is None
    # A decode that did go on past them is not stalled.
    assert (
        stalled_tail_cut(utt, stalled, spoken(("that", 2.0, 2.4)), voiced_everywhere, CONFIG)
        is None
    )
