"""The punctuation benchmark's counts: sentence ends, commas and sentence-initial capitals."""

from __future__ import annotations

from bench.punctuation import Marks, marks_of, pooled, punctuated


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
