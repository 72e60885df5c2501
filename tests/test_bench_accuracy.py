"""The accuracy harness's pure parts on hand-made words and clip rows: where streamed errors
sit, pooling by difficulty and source, the table, the offline cache. No model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.accuracy import _overrides, read_offline_cache, served_clip
from bench.accuracy_metrics import (
    DIFFICULTIES,
    LOCATIONS,
    by_difficulty,
    by_source,
    count_errors,
    headline,
    locate_errors,
    location_counts,
    pooled,
    table,
    token_times,
)
from bench.corpus import wer
from bench.replay import Replay
from bench.simulate import SimulationResult, TimedEvent
from server.protocol.messages import (
    FinalMessage,
    PartialMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    WordInfo,
)


def timed(*spec: tuple[str, float]) -> list[WordInfo]:
    """Words 0.3 s long starting at the given stream times."""
    return [WordInfo(w, start, start + 0.3, 1.0) for w, start in spec]


def text(words: list[WordInfo]) -> str:
    return " ".join(w.word for w in words)


REFERENCE = "alpha bravo charlie delta echo foxtrot golf hotel india juliet"
ONSETS = [0.0, 6.0]  # utterance A: alpha .. echo; utterance B: foxtrot .. juliet


def test_token_times_follow_words_the_normaliser_merges() -> None:
    words = timed(("I", 0.0), ("counted", 0.4), ("twenty", 1.0), ("five", 1.4), ("birds", 2.0))
    # "twenty five" is one token, "25", for the normaliser of the whole text.
    times = token_times(words, ["i", "counted", "25", "birds"])
    assert [start for start, _ in times] == [0.0, 0.4, 1.0, 2.0]


def test_token_times_of_a_split_word_share_its_times() -> None:
    words = timed(("Don't", 3.0), ("go", 3.5))
    assert [start for start, _ in token_times(words, ["do", "not", "go"])] == [3.0, 3.0, 3.5]


def test_errors_are_placed_by_their_utterance() -> None:
    words = timed(
        ("alfa", 0.2),  # substitution 0.2 s after A's onset: first_2s
        ("bravo", 0.6),
        ("charly", 2.5),  # substitution 2.5 s in: middle
        ("delta", 3.0),
        # echo, A's last word, deleted: placed at delta's end, last_word
        ("foxtrot", 6.2),
        ("golf", 8.5),
        ("extra", 8.8),  # insertion 2.8 s after B's onset: middle
        ("hotel", 9.0),
        ("india", 9.5),
        ("juliet", 10.0),
        ("thanks", 11.0),  # after the last reference word: after_last
        ("bye", 11.5),
    )
    located = locate_errors(REFERENCE, text(words), words, ONSETS)
    assert [(e.kind, e.ref, e.hyp, e.where) for e in located] == [
        ("substitute", "alpha", "alfa", "first_2s"),
        ("substitute", "charlie", "charly", "middle"),
        ("delete", "echo", "", "last_word"),
        ("insert", "", "extra", "middle"),
        ("insert", "", "thanks", "after_last"),
        ("insert", "", "bye", "after_last"),
    ]
    assert located[2].at_s == 3.3
    assert located[3].since_onset_s is not None and abs(located[3].since_onset_s - 2.8) < 1e-9
    counts = count_errors(REFERENCE, text(words))
    assert len(located) == counts.errors
    assert location_counts(located) == {
        "first_2s": 1,
        "middle": 2,
        "last_word": 1,
        "after_last": counts.trailing_insertions,
    }


def test_words_a_reference_holds_in_brackets_were_spoken_and_count() -> None:
    reference = "But the first Bible actually dated (which also was printed at Maintz)"
    heard = "But the first Bible actually dated, which also was printed at Maintz."
    assert count_errors(reference, heard).errors == 0
    assert wer(reference, heard) == 0.0
    # In a hypothesis a bracketed stretch is still an annotation, as Whisper's scoring has it.
    assert count_errors("the sea", "the sea (waves crashing)").errors == 0
    missing = count_errors(reference, "But the first Bible actually dated.")
    assert missing.deletions == 6 and missing.trailing_insertions == 0


def test_another_language_is_scored_with_case_and_marks_folded_and_unspaced_by_letter() -> None:
    german = count_errors("Der Raum, sagte er.", "der Raum sagte er. Danke.", "de")
    assert (german.ref_words, german.errors, german.trailing_insertions) == (4, 1, 1)
    # Japanese has no spaces: a "word" is a letter (three said after the last one).
    japanese = count_errors("今日は晴れ。", "今日は晴れ。ですね", "ja")
    assert (japanese.ref_words, japanese.errors, japanese.trailing_insertions) == (5, 3, 3)
    # The English normaliser strips diacritics; another language keeps them.
    assert count_errors("Räume", "Raume", "de").errors == 1
    assert count_errors("Räume", "Raume").errors == 0


def test_the_clips_last_word_is_a_last_word() -> None:
    words = timed(("alpha", 0.2), ("brave", 0.6))
    located = locate_errors("alpha bravo", text(words), words, [0.0])
    assert [(e.ref, e.hyp, e.where) for e in located] == [("bravo", "brave", "last_word")]


def test_a_lost_first_word_of_an_utterance_counts_at_the_previous_ones_end() -> None:
    words = timed(
        *((w, 0.2 + 0.5 * k) for k, w in enumerate(REFERENCE.split()[:5])),
        ("golf", 6.5),
        ("hotel", 7.0),
        ("india", 7.5),
        ("juliet", 8.0),
    )
    located = locate_errors(REFERENCE, text(words), words, ONSETS)
    # Documented approximation: foxtrot has no hypothesis word, so it follows echo.
    assert [(e.ref, e.where, e.at_s) for e in located] == [("foxtrot", "last_word", 2.5)]


def test_a_deletion_that_opens_the_stream_takes_the_next_words_start() -> None:
    words = timed(("bravo", 4.0), ("charlie", 4.5))
    located = locate_errors("alpha bravo charlie", text(words), words, [3.5])
    assert [(e.ref, e.where, e.at_s) for e in located] == [("alpha", "first_2s", 4.0)]


def test_words_shortly_before_an_onset_belong_to_its_utterance() -> None:
    # charly starts 0.1 s before the onset at 6 s (DTW starts run early).
    words = timed(("alpha", 0.2), ("bravo", 0.6), ("charly", 5.9), ("delta", 9.0))
    located = locate_errors("alpha bravo charlie delta", text(words), words, [0.0, 6.0])
    assert [(e.hyp, e.where) for e in located] == [("charly", "first_2s")]


def test_an_empty_stream_has_every_word_deleted() -> None:
    located = locate_errors("alpha bravo charlie", "", [], [])
    assert [(e.where, e.at_s) for e in located] == [
        ("middle", None),
        ("middle", None),
        ("last_word", None),
    ]


def test_with_no_reference_every_word_is_after_the_last() -> None:
    words = timed(("thanks", 1.0))
    assert [e.where for e in locate_errors("", "thanks", words, [0.5])] == ["after_last"]


def clip(
    file: str,
    ref_words: int,
    streamed: int,
    greedy: int,
    beam5: int | None = None,
    served: int | None = None,
) -> dict[str, Any]:
    """A clip row with just what pooling reads."""
    row: dict[str, Any] = {
        "file": file,
        "audio_s": 10.0,
        "ref_words": ref_words,
        "errors_streamed": streamed,
        "errors_greedy": greedy,
        "errors_beam5": beam5,
        "trailing_insertions_streamed": 1,
        "trailing_insertions_greedy": 0,
        "trailing_insertions_beam5": None if beam5 is None else 0,
        "error_locations": dict.fromkeys(LOCATIONS, 1),
        "final_latencies_s": [1.0],
        "first_partial_s": 0.5,
        "flicker_changed": 1,
        "flicker_shown": 10,
        "decodes": 20,
        "decode_s_total": 2.0,
    }
    if served is not None:
        row["errors_served"] = served
    return row


SETS = {
    "short": [
        clip("ljspeech/a.wav", 100, 5, 4, 3, served=6),
        clip("librispeech_test-other/b.wav", 50, 10, 8, 6, served=9),
        clip("librispeech_test-clean/c.wav", 100, 2, 2, 2, served=2),
        clip("librispeech_test-other/d.wav", 50, 4, 4, 4, served=4),
    ],
    "long": [
        clip("ljspeech/long/e.wav", 400, 20, 24, 22),
        clip("librispeech_test-other/long/f.wav", 200, 30, 20, 18),
    ],
}


def test_clips_pool_by_difficulty_hard_ones_first() -> None:
    groups = by_difficulty(SETS)
    assert tuple(groups) == DIFFICULTIES
    assert [c["file"] for c in groups["test_other"]] == [
        "librispeech_test-other/b.wav",
        "librispeech_test-other/d.wav",
    ]
    assert [c["file"] for c in groups["clean_long"]] == ["ljspeech/long/e.wav"]
    hard = pooled(groups["test_other"])
    assert (hard["clips"], hard["ref_words"]) == (2, 100)
    assert (hard["wer_streamed"], hard["wer_greedy"], hard["wer_beam5"]) == (0.14, 0.12, 0.1)
    assert hard["wer_served"] == 0.13
    assert (hard["points_vs_greedy"], hard["points_vs_beam5"]) == (2.0, 4.0)
    assert (hard["clips_worse_than_greedy"], hard["clips_better_than_greedy"]) == (1, 0)
    assert hard["error_locations"] == dict.fromkeys(LOCATIONS, 2)
    long = pooled(groups["test_other_long"])
    assert long["wer_served"] is None and long["points_vs_greedy"] == 5.0


def test_a_reference_missing_from_any_clip_has_no_pooled_figure() -> None:
    rows = [clip("ljspeech/a.wav", 10, 1, 1, 1), clip("ljspeech/b.wav", 10, 1, 1)]
    figures = pooled(rows)
    assert figures["wer_greedy"] == 0.1
    assert figures["wer_beam5"] is None and figures["points_vs_beam5"] is None
    assert figures["clips_worse_than_beam5"] is None
    assert figures["trailing_insertions_beam5"] is None


def test_headline_and_tables() -> None:
    groups = {name: pooled(rows) for name, rows in by_difficulty(SETS).items()}
    lead = headline(groups)
    assert list(lead) == list(DIFFICULTIES)
    assert list(lead["test_other"])[2:6] == [
        "wer_streamed",
        "wer_greedy",
        "wer_beam5",
        "wer_served",
    ]
    assert "wer_served" not in lead["clean_long"]
    json.dumps(lead)
    lines = table("difficulty", groups).splitlines()
    assert lines[0].split()[:7] == [
        "difficulty",
        "clips",
        "words",
        "streamed",
        "greedy",
        "beam5",
        "served",
    ]
    assert lines[1].split()[:7] == [
        "test_other",
        "2",
        "100",
        "14.00%",
        "12.00%",
        "10.00%",
        "13.00%",
    ]
    assert lines[2].split()[6] == "-"  # test_other_long: not served
    sources = {name: pooled(rows) for name, rows in by_source(SETS["long"]).items()}
    assert list(sources) == ["librispeech_test-other", "ljspeech"]
    assert "served" not in table("source", sources).splitlines()[0]


def test_offline_cache_reads_the_old_flat_layout_as_greedy(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"ljspeech/a.wav": "hello"}))
    assert read_offline_cache(old) == {"greedy": {"ljspeech/a.wav": "hello"}}
    new = tmp_path / "new.json"
    layout = {"greedy": {"ljspeech/a.wav": "hello"}, "beam5": {"ljspeech/a.wav": "hallo"}}
    new.write_text(json.dumps(layout))
    assert read_offline_cache(new) == layout
    assert read_offline_cache(tmp_path / "absent.json") == {}


def test_end_of_speech_to_final_times_each_utterances_last_word() -> None:
    def final(at_s: float, *spec: tuple[str, float]) -> TimedEvent:
        words = tuple(timed(*spec))
        msg = FinalMessage(0, text(list(words)), words[0].start, words[-1].end, words, at_s)
        return TimedEvent(at_s, msg)

    result = SimulationResult(audio_s=10.0)
    result.events = [
        TimedEvent(0.5, SpeechStartedMessage(0.0, 0.5)),
        final(2.0, ("alpha", 0.2)),
        final(3.9, ("bravo", 1.0), ("charlie", 2.0)),  # charlie ends at 2.3
        TimedEvent(3.0, SpeechEndedMessage(2.8, 3.0)),
        TimedEvent(6.5, SpeechStartedMessage(6.0, 6.5)),
        TimedEvent(7.5, SpeechEndedMessage(7.4, 7.5)),  # no words: nothing to time
        TimedEvent(8.1, SpeechStartedMessage(8.0, 8.1)),
        final(9.5, ("delta", 8.5)),
        TimedEvent(9.9, SpeechEndedMessage(9.0, 9.9)),
    ]
    got = result.end_of_speech_to_final_s()
    assert [round(x, 3) for x in got] == [1.6, 0.7]


def test_a_served_clip_is_timed_from_when_its_audio_was_sent() -> None:
    """The server's messages get the simulation's turn ends, final latencies, first-word
    latency and flicker, with each stream time taken to the wall time its 100 ms frame left
    the client."""
    record = Replay(text="alpha bravo charlie")
    for k in range(30):  # frame k, ending at (k + 1) / 10 s of stream, sent at 100 s + that
        record.sends.sent(0.1, 100.0 + (k + 1) / 10)

    def final(*spec: tuple[str, float]) -> dict[str, Any]:
        words = tuple(timed(*spec))
        message = FinalMessage(0, text(list(words)), words[0].start, words[-1].end, words, 0.0)
        parsed: dict[str, Any] = json.loads(message.to_json())
        return parsed

    def partial(words: str) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(PartialMessage(0, words, 0.0, 1.0, 1.0).to_json())
        return parsed

    messages = [
        (100.5, json.loads(SpeechStartedMessage(0.0, 0.5).to_json())),
        (100.8, partial("alpha brave")),  # the first word: onset 0.0 was sent at 100.1
        (101.1, final(("alpha", 0.2))),  # alpha ends at 0.5, sent at 100.5
        (101.4, partial("bravo")),  # not a final: not timed
        (101.6, partial("bravi charlie")),  # bravo taken back: flickered
        (103.0, json.loads(SpeechEndedMessage(2.8, 3.0).to_json())),
        (103.9, final(("bravo", 1.0), ("charlie", 2.0))),  # charlie ends at 2.3
    ]
    clip = served_clip(record, messages)
    assert clip.text == "alpha bravo charlie"
    assert [round(x, 3) for x in clip.final_latencies_s] == [0.6, 1.6]
    assert [round(x, 3) for x in clip.end_of_speech_to_final_s] == [1.6]
    assert clip.first_partial_s is not None and round(clip.first_partial_s, 3) == 0.7
    assert clip.flicker == (1, 5)


def test_set_reaches_nested_settings_and_names_a_wrong_one() -> None:
    streaming, commit, vad = _overrides(
        [
            "streaming.rules.bare_prompt.min_words=12",
            "streaming.clause_cut_s=4",
            "commit.min_right_context_s=0.5",
            'vad.detector="silero"',
        ]
    )
    assert streaming.rules.bare_prompt.min_words == 12 and streaming.clause_cut_s == 4
    assert commit.min_right_context_s == streaming.commit.min_right_context_s == 0.5
    assert vad.detector == "silero"
    with pytest.raises(SystemExit, match="no setting 'bare_promt'"):
        _overrides(["streaming.rules.bare_promt.min_words=12"])
