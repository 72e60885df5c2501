"""Renderers: turn server messages into live terminal captions, text, JSON lines, SRT or VTT.

A renderer gets every server message through ``on_message`` and ``close`` at the end, and
writes to the text stream it was given. The timestamp and cue formatters are pure functions.
"""

from __future__ import annotations

import math
import shutil
import unicodedata
from collections.abc import Sequence
from typing import Protocol, TextIO

from client.stream import StreamStats
from server.messages import FinalMessage, PartialMessage, ServerMessage

FORMATS = ("live", "text", "jsonl", "srt", "vtt")

_ERASE_LINE = "\r\x1b[2K"  # carriage return, then ANSI "erase entire line"
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"


class Renderer(Protocol):
    """Something that shows a stream's messages."""

    def on_message(self, message: ServerMessage) -> None:
        """Show one server message as it arrives."""
        ...

    def close(self) -> None:
        """The stream is over: finish the output."""
        ...


# --------------------------------------------------------------------------- pure formatting


def _split_ms(seconds: float) -> tuple[int, int, int, int]:
    total_ms = max(0, round(seconds * 1000))  # a negative time is a clock glitch: clamp
    hours, rest = divmod(total_ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, ms = divmod(rest, 1000)
    return hours, minutes, secs, ms


def format_srt_timestamp(seconds: float) -> str:
    """``HH:MM:SS,mmm`` as SubRip wants it, e.g. ``3725.5`` -> ``01:02:05,500``."""
    h, m, s, ms = _split_ms(seconds)
    return f"{h:02d}:{m:02d}:{s:02d},{ms:03d}"


def format_vtt_timestamp(seconds: float) -> str:
    """``HH:MM:SS.mmm`` as WebVTT wants it, e.g. ``3725.5`` -> ``01:02:05.500``."""
    h, m, s, ms = _split_ms(seconds)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"


def _cue_text(text: str) -> str:
    # A blank line ends a cue in both formats, so a cue's text is kept to one line.
    return " ".join(text.split())


def _cue_end(start: float, end: float) -> float:
    # Players drop cues that end before they start; round-off can make a tiny one do that.
    return max(start, end)


def srt_cue(index: int, start: float, end: float, text: str) -> str:
    """One SubRip cue, numbered from 1, with its trailing blank line."""
    times = f"{format_srt_timestamp(start)} --> {format_srt_timestamp(_cue_end(start, end))}"
    return f"{index}\n{times}\n{_cue_text(text)}\n\n"


def vtt_cue(start: float, end: float, text: str) -> str:
    """One WebVTT cue with its trailing blank line; ``&``, ``<`` and ``>`` are escaped."""
    times = f"{format_vtt_timestamp(start)} --> {format_vtt_timestamp(_cue_end(start, end))}"
    escaped = _cue_text(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return f"{times}\n{escaped}\n\n"


def display_width(text: str) -> int:
    """Terminal columns ``text`` takes: wide (CJK) characters take two, combining marks none."""
    return sum(_char_width(c) for c in text)


def _char_width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def fit_tail(text: str, columns: int) -> str:
    """The end of ``text`` that fits in ``columns``, with a leading ``…`` when cut.

    A live caption shows its newest words; a line that wraps could not be rewritten in place.
    """
    if display_width(text) <= columns:
        return text
    kept: list[str] = []
    used = 1  # the ellipsis
    for char in reversed(text):
        width = _char_width(char)
        if used + width > columns:
            break
        kept.append(char)
        used += width
    return "…" + "".join(reversed(kept)) if columns > 0 else ""


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of non-empty ``values``."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def format_stats(stats: StreamStats) -> str:
    """A few lines summing up a stream's timing, for ``--stats``."""
    lines = [f"audio: {stats.audio_s:.2f} s sent in {stats.wall_s:.2f} s"]
    rtf = stats.real_time_factor
    if rtf is not None:
        lines[0] += f" (real-time factor {rtf:.2f})"
    if stats.ttft_s is None:
        lines.append("time to first token: - (no words recognised)")
    else:
        lines.append(f"time to first token: {stats.ttft_s:.2f} s")
    latencies = stats.final_latencies_s
    if latencies:
        lines.append(
            f"final latency over {len(latencies)} final(s): "
            f"median {percentile(latencies, 50):.2f} s, p95 {percentile(latencies, 95):.2f} s, "
            f"max {max(latencies):.2f} s"
        )
        lines.append("  per final: " + " ".join(f"{x:.2f}" for x in latencies))
    else:
        lines.append("final latency: - (no finals with text)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- renderers


class TerminalRenderer:
    """Live captions: the partial line rewritten in place, finals printed as they land.

    ``width`` fixes the line width (tests); by default the terminal's width is read on every
    partial, so a resized window still gets lines that do not wrap.
    """

    def __init__(self, out: TextIO, *, width: int | None = None, color: bool = True) -> None:
        self._out = out
        self._width = width
        self._color = color
        self._partial_shown = False

    def _columns(self) -> int:
        width = self._width if self._width is not None else shutil.get_terminal_size().columns
        return max(1, width - 1)  # writing the last column makes some terminals wrap early

    def on_message(self, message: ServerMessage) -> None:
        """Rewrite the partial line, or replace it with a final."""
        if isinstance(message, PartialMessage):
            line = fit_tail(message.text.strip(), self._columns())
            styled = f"{_DIM}{line}{_RESET}" if self._color and line else line
            self._out.write(_ERASE_LINE + styled)
            self._partial_shown = True
        elif isinstance(message, FinalMessage):
            text = message.text.strip()
            if self._partial_shown:
                self._out.write(_ERASE_LINE)
                self._partial_shown = False
            if text:
                self._out.write(text + "\n")
        else:
            return
        self._out.flush()

    def close(self) -> None:
        """Erase a partial that no final replaced."""
        if self._partial_shown:
            self._out.write(_ERASE_LINE)
            self._partial_shown = False
            self._out.flush()


class TextRenderer:
    """Finals only, one per line."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def on_message(self, message: ServerMessage) -> None:
        """Write a final's text as a line."""
        if isinstance(message, FinalMessage) and message.text.strip():
            self._out.write(_cue_text(message.text) + "\n")
            self._out.flush()

    def close(self) -> None:
        """Nothing is pending."""


class JsonlRenderer:
    """Every server message as one line of JSON, flushed as it arrives."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def on_message(self, message: ServerMessage) -> None:
        """Write the message's JSON as a line."""
        self._out.write(message.to_json() + "\n")
        self._out.flush()

    def close(self) -> None:
        """Nothing is pending."""


class SrtRenderer:
    """Finals as SubRip cues, written as they land."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._index = 0

    def on_message(self, message: ServerMessage) -> None:
        """Write a final with text as the next cue."""
        if isinstance(message, FinalMessage) and message.text.strip():
            self._index += 1
            self._out.write(srt_cue(self._index, message.start, message.end, message.text))
            self._out.flush()

    def close(self) -> None:
        """Nothing is pending."""


class VttRenderer:
    """Finals as WebVTT cues, after the ``WEBVTT`` header, written as they land."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._header_written = False

    def _header(self) -> None:
        if not self._header_written:
            self._out.write("WEBVTT\n\n")
            self._header_written = True

    def on_message(self, message: ServerMessage) -> None:
        """Write a final with text as a cue."""
        if isinstance(message, FinalMessage) and message.text.strip():
            self._header()
            self._out.write(vtt_cue(message.start, message.end, message.text))
            self._out.flush()

    def close(self) -> None:
        """Make sure even a stream without speech gives a valid (empty) WebVTT file."""
        self._header()
        self._out.flush()


def make_renderer(fmt: str | None, out: TextIO) -> Renderer:
    """The renderer for ``--format``; None picks live captions on a terminal, else text.

    Raises:
        ValueError: ``fmt`` is not one of ``FORMATS``.
    """
    if fmt is None:
        fmt = "live" if out.isatty() else "text"
    if fmt == "live":
        return TerminalRenderer(out)
    if fmt == "text":
        return TextRenderer(out)
    if fmt == "jsonl":
        return JsonlRenderer(out)
    if fmt == "srt":
        return SrtRenderer(out)
    if fmt == "vtt":
        return VttRenderer(out)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
