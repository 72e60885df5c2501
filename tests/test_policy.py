"""The commit policy's rules on scripted decode tails (no model)."""

from __future__ import annotations

import pytest

from server.core.agreement import Word
from server.core.policy import CommitConfig, CommitPolicy


def words(*spec: tuple[str, float, float]) -> list[Word]:
    return [Word(f" {text}", start, end) for text, start, end in spec]


THREE = words(("the", 0.2, 0.4), ("dose", 0.5, 0.9), ("for", 1.0, 1.2))


def test_word_commits_only_with_enough_audio_after_it() -> None:
    policy = CommitPolicy(CommitConfig(min_right_context_s=1.0, min_window_s=0.0))
    # Window ends at 1.6 s: "the" has 1.2 s after it, "dose" 0.7 s, "for" 0.4 s.
    assert policy.update(THREE, window_start_s=0.0, window_end_s=1.6, closing=False) == []
    committed = policy.update(THREE, window_start_s=0.0, window_end_s=1.6, closing=False)
    assert [w.text for w in committed] == [" the"]
    assert [w.text for w in policy.tentative] == [" dose", " for"]
    # 0.4 s more audio: "dose" now has 1.1 s after it; "for" still waits.
    committed = policy.update(THREE[1:], window_start_s=0.0, window_end_s=2.0, closing=False)
    assert [w.text for w in committed] == [" dose"]


def test_agreement_is_still_required_with_enough_context() -> None:
    policy = CommitPolicy(CommitConfig(min_right_context_s=0.0, min_window_s=0.0))
    first = words(("his", 0.0, 0.3), ("followed", 0.3, 0.8))
    second = words(("his", 0.0, 0.3), ("father", 0.3, 0.8))
    assert policy.update(first, window_start_s=0.0, window_end_s=3.0, closing=False) == []
    committed = policy.update(second, window_start_s=0.0, window_end_s=3.3, closing=False)
    assert [w.text for w in committed] == [" his"]
    assert [w.text for w in policy.tentative] == [" father"]


# Two decodes that read one word differently (LJ long: "concerned" and "concern").
CONCERNED = words(
    ("at", 0.0, 0.3),
    ("present", 0.3, 0.8),
    ("concerned", 0.8, 1.4),
    ("differs", 1.4, 2.0),
    ("from", 2.0, 2.4),
)
CONCERN = [
    *CONCERNED[:2],
    *words(("concern", 0.8, 1.3)),
    *CONCERNED[3:],
    *words(("most", 2.5, 3.0)),
]


def test_a_word_heard_with_settled_context_commits_where_the_decodes_differ() -> None:
    """A word with ``settled_context_s`` of audio after it in the newest decode commits, and
    the words before it, whatever the decode before said; later words still need agreement."""
    policy = CommitPolicy(
        CommitConfig(min_right_context_s=0.8, min_window_s=0.0, settled_context_s=3.0)
    )
    assert policy.update(CONCERNED, window_start_s=0.0, window_end_s=4.0, closing=False) == []
    # Window ends at 4.5 s: "concern" has 3.2 s after it, "differs" 2.5 s.
    committed = policy.update(CONCERN, window_start_s=0.0, window_end_s=4.5, closing=False)
    assert [w.text for w in committed] == [" at", " present", " concern"]
    assert [w.text for w in policy.tentative] == [" differs", " from", " most"]


def test_a_decode_may_ask_for_less_settled_context_but_not_turn_the_rule_on() -> None:
    """``settled_context_s`` of one decode (a server past its capacity estimate) replaces the
    config's: at 2.0 s "concern", with 3.2 s after it, commits, as do "differs" (2.5 s) and
    "from" (2.1 s). Where the rule is off ("words" finals) it stays off."""
    policy = CommitPolicy(
        CommitConfig(min_right_context_s=0.8, min_window_s=0.0, settled_context_s=3.0)
    )
    policy.update(CONCERNED, window_start_s=0.0, window_end_s=4.0, closing=False)
    committed = policy.update(
        CONCERN, window_start_s=0.0, window_end_s=4.5, closing=False, settled_context_s=2.0
    )
    assert [w.text for w in committed] == [" at", " present", " concern", " differs", " from"]
    off = CommitPolicy(CommitConfig(min_right_context_s=0.8, min_window_s=0.0))
    off.update(CONCERNED, window_start_s=0.0, window_end_s=8.0, closing=False)
    committed = off.update(
        CONCERN, window_start_s=0.0, window_end_s=9.0, closing=False, settled_context_s=1.0
    )
    assert [w.text for w in committed] == [" at", " present"]


