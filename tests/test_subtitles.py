"""The cue builder: layout, split points and timing on scripted words, then every rule on the
finals a real server (tiny.en) makes of the long shared recordings.

The subtitle readers and the rule checker these tests use are in ``tests/subtitle_checks.py``.
"""

from __future__ import annotations

import io
import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from bench.corpus import load_clip, read_manifest
from client.render import SubtitleRenderer
from client.sources import FileSource
from client.stream import stream_audio
from client.subtitles import (
    Cue,
    CueBuilder,
    CueConfig,
    TimedWord,
    build_cues,
    ends_clause,
    ends_sentence,
    format_srt_timestamp,
    format_vtt_timestamp,
    join_text,
    layout,
    srt_cue,
    srt_document,
    vtt_cue,
    vtt_document,
    words_from_final,
    words_from_pieces,
)
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import FinalMessage, ServerMessage, WordInfo
from tests.helpers import two_readers, write_wav
from tests.subtitle_checks import ReadCue, read_srt, read_vtt, rule_violations

CONFIG = CueConfig()
# A punctuated long recording, whose long sentences exercise every rule (LibriSpeech's
# transcripts have no punctuation): LJ Speech's first 120 s, which hold some 300 words and
# every kind of cue break, at half the CPU of its 222 s. The LibriVox sonnets were streamed
# here too; tests/test_web_page.py streams them for the page's cue builder, and
# tests/test_client_cli.py holds a long test-other recording to the same rules.
LONG_READ = ("ljspeech/long/LJ001-0001_to_0032.concat.wav",)
LONG_READ_S = 120.0


def spoken(
    text: str, *, start_s: float = 0.0, word_s: float = 0.4, pause_s: float = 0.0
) -> list[TimedWord]:
    """Words of ``text`` said one after another, ``word_s`` each with ``pause_s`` between;
    a ``|`` in the text is a pause of 1.5 s more."""
    words = []
    t = start_s
    for token in text.split():
        if token == "|":
            t += 1.5
            continue
        words.append(TimedWord(token, t, t + word_s))
        t += word_s + pause_s
    return words


def texts(cues: list[Cue]) -> list[str]:
    return [c.text for c in cues]


def as_read(cues: list[Cue]) -> list[ReadCue]:
    return read_srt(srt_document(cues))


# --------------------------------------------------------------------------- layout


def test_a_cue_is_one_line_when_it_fits_and_two_even_lines_otherwise() -> None:
    assert layout(["Printing,", "in", "the", "only", "sense"], CONFIG) == (
        "Printing, in the only sense",
    )
    words = spoken("with which we are at present concerned differs from most if not")
    words = [w.text for w in words]
    lines = layout(words, CONFIG)
    assert lines == ("with which we are at present", "concerned differs from most if not")
    assert all(len(line) <= 42 for line in lines)


def test_two_lines_break_after_punctuation_when_it_costs_little_balance() -> None:
    words = [
        w.text
        for w in spoken("From fairest creatures we desire increase, that thereby beauty dies")
    ]
    assert layout(words, CONFIG) == (
        "From fairest creatures we desire increase,",
        "that thereby beauty dies",
    )


def test_words_that_need_three_lines_do_not_fit_but_one_word_always_does() -> None:
    assert layout(("word " * 18).split(), CONFIG) is None
    assert layout(["x" * 60], CONFIG) == ("x" * 60,)
    assert layout(("word " * 10).split(), CueConfig(max_lines=1)) is None


def test_sentence_and_clause_ends_see_through_closing_quotes() -> None:
    assert ends_sentence('surpassed."') and ends_sentence("way?")
    assert not ends_sentence("Bible") and not ends_sentence("then,")
    assert ends_clause("then,") and ends_clause("Basle;") and not ends_clause("Paris")


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="max_lines must be 1 or 2"):
        CueConfig(max_lines=3)
    with pytest.raises(ValueError, match="min_duration_s <= max_duration_s"):
        CueConfig(min_duration_s=8.0)
    with pytest.raises(ValueError, match="min_gap_s <= chain_gap_s"):
        CueConfig(min_gap_s=0.6)


# --------------------------------------------------------------------------- words


