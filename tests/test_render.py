"""Renderers fed with scripted server messages; then the live captions in a real terminal
(a tmux pane) with what a real server (tiny.en) makes of a real clip.

Scripted output is read back through ``screen_of``, a small model of what a terminal shows
after it (carriage return, line feed, erase line, cursor up and down).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import sys
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import TextIO

import pytest

from bench.corpus import read_manifest, wer
from client.render import (
    JsonlRenderer,
    Renderer,
    SubtitleRenderer,
    TerminalRenderer,
    TextRenderer,
    UtteranceTracker,
    color_wanted,
    display_width,
    fit_tail,
    format_stats,
    make_renderer,
    percentile,
    wrap_words,
)
from client.sources import FileSource
from client.stream import StreamStats, stream_audio
from client.subtitles import CueConfig, join_text
from server.protocol.messages import (
    DoneMessage,
    ErrorMessage,
    FinalMessage,
    PartialMessage,
    ReadyMessage,
    ServerMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    WordInfo,
    parse_server_message,
)
from tests.helpers import two_readers, write_wav
from tests.subtitle_checks import read_srt, read_vtt, rule_violations
from tests.tmux_pane import DEAD_ROW, TMUX, TmuxPane, render_png

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
JFK = "misc_en/jfk.wav"  # 11 s, two utterances
_CSI = re.compile(r"(\x1b\[[0-9;]*[A-Za-z]|\r|\n)")


def _final(seg: int, text: str, start: float, end: float, received: float) -> FinalMessage:
    """A final whose words split its span evenly (punctuation stays on its word here)."""
    tokens = text.split()
    step = (end - start) / max(len(tokens), 1)
    words = tuple(
        WordInfo(t, start + i * step, start + (i + 1) * step, 0.9) for i, t in enumerate(tokens)
    )
    return FinalMessage(seg, text, start, end, words, received)


# As a real server sends them: an utterance's speech_ended before its last final.
SCRIPT: list[ServerMessage] = [
    ReadyMessage("s", "tiny.en", 16000, "pcm_s16le", "en", "transcribe"),
    SpeechStartedMessage(0.5, 0.6),
    PartialMessage(0, " And so", 0.5, 1.2, 1.3),
    PartialMessage(0, " And so my fellow", 0.5, 2.0, 2.1),
    _final(0, " And so my fellow Americans,", 0.5, 3.25, 3.5),
    PartialMessage(1, " ask not", 3.3, 4.6, 4.7),
    ErrorMessage("protocol_error", "unknown type", False, 4.8),
    SpeechEndedMessage(7.2, 7.4),
    SpeechStartedMessage(7.6, 7.8),
    _final(1, " ask not what your country can do for you.", 3.3, 7.0, 7.9),
    PartialMessage(2, " Ask what", 7.6, 8.4, 8.5),
    _final(2, " Ask what you can do", 7.6, 9.2, 9.6),
    FinalMessage(3, "   ", 9.3, 9.3, (), 9.7),  # a segment that came out empty
    SpeechEndedMessage(10.5, 10.7),
    _final(4, " for your country.", 9.3, 10.2, 10.8),
    SpeechStartedMessage(3660.5, 3660.7),
    _final(5, " <ask> & --> what", 3661.0, 3662.5004, 3663.0),
    DoneMessage(6, 3663.0, 12.0, 14.2),
]


def screen_of(output: str) -> list[str]:
    """The rows a terminal shows after ``output`` (escape sequences for colour dropped)."""
    rows = [""]
    r = col = 0
    for token in _CSI.split(output):
        if token == "\r":
            col = 0
        elif token == "\n":
            r, col = r + 1, 0
            if r == len(rows):
                rows.append("")
        elif token.startswith("\x1b["):
            arg, cmd = token[2:-1], token[-1]
            if cmd == "K" and arg == "2":
                rows[r] = ""
            elif cmd == "A":
                r = max(0, r - int(arg or 1))
            elif cmd == "B":
                r = min(len(rows) - 1, r + int(arg or 1))
        elif token:
            rows[r] = rows[r][:col].ljust(col) + token + rows[r][col + len(token) :]
            col += len(token)
    return [row.rstrip() for row in rows]


class Shown:
    """What the screen should hold after each message: the finals, then the partial."""

    def __init__(self) -> None:
        self.finals = ""
        self.partial = ""

    def update(self, message: ServerMessage) -> None:
        if isinstance(message, PartialMessage):
            self.partial = " ".join(message.text.split())
        elif isinstance(message, FinalMessage):
            self.partial = ""
            self.finals = join_text(self.finals, " ".join(message.text.split()))

    def matches(self, rows: list[str]) -> bool:
        """The rows hold the finals' words, then the partial's, and nothing else: no stale or
        repeated fragment. A partial too long for the live region shows the words that fit
        after the finals, then "…" and its newest words (the first of them maybe cut)."""
        words = " ".join(rows).split()
        finals = self.finals.split()
        if words[: len(finals)] != finals:
            return False
        rest, partial = words[len(finals) :], self.partial.split()
        cut_at = next((k for k, word in enumerate(rest) if word.startswith("…")), None)
        if cut_at is None:
            return rest == partial
        head = rest[:cut_at]
        tail = (
            [rest[cut_at][1:], *rest[cut_at + 1 :]] if len(rest[cut_at]) > 1 else rest[cut_at + 1 :]
        )
        if head != partial[: len(head)]:
            return False
        if not tail:
            return True
        start = len(partial) - len(tail)
        return (
            start >= len(head)
            and tail[1:] == partial[start + 1 :]
            and partial[start].endswith(tail[0])
        )


def test_the_screen_model_takes_a_partial_cut_after_its_first_words() -> None:
    """Seen in a real run: a partial two rows long after a line ended shows its first words,
    then "…" and its newest ones. The model must take that, and still refuse stale words."""
    shown = Shown()
    shown.update(_final(0, "And so my fellow Americans.", 0.0, 2.0, 2.2))
    text = "Ask what your country can do for you. Ask what your country can do for you"
    shown.update(PartialMessage(1, text, 2.0, 5.0, 5.1))
    screen = ["And so my fellow Americans.", "Ask what your country can do"]
    assert shown.matches([*screen, "… your country can do for you"])
    assert shown.matches([*screen, "…ountry can do for you"])  # the first tail word cut
    assert not shown.matches([*screen, "… your country can do for me"])
    assert not shown.matches([*screen[:1], "Ask not what your", "… can do for you"])


# --------------------------------------------------------------------------- pure helpers


def test_fit_tail_keeps_the_newest_words() -> None:
    assert fit_tail("short", 10) == "short"
    assert fit_tail("0123456789abc", 6) == "…89abc"
    assert fit_tail("0123456789abc", 6, "...") == "...abc"
    assert display_width("日本語") == 6
    assert fit_tail("日本語です", 7) == "…語です"
    assert display_width(fit_tail("日本語です", 7)) <= 7


def test_wrap_words_fills_rows_and_cuts_only_words_wider_than_a_row() -> None:
    words = ["And", "so", "my", "fellow", "Americans,", "ask", "not"]
    assert wrap_words(words, 16) == ["And so my fellow", "Americans, ask", "not"]
    assert wrap_words(["abcdefghij", "k"], 4) == ["abcd", "efgh", "ij k"]
    assert wrap_words([], 10) == [""]


def test_percentile_nearest_rank() -> None:
    values = [0.5, 0.1, 0.3, 0.2, 0.4]
    assert percentile(values, 50) == 0.3
    assert percentile(values, 95) == 0.5
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_stats_report() -> None:
    stats = StreamStats(audio_s=1.0, wall_s=1.5, ttft_s=0.6, final_latencies_s=(0.4,))
    report = format_stats(stats)
    assert "real-time factor 1.50" in report
    assert "time to first token: 0.60 s" in report
    assert "final latency over 1 final(s): median 0.40 s" in report
    empty = format_stats(StreamStats(audio_s=0.0, wall_s=0.2, ttft_s=None, final_latencies_s=()))
    assert "no words recognised" in empty and "no finals with text" in empty


# --------------------------------------------------------------------------- utterances


def test_an_utterance_is_over_when_text_starts_at_or_after_its_end() -> None:
    tracker = UtteranceTracker()
    seen = [(type(m).__name__, tracker.observe(m)) for m in SCRIPT]
    ends = [(name, bound) for name, bound in seen if bound is not None]
    # speech_ended(7.2) comes before its final (3.3-7.0); the partial at 7.6 shows it over,
    # and no later word starts before the next utterance's start (7.6).
    assert ends == [
        ("PartialMessage", 7.6),
        ("FinalMessage", 3660.5),
        ("DoneMessage", float("-inf")),
    ]


def test_a_resumed_session_ends_the_utterances_before_it() -> None:
    tracker = UtteranceTracker()
    assert tracker.observe(SpeechStartedMessage(1.0, 1.2)) is None
    assert tracker.observe(PartialMessage(0, " hi", 1.0, 1.5, 1.6)) is None
    resumed = ReadyMessage("t", "tiny.en", 16000, "pcm_s16le", "en", "transcribe", 1.4)
    assert tracker.observe(resumed) == 1.4


# --------------------------------------------------------------------------- file formats


def _render(make: Callable[[TextIO], Renderer]) -> tuple[str, list[str]]:
    """The whole output of the renderer ``make`` builds, and the output after each message."""
    out = io.StringIO()
    renderer = make(out)
    steps = []
    for message in SCRIPT:
        renderer.on_message(message)
        steps.append(out.getvalue())
    renderer.close()
    return out.getvalue(), steps


def test_text_is_one_line_per_utterance_written_once_it_is_over() -> None:
    text, steps = _render(TextRenderer)
    assert text == (
        "And so my fellow Americans, ask not what your country can do for you.\n"
        "Ask what you can do for your country.\n"
        "<ask> & --> what\n"
    )
    # The first line appears with the next utterance's first text, not before.
    first = next(i for i, s in enumerate(steps) if s)
    assert isinstance(SCRIPT[first], PartialMessage) and SCRIPT[first].start == 7.6


def test_a_detected_language_is_tagged_where_it_starts_and_where_it_switches() -> None:
    def final(i: int, text: str, language: str, start: float) -> FinalMessage:
        return FinalMessage(i, text, start, start + 1, (), start + 2, 0.1, language, 0.97)

    out = io.StringIO()
    renderer = TextRenderer(out)
    for message in [
        final(0, " Der Raum", "de", 0.0),
        final(1, " wurde genutzt.", "de", 1.0),
        SpeechEndedMessage(2.2, 2.5),
        final(2, " And then", "en", 3.0),
    ]:
        renderer.on_message(message)
    renderer.close()
    assert out.getvalue() == "[de] Der Raum wurde genutzt.\n[en] And then\n"
    terminal = io.StringIO()
    flowing = TerminalRenderer(terminal, width=80, color=False)
    flowing.on_message(final(0, " Der Raum", "de", 0.0))
    flowing.on_message(final(1, " wurde", "de", 1.0))
    flowing.close()
    last_row = terminal.getvalue().rsplit("\x1b[2K", 1)[-1]  # the row as last redrawn
    assert last_row == "[de] Der Raum wurde\n"


def _spoken(segment: int, start: float, *words: tuple[str, int]) -> FinalMessage:
    """A final of ``words`` (text, speaker), 0.4 s each from ``start``."""
    infos = tuple(
        WordInfo(text, start + 0.4 * k, start + 0.4 * k + 0.3, 0.9, speaker, 0.8)
        for k, (text, speaker) in enumerate(words)
    )
    text = "".join(" " + w for w, _ in words)
    return FinalMessage(segment, text, infos[0].start, infos[-1].end, infos, start + 3)


def test_a_speaker_is_tagged_where_the_speaker_changes() -> None:
    """``[S1]`` before the first words, ``[S2]`` where the other speaker starts: a final that
    opens with another speaker starts a line, a change inside a final is tagged in place."""
    script = [
        _spoken(0, 0.0, ("Hello", 0), ("there.", 0)),
        _spoken(1, 1.0, ("I", 1), ("am", 1), ("fine.", 1)),
        _spoken(2, 2.5, ("Good.", 1), ("And", 0), ("you?", 0)),
        SpeechEndedMessage(4.0, 4.5),
        _spoken(3, 5.0, ("Well.", 0)),
    ]
    out = io.StringIO()
    renderer = TextRenderer(out)
    for message in script:
        renderer.on_message(message)
    renderer.close()
    assert out.getvalue() == "[S1] Hello there.\n[S2] I am fine. Good. [S1] And you?\nWell.\n"
    terminal = io.StringIO()
    flowing = TerminalRenderer(terminal, width=80, color=False)
    for message in script:
        flowing.on_message(message)
    flowing.close()
    assert screen_of(terminal.getvalue()) == [
        "[S1] Hello there.",
        "[S2] I am fine. Good. [S1] And you?",
        "Well.",
        "",  # the cursor's row, after the last line ended
    ]


@pytest.mark.asyncio(loop_scope="session")  # the speakers_server_url fixture's loop
async def test_two_readers_streamed_are_tagged_s1_then_s2(
    speakers_server_url: str, speech_dir: Path, tmp_path: Path
) -> None:
    """The text output of two shared readers streamed to a server with ``--speakers``: the
    first line is S1's, and S2 is tagged once, at the second reader."""
    talk = two_readers(speech_dir)
    path = tmp_path / "two_readers.wav"
    write_wav(path, talk.audio)
    out = io.StringIO()
    renderer = TextRenderer(out)
    await stream_audio(
        speakers_server_url + "/v1/stream", FileSource(path), pace=0, on_message=renderer.on_message
    )
    renderer.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[S1] ") and out.getvalue().count("[S1]") == 1, lines
    assert out.getvalue().count("[S2]") == 1 and "[S2] For although" in out.getvalue(), lines


