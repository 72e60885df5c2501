"""Streaming latency metrics from a timeline of what a client was shown (pure: no I/O, no model).

Both servers' messages are reduced to the same timeline of ``Observation``s -- the finalised
words so far and the tentative words shown after them, at the wall time the client saw
them -- so one set of functions measures ours and the peer alike:

- time to first token: speech onset (the first reference word's start) to the first
  observation showing any word;
- word emission latency: for each reference word, from when the audio at its end was sent
  to its first appearance in what was shown, and to its finalisation;
- end of speech to final: the same finalisation latency, for the last word of each utterance;
- flicker: words shown and later changed, over tentative words shown.

Hypothesis words are matched to reference words by sequence alignment on normalised words
(``difflib.SequenceMatcher``), never by position: a dropped or inserted word must not shift
every later match.
"""

from __future__ import annotations

import bisect
import difflib
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

_TIME_EPSILON_S = 1e-6
_NON_WORD = re.compile(r"[^a-z0-9]+")


@dataclass(frozen=True)
class RefWord:
    """A word of the reference timeline: offline transcription with word timestamps."""

    word: str
    start_s: float  # stream time
    end_s: float


@dataclass(frozen=True)
class Observation:
    """What the client showed at ``wall_s``: all finalised words, then the tentative ones."""

    wall_s: float
    final_words: tuple[str, ...]
    tentative_words: tuple[str, ...]

    @property
    def shown(self) -> tuple[str, ...]:
        return self.final_words + self.tentative_words


@dataclass
class SendLog:
    """When each audio frame left the client: maps stream time back to wall time."""

    frame_ends_s: list[float] = field(default_factory=list)
    walls_s: list[float] = field(default_factory=list)

    def sent(self, duration_s: float, wall_s: float) -> None:
        end = (self.frame_ends_s[-1] if self.frame_ends_s else 0.0) + duration_s
        self.frame_ends_s.append(end)
        self.walls_s.append(wall_s)

    @property
    def audio_s(self) -> float:
        return self.frame_ends_s[-1] if self.frame_ends_s else 0.0

    def sent_at(self, stream_s: float) -> float:
        """Wall time the frame holding the audio at ``stream_s`` was sent (past the end: the
        last frame)."""
        if not self.walls_s:
            raise ValueError("no audio was sent")
        # Summed frame ends drift (ten 0.1 s frames add up to 0.9999999999999999).
        i = bisect.bisect_left(self.frame_ends_s, stream_s - _TIME_EPSILON_S)
        return self.walls_s[min(i, len(self.walls_s) - 1)]

    def audio_sent_by(self, wall_s: float) -> float:
        """Seconds of audio sent at or before ``wall_s``."""
        i = bisect.bisect_right(self.walls_s, wall_s)
        return self.frame_ends_s[i - 1] if i else 0.0


def normalize_word(word: str) -> str:
    """Lower case, letters and digits only: both sides come from Whisper, so punctuation and
    case are the only differences that matter for matching."""
    return _NON_WORD.sub("", word.lower())


def words_of(text: str) -> tuple[str, ...]:
    """The words of ``text`` that survive normalisation, in their shown form."""
    return tuple(w for w in text.split() if normalize_word(w))


def join_word_pieces(words: Sequence[RefWord]) -> list[RefWord]:
    """Whisper word timings as whitespace-separated words, the way a transcript splits.

    Whisper's word timings split at token boundaries that are not spaces: punctuation comes
    as its own "word" ("," after " dinner") and so do pieces of hyphenated words (" flower",
    "-fatened"). A piece without a leading space belongs to the word before it; without this,
    punctuation could never be matched and a hyphenated word would count as two.
    """
    out: list[RefWord] = []
    for w in words:
        if out and not w.word.startswith(" "):
            last = out[-1]
            out[-1] = RefWord(last.word + w.word, last.start_s, max(last.end_s, w.end_s))
        else:
            out.append(w)
    return [w for w in out if normalize_word(w.word)]


def align(reference: Sequence[str], hypothesis: Sequence[str]) -> dict[int, int]:
    """Map reference word index -> hypothesis word index for words that match after
    normalisation, in order (longest-matching-block alignment)."""
    ref = [normalize_word(w) for w in reference]
    hyp = [normalize_word(w) for w in hypothesis]
    # autojunk off: in long texts "the" and "and" would otherwise be ignored as popular.
    matcher = difflib.SequenceMatcher(a=ref, b=hyp, autojunk=False)
    pairs: dict[int, int] = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            pairs[block.a + k] = block.b + k
    return pairs


def utterance_ends_at(
    words: Sequence[RefWord], speech_ends_s: Sequence[float], within_s: float = 0.8
) -> list[int]:
    """Indices of the last word of each utterance as a voice activity detector ended them:
    for each speech end (``speech_ends_s``, in order), the last word that ended before it,
    if it ended at most ``within_s`` before (a speech end includes the detector's trailing
    pad, 0.2 s on the server's default). A speech end with no word that close is left out:
    the reference has no word timed there (an alignment that skipped or misplaced it), and
    the word before would measure the missing ones' latency, not the turn's end."""
    ends: list[int] = []
    k = 0
    for end_s in speech_ends_s:
        while k < len(words) and words[k].end_s <= end_s:
            k += 1
        last = k - 1
        if last >= 0 and end_s - words[last].end_s <= within_s and (not ends or ends[-1] < last):
            ends.append(last)
    return ends