def test_pieces_without_a_leading_space_belong_to_the_word_before() -> None:
    words = words_from_pieces(
        [
            (" Printing", 0.0, 0.9),
            (",", 0.9, 1.0),
            (" the", 1.0, 1.2),
            (" flower", 1.2, 1.5),
            ("-fatened", 1.5, 1.9),
            (" ", 1.9, 1.9),
        ]
    )
    assert [(w.text, w.start_s, w.end_s) for w in words] == [
        ("Printing,", 0.0, 1.0),
        ("the", 1.0, 1.2),
        ("flower-fatened", 1.2, 1.9),
    ]


def test_a_finals_words_are_joined_the_way_its_text_spaces_them() -> None:
    final = FinalMessage(
        3,
        "Printing, in the flower-fatened",
        1.0,
        3.0,
        tuple(
            WordInfo(w, s, e, 0.9)
            for w, s, e in [
                ("Printing", 1.0, 1.9),
                (",", 1.9, 2.0),
                ("in", 2.0, 2.2),
                ("the", 2.2, 2.4),
                ("flower", 2.4, 2.7),
                ("-fatened", 2.7, 3.0),
            ]
        ),
        3.5,
    )
    assert [w.text for w in words_from_final(final)] == ["Printing,", "in", "the", "flower-fatened"]
    comma = FinalMessage(4, ",", 3.0, 3.1, (WordInfo(",", 3.0, 3.1, 0.9),), 3.6)
    assert words_from_final(comma) == [TimedWord(",", 3.0, 3.1, joins_previous=True)]
    assert join_text("my fellow Americans", ",") == "my fellow Americans,"
    assert join_text("Americans,", "ask not") == "Americans, ask not"


def test_a_final_without_word_times_gets_them_spread_by_length() -> None:
    final = FinalMessage(0, " ask not what", 4.0, 5.0, (), 5.5)
    words = words_from_final(final)
    assert [w.text for w in words] == ["ask", "not", "what"]
    assert words[0].start_s == 4.0 and words[-1].end_s == 5.0
    assert all(a.end_s == pytest.approx(b.start_s) for a, b in itertools.pairwise(words))
    assert words[1].end_s - words[1].start_s == pytest.approx(0.3)  # 3 of 10 characters


# --------------------------------------------------------------------------- split points


def test_a_full_cue_splits_at_its_last_sentence_end() -> None:
    words = spoken(
        "It was modern. For although the Chinese, took "
        "impressions from wood blocks for all centuries past"
    )
    cues = build_cues(words)
    assert cues[0].text == "It was modern."
    assert rule_violations(as_read(cues), CONFIG, words) == []


def test_without_a_sentence_end_it_splits_at_the_last_clause_end() -> None:
    words = spoken(
        "For although the Chinese took impressions, from "
        "wood blocks engraved in relief for centuries before"
    )
    cues = build_cues(words)
    assert cues[0].text == "For although the Chinese took impressions,"


def test_without_punctuation_it_splits_at_the_longest_pause() -> None:
    words = spoken(
        "for although the Chinese took impressions from wood "
        "blocks engraved in relief for centuries before the woodcutters"
    )
    longest = 7  # a longer pause after "from"
    words = [
        w if i < longest else TimedWord(w.text, w.start_s + 0.4, w.end_s + 0.4)
        for i, w in enumerate(words)
    ]
    cues = build_cues(words)
    assert cues[0].text == "for although the Chinese took impressions from"


def test_no_split_point_leaves_a_cue_too_short_to_read() -> None:
    # "Well." ends a sentence, but a cue of it alone would be gone in 0.3 s.
    words = spoken(
        "Well. for although the Chinese took impressions from "
        "wood blocks engraved in relief for centuries before"
    )
    cues = build_cues(words)
    assert cues[0].text.startswith("Well. for")
    assert rule_violations(as_read(cues), CONFIG, words) == []


def test_a_one_second_pause_ends_a_cue_that_still_fits() -> None:
    words = spoken("one | From fairest creatures we desire increase")
    cues = build_cues(words)
    assert texts(cues) == ["one", "From fairest creatures we desire increase"]
    assert cues[0].start_s == 0.0 and cues[0].end_s == pytest.approx(1.0)