def test_jsonl_is_every_message_one_per_line() -> None:
    text, _ = _render(JsonlRenderer)
    lines = text.splitlines()
    assert len(lines) == len(SCRIPT)
    assert [parse_server_message(line) for line in lines] == [
        parse_server_message(m.to_json()) for m in SCRIPT
    ]
    assert [json.loads(line)["type"] for line in lines][:3] == [
        "ready",
        "speech_started",
        "partial",
    ]


def test_srt_cues_come_from_the_words_and_only_once_complete() -> None:
    text, steps = _render(lambda out: SubtitleRenderer(out, "srt"))
    cues = read_srt(text)
    assert [c.text for c in cues] == [
        "And so my fellow Americans, ask not what your country can do for you.",
        "Ask what you can do for your country.",
        "<ask> & --> what",
    ]
    assert rule_violations(cues, CueConfig()) == []
    assert cues[0].start_s == 0.5 and cues[2].start_s == 3661.0
    # The first cue is written when the words after it show where it ends (the next
    # utterance's first final), the second when the third utterance begins, the last at the
    # end of the stream.
    first = next(i for i, step in enumerate(steps) if step)
    assert SCRIPT[first] == SCRIPT[11]
    assert steps[-1].count(" --> ") == 2
    assert text.count(" --> ") == 4  # 3 timing lines, and "-->" in the last cue's text


