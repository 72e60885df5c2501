from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.core.agreement import LocalAgreement, Word, normalize_word, read_alike


def words(text: str, start_s: float = 0.0, step_s: float = 0.5) -> list[Word]:
    """Scripted hypothesis: one Word per space-separated token, with Whisper's leading space."""
    return [
        Word(f" {token}", start_s + i * step_s, start_s + (i + 1) * step_s)
        for i, token in enumerate(text.split())
    ]


def texts(ws: list[Word]) -> str:
    return "".join(w.text for w in ws).strip()


# --- read_alike ---------------------------------------------------------------------------------


def test_read_alike_passes_over_punctuation_that_only_one_reading_has() -> None:
    """Two beam searches of test-other 3080-5032-0009: one put a comma after "deans" as a word
    of its own, the other did not. They agree on the words after it too."""
    older = words("deans , and has so many mistresses that")
    newer = words("deans and has so many mistresses and")
    assert texts(read_alike(newer, older)) == "deans and has so many mistresses"
    assert texts(read_alike(older, newer)) == "deans , and has so many mistresses"


def test_read_alike_ends_at_the_first_difference_and_at_a_spoken_word() -> None:
    assert read_alike(words("a b c"), words("x b c")) == []
    assert texts(read_alike(words("a b . c"), words("a b d"))) == "a b"  # not the "."
    assert texts(read_alike(words("a b c d"), words("a b"))) == "a b"  # the older is shorter
    assert read_alike(words(". ,"), words(". ,")) == []  # nothing spoken: nothing agreed


# --- normalize_word -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [(" Hello,", " hello"), (" WORLD.", "world"), (" don't", " Don't!"), (' "Yes?"', " yes")],
)
def test_normalize_word_ignores_case_punctuation_and_spaces(a: str, b: str) -> None:
    assert normalize_word(a) == normalize_word(b) != ""


def test_normalize_word_keeps_different_words_apart() -> None:
    assert normalize_word(" hello") != normalize_word(" help")
    assert normalize_word(" Straße") == normalize_word(" STRASSE")  # casefold, not lower


# --- LocalAgreement, scripted -------------------------------------------------------------------


def test_n2_commits_only_after_two_agreeing_tails() -> None:
    la = LocalAgreement(2)
    assert la.update(words("he hoped")) == []
    assert texts(la.tentative) == "he hoped"
    committed = la.update(words("he hoped there"))
    assert texts(committed) == "he hoped"
    assert texts(la.tentative) == "there"


def test_punctuation_and_case_differences_still_agree() -> None:
    la = LocalAgreement(2)
    la.update(words("He hoped, there"))
    committed = la.update(words("he Hoped there. Would"))
    assert [w.text for w in committed] == [" he", " Hoped", " there."]
    assert texts(la.tentative) == "Would"


def test_disagreement_commits_nothing() -> None:
    la = LocalAgreement(2)
    la.update(words("he hoped"))
    assert la.update(words("she hoped")) == []
    assert texts(la.tentative) == "she hoped"
    # Agreement is judged against the newest tail, not the first one ever seen.
    assert texts(la.update(words("she hoped there"))) == "she hoped"


def test_growing_tails_commit_progressively() -> None:
    la = LocalAgreement(2)
    # Each tail is what the decoder produced after the words committed so far.
    assert la.update(words("he")) == []
    assert texts(la.update(words("he hoped"))) == "he"
    assert texts(la.update(words("hoped there"))) == "hoped"
    assert texts(la.update(words("there would be"))) == "there"
    assert texts(la.update(words("would be stew"))) == "would be"
    assert texts(la.tentative) == "stew"
    assert texts(la.finalize()) == "stew"


def test_older_tail_that_disagrees_after_trimming_only_shortens_agreement() -> None:
    la = LocalAgreement(3)
    la.update(words("a b c"))
    la.update(words("a b d"))
    assert texts(la.update(words("a b c e"))) == "a b"
    # Remembered tails are now "c", "d", "c e": the middle one blocks "c" until it drops out.
    assert la.update(words("c e")) == []
    assert texts(la.update(words("c e f"))) == "c e"


def test_n1_commits_everything_at_once() -> None:
    la = LocalAgreement(1)
    assert texts(la.update(words("he hoped there"))) == "he hoped there"
    assert la.tentative == []
    assert texts(la.update(words("would be"))) == "would be"
    assert la.finalize() == []


def test_n3_needs_three_agreeing_tails() -> None:
    la = LocalAgreement(3)
    assert la.update(words("he hoped")) == []
    assert la.update(words("he hoped there")) == []
    assert texts(la.update(words("he hoped there would"))) == "he hoped"
    assert texts(la.tentative) == "there would"
    # The first tail drops out; of the last three, the oldest has "there" but not "would".
    assert texts(la.update(words("there would"))) == "there"
    assert texts(la.update(words("would be"))) == "would"
    assert texts(la.tentative) == "be"


def test_finalize_returns_the_remainder_exactly_once() -> None:
    la = LocalAgreement(2)
    la.update(words("he hoped"))
    la.update(words("he hoped there would"))
    assert texts(la.finalize()) == "there would"
    assert la.finalize() == []
    assert la.tentative == []
    # A new segment starts from scratch: one tail is not enough again.
    assert la.update(words("stew for")) == []


def test_reset_forgets_without_committing() -> None:
    la = LocalAgreement(2)
    la.update(words("he hoped"))
    la.reset()
    assert la.tentative == []
    assert la.update(words("he hoped")) == []
    assert la.finalize() == words("he hoped")


def test_times_come_from_the_newest_tail() -> None:
    la = LocalAgreement(2)
    la.update([Word(" Hello", 0.0, 0.4, 0.5), Word(" world", 0.4, 0.9, 0.6)])
    newest = [Word(" hello,", 0.1, 0.5, 0.9), Word(" world", 0.5, 1.0, 0.8), Word(" x", 1, 2)]
    assert la.update(newest) == newest[:2]
    assert la.tentative == newest[2:]


def test_empty_tails_are_harmless() -> None:
    la = LocalAgreement(2)
    assert la.update([]) == []
    assert la.update([]) == []
    assert la.update(words("a")) == []
    assert la.finalize() == words("a")


def test_n_must_be_positive() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        LocalAgreement(0)


# --- property: nothing doubled, nothing retracted ---------------------------------------------

TRUE_WORDS = [f" w{i}" for i in range(40)]


@st.composite
def decode_steps(draw: st.DrawFn) -> list[tuple[int, int]]:
    """A script of decodes: (words beyond the committed ones, how many of its last are wrong)."""
    steps = draw(st.integers(min_value=1, max_value=30))
    return [
        (draw(st.integers(min_value=0, max_value=8)), draw(st.integers(min_value=0, max_value=3)))
        for _ in range(steps)
    ]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=4),
    script=decode_steps(),
    colliding=st.booleans(),
    data=st.data(),
)
def test_committed_words_form_one_prefix_consistent_sequence(
    n: int, script: list[tuple[int, int]], colliding: bool, data: st.DataObject
) -> None:
    """A decoder that is forced with the committed words and gets the last few words of its
    tail wrong. Wrong words are unique, or (``colliding``) drawn from a two-word alphabet so
    that two decodes can agree on the same wrong word. Either way, whatever update() and
    finalize() return is returned once, in order, at the position it belongs to, and never
    taken back.
    """
    la = LocalAgreement(n)
    committed: list[Word] = []
    from_updates: list[Word] = []
    wrong = 0
    for new, bad in script:
        true_tail = TRUE_WORDS[len(committed) : len(committed) + new]
        tail = []
        for i, text in enumerate(true_tail):
            if i >= len(true_tail) - bad:
                wrong += 1
                suffix = data.draw(st.sampled_from("ab")) if colliding else str(wrong)
                text = f" x{suffix}"
            tail.append(Word(text, 0.0, 0.0))
        tentative_before = la.tentative
        got = la.update(tail)
        # Newly committed words are a prefix of the newest tail...
        assert got == tail[: len(got)]
        assert la.tentative == tail[len(got) :]
        # ...that, for n >= 2, the previous decode had already shown as tentative.
        if n > 1:
            assert [normalize_word(w.text) for w in got] == [
                normalize_word(w.text) for w in tentative_before[: len(got)]
            ]
        committed += got
        from_updates += got
    committed += la.finalize()
    assert la.finalize() == []
    assert la.tentative == []
    # Position i holds the i-th true word or a wrong word in its place: nothing doubled or
    # skipped, so the clean words are a subsequence of the truth without duplicates.
    for i, word in enumerate(committed):
        assert word.text == TRUE_WORDS[i] or word.text.startswith(" x"), (i, committed)
    clean = [w.text for w in committed if not w.text.startswith(" x")]
    assert len(clean) == len(set(clean))
    if n > 1 and not colliding:
        # Unique wrong words never agree, so updates commit only the truth.
        assert [w.text for w in from_updates] == TRUE_WORDS[: len(from_updates)]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=4),
    lengths=st.lists(st.integers(min_value=0, max_value=10), min_size=1, max_size=30),
)
def test_clean_decodes_commit_exactly_the_truth(n: int, lengths: list[int]) -> None:
    la = LocalAgreement(n)
    out: list[str] = []
    for length in lengths:
        out += [w.text for w in la.update(words(" ".join(TRUE_WORDS[len(out) :][:length])))]
        assert out == TRUE_WORDS[: len(out)]
    out += [w.text for w in la.finalize()]
    assert out == TRUE_WORDS[: len(out)]