def test_words_over_seven_seconds_make_two_cues() -> None:
    words = spoken("slow words said one by one with long breaths between", word_s=0.5, pause_s=0.4)
    cues = build_cues(words)
    assert len(cues) == 2
    assert all(c.last_word_s - c.first_word_s <= 7.0 for c in cues)
    assert rule_violations(as_read(cues), CONFIG, words) == []


# --------------------------------------------------------------------------- timing


def test_a_short_cue_stays_a_second_and_long_text_its_reading_time() -> None:
    (cue,) = build_cues([TimedWord("Yes.", 5.0, 5.3)])
    assert (cue.start_s, cue.end_s) == (5.0, 6.0)
    fast = spoken(
        "Printing in the only sense with which we are at present concerned differs", word_s=0.1
    )
    (cue,) = build_cues(fast)
    assert cue.end_s == pytest.approx(len(cue.text) / 20)  # 20 characters a second


def test_cues_chain_across_short_gaps_and_keep_two_frames_apart() -> None:
    first = spoken("And so my fellow Americans, ask not what your country can do for you.")
    second = spoken("Ask what you can do for your country.", start_s=first[-1].end_s + 0.3)
    cues = build_cues(first + second)
    assert len(cues) == 2
    assert cues[1].start_s == second[0].start_s  # never before its first word
    assert cues[1].start_s - cues[0].end_s == pytest.approx(0.08)  # the 0.3 s gap chained
    far = spoken("Ask what you can do for your country.", start_s=first[-1].end_s + 0.9)
    cues = build_cues(first + far)
    assert cues[0].end_s == pytest.approx(max(first[-1].end_s, len(cues[0].text) / 20))


def test_a_cue_ends_two_frames_before_a_word_that_follows_at_once() -> None:
    words = spoken(
        "It was modern. For although the Chinese took impressions from wood blocks for centuries"
    )
    cues = build_cues(words)
    assert cues[0].end_s == pytest.approx(words[3].start_s - 0.08)
    assert cues[0].end_s < cues[0].last_word_s  # the gap is taken from the cue before


# --------------------------------------------------------------------------- live


def test_a_cue_is_given_out_once_nothing_later_can_change_it() -> None:
    builder = CueBuilder()
    words = spoken("one two three")
    assert [c for w in words for c in builder.add_word(w)] == []
    # The utterance ended; the next word could still start 0.3 s after "three".
    assert builder.advance(words[-1].end_s + 0.3) == []
    (cue,) = builder.advance(words[-1].end_s + 1.5)
    assert cue.text == "one two three" and cue.end_s == pytest.approx(1.2)
    assert builder.finish() == []


def test_pieces_that_join_the_word_before_land_in_its_cue() -> None:
    builder = CueBuilder()
    for w in spoken("my fellow Americans"):
        builder.add_word(w)
    builder.add_word(TimedWord(",", 0.9, 1.0, joins_previous=True))
    assert texts(builder.finish()) == ["my fellow Americans,"]


def test_one_by_one_or_all_at_once_the_cues_are_the_same() -> None:
    words = (
        spoken("It was modern. For although the Chinese, took impressions from wood blocks")
        + spoken(
            "engraved in relief | for centuries before the woodcutters of the Netherlands.",
            start_s=6.0,
        )
        + spoken("Yes. | No.", start_s=12.0)
    )
    live = CueBuilder()
    cues = []
    for w in words:
        cues.extend(live.advance(w.start_s))  # the most a stream could tell in advance
        cues.extend(live.add_word(w))
    cues.extend(live.finish())
    assert cues == build_cues(words)
    assert rule_violations(as_read(cues), CONFIG, words) == []


def test_the_rule_checker_finds_broken_cues() -> None:
    words = spoken("one two three four")
    bad = [
        ReadCue(0.0, 0.5, ("one",)),  # too short
        ReadCue(0.55, 9.0, ("two", "three", "x")),  # too close, too long, three lines
    ]
    problems = rule_violations(bad, CONFIG, words)
    assert any("only 0.500 s" in p for p in problems)
    assert any("after the last" in p for p in problems)
    assert any("3 lines" in p for p in problems)
    assert any("8.450 s on screen" in p for p in problems)
    assert any("differ from the transcript" in p for p in problems)
    early = rule_violations([ReadCue(0.0, 1.2, ("two",))], CONFIG, spoken("two", start_s=0.5))
    assert any("before its word" in p for p in early)