def test_without_settled_context_a_difference_holds_every_word_after_it() -> None:
    """Off by default ("words" finals): however much audio follows, a word the decodes read
    differently waits, and every word after it."""
    policy = CommitPolicy(CommitConfig(min_right_context_s=0.8, min_window_s=0.0))
    assert policy.update(CONCERNED, window_start_s=0.0, window_end_s=8.0, closing=False) == []
    committed = policy.update(CONCERN, window_start_s=0.0, window_end_s=9.0, closing=False)
    assert [w.text for w in committed] == [" at", " present"]


def test_a_closing_decode_commits_its_words_and_finalize_takes_the_newest_shown_words() -> None:
    config = CommitConfig(min_right_context_s=0.0, min_window_s=0.0)
    policy = CommitPolicy(config)
    first = words(("his", 0.0, 0.3), ("followed", 0.3, 0.8))
    second = words(("his", 0.0, 0.3), ("father", 0.3, 0.8))
    policy.update(first, window_start_s=0.0, window_end_s=3.0, closing=False)
    committed = policy.update(second, window_start_s=0.0, window_end_s=3.1, closing=True)
    assert [w.text for w in committed] == [" his", " father"]

    policy = CommitPolicy(config)
    policy.update(first, window_start_s=0.0, window_end_s=3.0, closing=False)
    committed = policy.update(second, window_start_s=0.0, window_end_s=3.2, closing=False)
    assert [w.text for w in committed] == [" his"]
    assert [w.text for w in policy.finalize()] == [" father"]
    assert policy.tentative == []


def test_short_window_commits_nothing_until_it_closes() -> None:
    policy = CommitPolicy(CommitConfig(min_right_context_s=0.0, min_window_s=2.5))
    for end in (1.6, 1.9, 2.2):
        assert policy.update(THREE, window_start_s=0.0, window_end_s=end, closing=False) == []
    committed = policy.update(THREE, window_start_s=0.0, window_end_s=2.4, closing=True)
    assert [w.text for w in committed] == [" the", " dose", " for"]
    assert policy.tentative == []


def test_window_length_counts_from_the_window_start() -> None:
    policy = CommitPolicy(CommitConfig(min_right_context_s=0.0, min_window_s=2.0))
    late = [Word(w.text, w.start_s + 10, w.end_s + 10) for w in THREE]
    for _ in range(2):
        out = policy.update(late, window_start_s=10.0, window_end_s=11.5, closing=False)
        assert out == []
    out = policy.update(late, window_start_s=10.0, window_end_s=12.0, closing=False)
    assert [w.text for w in out] == [" the", " dose", " for"]


def test_agreement_n_is_read_from_the_config() -> None:
    policy = CommitPolicy(CommitConfig(agreement_n=3, min_right_context_s=0.0, min_window_s=0.0))
    for _ in range(2):
        assert policy.update(THREE, window_start_s=0.0, window_end_s=3.0, closing=False) == []
    assert len(policy.update(THREE, window_start_s=0.0, window_end_s=3.0, closing=False)) == 3


def test_reset_forgets_and_finalize_commits_tentative() -> None:
    policy = CommitPolicy(CommitConfig(min_right_context_s=5.0))
    policy.update(THREE, window_start_s=0.0, window_end_s=3.0, closing=False)
    assert [w.text for w in policy.finalize()] == [" the", " dose", " for"]
    policy.update(THREE, window_start_s=0.0, window_end_s=3.0, closing=False)
    policy.reset()
    assert policy.tentative == []
    assert policy.update(THREE, window_start_s=0.0, window_end_s=9.0, closing=False) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"agreement_n": 0},
        {"min_right_context_s": -0.1},
        {"min_window_s": -1.0},
        {"past_audio_min_probability": -0.1},
        {"past_audio_margin_s": -0.1},
        {"settled_context_s": -1.0},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CommitConfig(**kwargs)  # type: ignore[arg-type]


def test_closing_decode_drops_doubtful_words_placed_at_the_end_of_the_audio() -> None:
    policy = CommitPolicy(CommitConfig(past_audio_margin_s=0.06, past_audio_min_probability=0.5))
    tail = words(("form", 7.98, 8.28), ("letterpress", 8.28, 8.8))
    tail.append(Word(",", 8.8, 8.8, 0.54))
    tail += [Word(f" {t}", 8.8, 8.8, p) for t, p in (("and", 0.16), ("the", 0.08), ("one", 0.3))]
    tail.append(Word(".", 8.8, 8.8, 0.37))
    committed = policy.update(tail, window_start_s=0.0, window_end_s=8.8, closing=True)
    assert "".join(w.text for w in committed) == " form letterpress,"


