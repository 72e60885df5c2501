"""Subtitle cues from timed words, the way broadcast subtitles are made. Pure: no I/O.

The rules, with the numbers in ``CueConfig`` (the BBC's and Netflix's timed-text guidelines
agree on them for English):

- **Layout.** A cue has at most two lines of at most 42 characters, and one line when its
  text fits on one. Two lines break after a sentence end, else after a clause end, else
  anywhere, where the two lengths are most even (the BBC's guidelines put the natural break
  before the even shape); a word longer than a line gets a line of its own.
- **Where a cue ends.** Words are gathered until the next one would not fit (characters,
  or more than 7 s from the first word's start to the last word's end); the gathered words
  are then split at the last sentence end, else the last clause end, else the longest pause
  between two words (the latest of equal pauses). Only split points that leave the cue at
  least 1 s on screen before the next word count, while there are any. A pause of 1 s or
  more between two words always ends a cue (text does not wait on screen through silence).
- **Timing.** A cue starts at its first word, and never before it. It stays at least 1 s,
  at least as long as its characters take to read at 20 characters a second, and until its
  last word ends; at most 7 s. It ends 2 frames (80 ms at 25 fps) before the next cue
  starts when the two would otherwise be closer than that, and is stretched to that point
  when the gap would be shorter than 0.5 s (chaining: no flicker between cues).

``CueBuilder`` takes words one at a time, as a live stream delivers them, and gives back a
cue only once nothing that comes later can change it. ``advance`` tells it that no word will
start before a time (after the end of an utterance), which lets it finish a cue without
waiting for the next word. The cues are the same whether words come one by one or all at
once: every decision waits until the words that could change it are known.

- **Speakers.** With speaker labels (a server with ``--speakers``), a cue holds one speaker's
  words: a change of speaker ends it. WebVTT marks every cue's voice (``<v S1>``); SubRip,
  which has no markup for it, starts the first line of a cue with ``[S1]`` where the speaker
  changes (room for the label is kept within the line's 42 characters).

``server/web/app.js`` builds the page's downloads with a port of this module; the browser
test checks that both give the same cues.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from server.protocol.messages import FinalMessage

SENTENCE_END = frozenset(".?!…。？！")
CLAUSE_END = frozenset(",;:–—、，；：")
# Closing quotes and brackets that may follow a sentence's or clause's punctuation.
_CLOSERS = "\"'”’»)]}"
# Unicode categories of a piece of text that belongs to the word before it when it opens a
# final: closing brackets, final quotes, and other punctuation (",", ".", "'s" pieces).
_JOINING_CATEGORIES = frozenset({"Pe", "Pf", "Po"})
_MIN_VISIBLE_S = 0.04  # one frame at 25 fps: a cue squeezed by its neighbours still shows


@dataclass(frozen=True)
class CueConfig:
    """Limits and timings of subtitle cues."""

    max_line_chars: int = 42  # characters per line (BBC, Netflix)
    max_lines: int = 2  # lines per cue: 1 or 2
    min_duration_s: float = 1.0  # shortest time a cue stays on screen
    max_duration_s: float = 7.0  # longest time a cue stays on screen
    min_gap_s: float = 0.08  # between two cues: 2 frames at 25 fps
    chain_gap_s: float = 0.5  # gaps shorter than this are closed to min_gap_s
    pause_break_s: float = 1.0  # a pause this long between words always ends a cue
    max_chars_per_s: float = 20.0  # reading speed a cue's duration allows for

    def __post_init__(self) -> None:
        if self.max_line_chars < 1:
            raise ValueError(f"max_line_chars must be >= 1; got {self.max_line_chars}")
        if self.max_lines not in (1, 2):
            raise ValueError(f"max_lines must be 1 or 2; got {self.max_lines}")
        if not 0 < self.min_duration_s <= self.max_duration_s:
            raise ValueError("need 0 < min_duration_s <= max_duration_s")
        if not 0 <= self.min_gap_s <= self.chain_gap_s:
            raise ValueError("need 0 <= min_gap_s <= chain_gap_s")
        if self.pause_break_s <= 0 or self.max_chars_per_s <= 0:
            raise ValueError("pause_break_s and max_chars_per_s must be > 0")


@dataclass(frozen=True)
class TimedWord:
    """A word as a subtitle shows it (its punctuation attached), with stream times.

    ``joins_previous``: the text belongs to the end of the word before it (a "," that a
    final opened with), with no space between.
    """

    text: str
    start_s: float
    end_s: float
    joins_previous: bool = False
    speaker: int | None = None  # who said it (0, 1, ...), with speaker labels


@dataclass(frozen=True)
class Cue:
    """One subtitle: what it shows and when."""

    start_s: float
    end_s: float
    lines: tuple[str, ...]
    first_word_s: float  # start of its first word (the cue never starts before it)
    last_word_s: float  # end of its last word
    speaker: int | None = None  # the speaker of all its words, with speaker labels
    speaker_changed: bool = False  # its speaker is not the previous cue's (SRT labels it)

    @property
    def text(self) -> str:
        """The lines joined with spaces."""
        return " ".join(self.lines)


# --------------------------------------------------------------------------- words


def _joins(piece: str) -> bool:
    return bool(piece) and unicodedata.category(piece[0]) in _JOINING_CATEGORIES


def _merge(words: list[TimedWord], piece: TimedWord) -> None:
    last = words[-1]
    words[-1] = replace(last, text=last.text + piece.text, end_s=max(last.end_s, piece.end_s))


def words_from_pieces(
    pieces: Iterable[tuple[str, float, float] | tuple[str, float, float, int | None]],
) -> list[TimedWord]:
    """Whisper's word timings as subtitle words.

    Each piece is ``(text, start_s, end_s)`` with Whisper's leading space, or with the
    speaker fourth; a piece without a leading space (a "," after " dinner", "-fatened" after
    " flower") belongs to the word before it.
    """
    words: list[TimedWord] = []
    for text, start_s, end_s, *speaker in pieces:
        piece = TimedWord(text.strip(), start_s, end_s, speaker=speaker[0] if speaker else None)
        if not piece.text:
            continue
        if words and not text[:1].isspace():
            _merge(words, piece)
        else:
            words.append(piece)
    return words


def words_from_final(final: FinalMessage) -> list[TimedWord]:
    """A final's words as subtitle words, their pieces joined the way its text spaces them.

    The wire's words have no leading space (``docs/protocol.md``), but the final's ``text``
    is their concatenation with Whisper's spaces, which tells a word from a piece of one. A
    final with text but no word times gets times spread over its span by length.
    """
    text = final.text
    if not final.words:
        return _estimated_words(text, final.start, final.end)
    words: list[TimedWord] = []
    pos = 0
    for w in final.words:
        piece = w.word.strip()
        if not piece:
            continue
        found = text.find(piece, pos)
        if found < 0:  # the text and the words disagree: space by punctuation
            spaced = not _joins(piece)
        else:
            spaced = found > pos
            pos = found + len(piece)
        word = TimedWord(piece, w.start, w.end, speaker=w.speaker)
        if not words:
            words.append(replace(word, joins_previous=_joins(piece)))
        elif spaced:
            words.append(word)
        else:
            _merge(words, word)
    return words or _estimated_words(text, final.start, final.end)


def _estimated_words(text: str, start_s: float, end_s: float) -> list[TimedWord]:
    tokens = text.split()
    total = sum(len(t) for t in tokens)
    words: list[TimedWord] = []
    at = 0
    for token in tokens:
        t0 = start_s + (end_s - start_s) * at / total
        at += len(token)
        t1 = start_s + (end_s - start_s) * at / total
        words.append(TimedWord(token, t0, t1, joins_previous=not words and _joins(token)))
    return words


def speaker_name(speaker: int) -> str:
    """How a speaker is shown: ``S1`` for the first (the wire counts from 0)."""
    return f"S{speaker + 1}"


def speaker_tag(speaker: int) -> str:
    """The label SubRip and the terminal put before a new speaker's words: ``[S1]``."""
    return f"[{speaker_name(speaker)}]"


def speaker_lines(words: Sequence[TimedWord]) -> str:
    """A transcript with speakers: a line per turn, led by its speaker's tag (``[S1] ...``)."""
    lines: list[str] = []
    current: int | None = None
    for word in words:
        if not lines or (word.speaker is not None and word.speaker != current):
            current = word.speaker
            lines.append("" if current is None else speaker_tag(current))
        lines[-1] = join_text(lines[-1], word.text)
    return "".join(line + "\n" for line in lines)


def join_text(before: str, after: str) -> str:
    """Two stretches of transcript joined with a space, or without one when ``after`` opens
    with punctuation that belongs to ``before`` (a final holding only ",")."""
    if not before or not after:
        return before or after
    return before + after if _joins(after) else before + " " + after


# --------------------------------------------------------------------------- layout


def _ends_with(text: str, marks: frozenset[str]) -> bool:
    core = text.rstrip(_CLOSERS)
    return bool(core) and core[-1] in marks


def ends_sentence(text: str) -> bool:
    """Whether a word ends a sentence ("modern.", "way?\"")."""
    return _ends_with(text, SENTENCE_END)


def ends_clause(text: str) -> bool:
    """Whether a word ends a clause ("concerned,", "then;")."""
    return _ends_with(text, CLAUSE_END)


