"""Renderers: turn server messages into live terminal captions, text, JSON lines, SRT or VTT.

A renderer gets every server message through ``on_message`` and ``close`` at the end, and
writes to the text stream it was given. Cue building lives in ``client.subtitles``; what is
here is the I/O around it and the terminal's line layout.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import unicodedata
from collections import deque
from collections.abc import Sequence
from typing import Protocol, TextIO

from client.stream import StreamStats
from client.subtitles import (
    VTT_HEADER,
    Cue,
    CueBuilder,
    CueConfig,
    ends_sentence,
    join_text,
    speaker_tag,
    srt_cue,
    vtt_cue,
    words_from_final,
)
from server.protocol.messages import (
    DoneMessage,
    FinalMessage,
    PartialMessage,
    ReadyMessage,
    ServerMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
)

FORMATS = ("live", "text", "jsonl", "srt", "vtt")
LONG_LINE_ROWS = 2  # a live caption line this many rows long ends at its next sentence end

_ERASE_ROW = "\r\x1b[2K"  # carriage return, then ANSI "erase entire line"
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


# --------------------------------------------------------------------------- pure helpers


def display_width(text: str) -> int:
    """Terminal columns ``text`` takes: wide (CJK) characters take two, combining marks none."""
    return sum(_char_width(c) for c in text)


def _char_width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def fit_tail(text: str, columns: int, ellipsis: str = "…") -> str:
    """The end of ``text`` that fits in ``columns``, led by ``ellipsis`` when cut."""
    if display_width(text) <= columns:
        return text
    kept: list[str] = []
    used = display_width(ellipsis)
    for char in reversed(text):
        width = _char_width(char)
        if used + width > columns:
            break
        kept.append(char)
        used += width
    return ellipsis + "".join(reversed(kept)) if columns >= display_width(ellipsis) else ""


def wrap_words(words: Sequence[str], columns: int) -> list[str]:
    """``words`` in rows of at most ``columns``; a word wider than a row is cut across rows."""
    rows = [""]
    for word in words:
        while display_width(word) > columns:  # a URL in a narrow window
            if rows[-1]:
                rows.append("")
            head = fit_head(word, columns)
            rows[-1] = head
            rows.append("")
            word = word[len(head) :]
        if not word:
            continue
        joined = f"{rows[-1]} {word}" if rows[-1] else word
        if display_width(joined) <= columns:
            rows[-1] = joined
        else:
            rows.append(word)
    if len(rows) > 1 and not rows[-1]:
        rows.pop()
    return rows


def fit_head(text: str, columns: int) -> str:
    """The start of ``text`` that fits in ``columns`` (at least one character)."""
    used = 0
    for i, char in enumerate(text):
        used += _char_width(char)
        if used > columns:
            return text[: max(i, 1)]
    return text


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


def _sentences(text: str) -> list[str]:
    """``text`` cut after each word that ends a sentence."""
    pieces: list[str] = []
    start = 0
    words = text.split(" ") if text else []
    for i, word in enumerate(words):
        if ends_sentence(word) or i == len(words) - 1:
            pieces.append(" ".join(words[start : i + 1]))
            start = i + 1
    return pieces


def _encoder(out: TextIO) -> tuple[str, bool]:
    """The stream's encoding, and whether it can write "…" (false for ASCII, Latin-1)."""
    encoding = getattr(out, "encoding", None) or "utf-8"
    try:
        "…".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return encoding, False
    return encoding, True


# --------------------------------------------------------------------------- utterances