def test_closing_decode_drops_confident_words_decoded_on_from_a_doubtful_one_at_the_end() -> None:
    """LJ001-0006 per utterance: the beam search went on past the clip's last word, and
    only the first word it made up was doubtful."""
    policy = CommitPolicy(CommitConfig(past_audio_margin_s=0.06, past_audio_min_probability=0.5))
    tail = words(("fine", 4.7, 5.16), ("typography", 5.16, 5.68))
    tail.append(Word(",", 5.68, 5.68, 0.58))
    made_up = (("that", 0.19), ("has", 0.68), ("an", 0.93), ("example", 0.86))
    tail += [Word(f" {t}", 5.68, 5.68, p) for t, p in made_up]
    committed = policy.update(tail, window_start_s=0.0, window_end_s=5.684, closing=True)
    assert "".join(w.text for w in committed) == " fine typography,"


def test_closing_decode_keeps_a_confident_last_word_squeezed_to_the_end() -> None:
    policy = CommitPolicy(CommitConfig(past_audio_margin_s=0.06, past_audio_min_probability=0.5))
    tail = [
        Word(" to", 3.49, 3.95, 0.98),
        Word(" buy", 3.95, 3.95, 0.9),
        Word(".", 3.95, 3.95, 0.4),
    ]
    committed = policy.update(tail, window_start_s=0.0, window_end_s=3.955, closing=True)
    assert "".join(w.text for w in committed) == " to buy."


def test_closing_decode_keeps_a_word_cut_off_by_a_flush() -> None:
    policy = CommitPolicy(CommitConfig(past_audio_margin_s=0.06))
    tail = [Word(" to", 1.0, 1.3, 0.9), Word(" fo", 1.7, 1.9, 0.2)]
    committed = policy.update(tail, window_start_s=0.0, window_end_s=1.9, closing=True)
    assert [w.text for w in committed] == [" to", " fo"]


def test_audio_the_server_cut_inside_speech_commits_nothing_at_its_very_end() -> None:
    """At a drain the session's audio stops mid-speech; the words decoded at its last frames
    are the prompt's continuation, however confident, and the client that goes on sends
    that audio again from its last final words (seen: "by a similar" with "a similar" in
    the last 40 ms; the new session heard it whole as "the miller", and it showed twice)."""
    tail = [
        Word(" netherlands", 19.5, 20.0, 0.95),
        Word(" by", 20.0, 20.24, 0.9),
        Word(" a", 20.25, 20.28, 0.8),
        Word(" similar", 20.28, 20.28, 0.9),
    ]
    config = CommitConfig(past_audio_margin_s=0.06, past_audio_min_probability=0.5)
    kept = CommitPolicy(config).update(tail, window_start_s=0.0, window_end_s=20.3, closing=True)
    assert "".join(w.text for w in kept) == " netherlands by a similar"  # confident: kept
    cut = CommitPolicy(config).update(
        tail, window_start_s=0.0, window_end_s=20.3, closing=True, cut_in_speech=True
    )
    assert "".join(w.text for w in cut) == " netherlands by"
    # Words the alignment packed before the cut, more than 16 a second, go with it: decoded
    # on from the prompt (seen at a session limit: 17 words in the last 0.34 s).
    packed = [Word(" country", 8.9, 9.4, 0.9), Word(" and", 9.5, 9.7, 0.9)] + [
        Word(f" w{k}", 10.33 + 0.02 * k, 10.35 + 0.02 * k, 0.9) for k in range(17)
    ]
    cut = CommitPolicy(config).update(
        packed, window_start_s=0.0, window_end_s=10.7, closing=True, cut_in_speech=True
    )
    assert "".join(w.text for w in cut) == " country and"
    # A word that the packed run would make 16 a second with it goes too: the next session
    # hears it again.
    closer = [*packed[:1], Word(" and", 10.0, 10.1, 0.9), *packed[2:]]
    cut = CommitPolicy(config).update(
        closer, window_start_s=0.0, window_end_s=10.7, closing=True, cut_in_speech=True
    )
    assert "".join(w.text for w in cut) == " country"
    kept = CommitPolicy(config).update(packed, window_start_s=0.0, window_end_s=10.7, closing=True)
    assert len(kept) == len(packed)  # not at a cut: the rules for a clip's end apply
    # A word the cut went through started well before it: heard in part, it stays.
    through = [Word(" to", 1.0, 1.3, 0.9), Word(" fo", 1.7, 1.9, 0.2)]
    committed = CommitPolicy(config).update(
        through, window_start_s=0.0, window_end_s=1.9, closing=True, cut_in_speech=True
    )
    assert [w.text for w in committed] == [" to", " fo"]