def layout(words: Sequence[str], config: CueConfig) -> tuple[str, ...] | None:
    """The lines of a cue holding ``words``, or None when they do not fit in it.

    Two lines break after a sentence end if one fits, else after a clause end, else
    anywhere; the most even break of the best kind wins. One word always fits, on a line of
    its own however long.
    """
    limit = config.max_line_chars
    text = " ".join(words)
    if len(text) <= limit or len(words) == 1:
        return (text,)
    if config.max_lines < 2:
        return None
    best: tuple[int, int, str, str] | None = None
    for i in range(1, len(words)):
        top, bottom = " ".join(words[:i]), " ".join(words[i:])
        if len(top) > limit or len(bottom) > limit:
            continue
        kind = 0 if ends_sentence(words[i - 1]) else 1 if ends_clause(words[i - 1]) else 2
        cost = (kind, abs(len(top) - len(bottom)))
        if best is None or cost < best[:2]:
            best = (*cost, top, bottom)
    return None if best is None else (best[2], best[3])


def _wrapped(words: Sequence[str], config: CueConfig) -> tuple[str, ...]:
    """Lines for words that ``layout`` refuses: greedy wrapping, as many lines as it takes.

    Only a piece of punctuation joined onto a full cue's last word gets here.
    """
    lines: list[str] = []
    for word in words:
        if lines and len(lines[-1]) + 1 + len(word) <= config.max_line_chars:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return tuple(lines)


# --------------------------------------------------------------------------- cues


def _pause(before: TimedWord, after: TimedWord) -> float:
    return max(0.0, after.start_s - before.end_s)


