"""The finals strategies: word by word, or an utterance's together."""

from __future__ import annotations

from server.config import StreamingConfig
from server.core.finals import UtteranceFinals, WordFinals, finals_for
from server.core.rules import RulesConfig
from tests.core_doubles import job, utterance


def test_the_strategy_follows_the_streams_finals() -> None:
    assert isinstance(finals_for(StreamingConfig(finals="words")), WordFinals)
    assert isinstance(finals_for(StreamingConfig(finals="utterance")), UtteranceFinals)


def test_word_finals_go_out_at_once_and_count_the_window_from_its_start() -> None:
    words = finals_for(StreamingConfig(finals="words"))
    utt = utterance(window_start_s=12.0)
    assert words.commit_window_start_s(utt, job(12.0, 15.0)) == 12.0
    assert not words.holds(closing=True, committed=False)
    assert not (words.supersedes or words.searches or words.cuts_inside_commit)


def test_utterance_finals_hold_a_closing_decodes_words_and_count_from_the_utterance() -> None:
    per = finals_for(StreamingConfig(finals="utterance"))
    utt = utterance(start_s=3.0, window_start_s=12.0)
    assert per.commit_window_start_s(utt, job(12.0, 15.0)) == 3.0
    assert per.holds(closing=True, committed=True)
    assert per.holds(closing=False, committed=False)  # held search words wait too
    assert not per.holds(closing=False, committed=True)  # past half the window: word by word
    assert per.supersedes and per.searches and per.cuts_inside_commit


def test_utterance_finals_rules_can_be_switched_off() -> None:
    off = RulesConfig(disabled=("supersede", "background_search", "cut_inside_commit"))
    per = finals_for(StreamingConfig(finals="utterance", rules=off))
    assert not (per.supersedes or per.searches or per.cuts_inside_commit)
    assert not finals_for(StreamingConfig(finals="utterance", utterance_search_s=0.0)).searches