def test_vtt_cues_are_escaped_and_a_stream_without_speech_is_still_valid() -> None:
    text, _ = _render(lambda out: SubtitleRenderer(out, "vtt"))
    assert text.startswith("WEBVTT\n\n")
    assert "&lt;ask&gt; &amp; --&gt; what" in text
    assert [c.text for c in read_vtt(text)][-1] == "<ask> & --> what"
    out = io.StringIO()
    renderer = SubtitleRenderer(out, "vtt")
    renderer.on_message(SpeechStartedMessage(0.0, 0.1))
    renderer.close()
    assert out.getvalue() == "WEBVTT\n\n"
    with pytest.raises(ValueError, match="srt or vtt"):
        SubtitleRenderer(out, "ass")


# --------------------------------------------------------------------------- terminal


def test_finals_flow_into_lines_wrapped_at_the_width() -> None:
    out = io.StringIO()
    renderer = TerminalRenderer(out, width=30, color=False)
    shown = Shown()
    for message in SCRIPT:
        renderer.on_message(message)
        shown.update(message)
        assert shown.matches(screen_of(out.getvalue())), (message, screen_of(out.getvalue()))
    renderer.close()
    assert screen_of(out.getvalue()) == [
        "And so my fellow Americans,",
        "ask not what your country can",
        "do for you.",
        "Ask what you can do for your",
        "country.",
        "<ask> & --> what",
        "",
    ]
    assert all(display_width(row) <= 29 for row in screen_of(out.getvalue()))


def test_the_partial_is_dim_and_redrawn_in_place() -> None:
    out = io.StringIO()
    renderer = TerminalRenderer(out, width=80)
    renderer.on_message(_final(0, " And so my fellow", 0.0, 1.0, 1.1))
    renderer.on_message(PartialMessage(1, " Americans ask", 1.0, 1.8, 1.9))
    renderer.on_message(PartialMessage(1, " Americans, ask not", 1.0, 2.3, 2.4))
    assert out.getvalue().endswith("\r\x1b[2KAnd so my fellow \x1b[2mAmericans, ask not\x1b[0m")
    assert screen_of(out.getvalue()) == ["And so my fellow Americans, ask not"]
    renderer.close()
    assert screen_of(out.getvalue()) == ["And so my fellow", ""]  # the partial is erased


def test_a_partial_too_long_for_the_row_starts_the_next_and_is_cut_to_fit() -> None:
    out = io.StringIO()
    renderer = TerminalRenderer(out, width=21, color=False)
    renderer.on_message(_final(0, " And so my fellow", 0.0, 1.0, 1.1))
    renderer.on_message(PartialMessage(1, " Americans ask", 1.0, 1.8, 1.9))
    assert screen_of(out.getvalue()) == ["And so my fellow", "Americans ask"]
    renderer.on_message(PartialMessage(1, " Americans ask not what your country", 1.0, 3.0, 3.1))
    assert screen_of(out.getvalue()) == ["And so my fellow", "…t what your country"]