class CueBuilder:
    """Cues from words that arrive in time order; see the module docstring for the rules."""

    def __init__(self, config: CueConfig | None = None) -> None:
        self._config = config or CueConfig()
        self._open: list[TimedWord] = []  # the cue being gathered
        self._closed: list[list[TimedWord]] = []  # settled text, waiting for the next start
        self._no_words_before_s = -math.inf
        self._last_end_s: float | None = None  # end of the last cue given out
        self._last_word: TimedWord | None = None
        self._closed_speaker: int | None = None  # of the last words closed into a cue
        self._emitted_speaker: int | None = None  # of the last cue given out

    @property
    def config(self) -> CueConfig:
        return self._config

    def add_word(self, word: TimedWord) -> list[Cue]:
        """Take the next word; returns the cues it completed, in order."""
        word = self._in_order(word)
        if word.joins_previous and self._open:
            merged = replace(
                self._open[-1],
                text=self._open[-1].text + word.text,
                end_s=max(self._open[-1].end_s, word.end_s),
            )
            if self._fits([*self._open[:-1], merged]):
                self._open[-1] = merged
                self._last_word = merged
                return self._ready()
            word = replace(merged, joins_previous=False)
            self._open.pop()
        if self._open and (
            self._breaks_before(word.start_s) or word.speaker != self._open[-1].speaker
        ):
            self._close(len(self._open))
        while self._open and not self._fits([*self._open, word]):
            self._close(self._split_point(word))
        self._open.append(word)
        self._last_word = word
        return self._ready()

    def advance(self, no_words_before_s: float) -> list[Cue]:
        """No word will start before ``no_words_before_s`` (an utterance ended); returns the
        cues that this completes."""
        self._no_words_before_s = max(self._no_words_before_s, no_words_before_s)
        if self._open and self._breaks_before(self._no_words_before_s):
            self._close(len(self._open))
        return self._ready()

    def finish(self) -> list[Cue]:
        """No more words: the remaining cues."""
        if self._open:
            self._close(len(self._open))
        cues = self._ready()
        while self._closed:
            cues.append(self._emit(self._closed.pop(0), None))
        return cues

    # -- decisions -------------------------------------------------------------------------

    def _in_order(self, word: TimedWord) -> TimedWord:
        # Word times only grow along a stream; a seam between two sessions can step back a
        # few milliseconds, and a cue must not start before the one it follows.
        last = self._last_word
        start = word.start_s if last is None else max(word.start_s, last.start_s)
        return replace(word, start_s=start, end_s=max(word.end_s, start))

    def _breaks_before(self, next_start_s: float) -> bool:
        """Whether a pause up to ``next_start_s`` ends the open cue."""
        c = self._config
        return (
            next_start_s - self._open[-1].end_s >= c.pause_break_s
            and next_start_s - self._open[0].start_s >= c.min_duration_s + c.min_gap_s
        )

    def _fits(self, words: Sequence[TimedWord]) -> bool:
        if len(words) > 1 and words[-1].end_s - words[0].start_s > self._config.max_duration_s:
            return False
        return layout(self._texts(words, self._closed_speaker), self._config) is not None

    @staticmethod
    def _texts(words: Sequence[TimedWord], speaker_before: int | None) -> list[str]:
        """The words' texts, the first led by its speaker's tag when the speaker changes
        there (SubRip shows it: the lines keep room for it)."""
        texts = [w.text for w in words]
        first = words[0].speaker if words else None
        if first is not None and first != speaker_before:
            texts[0] = f"{speaker_tag(first)} {texts[0]}"
        return texts

    def _split_point(self, word: TimedWord) -> int:
        """How many of the open words the cue takes, ``word`` being the one that overflows."""
        c = self._config
        words = self._open
        n = len(words)

        def next_start(i: int) -> float:
            return words[i].start_s if i < n else word.start_s

        def pause_at(i: int) -> float:
            return _pause(words[i - 1], words[i] if i < n else word)

        points = range(1, n + 1)
        roomy = [
            i for i in points if next_start(i) - words[0].start_s >= c.min_duration_s + c.min_gap_s
        ]
        candidates = roomy or list(points)
        for ends in (ends_sentence, ends_clause):
            found = [i for i in candidates if ends(words[i - 1].text)]
            if found:
                return found[-1]
        return max(candidates, key=lambda i: (pause_at(i), i))

    def _close(self, count: int) -> None:
        self._closed.append(self._open[:count])
        self._closed_speaker = self._open[count - 1].speaker
        self._open = self._open[count:]

    # -- timing ----------------------------------------------------------------------------

    def _ready(self) -> list[Cue]:
        """The closed cues whose timing is decided."""
        cues: list[Cue] = []
        while self._closed:
            words = self._closed[0]
            if len(self._closed) > 1:
                next_start: float | None = self._closed[1][0].start_s
            elif self._open:
                next_start = self._open[0].start_s
            else:
                # Only a bound on the next word: enough when the next cue cannot come close
                # enough to change this one's end.
                _, desired = self._span(words)
                if self._no_words_before_s - desired < self._config.chain_gap_s:
                    break
                next_start = None
            cues.append(self._emit(self._closed.pop(0), next_start))
        return cues

    def _span(self, words: Sequence[TimedWord]) -> tuple[float, float]:
        """Start and wished-for end of a cue, before its neighbour has a say."""
        c = self._config
        start = words[0].start_s
        if self._last_end_s is not None:
            start = max(start, self._last_end_s + c.min_gap_s)
        chars = len(" ".join(w.text for w in words))
        end = max(words[-1].end_s, start + c.min_duration_s, start + chars / c.max_chars_per_s)
        return start, end

    def _emit(self, words: list[TimedWord], next_start_s: float | None) -> Cue:
        c = self._config
        start, end = self._span(words)
        if next_start_s is not None and next_start_s - end < c.chain_gap_s:
            end = next_start_s - c.min_gap_s
        end = max(min(end, start + c.max_duration_s), start + _MIN_VISIBLE_S)
        self._last_end_s = end
        speaker = words[0].speaker
        changed = speaker is not None and speaker != self._emitted_speaker
        self._emitted_speaker = speaker
        texts = self._texts(words, None if changed else speaker)
        lines = layout(texts, c) or _wrapped(texts, c)
        if changed:
            assert speaker is not None
            tag = speaker_tag(speaker) + " "
            lines = (lines[0].removeprefix(tag), *lines[1:])  # SubRip puts it back
        return Cue(start, end, lines, words[0].start_s, words[-1].end_s, speaker, changed)


