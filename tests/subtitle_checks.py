"""Subtitle files read back strictly, and cues checked against the rules of
``client/subtitles.py``; shared by the tests of the renderers, the CLI and the cue builder.

The readers accept only what the formats allow: SubRip blocks of a number counting from 1,
a timing line and text lines, one blank line after each; WebVTT's ``WEBVTT`` header line
and blank line, timing lines with ``-->``, cue text without blank lines, ``-->`` or raw
``<``/``&``, cues separated by blank lines (the WebVTT spec, sections 4.1 and 6.1).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from client.subtitles import CueConfig, TimedWord

MS_TOLERANCE_S = 0.0015  # two times each rounded to the millisecond
_SRT_TIMES = re.compile(
    r"(\d{2,}):([0-5]\d):([0-5]\d),(\d{3}) --> (\d{2,}):([0-5]\d):([0-5]\d),(\d{3})"
)
_VTT_TIMES = re.compile(
    r"(\d{2,}):([0-5]\d):([0-5]\d)\.(\d{3}) --> (\d{2,}):([0-5]\d):([0-5]\d)\.(\d{3})(?: .*)?"
)
_VTT_ENTITY = re.compile(r"&(amp|lt|gt|nbsp|lrm|rlm);")
_VTT_VOICE = re.compile(r"<v ([^>]+)>")


@dataclass(frozen=True)
class ReadCue:
    """A cue as a file holds it."""

    start_s: float
    end_s: float
    lines: tuple[str, ...]
    voice: str | None = None  # WebVTT: the cue's voice span (<v S1>...</v>), without it

    @property
    def text(self) -> str:
        return " ".join(self.lines)


def _seconds(h: str, m: str, s: str, ms: str) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def _times(match: re.Match[str]) -> tuple[float, float]:
    g = match.groups()
    return _seconds(*g[0:4]), _seconds(*g[4:8])


def read_srt(text: str) -> list[ReadCue]:
    """The cues of a SubRip file; AssertionError names the first block that is not one."""
    if not text:
        return []
    assert text.endswith("\n\n") and not text.endswith("\n\n\n"), repr(text[-40:])
    cues = []
    for n, block in enumerate(text[:-2].split("\n\n"), 1):
        lines = block.split("\n")
        assert len(lines) >= 3, f"SRT block {n} needs number, times and text: {block!r}"
        assert lines[0] == str(n), f"SRT block {n} is numbered {lines[0]!r}"
        times = _SRT_TIMES.fullmatch(lines[1])
        assert times is not None, f"SRT block {n}: bad timing line {lines[1]!r}"
        assert all(line.strip() == line and line for line in lines[2:]), block
        cues.append(ReadCue(*_times(times), tuple(lines[2:])))
    return cues


def read_vtt(text: str) -> list[ReadCue]:
    """The cues of a WebVTT file; AssertionError says what is not WebVTT."""
    assert text.startswith("WEBVTT\n\n") or text == "WEBVTT\n", repr(text[:40])
    body = text[len("WEBVTT\n") :].lstrip("\n")
    cues = []
    for block in re.split(r"\n{2,}", body.rstrip("\n")) if body else []:
        lines = block.split("\n")
        if "-->" not in lines[0]:  # an optional cue identifier
            lines = lines[1:]
        times = _VTT_TIMES.fullmatch(lines[0]) if lines else None
        assert times is not None, f"not a WebVTT cue: {block!r}"
        payload = lines[1:]
        assert payload and all(line.strip() for line in payload), block
        voice = _VTT_VOICE.match(payload[0])
        if voice is not None:  # a voice span around the whole cue
            assert payload[-1].endswith("</v>"), block
            payload = "\n".join(payload)[voice.end() : -len("</v>")].split("\n")
        for line in payload:
            assert "-->" not in line and "<" not in line, line
            assert "&" not in _VTT_ENTITY.sub("", line), f"unescaped & in {line!r}"
        unescaped = tuple(
            line.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&") for line in payload
        )
        cues.append(ReadCue(*_times(times), unescaped, voice[1] if voice else None))
    return cues


def rule_violations(
    cues: Sequence[ReadCue],
    config: CueConfig,
    words: Sequence[TimedWord] | None = None,
) -> list[str]:
    """Every way ``cues`` break the cue rules; with ``words`` (the transcript's words, in
    order), also every cue that starts before its first word, a word missing or repeated,
    and a cue holding a pause that should have ended it."""
    problems: list[str] = []
    for i, cue in enumerate(cues):
        where = f"cue {i + 1} {cue.start_s:.3f}-{cue.end_s:.3f} {cue.text!r}"
        if len(cue.lines) > config.max_lines:
            problems.append(f"{where}: {len(cue.lines)} lines")
        for line in cue.lines:
            if len(line) > config.max_line_chars and " " in line:
                problems.append(f"{where}: a line of {len(line)} characters")
        duration = cue.end_s - cue.start_s
        if duration > config.max_duration_s + MS_TOLERANCE_S:
            problems.append(f"{where}: {duration:.3f} s on screen")
        if duration < config.min_duration_s - MS_TOLERANCE_S:
            problems.append(f"{where}: only {duration:.3f} s on screen")
        if i and cue.start_s - cues[i - 1].end_s < config.min_gap_s - MS_TOLERANCE_S:
            problems.append(f"{where}: {cue.start_s - cues[i - 1].end_s:.3f} s after the last")
    if words is not None:
        problems.extend(_word_violations(cues, config, words))
    return problems


def _merged(words: Sequence[TimedWord]) -> list[TimedWord]:
    """Pieces that join the word before them, joined (as the cue builder does)."""
    out: list[TimedWord] = []
    for w in words:
        if w.joins_previous and out:
            out[-1] = replace(
                out[-1], text=out[-1].text + w.text, end_s=max(out[-1].end_s, w.end_s)
            )
        else:
            out.append(w)
    return out


def _word_violations(
    cues: Sequence[ReadCue], config: CueConfig, words: Sequence[TimedWord]
) -> list[str]:
    words = _merged(words)
    shown = [w for cue in cues for w in cue.text.split()]
    expected = [w.text for w in words]
    if shown != expected:
        first = next(
            (k for k, (a, b) in enumerate(zip(shown, expected, strict=False)) if a != b),
            min(len(shown), len(expected)),
        )
        got, want = shown[first : first + 5], expected[first : first + 5]
        return [f"cue words differ from the transcript's at word {first}: {got} != {want}"]
    problems = []
    at = 0
    for i, cue in enumerate(cues):
        count = len(cue.text.split())
        mine = words[at : at + count]
        at += count
        if cue.start_s < mine[0].start_s - MS_TOLERANCE_S:
            problems.append(f"cue {i + 1} starts at {cue.start_s} before its word {mine[0]}")
        for a, b in itertools.pairwise(mine):
            if b.start_s - a.end_s >= config.pause_break_s and (
                b.start_s - mine[0].start_s >= config.min_duration_s + config.min_gap_s
            ):
                problems.append(f"cue {i + 1} holds a {b.start_s - a.end_s:.2f} s pause")
    return problems