# --------------------------------------------------------------------------- file formats


@pytest.mark.parametrize(
    ("seconds", "srt", "vtt"),
    [
        (0.0, "00:00:00,000", "00:00:00.000"),
        (1.5, "00:00:01,500", "00:00:01.500"),
        (1.0005, "00:00:01,001", "00:00:01.001"),  # half a millisecond rounds up
        (59.9995, "00:01:00,000", "00:01:00.000"),  # carrying into the minutes
        (3725.5, "01:02:05,500", "01:02:05.500"),
        (360000.0, "100:00:00,000", "100:00:00.000"),
        (-0.2, "00:00:00,000", "00:00:00.000"),
    ],
)
def test_timestamps(seconds: float, srt: str, vtt: str) -> None:
    assert format_srt_timestamp(seconds) == srt
    assert format_vtt_timestamp(seconds) == vtt


def test_cue_formats() -> None:
    cue = Cue(1.0, 2.5, ("<ask> & not", "what"), 1.0, 2.4)
    assert srt_cue(3, cue) == "3\n00:00:01,000 --> 00:00:02,500\n<ask> & not\nwhat\n\n"
    assert vtt_cue(cue) == "00:00:01.000 --> 00:00:02.500\n&lt;ask&gt; &amp; not\nwhat\n\n"
    assert vtt_document([]) == "WEBVTT\n\n" and read_vtt(vtt_document([])) == []
    assert read_vtt(vtt_document([cue])) == [ReadCue(1.0, 2.5, ("<ask> & not", "what"))]
    assert srt_document([]) == "" and read_srt("") == []


# --------------------------------------------------------------------------- speakers


def voices(text: str, speaker: int, *, start_s: float) -> list[TimedWord]:
    return [replace(w, speaker=speaker) for w in spoken(text, start_s=start_s)]


def test_a_change_of_speaker_ends_a_cue_and_srt_labels_it_where_it_changes() -> None:
    first = voices("Hello there, my friend.", 0, start_s=0.0)  # 0.0-1.6 s
    second = voices("Hi. How are you?", 1, start_s=1.6)  # at once: no pause between them
    later = voices("I am well.", 1, start_s=5.0)  # the same speaker after a pause
    back = voices("Good.", 0, start_s=6.2)
    cues = build_cues([*first, *second, *later, *back])
    assert texts(cues) == ["Hello there, my friend.", "Hi. How are you?", "I am well.", "Good."]
    assert [(c.speaker, c.speaker_changed) for c in cues] == [
        (0, True),
        (1, True),
        (1, False),
        (0, True),
    ]
    srt = [cue.lines[0] for cue in read_srt(srt_document(cues))]
    assert srt == [
        "[S1] Hello there, my friend.",
        "[S2] Hi. How are you?",
        "I am well.",
        "[S1] Good.",
    ]
    vtt = vtt_document(cues).split("\n\n")[1:-1]
    assert [c.split("\n", 1)[1] for c in vtt] == [
        "<v S1>Hello there, my friend.</v>",
        "<v S2>Hi. How are you?</v>",
        "<v S2>I am well.</v>",
        "<v S1>Good.</v>",
    ]


def test_an_srt_label_is_kept_within_the_line_length() -> None:
    # 40 characters: one line alone, two with "[S1] " before them.
    text = "Twelve words make a line of forty chars."
    assert len(text) == 40
    [plain] = build_cues(spoken(text))
    [labelled] = build_cues(voices(text, 0, start_s=0.0))
    assert len(plain.lines) == 1 and len(labelled.lines) == 2
    lines = read_srt(srt_document([labelled]))[0].lines
    assert lines[0].startswith("[S1] ") and all(
        len(line) <= CONFIG.max_line_chars for line in lines
    )