class UtteranceTracker:
    """Tells from the messages when an utterance's text is all in.

    ``speech_ended`` usually comes before the utterance's last finals: they are decoded
    after the voice activity detector closed it. The server decodes utterances in order and
    starts each where the last one ended, so the first final or partial that starts at or
    after an utterance's end shows it is over. A new session (``ready`` after a reconnect)
    or ``done`` ends every utterance before it.
    """

    def __init__(self) -> None:
        # Utterances not known to be over: (start, end), end None while speech goes on.
        self._open: deque[tuple[float, float | None]] = deque()

    def observe(self, message: ServerMessage) -> float | None:
        """None, or, when ``message`` shows that an utterance is over, the stream time no
        later word starts before (``-inf`` when that is not known)."""
        if isinstance(message, SpeechStartedMessage):
            if self._open and self._open[-1][1] is None:  # a session that died mid-speech
                self._open[-1] = (self._open[-1][0], message.start)
            self._open.append((message.start, None))
        elif isinstance(message, SpeechEndedMessage):
            if self._open and self._open[-1][1] is None:
                self._open[-1] = (self._open[-1][0], message.end)
            else:
                self._open.append((message.end, message.end))
        elif isinstance(message, (FinalMessage, PartialMessage)):
            return self._ended_before(message.start)
        elif isinstance(message, ReadyMessage):
            # Words of a resumed session start no earlier than the audio it resumed from.
            if self._open:
                self._open.clear()
                return message.audio_received_s
        elif isinstance(message, DoneMessage):
            self._open.clear()
            return -math.inf
        return None

    def _ended_before(self, start_s: float) -> float | None:
        over: float | None = None
        while self._open:
            end = self._open[0][1]
            if end is None or start_s < end:
                break
            self._open.popleft()
            over = end
        if over is None:
            return None
        return max(over, self._open[0][0]) if self._open else over


# --------------------------------------------------------------------------- renderers


def language_tag(final: FinalMessage, current: str | None) -> str:
    """ "[de] " before the first final in a detected language, and at each switch; "" for the
    rest, and for sessions that do not detect their language."""
    if final.language is None or final.language == current:
        return ""
    return f"[{final.language}] "


def speaker_tagged(final: FinalMessage, current: int | None) -> tuple[str, int | None]:
    """A final's text with ``[S1]`` before each word where the speaker changes from
    ``current`` (the last one shown), and the speaker it ends with. A final without speaker
    labels is its text, and leaves ``current`` as it was."""
    words = words_from_final(final) if final.words else []
    if not any(w.speaker is not None for w in words):
        return " ".join(final.text.split()), current
    parts: list[str] = []
    for word in words:
        if word.speaker is not None and word.speaker != current:
            current = word.speaker
            parts.append(speaker_tag(current))
        parts.append(word.text)
    return " ".join(parts), current


def opens_with_new_speaker(final: FinalMessage, current: int | None) -> bool:
    """Whether a final's first word is another speaker's than ``current``: its line starts
    afresh (a conversation reads as one line per turn)."""
    first = final.words[0].speaker if final.words else None
    return first is not None and current is not None and first != current