def build_cues(words: Iterable[TimedWord], config: CueConfig | None = None) -> list[Cue]:
    """All cues of a finished transcript."""
    builder = CueBuilder(config)
    cues: list[Cue] = []
    for word in words:
        cues.extend(builder.add_word(word))
    cues.extend(builder.finish())
    return cues


# --------------------------------------------------------------------------- file formats


def _split_ms(seconds: float) -> tuple[int, int, int, int]:
    # floor(x + 0.5) rather than round(): half-way values round up, as in the page's copy
    # of this code (JavaScript's Math.round), so both write the same times.
    total_ms = max(0, math.floor(seconds * 1000 + 0.5))  # negative: a clock glitch, clamped
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


def _clean(line: str) -> str:
    # A blank line ends a cue in both formats: a line never holds a line break.
    return " ".join(line.split())


def srt_cue(index: int, cue: Cue) -> str:
    """One SubRip cue, numbered from 1, with its trailing blank line."""
    times = f"{format_srt_timestamp(cue.start_s)} --> {format_srt_timestamp(cue.end_s)}"
    lines = [_clean(line) for line in cue.lines]
    if cue.speaker_changed and cue.speaker is not None and lines:
        lines[0] = f"{speaker_tag(cue.speaker)} {lines[0]}"
    text = "\n".join(lines)
    return f"{index}\n{times}\n{text}\n\n"


VTT_HEADER = "WEBVTT\n\n"


def vtt_cue(cue: Cue) -> str:
    """One WebVTT cue with its trailing blank line; ``&``, ``<`` and ``>`` are escaped. A cue
    with a speaker is one voice span (``<v S1>...</v>``)."""
    times = f"{format_vtt_timestamp(cue.start_s)} --> {format_vtt_timestamp(cue.end_s)}"
    text = "\n".join(
        _clean(line).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        for line in cue.lines
    )
    if cue.speaker is not None:
        text = f"<v {speaker_name(cue.speaker)}>{text}</v>"
    return f"{times}\n{text}\n\n"


def srt_document(cues: Sequence[Cue]) -> str:
    """A whole SubRip file."""
    return "".join(srt_cue(i, cue) for i, cue in enumerate(cues, 1))


def vtt_document(cues: Sequence[Cue]) -> str:
    """A whole WebVTT file, header included (an empty file is just the header)."""
    return VTT_HEADER + "".join(vtt_cue(cue) for cue in cues)
