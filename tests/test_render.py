"""Renderers and the pure formatting they share, fed with scripted server messages."""

from __future__ import annotations

import io
import json

import pytest

from client.render import (
    JsonlRenderer,
    SrtRenderer,
    TerminalRenderer,
    TextRenderer,
    VttRenderer,
    display_width,
    fit_tail,
    format_srt_timestamp,
    format_stats,
    format_vtt_timestamp,
    make_renderer,
    percentile,
    srt_cue,
    vtt_cue,
)
from client.stream import StreamStats
from server.messages import (
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

ERASE = "\r\x1b[2K"

SCRIPT: list[ServerMessage] = [
    ReadyMessage("s", "tiny.en", 16000, "pcm_s16le", "en", "transcribe"),
    SpeechStartedMessage(0.5, 0.6),
    PartialMessage(0, " And so", 0.5, 1.2, 1.3),
    PartialMessage(0, " And so my fellow", 0.5, 2.0, 2.1),
    FinalMessage(
        0,
        " And so my fellow Americans,",
        0.5,
        3.25,
        (WordInfo(" And", 0.5, 0.7, 0.9), WordInfo(" Americans,", 2.4, 3.25, 0.8)),
        3.5,
    ),
    PartialMessage(1, " ask not", 4.0, 4.6, 4.7),
    ErrorMessage("protocol_error", "unknown type", False, 4.8),
    FinalMessage(1, " ask not what your country can do for you", 4.0, 7.0, (), 7.4),
    FinalMessage(2, "   ", 7.5, 7.6, (), 7.9),  # a segment that came out empty
    SpeechEndedMessage(7.7, 8.0),
    FinalMessage(3, " <ask> & --> what", 3661.0, 3662.5004, (), 3663.0),
    DoneMessage(4, 3663.0, 12.0, 14.2),
]


def _render(renderer_type: type[TextRenderer | SrtRenderer | VttRenderer | JsonlRenderer]) -> str:
    out = io.StringIO()
    renderer = renderer_type(out)
    for message in SCRIPT:
        renderer.on_message(message)
    renderer.close()
    return out.getvalue()


# --------------------------------------------------------------------------- pure formatting


@pytest.mark.parametrize(
    ("seconds", "srt", "vtt"),
    [
        (0.0, "00:00:00,000", "00:00:00.000"),
        (1.5, "00:00:01,500", "00:00:01.500"),
        (59.9995, "00:01:00,000", "00:01:00.000"),  # rounds to the millisecond, carrying
        (61.001, "00:01:01,001", "00:01:01.001"),
        (3725.5, "01:02:05,500", "01:02:05.500"),
        (360000.0, "100:00:00,000", "100:00:00.000"),
        (-0.2, "00:00:00,000", "00:00:00.000"),
    ],
)
def test_timestamps(seconds: float, srt: str, vtt: str) -> None:
    assert format_srt_timestamp(seconds) == srt
    assert format_vtt_timestamp(seconds) == vtt


def test_cues() -> None:
    assert (
        srt_cue(3, 1.0, 2.5, " hello\nworld ")
        == "3\n00:00:01,000 --> 00:00:02,500\nhello world\n\n"
    )
    assert vtt_cue(1.0, 0.9, "a<b>") == "00:00:01.000 --> 00:00:01.000\na&lt;b&gt;\n\n"


def test_fit_tail_keeps_the_newest_words() -> None:
    assert fit_tail("short", 10) == "short"
    assert fit_tail("0123456789abc", 6) == "…89abc"
    assert display_width("日本語") == 6
    assert fit_tail("日本語です", 7) == "…語です"
    assert display_width(fit_tail("日本語です", 7)) <= 7


def test_percentile_nearest_rank() -> None:
    values = [0.5, 0.1, 0.3, 0.2, 0.4]
    assert percentile(values, 50) == 0.3
    assert percentile(values, 95) == 0.5
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


# --------------------------------------------------------------------------- file formats


def test_text_is_finals_one_per_line() -> None:
    assert _render(TextRenderer) == (
        "And so my fellow Americans,\nask not what your country can do for you\n<ask> & --> what\n"
    )


def test_jsonl_is_every_message_one_per_line() -> None:
    lines = _render(JsonlRenderer).splitlines()
    assert len(lines) == len(SCRIPT)
    assert [parse_server_message(line) for line in lines] == [
        parse_server_message(m.to_json()) for m in SCRIPT
    ]
    assert [json.loads(line)["type"] for line in lines][:3] == [
        "ready",
        "speech_started",
        "partial",
    ]


def test_srt_from_finals() -> None:
    assert _render(SrtRenderer) == (
        "1\n00:00:00,500 --> 00:00:03,250\nAnd so my fellow Americans,\n\n"
        "2\n00:00:04,000 --> 00:00:07,000\nask not what your country can do for you\n\n"
        "3\n01:01:01,000 --> 01:01:02,500\n<ask> & --> what\n\n"
    )


def test_vtt_from_finals() -> None:
    assert _render(VttRenderer) == (
        "WEBVTT\n\n"
        "00:00:00.500 --> 00:00:03.250\nAnd so my fellow Americans,\n\n"
        "00:00:04.000 --> 00:00:07.000\nask not what your country can do for you\n\n"
        "01:01:01.000 --> 01:01:02.500\n&lt;ask&gt; &amp; --&gt; what\n\n"
    )


def test_vtt_without_finals_is_still_valid() -> None:
    out = io.StringIO()
    renderer = VttRenderer(out)
    renderer.on_message(SpeechStartedMessage(0.0, 0.1))
    renderer.close()
    assert out.getvalue() == "WEBVTT\n\n"


# --------------------------------------------------------------------------- terminal


def test_terminal_rewrites_the_partial_in_place_and_prints_finals() -> None:
    out = io.StringIO()
    renderer = TerminalRenderer(out, width=80, color=False)
    for message in SCRIPT:
        renderer.on_message(message)
    renderer.close()
    assert out.getvalue() == (
        f"{ERASE}And so"
        f"{ERASE}And so my fellow"
        f"{ERASE}And so my fellow Americans,\n"
        f"{ERASE}ask not"
        f"{ERASE}ask not what your country can do for you\n"
        "<ask> & --> what\n"
    )
    # What a terminal would show: after each \r the line restarts; finals end with \n.
    shown = [line.split("\r")[-1].replace("\x1b[2K", "") for line in out.getvalue().split("\n")]
    assert shown == [
        "And so my fellow Americans,",
        "ask not what your country can do for you",
        "<ask> & --> what",
        "",
    ]


def test_terminal_partial_never_wraps_and_is_dimmed() -> None:
    out = io.StringIO()
    renderer = TerminalRenderer(out, width=20)
    renderer.on_message(PartialMessage(0, " one two three four five six seven", 0.0, 1.0, 1.0))
    assert out.getvalue() == f"{ERASE}\x1b[2m…our five six seven\x1b[0m"
    assert display_width("…our five six seven") == 19  # one column spare: width 20
    renderer.close()
    assert out.getvalue().endswith(ERASE)  # an unfinished partial is erased at the end


def test_make_renderer_picks_live_only_on_a_terminal() -> None:
    class _Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(make_renderer(None, _Tty()), TerminalRenderer)
    assert isinstance(make_renderer(None, io.StringIO()), TextRenderer)
    assert isinstance(make_renderer("srt", _Tty()), SrtRenderer)
    with pytest.raises(ValueError, match="format must be one of"):
        make_renderer("html", io.StringIO())


# --------------------------------------------------------------------------- stats


def test_stats_report() -> None:
    stats = StreamStats(audio_s=1.0, wall_s=1.5, ttft_s=0.6, final_latencies_s=(0.4,))
    report = format_stats(stats)
    assert "real-time factor 1.50" in report
    assert "time to first token: 0.60 s" in report
    assert "final latency over 1 final(s): median 0.40 s" in report


def test_stats_report_without_words() -> None:
    report = format_stats(StreamStats(audio_s=0.0, wall_s=0.2, ttft_s=None, final_latencies_s=()))
    assert "no words recognised" in report
    assert "no finals with text" in report