@dataclass(frozen=True)
class StreamMetrics:
    """The latency metrics of one stream; latencies in seconds."""

    ttft_s: float | None  # None: no word was ever shown
    first_seen_s: tuple[float, ...]  # per matched reference word: end sent -> first shown
    finalised_s: tuple[float, ...]  # per matched reference word: end sent -> finalised
    end_of_speech_to_final_s: tuple[float, ...]  # per utterance with a finalised end
    words_reference: int
    words_seen: int  # reference words that ever appeared
    words_finalised: int  # reference words matched in the final text
    flicker_changed: int
    flicker_shown: int

    @property
    def flicker_rate(self) -> float:
        return self.flicker_changed / self.flicker_shown if self.flicker_shown else 0.0


def first_seen_walls(
    reference: Sequence[RefWord], observations: Sequence[Observation], sends: SendLog
) -> list[float | None]:
    """Per reference word, the wall time it first appeared in what was shown."""
    seen: list[float | None] = [None] * len(reference)
    ref_words = [w.word for w in reference]
    starts = [w.start_s for w in reference]
    for obs in observations:
        if not obs.shown:
            continue
        # A word cannot be recognised before its audio was sent: aligning only against the
        # words already spoken keeps the alignment small and an early "the" from matching a
        # "the" a minute later.
        spoken = bisect.bisect_right(starts, sends.audio_sent_by(obs.wall_s) + _TIME_EPSILON_S)
        for i in align(ref_words[:spoken], obs.shown):
            if seen[i] is None:
                seen[i] = obs.wall_s
    return seen


def finalised_walls(
    reference: Sequence[RefWord], observations: Sequence[Observation]
) -> list[float | None]:
    """Per reference word, the wall time the final word matched to it was finalised."""
    if not observations:
        return [None] * len(reference)
    final = observations[-1].final_words
    # Finalised words are only ever appended: word k was final from the first observation
    # holding more than k of them.
    when: list[float] = []
    for obs in observations:
        while len(when) < len(obs.final_words):
            when.append(obs.wall_s)
    out: list[float | None] = [None] * len(reference)
    for i, j in align([w.word for w in reference], final).items():
        out[i] = when[j]
    return out


def flicker(observations: Sequence[Observation]) -> tuple[int, int]:
    """(words shown and later changed, tentative words shown).

    A word counts as changed when a later observation no longer shows it at the same place:
    everything of the previous view after the common prefix (of normalised words) with the
    next view. Words moving from tentative to final unchanged do not count.
    """
    changed = shown = 0
    previous: tuple[str, ...] = ()
    for obs in observations:
        now = obs.shown
        common = 0
        for a, b in zip(previous, now, strict=False):
            if normalize_word(a) != normalize_word(b):
                break
            common += 1
        changed += len(previous) - common
        shown += len(obs.tentative_words)
        previous = now
    return changed, shown


def stream_metrics(
    reference: Sequence[RefWord],
    observations: Sequence[Observation],
    sends: SendLog,
    *,
    speech_ends_s: Sequence[float],
) -> StreamMetrics:
    """All metrics of one stream. ``observations`` in arrival order. Utterances end where
    the server's voice activity detector ended speech (``speech_ends_s``, stream seconds:
    ``utterance_ends_at``)."""
    ttft: float | None = None
    first = next((o.wall_s for o in observations if o.shown), None)
    if first is not None and reference:
        ttft = first - sends.sent_at(reference[0].start_s)
    seen = first_seen_walls(reference, observations, sends)
    final = finalised_walls(reference, observations)
    sent_end = [sends.sent_at(w.end_s) for w in reference]
    first_seen = tuple(s - e for s, e in zip(seen, sent_end, strict=True) if s is not None)
    finalised = tuple(f - e for f, e in zip(final, sent_end, strict=True) if f is not None)
    eos: list[float] = []
    begin = 0
    for end in utterance_ends_at(reference, speech_ends_s):
        # The final that holds the end of the utterance: its last word, or when the
        # recogniser dropped that word, the last word of the utterance it did finalise.
        done = [final[k] for k in range(begin, end + 1) if final[k] is not None]
        if done:
            eos.append(max(d for d in done if d is not None) - sent_end[end])
        begin = end + 1
    changed, shown = flicker(observations)
    return StreamMetrics(
        ttft_s=ttft,
        first_seen_s=first_seen,
        finalised_s=finalised,
        end_of_speech_to_final_s=tuple(eos),
        words_reference=len(reference),
        words_seen=sum(s is not None for s in seen),
        words_finalised=sum(f is not None for f in final),
        flicker_changed=changed,
        flicker_shown=shown,
    )


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank, as the other benchmarks report p95; NaN
    without samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def p50_p95_ms(samples: Sequence[float]) -> dict[str, float | int | None]:
    """Median and p95 in milliseconds, and the count (None for empty)."""
    if not samples:
        return {"p50_ms": None, "p95_ms": None, "n": 0}
    return {
        "p50_ms": round(statistics.median(samples) * 1000.0, 1),
        "p95_ms": round(percentile(samples, 0.95) * 1000.0, 1),
        "n": len(samples),
    }
