"""The punctuation benchmark's counts: sentence ends, commas and sentence-initial capitals."""

from __future__ import annotations

from pathlib import Path

from bench.punctuation import NOPAUSE, Marks, _languages, marks_of, pooled, punctuated, recordings


def test_sentence_ends_commas_and_capitals_are_counted_per_sentence() -> None:
    marks = marks_of('Printing, in the only sense. for although "he said so." Then why? yes!')
    assert marks == Marks(
        words=13, sentence_ends=4, commas=1, sentences=4, capitalised=2
    )  # "for" and "yes!" start a sentence in lower case


def test_a_mark_standing_alone_counts_with_the_word_before_it() -> None:
    # Finals joined with spaces: one opens with the comma or full stop of the one before.
    assert marks_of("concerned , differs from types . Now") == marks_of(
        "concerned, differs from types. Now"
    )


def test_an_abbreviation_ends_no_sentence_and_a_digit_needs_no_capital() -> None:
    marks = marks_of("Black letter, i.e. the letter, etc. produced here. 2. When forty")
    # "here." and "2." end sentences; "2." and "When" start them, and a digit has no case.
    assert marks == Marks(words=11, sentence_ends=2, commas=2, sentences=3, capitalised=3)


def test_only_a_mixed_case_text_with_marks_is_a_punctuated_reference() -> None:
    assert punctuated("Printing, in the only sense.")
    assert not punctuated("THEN MOSES WAS AFRAID AND SAID")
    assert not punctuated("one from fairest creatures")


def test_pooled_marks_sum_the_long_recordings_and_trailing_words_every_recording() -> None:
    def row(name: str, text: str, offline: str, trailing: int, *, long: bool) -> dict[str, object]:
        out: dict[str, object] = {
            "name": name,
            "long": long,
            "errors": 1,
            "trailing_insertions": trailing,
            "trailing_insertions_offline": 0,
        }
        if long:
            out["streamed"] = marks_of(text).as_dict()
            out["offline"] = marks_of(offline).as_dict()
        return out

    rows = [
        row("a", "One, two. three", "One, two. Three.", 0, long=True),
        row("b", "Four five", "Four, five.", 0, long=True),
        row("c", "six thank you", "", 2, long=False),
    ]
    summary = pooled(rows)
    assert summary["streamed"]["sentence_ends"] == 1 and summary["offline"]["sentence_ends"] == 3
    assert summary["commas_vs_offline"] == 0.5
    assert summary["capitalised_share"] == 0.667
    assert summary["trailing_insertions"] == 2
    assert summary["recordings_with_trailing"] == ["c"]


def test_other_languages_bring_their_long_and_short_recordings_once(speech_dir: Path) -> None:
    german = recordings(True, ("de",))
    names = [name for name, _, _, _ in german]
    assert names == ["aeneas_librivox/de_example7.wav", "picovoice/test_de.wav"]
    assert [(long, language) for _, _, long, language in german] == [(True, "de"), (False, "de")]
    english = [name for name, _, _, _ in recordings(False)]
    assert english[:2] == ["ljspeech/long/LJ001-0001_to_0032.concat.wav", NOPAUSE]
    assert {"de", "en", "ja"} <= set(_languages("all")) and _languages("de,es") == ("de", "es")
