"""``client.timeline``: later sessions' messages moved onto the source's timeline, and the
words heard again at a seam dropped once."""

from __future__ import annotations

from client.timeline import drop_seam_repeat, shift_message
from server.protocol.messages import (
    DoneMessage,
    FinalMessage,
    PartialMessage,
    TurnMessage,
    WordInfo,
)


def words(text: str, start_s: float) -> tuple[WordInfo, ...]:
    """One word every 0.5 s from ``start_s``, each 0.4 s long."""
    return tuple(
        WordInfo(w, start_s + 0.5 * k, start_s + 0.5 * k + 0.4, 0.9)
        for k, w in enumerate(text.split())
    )


def final_of(text: str, start_s: float) -> FinalMessage:
    said = words(text, start_s)
    return FinalMessage(0, text, said[0].start, said[-1].end, said, said[-1].end)


def test_the_words_heard_again_at_the_seam_are_dropped_once() -> None:
    seam = words("all the", 6.0)  # the last final words before the cut
    # The next session began at 6.0, at the seam words, and heard them again.
    heard = drop_seam_repeat(final_of("All the arts, and crafts", 6.0), seam, 6.0)
    assert heard.text == "arts, and crafts" and [w.word for w in heard.words] == [
        "arts,",
        "and",
        "crafts",
    ]
    assert heard.start == heard.words[0].start == 7.0
    # One of them only (the other was cut), or none: what is new stays.
    assert drop_seam_repeat(final_of("the arts", 6.5), seam, 6.0).text == "arts"
    assert drop_seam_repeat(final_of("arts and", 7.0), seam, 6.0).text == "arts and"
    # A repeat that is not at the seam is what the speaker said again.
    assert drop_seam_repeat(final_of("all the", 7.5), seam, 6.0).text == "all the"
    # All of it a repeat: an empty final keeps the segment ids in step.
    empty = drop_seam_repeat(final_of("the", 6.5), seam, 6.0)
    assert (empty.text, empty.words) == ("", ())


def test_messages_of_a_later_session_are_moved_onto_the_sources_timeline() -> None:
    final = FinalMessage(0, " hi", 1.0, 2.0, (WordInfo(" hi", 1.0, 1.5, 0.9),), 2.5, 0.1)
    moved = shift_message(final, 10.0, 3)
    assert isinstance(moved, FinalMessage)
    assert (moved.segment_id, moved.start, moved.end, moved.audio_received_s) == (
        3,
        11.0,
        12.0,
        12.5,
    )
    assert (moved.words[0].start, moved.words[0].end, moved.lag_s) == (11.0, 11.5, 0.1)
    partial = shift_message(PartialMessage(1, " a", 0.5, 0.7, 1.0), 10.0, 3)
    assert partial == PartialMessage(4, " a", 10.5, 10.7, 11.0)
    done = shift_message(DoneMessage(2, 5.0, 4.0, 6.0, 1.0, 4.0, 0.0), 10.0, 3)
    assert done == DoneMessage(5, 15.0, 4.0, 6.0, 1.0, 4.0, 0.0)
    turn = TurnMessage("end", 0, 1.0, 1.5, " hi", final.words, 0.8, 2.5, "model")
    assert shift_message(turn, 10.0, 3) == TurnMessage(
        "end", 0, 11.0, 11.5, " hi", moved.words, 0.8, 12.5, "model"
    )
    assert shift_message(final, 0.0, 0) == final


def heard(*timed: tuple[str, float, float]) -> FinalMessage:
    said = tuple(WordInfo(w, a, b, 0.9) for w, a, b in timed)
    return FinalMessage(0, " ".join(w for w, _, _ in timed), said[0].start, said[-1].end, said, 9.0)


def test_words_heard_inside_the_seams_time_are_dropped_whatever_they_were_heard_as() -> None:
    """A session resumed at the seam hears its words again, and from a little before them:
    a tail of the word before (or of a seam word it began inside) comes out as some other
    word, and the last seam word may be heard as another. What ends by the seam's end is
    dropped; the first word after it, and all that follow, stay."""
    seam = (WordInfo("similar", 6.0, 6.4, 0.9), WordInfo("process", 6.5, 6.9, 0.9))
    produced = ("produced", 7.0, 7.4)
    # Begun inside "similar": its tail heard as "or" (the fault this rule mends).
    inside = heard(("or", 6.2, 6.4), ("process", 6.5, 6.9), produced)
    assert drop_seam_repeat(inside, seam, 6.1).text == "produced"
    # Begun before it: the word before, then both seam words.
    before = heard(("a", 5.7, 5.9), ("similar", 6.0, 6.4), ("process", 6.5, 6.9), produced)
    assert drop_seam_repeat(before, seam, 5.75).text == "produced"
    # The last seam word heard as another.
    misheard = heard(("similar", 6.0, 6.4), ("progress", 6.5, 6.92), produced)
    assert drop_seam_repeat(misheard, seam, 5.75).text == "produced"
    # A new word that reads as a seam word once the seam's were read is new.
    again = heard(("similar", 6.0, 6.4), ("process", 6.5, 6.9), ("process", 7.0, 7.4))
    assert drop_seam_repeat(again, seam, 5.75).text == "process"


def test_a_seam_word_heard_with_another_ending_is_dropped_wherever_its_time_falls() -> None:
    """The later session may read the last seam word with a letter more or less ("book" for
    "books") and place it later than the seam's end: it is still the seam word (a page once
    showed "the block books book which"). A word that only begins like it is not."""
    seam = (WordInfo("block", 6.0, 6.4, 0.9), WordInfo("books,", 6.5, 6.9, 0.9))
    late = heard(("block", 6.0, 6.4), ("book", 6.6, 7.1), ("which", 7.2, 7.5))
    assert drop_seam_repeat(late, seam, 5.75).text == "which"
    other = heard(("block", 6.0, 6.4), ("bookshelves", 6.6, 7.1), ("which", 7.2, 7.5))
    assert drop_seam_repeat(other, seam, 5.75).text == "bookshelves which"