class TerminalRenderer:
    """Live captions that flow: finals fill the line, wrapped at the terminal's width, with
    the partial after them, dimmed and redrawn in place.

    A line ends where an utterance ends, or at a sentence end once it is
    ``LONG_LINE_ROWS`` rows long. What is redrawn is the live region: the cursor's row
    (the line's last finals) and, when the partial does not fit after them, one row below
    for the rest of it (its newest words, when even that is too short). Rows above it are
    never touched again. ``width`` fixes the width (tests); by default it is read from the
    terminal at every redraw and on ``resized`` (SIGWINCH).
    """

    def __init__(self, out: TextIO, *, width: int | None = None, color: bool = True) -> None:
        self._out = out
        self._fixed_width = width
        self._color = color
        self._encoding, unicode_ok = _encoder(out)
        self._ellipsis = "…" if unicode_ok else "..."
        self._tracker = UtteranceTracker()
        self._row = ""  # finals on the live region's first row
        self._rows_above = 0  # rows of the current line above the live region
        self._partial = ""
        self._drawn: list[int] = [0]  # columns each row of the live region shows
        self._width = self._query_width()
        self._language: str | None = None  # of the last final, when the server detects it
        self._speaker: int | None = None  # of the last final's last word, with speaker labels

    def _query_width(self) -> int:
        if self._fixed_width is not None:
            return self._fixed_width
        try:
            return os.get_terminal_size(self._out.fileno()).columns
        except (OSError, ValueError, io.UnsupportedOperation):
            return shutil.get_terminal_size().columns

    def _safe(self, text: str) -> str:
        # What the terminal's encoding cannot show becomes "?", counted as the column it takes.
        return text.encode(self._encoding, "replace").decode(self._encoding)

    def on_message(self, message: ServerMessage) -> None:
        """Flow a final into the line, or redraw the partial after it."""
        if self._tracker.observe(message) is not None:
            self._end_line()
        if isinstance(message, PartialMessage):
            self._partial = self._safe(" ".join(message.text.split()))
            self._draw()
        elif isinstance(message, FinalMessage):
            self._partial = ""
            if opens_with_new_speaker(message, self._speaker):
                self._end_line()
            spoken, self._speaker = speaker_tagged(message, self._speaker)
            text = language_tag(message, self._language) + spoken
            self._language = message.language or self._language
            for sentence in _sentences(self._safe(text)):
                self._add(sentence)
                if self._rows_above + 1 >= LONG_LINE_ROWS and ends_sentence(sentence):
                    self._end_line()
            self._draw()

    def resized(self) -> None:
        """The terminal changed size (SIGWINCH): redraw the live region at the new width."""
        self._draw()

    def close(self) -> None:
        """End the last line; a partial that no final replaced is erased."""
        self._partial = ""
        if self._row or self._rows_above:
            self._end_line()
        elif any(self._drawn):
            self._draw()

    def _columns(self) -> int:
        return max(1, self._width - 1)  # writing the last column makes some terminals wrap

    def _add(self, text: str) -> None:
        """Append a final's text to the line, finishing rows that fill up."""
        row = join_text(self._row, text) if self._row else text
        rows = wrap_words(row.split(" "), self._columns())
        if len(rows) > 1:
            self._out.write(self._erase())
            for finished in rows[:-1]:
                self._out.write(finished + "\n")
                self._rows_above += 1
            self._drawn = [0]
        self._row = rows[-1]

    def _end_line(self) -> None:
        if not self._row and not self._rows_above:
            return
        self._partial = ""
        self._draw()
        self._out.write("\n")
        self._row = ""
        self._rows_above = 0
        self._drawn = [0]
        self._out.flush()

    def _erase(self) -> str:
        """To the start of the live region, its rows erased. After the window shrank, a
        terminal that reflows (tmux, VTE, kitty, iTerm2) has split each row that no longer
        fits into several: those are erased too."""
        width = self._query_width()
        if width < self._width:
            rows = sum(max(1, math.ceil(w / width)) for w in self._drawn)
        else:
            rows = len(self._drawn)
        self._width = width
        up = rows - 1
        if not up:
            return _ERASE_ROW
        # Row by row rather than "erase down": tmux keeps a screen erased from its top row in
        # the scrollback (scroll-on-clear), which would keep the stale rows there.
        return f"\r\x1b[{up}A" + "\x1b[2K\x1b[B" * up + f"\x1b[2K\x1b[{up}A"

    def _dim(self, text: str) -> str:
        return f"{_DIM}{text}{_RESET}" if self._color and text else text

    def _draw(self) -> None:
        out = [self._erase()]
        cols = self._columns()
        if display_width(self._row) > cols:  # narrower than when the row was written
            rows = wrap_words(self._row.split(" "), cols)
            out.extend(r + "\n" for r in rows[:-1])
            self._rows_above += len(rows) - 1
            self._row = rows[-1]
        sep = " " if self._row and self._partial else ""
        room = cols - display_width(self._row) - len(sep)
        words = self._partial.split(" ") if self._partial else []
        here: list[str] = []  # the partial's words that fit after the finals
        while words and display_width(" ".join([*here, words[0]])) <= room:
            here.append(words.pop(0))
        if words and not here and not self._row:
            rest = fit_tail(" ".join(words), cols, self._ellipsis)  # one row, newest words
            out.append(self._dim(rest))
            self._drawn = [display_width(rest)]
        elif words:
            rest = fit_tail(" ".join(words), cols, self._ellipsis)
            first = self._row + (sep if here else "") + self._dim(" ".join(here))
            out.append(f"{first}\n{self._dim(rest)}")
            shown = self._row + (sep + " ".join(here) if here else "")
            self._drawn = [display_width(shown), display_width(rest)]
        else:
            out.append(self._row + sep + self._dim(" ".join(here)))
            self._drawn = [display_width(self._row + sep + " ".join(here))]
        self._out.write("".join(out))
        self._out.flush()


