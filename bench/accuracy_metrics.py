"""The pure half of bench-accuracy: word errors against a reference, where a stream's errors
sit, pooling by source folder and by difficulty, and the printed tables. No model and no
audio: ``tests/test_bench_accuracy.py`` feeds it hand-made words.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import jiwer
from whisper_normalizer.basic import BasicTextNormalizer

from bench.corpus import normalize, normalize_reference
from server.protocol.messages import WordInfo

# What each clip is held against the reference with: the simulated stream, offline greedy
# and offline beam-5 decoding of the whole clip, and a real server (``--server``).
SYSTEMS = ("streamed", "greedy", "beam5", "served")
OFFLINE = ("greedy", "beam5")
# Where a streamed error sits (``locate_errors``).
LOCATIONS = ("first_2s", "middle", "last_word", "after_last")
# Pooled groups, the hard ones first: the headline leads with them.
DIFFICULTIES = ("test_other", "test_other_long", "clean", "clean_long")
HARD_SOURCE = "librispeech_test-other"

FIRST_S = 2.0  # an error this soon after its utterance's onset sits in the first_2s
# A word may start up to this long before the VAD onset of its utterance and still belong to
# it: DTW word starts run early by a timestamp step or two, while the onset already includes
# the VAD's speech pad (VadConfig.speech_pad_ms, 200 ms).
ONSET_SLACK_S = 0.2


@dataclasses.dataclass(frozen=True)
class Counts:
    """Word errors against one reference (after Whisper's English normaliser)."""

    ref_words: int
    substitutions: int
    deletions: int
    insertions: int
    trailing_insertions: int  # hypothesis words after the last reference word

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float:
        return self.errors / self.ref_words if self.ref_words else 0.0


# Languages written without spaces between words: their texts are scored letter by letter.
UNSPACED = frozenset({"ja", "zh", "yue", "th", "lo", "my"})


def count_errors(reference: str, hypothesis: str, language: str = "en") -> Counts:
    """Errors of ``hypothesis`` against ``reference``, both normalised: with Whisper's English
    normaliser, or for another ``language`` its basic one (case and marks folded), letter by
    letter where words are not spaced (``UNSPACED``: then a "word" below is a letter)."""
    if language == "en":
        ref, hyp = normalize_reference(reference), normalize(hypothesis)
    else:
        basic = BasicTextNormalizer(split_letters=language in UNSPACED)
        ref, hyp = basic(reference).strip(), basic(hypothesis).strip()
    if not ref:
        return Counts(0, 0, 0, len(hyp.split()), len(hyp.split()))
    out = jiwer.process_words(ref, hyp)
    trailing = 0
    n_ref = len(ref.split())
    for chunk in out.alignments[0]:
        if chunk.type == "insert" and chunk.ref_start_idx >= n_ref:
            trailing += chunk.hyp_end_idx - chunk.hyp_start_idx
    return Counts(
        n_ref, out.substitutions, out.deletions, out.insertions, trailing_insertions=trailing
    )


# --- where the streamed errors sit ------------------------------------------------------------


def token_times(words: Sequence[WordInfo], tokens: Sequence[str]) -> list[tuple[float, float]]:
    """(start, end) in stream seconds of each token of the normalised hypothesis ``tokens``,
    from the finals' ``words``.

    The normaliser works on the whole text and may split a word ("don't" -> "do not"), merge
    several ("twenty five" -> "25") or drop one ("uh"), so tokens cannot be counted off word by
    word. Instead each word is normalised on its own, with its times, and that token list is
    aligned to ``tokens``: a token that matches takes its word's times; the tokens of a block
    that differs (a merge or a split) are spread over that block's words in order, so "25"
    takes the times of "twenty"; a token with no counterpart takes the previous word's. The
    approximation is good to a word or two, which is all the 2 s and last-word tests need.
    """
    if not words:
        return [(0.0, 0.0)] * len(tokens)
    pieces: list[str] = []
    owner_of_piece: list[int] = []  # index into words
    for k, word in enumerate(words):
        for piece in normalize(word.word).split():
            pieces.append(piece)
            owner_of_piece.append(k)
    owner = [0] * len(tokens)
    # autojunk off: in long texts "the" and "and" would otherwise be ignored as popular.
    matcher = difflib.SequenceMatcher(a=pieces, b=list(tokens), autojunk=False)
    for _, i1, i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            if i2 > i1:  # equal (one to one) or replace (spread in order)
                owner[j] = owner_of_piece[i1 + (j - j1) * (i2 - i1) // (j2 - j1)]
            elif i1 > 0:
                owner[j] = owner_of_piece[i1 - 1]
            elif pieces:
                owner[j] = owner_of_piece[0]
    return [(words[k].start, words[k].end) for k in owner]


@dataclasses.dataclass(frozen=True)
class LocatedError:
    """One word error of a stream, placed in time."""

    kind: str  # jiwer's name: "substitute", "delete" or "insert"
    ref: str  # the normalised reference word ("" for an insertion)
    hyp: str  # the normalised hypothesis word ("" for a deletion)
    at_s: float | None  # stream seconds; None when the stream had no word to place it by
    since_onset_s: float | None  # at_s minus the onset of its utterance
    where: str  # one of LOCATIONS


def locate_errors(
    reference: str,
    hypothesis: str,
    words: Sequence[WordInfo],
    onsets_s: Sequence[float],
    *,
    first_s: float = FIRST_S,
) -> list[LocatedError]:
    """Every word error of ``hypothesis`` (the finals' text) against ``reference``, from the
    same alignment as ``count_errors``, each placed in one of ``LOCATIONS``.

    ``words`` are the finals' words (stream times), ``onsets_s`` the utterance onsets
    (``speech_started.start``). An utterance runs from one onset to the next. The first rule
    that fits wins:

    - ``after_last``: an insertion after the clip's last reference word (the trailing
      insertions of ``count_errors``);
    - ``last_word``: a substitution or deletion of the last reference word of an utterance
      (the clip's last word included);
    - ``first_2s``: the error's hypothesis word starts less than ``first_s`` after its
      utterance's onset;
    - ``middle``: the rest.

    A deletion has no hypothesis word: it is placed at the end of the hypothesis word before
    it (the word was said about then), or at the start of the one after it when it opens the
    stream. So a deletion between two utterances is charged to the earlier one: a lost first
    word of an utterance counts as the previous utterance's last word. Reference words take
    their aligned hypothesis word's time, which is how an utterance's last reference word is
    found; with no hypothesis word at all, only the clip's last word is ``last_word`` and the
    rest are ``middle``.
    """
    ref = normalize_reference(reference).split()
    hyp = normalize(hypothesis).split()
    times = token_times(words, hyp)
    starts = sorted(onsets_s) or [times[0][0] if times else 0.0]

    def onset_of(at: float) -> int:
        return max(bisect.bisect_right(starts, at + ONSET_SLACK_S) - 1, 0)

    if not ref:
        return [
            LocatedError("insert", "", h, t, t - starts[onset_of(t)], "after_last")
            for h, (t, _) in zip(hyp, times, strict=True)
        ]
    chunks = jiwer.process_words(" ".join(ref), " ".join(hyp)).alignments[0]

    def deleted_at(j: int) -> float | None:
        """Where a deletion at hypothesis position ``j`` is placed (see the docstring)."""
        if j > 0:
            return times[j - 1][1]
        return times[j][0] if j < len(times) else None

    ref_at: list[float | None] = [None] * len(ref)
    for c in chunks:
        for i in range(c.ref_start_idx, c.ref_end_idx):
            if c.type == "delete":
                ref_at[i] = deleted_at(c.hyp_start_idx)
            else:
                ref_at[i] = times[c.hyp_start_idx + i - c.ref_start_idx][0]
    utterance = [onset_of(t) if t is not None else 0 for t in ref_at]
    last = [i == len(ref) - 1 or utterance[i + 1] != utterance[i] for i in range(len(ref))]

    def place(kind: str, r: str, h: str, i: int | None, at: float | None) -> LocatedError:
        since = None if at is None else at - starts[onset_of(at)]
        if i is not None and last[i]:
            where = "last_word"
        elif since is not None and since < first_s:
            where = "first_2s"
        else:
            where = "middle"
        return LocatedError(kind, r, h, at, since, where)

    located: list[LocatedError] = []
    for c in chunks:
        if c.type == "substitute":
            for k in range(c.ref_end_idx - c.ref_start_idx):
                i, j = c.ref_start_idx + k, c.hyp_start_idx + k
                located.append(place(c.type, ref[i], hyp[j], i, times[j][0]))
        elif c.type == "delete":
            for i in range(c.ref_start_idx, c.ref_end_idx):
                located.append(place(c.type, ref[i], "", i, ref_at[i]))
        elif c.type == "insert":
            for j in range(c.hyp_start_idx, c.hyp_end_idx):
                at = times[j][0]
                if c.ref_start_idx >= len(ref):
                    since = at - starts[onset_of(at)]
                    located.append(LocatedError(c.type, "", hyp[j], at, since, "after_last"))
                else:
                    located.append(place(c.type, "", hyp[j], None, at))
    return located


def location_counts(errors: Sequence[LocatedError]) -> dict[str, int]:
    """How many errors sit in each of ``LOCATIONS``."""
    return {where: sum(e.where == where for e in errors) for where in LOCATIONS}


# --- pooling ----------------------------------------------------------------------------------


def source_of(file: str) -> str:
    """A clip's source folder: the first part of its path in the speech folder."""
    return file.split("/")[0]


def difficulty_of(file: str, *, long: bool) -> str:
    """``test_other`` / ``test_other_long`` for LibriSpeech test-other (its noisier half),
    ``clean`` / ``clean_long`` for every other folder."""
    hard = source_of(file) == HARD_SOURCE
    if long:
        return "test_other_long" if hard else "clean_long"
    return "test_other" if hard else "clean"


def by_difficulty(
    sets: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, list[Mapping[str, Any]]]:
    """The clips of ``sets`` ("short", "long") by ``difficulty_of``, in ``DIFFICULTIES``
    order; empty groups left out."""
    groups: dict[str, list[Mapping[str, Any]]] = {name: [] for name in DIFFICULTIES}
    for name, rows in sets.items():
        for row in rows:
            groups[difficulty_of(row["file"], long=name == "long")].append(row)
    return {name: rows for name, rows in groups.items() if rows}


def by_source(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """``rows`` by source folder, sorted by name."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(source_of(row["file"]), []).append(row)
    return dict(sorted(groups.items()))


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _total(rows: Sequence[Mapping[str, Any]], key: str) -> int | None:
    """The sum of ``key`` over the rows; None unless every row has a value (a system that was
    not run, or not for every clip, has no pooled figure)."""
    values: list[int | None] = [r.get(key) for r in rows]
    known = [v for v in values if v is not None]
    return sum(known) if values and len(known) == len(values) else None


def pooled(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Pooled figures of clip rows (``bench.accuracy.run_clip``'s dicts, non-empty): WER per
    system, streamed minus each offline reference in points, where the streamed errors sit,
    latency, flicker and decode load. A system missing from any clip is None."""
    ref = sum(r["ref_words"] for r in rows)
    errors = {system: _total(rows, f"errors_{system}") for system in SYSTEMS}
    streamed = errors["streamed"]
    out: dict[str, Any] = {"clips": len(rows), "ref_words": ref}
    for system, total in errors.items():
        out[f"wer_{system}"] = round(total / ref, 4) if total is not None and ref else None
    for system in (*OFFLINE, "served"):
        other = errors[system]  # streamed minus this one, in WER points
        out[f"points_vs_{system}"] = (
            round(100 * (streamed - other) / ref, 2)
            if streamed is not None and other is not None and ref
            else None
        )
    for system in OFFLINE:
        if errors[system] is None:
            out[f"clips_worse_than_{system}"] = out[f"clips_better_than_{system}"] = None
            continue
        key = f"errors_{system}"
        out[f"clips_worse_than_{system}"] = sum(r["errors_streamed"] > r[key] for r in rows)
        out[f"clips_better_than_{system}"] = sum(r["errors_streamed"] < r[key] for r in rows)
    out["clips_served_differs"] = (
        None
        if errors["served"] is None
        else sum(r["errors_served"] != r["errors_streamed"] for r in rows)
    )
    out["error_locations"] = {
        where: sum(r["error_locations"][where] for r in rows) for where in LOCATIONS
    }
    for system in ("streamed", *OFFLINE):
        out[f"trailing_insertions_{system}"] = _total(rows, f"trailing_insertions_{system}")
    finals = [x for r in rows for x in r["final_latencies_s"]]
    word_finals = [x for r in rows for x in r.get("word_final_latencies_s", [])]
    turn_ends = [x for r in rows for x in r.get("end_of_speech_to_final_s", [])]
    served_finals = [x for r in rows for x in r.get("final_latencies_served_s", [])]
    served_turn_ends = [x for r in rows for x in r.get("end_of_speech_to_final_served_s", [])]
    firsts = [r["first_partial_s"] for r in rows if r["first_partial_s"] is not None]
    shown = sum(r["flicker_shown"] for r in rows)
    served_firsts = [
        r["first_partial_served_s"] for r in rows if r.get("first_partial_served_s") is not None
    ]
    served_shown = sum(r.get("flicker_shown_served", 0) for r in rows)
    served_changed = sum(r.get("flicker_changed_served", 0) for r in rows)
    audio_s = sum(r["audio_s"] for r in rows)
    out |= {
        "final_latency_p50_s": percentile(finals, 0.5),
        "final_latency_p95_s": percentile(finals, 0.95),
        "word_final_latency_p50_s": percentile(word_finals, 0.5),
        "word_final_latency_p95_s": percentile(word_finals, 0.95),
        "end_of_speech_to_final_p50_s": percentile(turn_ends, 0.5),
        "end_of_speech_to_final_p95_s": percentile(turn_ends, 0.95),
        "final_latency_served_p95_s": percentile(served_finals, 0.95),
        "end_of_speech_to_final_served_p50_s": percentile(served_turn_ends, 0.5),
        "end_of_speech_to_final_served_p95_s": percentile(served_turn_ends, 0.95),
        "first_partial_p50_s": percentile(firsts, 0.5),
        "first_partial_p95_s": percentile(firsts, 0.95),
        "flicker": round(sum(r["flicker_changed"] for r in rows) / shown, 4) if shown else 0.0,
        "first_partial_served_p50_s": percentile(served_firsts, 0.5),
        "first_partial_served_p95_s": percentile(served_firsts, 0.95),
        "flicker_served": round(served_changed / served_shown, 4) if served_shown else None,
        "decodes_per_audio_s": round(sum(r["decodes"] for r in rows) / audio_s, 3),
        "decode_busy": round(sum(r["decode_s_total"] for r in rows) / audio_s, 3),
    }
    return out


HEADLINE_KEYS = (
    "clips",
    "ref_words",
    "wer_streamed",
    "wer_greedy",
    "wer_beam5",
    "wer_served",
    "points_vs_greedy",
    "points_vs_beam5",
    "error_locations",
    "final_latency_p95_s",
    "word_final_latency_p95_s",
    "end_of_speech_to_final_p50_s",
    "end_of_speech_to_final_p95_s",
    "final_latency_served_p95_s",
    "end_of_speech_to_final_served_p50_s",
    "end_of_speech_to_final_served_p95_s",
    "first_partial_p50_s",
    "first_partial_served_p50_s",
    "flicker",
    "flicker_served",
)


def headline(groups: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The figures that lead the run's last line, per difficulty in ``DIFFICULTIES`` order
    (test-other first); a figure that was not measured is left out."""
    return {
        name: {k: groups[name][k] for k in HEADLINE_KEYS if groups[name].get(k) is not None}
        for name in DIFFICULTIES
        if name in groups
    }


# --- the printed table ------------------------------------------------------------------------


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _points(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def table(label: str, groups: Mapping[str, Mapping[str, Any]]) -> str:
    """A fixed-width table of pooled ``groups``: clips, reference words, WER per system (the
    served column only when a group has it), streamed minus each reference in points, and
    where the streamed errors sit."""
    served = any(g.get("wer_served") is not None for g in groups.values())
    header = [label, "clips", "words", "streamed", "greedy", "beam5"]
    header += ["served"] if served else []
    header += ["vs greedy", "vs beam5"]
    header += ["vs served"] if served else []
    header += list(LOCATIONS)
    lines = [header]
    for name, g in groups.items():
        row = [name, str(g["clips"]), str(g["ref_words"])]
        row += [_percent(g[f"wer_{s}"]) for s in ("streamed", *OFFLINE)]
        row += [_percent(g.get("wer_served"))] if served else []
        row += [_points(g[f"points_vs_{s}"]) for s in OFFLINE]
        row += [_points(g.get("points_vs_served"))] if served else []
        row += [str(g["error_locations"][where]) for where in LOCATIONS]
        lines.append(row)
    widths = [max(len(line[k]) for line in lines) for k in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if k == 0 else cell.rjust(width)
            for k, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )
