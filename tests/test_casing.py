"""Sentence case across finals: which words end a sentence, and which letter is written up."""

from __future__ import annotations

import pytest

from server.core.casing import SentenceCase, capitalised, ends_sentence
from tests.core_doubles import spoken


@pytest.mark.parametrize(
    ("word", "ends"),
    [
        (" ends.", True),
        ("why?", True),
        ("die.'", True),  # a closing quote after the mark
        ("(so!)", True),
        ("etc.", False),
        ("Mr.", False),
        ("i.e.", False),
        (".e.", False),  # "i .e." as word finals split it
        ("J.", False),  # an initial
        ("U.S.", False),
        ("clause,", False),
        ("1465,", False),
        ("1465.", True),
        ("終わり。", True),
        ("the...", False),  # trailing off, and going on
        ("so…", False),
    ],
)
def test_what_ends_a_sentence(word: str, ends: bool) -> None:
    assert ends_sentence(word) is ends


@pytest.mark.parametrize(
    ("text", "out"),
    [
        (" pity", " Pity"),
        (" 'tis", " 'Tis"),
        (' "why', ' "Why'),
        (" Then", None),  # already
        (" 2nd", None),  # a digit first: nothing to case
        (" ßtraße", None),  # no single-letter capital
        (" über", " Über"),
        (" 東京", None),  # a script without case
        (" ,", None),
    ],
)
def test_the_first_letter_is_written_up(text: str, out: str | None) -> None:
    assert capitalised(text) == out


def test_each_word_after_a_sentence_end_is_capitalised_across_calls() -> None:
    case = SentenceCase()
    # The stream's first word keeps its case: the audio may begin mid-sentence.
    words, changed = case.apply(
        spoken(("in", 0, 1), ("being.", 1, 2), ("so", 2, 3), ("he", 3, 4), ("went.", 4, 5)),
        advance=True,
    )
    assert [w.text.strip() for w in words] == ["in", "being.", "So", "he", "went."]
    assert changed == 1
    # The next final starts a sentence: the place is kept from one call to the next.
    words, changed = case.apply(spoken(("pity", 3, 4), ("the", 4, 5)), advance=True)
    assert [w.text.strip() for w in words] == ["Pity", "the"] and changed == 1
    assert [(w.start_s, w.end_s) for w in words] == [(3, 4), (4, 5)]  # only the text changes
    assert words[0].tokens == spoken(("pity", 3, 4))[0].tokens


def test_a_partial_does_not_move_the_place() -> None:
    case = SentenceCase()
    case.apply(spoken(("It", 0, 1), ("ends.", 1, 2)), advance=True)
    shown, _ = case.apply(spoken(("and", 2, 3), ("then.", 3, 4)), advance=False)
    assert [w.text.strip() for w in shown] == ["And", "then."]
    final, _ = case.apply(spoken(("and", 2, 3), ("so", 3, 4)), advance=True)
    assert [w.text.strip() for w in final] == ["And", "so"]


def test_a_mark_decoded_as_a_word_of_its_own_belongs_to_the_word_before() -> None:
    case = SentenceCase()
    words, _ = case.apply(
        spoken(("It", 0, 1), ("ends", 1, 2), (".", 2, 2), ("now", 2, 3), (",", 3, 3), ("so", 3, 4)),
        advance=True,
    )
    assert [w.text.strip() for w in words] == ["It", "ends", ".", "Now", ",", "so"]
    # ... and an ellipsis ends nothing: the speaker trailed off and went on.
    words, changed = case.apply(spoken(("the", 4, 5), ("...", 5, 5), ("that", 5, 6)), advance=True)
    assert [w.text.strip() for w in words] == ["the", "...", "that"] and changed == 0