def test_a_long_line_ends_at_its_next_sentence_end() -> None:
    out = io.StringIO()
    renderer = TerminalRenderer(out, width=30, color=False)
    renderer.on_message(_final(0, " Printing, in the only sense with which", 0.0, 2.0, 2.1))
    renderer.on_message(_final(1, " we are concerned. Now as all books", 2.0, 4.0, 4.1))
    renderer.on_message(_final(2, " consist of types.", 4.0, 5.0, 5.1))
    renderer.on_message(_final(3, " And it was", 5.0, 6.0, 6.1))
    renderer.close()
    assert screen_of(out.getvalue()) == [
        "Printing, in the only sense",
        "with which we are concerned.",
        "Now as all books consist of",
        "types.",
        "And it was",
        "",
    ]


def test_a_latin_1_terminal_gets_question_marks_not_an_error() -> None:
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="latin-1", errors="strict", write_through=True)
    renderer = TerminalRenderer(out, width=12, color=False)
    renderer.on_message(_final(0, " café 日本", 0.0, 1.0, 1.1))
    renderer.on_message(PartialMessage(1, " a long partial here", 1.0, 2.0, 2.1))
    renderer.close()
    shown = raw.getvalue().decode("latin-1")
    assert "café ??" in shown and "...ial here" in shown


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_format_follows_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    assert color_wanted({"TERM": "xterm-256color"})
    assert not color_wanted({"TERM": "xterm-256color", "NO_COLOR": "1"})
    assert not color_wanted({"TERM": "dumb"})
    assert color_wanted({"NO_COLOR": ""})  # set but empty does not count (no-color.org)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert isinstance(make_renderer(None, _Tty()), TerminalRenderer)
    monkeypatch.setenv("TERM", "dumb")  # no cursor movement: plain lines
    assert isinstance(make_renderer(None, _Tty()), TextRenderer)
    assert isinstance(make_renderer(None, io.StringIO()), TextRenderer)
    assert isinstance(make_renderer("srt", _Tty()), SubtitleRenderer)
    with pytest.raises(ValueError, match="format must be one of"):
        make_renderer("html", io.StringIO())


