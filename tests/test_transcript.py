"""The stream's text: every final through one place, held words, cuts, the prompt."""

from __future__ import annotations

import logging

from server.config import StreamingConfig
from server.core.cuts import Cut
from server.core.emitter import Clock
from server.core.rules import BarePromptConfig, RuleCounts, RulesConfig
from server.core.transcript import Transcript
from server.protocol.messages import FinalMessage, PartialMessage
from tests.core_doubles import SR, commit, spoken, utterance

CLOCK = Clock(audio_received_s=5.0, lag_s=0.0)
LOG = logging.LoggerAdapter(logging.getLogger("tests.transcript"), {"session_id": "t"})


def transcript(**rules: object) -> Transcript:
    streaming = StreamingConfig(rules=RulesConfig(**rules))  # type: ignore[arg-type]
    return Transcript(streaming, RuleCounts(), LOG)


def finals(text: Transcript) -> list[FinalMessage]:
    return [e for e in text.emit.take(None, all_heard=True) if isinstance(e, FinalMessage)]


def test_a_commit_sends_one_final_and_counts_its_path() -> None:
    text = transcript()
    utt = utterance()
    words = spoken(("hello", 0.2, 0.6), ("world.", 0.7, 1.2))
    text.commit(utt, words, why="agreement", clock=CLOCK, language=(None, None), labelled=False)
    [final] = finals(text)
    assert (final.text, final.segment_id, final.start, final.end) == ("hello world.", 0, 0.2, 1.2)
    assert utt.committed == words and utt.committed_tokens == [100, 101]
    assert text.counts["final:agreement"] == 1


def test_held_words_go_out_with_the_next_final() -> None:
    text = transcript()
    utt = utterance()
    held = spoken(("first", 0.2, 0.6))
    text.commit(
        utt, held, why="held_search", clock=CLOCK, language=(None, None), labelled=False, hold=True
    )
    assert finals(text) == []
    text.partial(utt, CLOCK, (None, None), provisional=False)
    shown = text.emit.take(None, all_heard=True)
    assert isinstance(shown[0], PartialMessage) and shown[0].text == "first"
    text.commit(
        utt,
        spoken(("then", 0.7, 0.9)),
        why="closing",
        clock=CLOCK,
        language=(None, None),
        labelled=False,
    )
    [final] = finals(text)
    assert final.text == "first then"


def test_a_cut_moves_the_window_carries_words_and_releases_the_rest_to_the_prompt() -> None:
    text = transcript()
    utt = utterance(heard_to_s=3.0)
    commit(utt, spoken(("a", 0.1, 0.3), ("b", 0.4, 0.6), ("c", 0.7, 0.9)))
    text.cut(utt, Cut(round(0.4 * SR), 2, "sentence_cut"))
    assert utt.window_start == round(0.4 * SR)
    assert [x.text for x in utt.committed] == [" b", " c"]
    assert utt.prompted_tokens == 2  # the carried words are in the prompt already
    assert text.prompt == (100, 101, 102)
    assert text.emit.account.transcribed == round(0.4 * SR)
    assert text.counts["sentence_cut"] == 1


def test_after_a_decode_that_looped_the_next_window_gets_no_prompt() -> None:
    text = transcript()
    utt = utterance(heard_to_s=3.0)
    commit(utt, spoken(("a", 0.1, 0.3)))
    text.release_to_prompt(utt)
    text.decoded(looped=True)
    assert text.prompt == ()
    text.decoded(looped=False)
    assert list(text.prompt) == [100]
    kept = transcript(disabled=("loop_prompt_drop",))
    other = utterance(heard_to_s=3.0)
    commit(other, spoken(("a", 0.1, 0.3)))
    kept.release_to_prompt(other)
    kept.decoded(looped=True)
    assert kept.prompt == (100,)


def _released(text: Transcript, words: list[str]) -> None:
    """``words`` made final in an utterance of their own and released to the prompt."""
    utt = utterance(heard_to_s=float(len(words)))
    commit(utt, spoken(*((word, k * 0.5, k * 0.5 + 0.4) for k, word in enumerate(words))))
    text.release_to_prompt(utt)


def test_a_prompt_whose_last_words_lost_their_punctuation_is_not_passed_on() -> None:
    text = transcript(bare_prompt=BarePromptConfig(min_words=4))
    _released(text, ["Printing,", "in", "the", "only", "sense."])
    assert len(text.prompt) == 5  # a mark within its last four words
    _released(text, ["with", "which", "we", "are"])
    assert not text.prompt  # four words since the full stop: a bare run
    assert not text.prompt and text.counts["bare_prompt_drop"] == 1  # counted once a run
    _released(text, ["concerned", ",", "differs"])  # a mark decoded as a word of its own
    assert len(text.prompt) == 12  # punctuated again: the whole prompt goes back
    _released(text, ["from", "most", "if", "not"])
    assert not text.prompt and text.counts["bare_prompt_drop"] == 2