def test_a_finals_words_keep_their_speakers() -> None:
    final = FinalMessage(
        0,
        " Yes, I do.",
        0.0,
        1.0,
        (
            WordInfo("Yes", 0.0, 0.3, 0.9, 0, 0.9),
            WordInfo(",", 0.3, 0.35, 0.9, 0, 0.9),
            WordInfo("I", 0.4, 0.6, 0.9, 1, 0.8),
            WordInfo("do.", 0.6, 1.0, 0.9, 1, 0.8),
        ),
        2.0,
    )
    assert [(w.text, w.speaker) for w in words_from_final(final)] == [
        ("Yes,", 0),
        ("I", 1),
        ("do.", 1),
    ]


@pytest.mark.asyncio(loop_scope="session")  # the speakers_server_url fixture's loop
async def test_live_subtitles_of_two_readers_carry_their_voices(
    speakers_server_url: str, speech_dir: Path, tmp_path: Path
) -> None:
    """Two shared readers streamed to a server with ``--speakers``: VTT cues before the
    change are S1's voice and after it S2's; SRT labels the first cue and the change, and
    nothing else; no line is longer than 42 characters, label included."""
    talk = two_readers(speech_dir)
    path = tmp_path / "two_readers.wav"
    write_wav(path, talk.audio)
    messages = await stream_messages(speakers_server_url, path, len(talk.audio) / SAMPLE_RATE_HZ)
    files = {}
    for fmt in ("srt", "vtt"):
        out = io.StringIO()
        renderer = SubtitleRenderer(out, fmt)
        for message in messages:
            renderer.on_message(message)
        renderer.close()
        files[fmt] = out.getvalue()
    cues = read_srt(files["srt"])
    assert len(cues) >= 4
    labels = [c.lines[0].split(" ", 1)[0] for c in cues if c.lines[0].startswith("[S")]
    assert labels == ["[S1]", "[S2]"], files["srt"]
    assert all(len(line) <= CONFIG.max_line_chars for c in cues for line in c.lines)
    vtt_cues = files["vtt"].split("\n\n")[1:-1]
    assert len(vtt_cues) == len(cues)
    for cue, block in zip(cues, vtt_cues, strict=True):
        voice = "<v S1>" if cue.start_s < talk.boundary_s else "<v S2>"
        assert block.split("\n", 1)[1].startswith(voice), (block, talk.boundary_s)


# --------------------------------------------------------------------------- real speech


async def stream_messages(server_url: str, path: Path, audio_s: float) -> list[ServerMessage]:
    """All of ``path`` sent at once: ``done`` comes once the server has decoded it, which on a
    slow, busy 2-core machine takes about as long as the audio (the bound only catches a hang)."""
    messages: list[ServerMessage] = []
    await stream_audio(
        server_url + "/v1/stream",
        FileSource(path),
        pace=0,
        on_message=messages.append,
        done_timeout_s=max(60.0, 2.0 * audio_s),
    )
    return messages


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_live_subtitles_of_the_long_recordings_follow_every_rule(
    server_url: str, speech_dir: Path, tmp_path: Path
) -> None:
    rows = [r for r in read_manifest(speech_dir / "manifest_long.tsv") if r.file in LONG_READ]
    assert len(rows) == len(LONG_READ)
    for row in rows:
        recording = tmp_path / Path(row.file).name
        write_wav(
            recording, load_clip(speech_dir / row.file)[: round(LONG_READ_S * SAMPLE_RATE_HZ)]
        )
        messages = await stream_messages(server_url, recording, LONG_READ_S)
        words = [w for m in messages if isinstance(m, FinalMessage) for w in words_from_final(m)]
        assert len(words) > 200, row.file
        files = {}
        for fmt in ("srt", "vtt"):
            out = io.StringIO()
            renderer = SubtitleRenderer(out, fmt)
            for message in messages:
                renderer.on_message(message)
            renderer.close()
            files[fmt] = out.getvalue()
        cues = read_srt(files["srt"])
        assert read_vtt(files["vtt"]) == cues
        assert rule_violations(cues, CONFIG, words) == [], row.file
        # Written cue by cue as the stream went, they are the cues of the whole transcript.
        assert files["srt"] == srt_document(build_cues(words)), row.file
        # Not a word at a time: cues of several words that stay up for seconds.
        duration = [c.end_s - c.start_s for c in cues]
        assert len(words) / len(cues) >= 5, (row.file, len(cues))
        assert sum(duration) / len(duration) > 2.0, duration