class TextRenderer:
    """One line per utterance, written once the utterance is over; nothing is redrawn."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._tracker = UtteranceTracker()
        self._line = ""
        self._language: str | None = None  # of the last final, when the server detects it
        self._speaker: int | None = None  # of the last final's last word, with speaker labels

    def on_message(self, message: ServerMessage) -> None:
        """Gather a final's text; write the line when its utterance is over (or another
        speaker's final begins)."""
        if self._tracker.observe(message) is not None:
            self._write_line()
        if isinstance(message, FinalMessage):
            if opens_with_new_speaker(message, self._speaker):
                self._write_line()
            spoken, self._speaker = speaker_tagged(message, self._speaker)
            text = language_tag(message, self._language) + spoken
            self._language = message.language or self._language
            self._line = join_text(self._line, text)

    def close(self) -> None:
        """Write the last line."""
        self._write_line()

    def _write_line(self) -> None:
        if self._line:
            self._out.write(self._line + "\n")
            self._out.flush()
            self._line = ""


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


class SubtitleRenderer:
    """SubRip or WebVTT cues from the finals' word times (``client.subtitles``), each
    written once it is complete: when the words after it are known, or its utterance is over
    and nothing later could change it."""

    def __init__(self, out: TextIO, fmt: str, config: CueConfig | None = None) -> None:
        if fmt not in ("srt", "vtt"):
            raise ValueError(f"subtitle format must be srt or vtt; got {fmt!r}")
        self._out = out
        self._fmt = fmt
        self._builder = CueBuilder(config)
        self._tracker = UtteranceTracker()
        self._written = 0
        self._header_written = False

    def on_message(self, message: ServerMessage) -> None:
        """Feed a final's words to the cue builder; write the cues it completes."""
        cues: list[Cue] = []
        ended = self._tracker.observe(message)
        if ended is not None:
            cues.extend(self._builder.advance(ended))
        if isinstance(message, FinalMessage):
            for word in words_from_final(message):
                cues.extend(self._builder.add_word(word))
        self._write(cues)

    def close(self) -> None:
        """Write the last cues (a VTT file without any is still valid: just its header)."""
        self._write(self._builder.finish())
        self._header()
        self._out.flush()

    def _header(self) -> None:
        if self._fmt == "vtt" and not self._header_written:
            self._out.write(VTT_HEADER)
            self._header_written = True

    def _write(self, cues: Sequence[Cue]) -> None:
        if not cues:
            return
        self._header()
        for cue in cues:
            self._written += 1
            self._out.write(srt_cue(self._written, cue) if self._fmt == "srt" else vtt_cue(cue))
        self._out.flush()


def color_wanted(environ: dict[str, str] | None = None) -> bool:
    """False when ``NO_COLOR`` is set to anything (no-color.org) or the terminal is dumb."""
    env = os.environ if environ is None else environ
    return not env.get("NO_COLOR") and env.get("TERM") != "dumb"


def make_renderer(fmt: str | None, out: TextIO, *, color: bool | None = None) -> Renderer:
    """The renderer for ``--format``; None picks live captions on a terminal that can move
    its cursor, else text.

    Raises:
        ValueError: ``fmt`` is not one of ``FORMATS``.
    """
    if fmt is None:
        fmt = "live" if out.isatty() and os.environ.get("TERM") != "dumb" else "text"
    if fmt == "live":
        return TerminalRenderer(out, color=color_wanted() if color is None else color)
    if fmt == "text":
        return TextRenderer(out)
    if fmt == "jsonl":
        return JsonlRenderer(out)
    if fmt in ("srt", "vtt"):
        return SubtitleRenderer(out, fmt)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