def test_a_prompt_running_on_without_a_sentence_end_is_not_passed_on() -> None:
    rules = BarePromptConfig(min_words=4, max_sentence_words=6)
    text = transcript(bare_prompt=rules)
    _released(text, ["Printing.", "then,", "for", "our", "purpose,", "may"])
    assert len(text.prompt) == 6  # commas within four words, five words since the full stop
    _released(text, ["be,"])
    assert not text.prompt  # six words since it: one sentence running on
    assert text.counts["bare_prompt_drop"] == 1
    _released(text, ["considered."])
    assert len(text.prompt) == 8
    commas_only = transcript(bare_prompt=BarePromptConfig(min_words=4, max_sentence_words=0))
    _released(commas_only, ["Printing.", "then,", "for", "our", "purpose,", "may", "be,"])
    assert len(commas_only.prompt) == 7  # off (0): commas keep the prompt however long


def test_the_windows_final_words_read_after_the_prompt_count_too() -> None:
    text = transcript(bare_prompt=BarePromptConfig(min_words=4))
    _released(text, ["with", "which", "we", "are"])
    assert not text.prompt
    utt = utterance(heard_to_s=3.0)
    # Final in the open window, so forced as the next decode's prefix: a full stop there.
    words = spoken(("present", 0.1, 0.5), ("concerned.", 0.6, 1.0))
    text.commit(utt, words, why="agreement", clock=CLOCK, language=(None, None), labelled=False)
    assert len(text.prompt) == 4
    more = spoken(("differs", 1.1, 1.5), ("from", 1.6, 1.8), ("most", 1.9, 2.1), ("if", 2.2, 2.4))
    text.commit(utt, more, why="agreement", clock=CLOCK, language=(None, None), labelled=False)
    assert not text.prompt


def test_a_mark_inside_closing_quotes_or_a_short_prompt_keeps_the_prompt() -> None:
    text = transcript(bare_prompt=BarePromptConfig(min_words=3))
    _released(text, ["no", "marks"])
    assert len(text.prompt) == 2  # shorter than min_words: too little to judge its style
    _released(text, ['die."', "so", "it"])
    assert len(text.prompt) == 5
    kept = transcript(disabled=("bare_prompt_drop",), bare_prompt=BarePromptConfig(min_words=3))
    _released(kept, ["with", "which", "we", "are"])
    assert len(kept.prompt) == 4 and "bare_prompt_drop" not in kept.counts
    unread = transcript(bare_prompt=BarePromptConfig(min_words=3))
    _released(unread, ["with", "which", "we", "are"])
    assert "bare_prompt_drop" not in unread.counts  # no decode went without it yet


def test_retiring_an_utterance_accounts_for_its_audio_and_clears_its_partial() -> None:
    text = transcript()
    utt = utterance(heard_to_s=2.0)
    commit(utt, spoken(("so", 0.1, 0.3)))
    utt.tentative = spoken(("maybe", 0.4, 0.6))
    text.partial(utt, CLOCK, (None, None), provisional=False)
    utt.end = round(3.0 * SR)
    text.retire(utt, decoded=False, audio_received_s=3.5)
    events = text.emit.take(None, all_heard=True)
    assert isinstance(events[-1], PartialMessage) and events[-1].text == ""
    assert text.emit.account.transcribed == round(2.0 * SR)
    assert text.emit.account.failed == round(1.0 * SR)


def test_a_word_that_begins_a_sentence_is_final_with_a_capital_and_shown_so_before() -> None:
    text = transcript()
    utt = utterance()
    first = spoken(("so", 0.2, 0.4), ("it", 0.5, 0.6), ("ends.", 0.7, 1.0))
    text.commit(utt, first, why="agreement", clock=CLOCK, language=(None, None), labelled=False)
    # The next window's decode starts the sentence in lower case: its partial already shows
    # the capital it will be final with, and a word after an abbreviation keeps its case.
    utt.tentative = spoken(("then", 1.2, 1.4), ("etc.", 1.5, 1.8), ("and", 1.9, 2.0))
    text.partial(utt, CLOCK, (None, None), provisional=False)
    text.commit(
        utt, utt.tentative, why="closing", clock=CLOCK, language=(None, None), labelled=False
    )
    events = text.emit.take(None, all_heard=True)
    shown = [e.text for e in events if isinstance(e, PartialMessage)]
    sent = [e.text for e in events if isinstance(e, FinalMessage)]
    # The stream's first word keeps its case: Whisper writes it in lower case where the audio
    # begins mid-sentence, as offline decoding does.
    assert shown == ["Then etc. and"] and sent == ["so it ends.", "Then etc. and"]
    assert text.counts["sentence_case"] == 1  # the partial is not counted


def test_with_sentence_case_off_the_words_keep_the_decoders_case() -> None:
    text = transcript(disabled=("sentence_case",))
    utt = utterance()
    words = spoken(("so", 0.2, 0.4), ("it", 0.5, 0.6), ("ends.", 0.7, 1.0), ("then", 1.2, 1.4))
    text.commit(utt, words, why="agreement", clock=CLOCK, language=(None, None), labelled=False)
    assert [f.text for f in finals(text)] == ["so it ends. then"]
    assert "sentence_case" not in text.counts