def test_hold_keeps_the_last_words_of_the_newest_tail_tentative() -> None:
    la = LocalAgreement(2)
    tail = [Word(" ask", 0.0, 0.3), Word(" not", 0.3, 0.6)]
    assert la.update(tail, hold=1) == []
    assert [w.text for w in la.update([*tail[:1], Word(" not!", 0.3, 0.6)], hold=1)] == [" ask"]
    assert [w.text for w in la.tentative] == [" not!"]
    longer = [Word(" not,", 0.3, 0.6), Word(" what", 0.6, 0.9)]
    # "not" is no longer the last word, so it commits, with the newest tail's punctuation.
    assert [w.text for w in la.update(longer, hold=1)] == [" not,"]
    assert [w.text for w in la.tentative] == [" what"]
    with pytest.raises(ValueError):
        la.update(longer, hold=-1)


def test_at_least_commits_past_a_disagreement_from_the_newest_tail_but_never_held_words() -> None:
    la = LocalAgreement(2)
    # Nothing commits from the first tail alone, however many words are asked for.
    assert la.update(words("at present concerned differs from"), at_least=3) == []
    newest = words("at present concern differs from most")
    committed = la.update(newest, hold=2, at_least=4)
    # Past "concern" (the tails differ there), with the newest tail's words; never the held.
    assert texts(committed) == "at present concern differs"
    assert texts(la.tentative) == "from most"
    # The next tail is compared after the committed words, as after any commit.
    assert texts(la.update(words("from most if", 2.0))) == "from most"
    with pytest.raises(ValueError):
        la.update(newest, at_least=-1)


def _split_punctuation(text: str) -> list[Word]:
    """Words as the engine splits them: a punctuation mark is a word of its own, with no
    leading space and no length, at the end of the word before it."""
    out: list[Word] = []
    for token in text.split():
        if normalize_word(token):
            start = out[-1].end_s if out else 0.0
            out.append(Word(f" {token}", start, start + 0.5))
        else:
            out.append(Word(token, out[-1].end_s, out[-1].end_s))
    return out


def test_a_word_waits_for_the_punctuation_the_newest_tail_puts_after_it() -> None:
    la = LocalAgreement(2, marks_wait=True)
    la.update(_split_punctuation("to me and I"))
    # The tails agree on "to me", but the newest puts a comma after "me" that the one before
    # did not: "me" waits, so that it and its comma go out in one final.
    assert texts(la.update(_split_punctuation("to me , and I know"), hold=2)) == "to"
    assert [w.text for w in la.update(_split_punctuation("me , and I know it"), hold=2)] == [
        " me",
        ",",
        " and",
        " I",
    ]
    # Read without the comma, the word needs no wait.
    la = LocalAgreement(2, marks_wait=True)
    la.update(_split_punctuation("so it is"))
    assert texts(la.update(_split_punctuation("so it is clear"), hold=1)) == "so it is"
    # The closing decode takes what is left, marks and all.
    la.update(_split_punctuation("clear ."))
    assert [w.text for w in la.finalize()] == [" clear", "."]


def test_by_default_a_word_commits_without_the_punctuation_after_it() -> None:
    la = LocalAgreement(2)
    la.update(_split_punctuation("to me and I"))
    assert texts(la.update(_split_punctuation("to me , and I know"), hold=2)) == "to me"