def test_no_color_means_no_escape_for_colour(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("NO_COLOR", "1")
    out = _Tty()
    renderer = make_renderer(None, out)
    renderer.on_message(PartialMessage(0, " hi", 0.0, 0.5, 0.6))
    assert "\x1b[2m" not in out.getvalue() and out.getvalue().endswith("hi")
    monkeypatch.delenv("NO_COLOR")
    out = _Tty()
    make_renderer(None, out).on_message(PartialMessage(0, " hi", 0.0, 0.5, 0.6))
    assert "\x1b[2mhi\x1b[0m" in out.getvalue()


# --------------------------------------------------------------------------- a real terminal


@pytest.fixture
def tmux_socket(tmp_path: Path) -> Path:
    """Where a test's private tmux server listens. Without tmux the test fails under CI
    (``make test`` installs it) and is skipped elsewhere."""
    if TMUX is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tmux is not installed; `make tmux` installs Debian's package")
        pytest.skip("tmux is not installed: make tmux (apt-get install tmux)")
    return tmp_path / "tmux.sock"


def whisperwire_command() -> list[str]:
    """The installed entry point next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("whisperwire")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "client.cli"]


def stream_jfk_command(server_url: str, speech_dir: Path, *extra: str) -> list[str]:
    """``whisperwire stream`` of jfk.wav in real time against the test server."""
    url = server_url + "/v1/stream"
    return [
        *whisperwire_command(),
        "stream",
        str(speech_dir / JFK),
        "--url",
        url,
        "--pace",
        "1",
        *extra,
    ]


def reference(speech_dir: Path, file: str) -> str:
    rows = read_manifest(speech_dir / "manifest.tsv")
    return next(row.transcript for row in rows if row.file == file)


@pytest.mark.asyncio(loop_scope="session")
async def test_live_captions_in_a_terminal_flow_and_redraw_the_partial_in_place(
    server_url: str, speech_dir: Path, tmux_socket: Path
) -> None:
    """A real stream's messages (jfk.wav in real time), drawn into a tmux pane: after every
    message the screen holds exactly the finals so far and the partial, also across a resize
    that makes the terminal reflow what it shows."""
    messages: list[ServerMessage] = []
    await stream_audio(
        server_url + "/v1/stream",
        FileSource(speech_dir / JFK),
        pace=1.0,
        on_message=messages.append,
        finals="words",  # several finals within an utterance, each flowing on from the last
    )
    assert sum(isinstance(m, PartialMessage) for m in messages) >= 5, messages
    pane = TmuxPane(tmux_socket, ["sleep", "600"], width=48, height=12)
    try:
        with open(pane.tty, "w", encoding="utf-8") as tty:
            renderer = TerminalRenderer(tty)
            shown = Shown()
            half = len(messages) // 2
            for i, message in enumerate(messages):
                if i == half:
                    pane.resize(30, 12)
                    renderer.resized()
                renderer.on_message(message)
                shown.update(message)
                rows = await pane.wait_for(shown.matches, timeout_s=2.0)
                assert shown.matches(rows), (i, message, rows)
            renderer.close()
        said = [m for m in messages if isinstance(m, FinalMessage) and m.text.strip()]
        finals = [m.text.split() for m in said]
        rows = await pane.wait_for(shown.matches, timeout_s=2.0)
        assert shown.matches(rows), rows
        # Flowing: within an utterance, a final goes on in the row where the one before it
        # ended unless that row has no room for its first word (the renderer leaves the last
        # of the 30 columns free). Where the finals fall depends on the machine's speed.
        row_of = [r for r, row in enumerate(rows) for _ in row.split()]
        ends = [m.end for m in messages if isinstance(m, SpeechEndedMessage)]
        first = 0
        boundaries = 0
        for before, final in pairwise(said):
            last, first = first + len(before.text.split()) - 1, first + len(before.text.split())
            if any(before.end <= end <= final.start for end in ends):
                continue  # a new utterance starts a new line
            boundaries += 1
            if row_of[first] != row_of[last]:
                room = 29 - len(rows[row_of[last]]) - 1
                assert len(final.text.split()[0]) > room, (rows, final.text)
        assert len(finals) >= 3 and boundaries >= 1 and len(rows) <= 6, (finals, rows)
    finally:
        pane.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_the_stream_command_in_a_terminal_shows_flowing_captions(
    server_url: str, speech_dir: Path, tmux_socket: Path
) -> None:
    """``whisperwire stream`` in a real terminal, in real time: rows of several words,
    the partial dim while it lasts and gone at the end, the stats after the captions.
    Saves the screen as tests/artifacts/terminal.txt and terminal.png."""
    width = 72
    command = stream_jfk_command(server_url, speech_dir, "--stats")
    pane = TmuxPane(
        tmux_socket,
        command,
        width=width,
        height=16,
        env={"LANG": "C.UTF-8"},
        prompt="whisperwire stream jfk.wav --stats",
    )
    try:
        with_partial: list[str] = []
        while pane.exit_status() is None:
            rows = pane.screen(escapes=True)
            if any("\x1b[2m" in r for r in rows):
                with_partial = rows
            await asyncio.sleep(0.1)
        assert pane.exit_status() == 0, pane.screen()
        final = pane.screen(escapes=True, scrollback=True)
        ARTIFACTS.mkdir(exist_ok=True)
        shown = pane.text_rows(scrollback=True)
        shown = [r for r in shown if not DEAD_ROW.search(r)]
        while shown and not shown[-1]:
            shown.pop()
        (ARTIFACTS / "terminal.txt").write_text("\n".join(shown) + "\n")
        assert with_partial, "no dim partial was ever on screen"
        render_png(with_partial, ARTIFACTS / "terminal.png", columns=width)
    finally:
        pane.close()
    assert not any("\x1b[2m" in r for r in final), final  # no partial left behind
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", r) for r in final]
    assert plain[0] == "$ whisperwire stream jfk.wav --stats", plain
    stats_at = next(i for i, r in enumerate(plain) if r.startswith("audio: "))
    captions = [r for r in plain[1:stats_at] if r]
    assert "time to first token:" in plain[stats_at + 1]
    text = " ".join(captions)
    ref = reference(speech_dir, JFK)
    assert wer(ref, text) <= 0.35, captions
    assert len(text.split()) <= len(ref.split()) + 2, captions  # no partial appended
    assert 2 <= len(captions) <= 4, captions  # 22 words in rows of 71 columns
    assert all(display_width(r) < width for r in captions), captions


@pytest.mark.asyncio(loop_scope="session")
async def test_the_stream_command_redraws_at_the_new_width_when_the_terminal_shrinks(
    server_url: str, speech_dir: Path, tmux_socket: Path
) -> None:
    """SIGWINCH: the window shrinks from 60 to 36 columns while a partial shows; the
    terminal reflows what is on it, the command redraws its row at the new width, and the
    screen ends with the transcript once, nothing of a partial left over."""
    # Finals word by word: a partial then goes on in the row of the finals before it.
    command = stream_jfk_command(server_url, speech_dir, "--finals", "words")
    pane = TmuxPane(
        tmux_socket, command, width=60, height=16, env={"LANG": "C.UTF-8"}, prompt="whisperwire"
    )
    try:
        resized = False
        while pane.exit_status() is None:
            rows = pane.screen(escapes=True)
            # Once a partial follows the finals on their row: the row the command redraws.
            if not resized and any("\x1b[2m" in r and not r.startswith("\x1b[2m") for r in rows):
                pane.resize(36, 16)
                resized = True
            await asyncio.sleep(0.1)
        assert resized and pane.exit_status() == 0, pane.screen()
        final = pane.screen(escapes=True, scrollback=True)
    finally:
        pane.close()
    assert not any("\x1b[2m" in r for r in final), final
    captions = [re.sub(r"\x1b\[[0-9;]*m", "", r) for r in final[1:] if r]
    captions = [r for r in captions if not DEAD_ROW.search(r)]
    text = " ".join(captions)
    ref = reference(speech_dir, JFK)
    assert wer(ref, text) <= 0.35, captions
    assert len(text.split()) <= len(ref.split()) + 2, captions  # no stale fragment
