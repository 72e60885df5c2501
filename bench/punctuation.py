"""Captions that read like the transcript: sentence ends, commas and capitals in the streamed
finals beside an offline decode of the same audio, and words after the last spoken word.

    python -m bench.punctuation                  # or: make bench-punctuation
    python -m bench.punctuation --modes utterance --set streaming.rules.disabled='["x"]'

Every normaliser a WER uses strips punctuation and case, so no accuracy figure sees a caption
that runs on as one lower-case sentence. This one counts, per recording and pooled:
- sentence ends (a word ending in . ? ! but an abbreviation's or initial's: "etc.", "i.e."),
  commas, and the sentences that start with a capital (or a digit, which has no case),
  in the streamed finals, in the offline decode (``transcribe_audio``'s long-form loop, as
  ``bench.accuracy`` calls it) and in the reference where it is punctuated (LJ Speech, the
  sonnets; LibriSpeech's is upper case without punctuation);
- the streamed ends and commas as a share of offline's (the issue's targets: >= 90% and 80%);
- words after the last reference word (``Counts.trailing_insertions``), streamed and offline;
- errors against the reference and final latency p95, so a lever's cost shows beside it.

The recordings: every English one in ``manifest_long.tsv`` (``--languages de,es`` or ``all``
for others, with a multilingual ``--model`` such as ``base``: then each stream and the
offline decode detect their language, and texts in another language are scored with
Whisper's basic normaliser, letter by letter where words are not spaced), and ``test-other
nopause``: the ten clips of one test-other chapter with the silence at their edges trimmed,
joined back to back, so that hard speech, too, comes as one long utterance with no pause
(built here from the shared clips, in memory). With ``--short`` the short clips of
``manifest.tsv`` in those languages are streamed too, for their trailing insertions only.

Each recording is streamed through ``Session`` at the modelled decode cost
(``bench.accuracy.modelled_cost_s``), so the text is the same on every run; decodes are kept
in ``--cache`` (``bench.ablation.DecodeCache``) and offline transcripts in
``--offline-cache``, so a rerun decodes only what a change moved. One stream at a time:
``bench.punctuation_served`` streams them through a real server, several at once. Writes
``bench/results/punctuation.json`` (``--out NAME``) and prints one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.ablation import DecodeCache
from bench.accuracy import _overrides, modelled_cost_s
from bench.accuracy_metrics import count_errors
from bench.corpus import read_manifest
from bench.engine import RESULTS, Float32Array, load_speech, speech_dir, write_results
from bench.simulate import simulate
from server.config import StreamingConfig
from server.core.casing import ends_sentence
from server.core.engine_api import DecodeOptions
from server.engine.engine import Engine, EngineConfig
from server.engine.offline import transcribe_audio
from server.protocol.formats import SAMPLE_RATE_HZ

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO / ".cache" / "punctuation-decodes.pkl"
DEFAULT_OFFLINE = REPO / ".cache" / "punctuation-offline.json"
MODES = ("utterance", "words")
NOPAUSE_CHAPTER = "3080-5032"  # the test-other chapter joined with no pause
NOPAUSE = f"test-other nopause {NOPAUSE_CHAPTER}"
CHAPTERS = "librispeech_test-other/long/"


@dataclass(frozen=True)
class Marks:
    """The punctuation and capitals of one text."""

    words: int
    sentence_ends: int
    commas: int
    sentences: int  # the first word and every word after a sentence end
    capitalised: int  # ... of which start with a capital letter

    def as_dict(self) -> dict[str, int]:
        return {
            "words": self.words,
            "sentence_ends": self.sentence_ends,
            "commas": self.commas,
            "sentences": self.sentences,
            "capitalised": self.capitalised,
        }


def marks_of(text: str) -> Marks:
    """Count ``text``'s sentence ends, commas and sentence-initial capitals. A mark that
    stands alone (a final that opens with the comma of the word before: "concerned , differs")
    counts with the word before it."""
    words: list[str] = []
    for token in text.split():
        if any(ch.isalnum() for ch in token) or not words:
            words.append(token)
        else:
            words[-1] += token
    words = [w for w in words if any(ch.isalnum() for ch in w)]
    ends = commas = sentences = capitalised = 0
    starts_sentence = True
    for word in words:
        if starts_sentence:
            sentences += 1
            # A sentence that opens with a digit ("2. When forty winters") has nothing to case.
            first = next((ch for ch in word if ch.isalnum()), "")
            capitalised += first.isupper() or first.isdigit()
        starts_sentence = ends_sentence(word)
        ends += starts_sentence
        commas += word.count(",")
    return Marks(len(words), ends, commas, sentences, capitalised)


def rescore(data: dict[str, Any]) -> dict[str, Any]:
    """A results file's marks and shares counted again from the texts it keeps."""
    for run in data["runs"].values():
        for row in run["recordings"]:
            if row["long"]:
                row.update(marks_row(row["text"], row["offline_text"], row.get("reference_text")))
        run["pooled"] = pooled(run["recordings"])
    return data


def marks_row(text: str, offline: str, reference: str | None) -> dict[str, Any]:
    """A long recording's marks: streamed, offline, the reference's where it is punctuated."""
    mine, theirs = marks_of(text), marks_of(offline)
    row: dict[str, Any] = {"streamed": mine.as_dict(), "offline": theirs.as_dict()}
    if reference and punctuated(reference):
        row["reference"] = marks_of(reference).as_dict()
    row["ends_vs_offline"] = _share(mine.sentence_ends, theirs.sentence_ends)
    row["commas_vs_offline"] = _share(mine.commas, theirs.commas)
    row["capitalised_share"] = _share(mine.capitalised, mine.sentences)
    return row


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 3) if whole else None


def _edges(audio: Float32Array, *, frame_s: float = 0.02, floor_db: float = -35.0) -> Float32Array:
    """``audio`` without the quiet at its start and end: frames more than ``floor_db`` under
    the loudest frame, keeping 60 ms of margin so no word's edge is lost."""
    frame = int(frame_s * SAMPLE_RATE_HZ)
    n = audio.shape[0] // frame
    if n == 0:
        return audio
    rms = np.sqrt(np.mean(audio[: n * frame].reshape(n, frame) ** 2, axis=1) + 1e-12)
    loud = np.nonzero(20 * np.log10(rms / rms.max()) > floor_db)[0]
    if loud.size == 0:
        return audio
    margin = 3
    start = max(0, int(loud[0]) - margin) * frame
    end = min(n, int(loud[-1]) + 1 + margin) * frame
    return audio[start:end]


def nopause_recording(chapter: str = NOPAUSE_CHAPTER) -> tuple[Float32Array, str]:
    """One test-other chapter's clips, their edges trimmed, back to back; and the reference."""
    rows = [
        r
        for r in read_manifest(speech_dir() / "manifest.tsv")
        if r.file.startswith(f"librispeech_test-other/{chapter}-")
    ]
    if not rows:
        raise SystemExit(f"no test-other clips of chapter {chapter} in manifest.tsv")
    rows.sort(key=lambda r: r.file)
    audio = np.concatenate([_edges(load_speech(r.file)) for r in rows]).astype(np.float32)
    return audio, " ".join(r.transcript for r in rows)


def recordings(short: bool, languages: Sequence[str] = ("en",)) -> list[tuple[str, str, bool, str]]:
    """(name, reference, long, language) of each recording in ``languages``: the long ones,
    the no-pause chapter (English), and with ``short`` the short clips."""
    folder = speech_dir()
    out = [
        (r.file, r.transcript, True, r.language)
        for r in read_manifest(folder / "manifest_long.tsv")
        if r.language in languages
    ]
    # LJ Speech first (the case), then the no-pause chapter, then the rest.
    out.sort(key=lambda row: "ljspeech" not in row[0])
    if "en" in languages:
        out.insert(1, (NOPAUSE, "", True, "en"))
    if short:
        longs = {row[0] for row in out}
        out += [
            (r.file, r.transcript, False, r.language)
            for r in read_manifest(folder / "manifest.tsv")
            if r.language in languages and r.file not in longs
        ]
    return out


def _languages(spec: str) -> tuple[str, ...]:
    """``--languages``: codes, or every language the manifests hold."""
    if spec != "all":
        return tuple(code for code in spec.split(",") if code)
    folder = speech_dir()
    rows = [*read_manifest(folder / "manifest.tsv"), *read_manifest(folder / "manifest_long.tsv")]
    return tuple(sorted({r.language for r in rows}))


def punctuated(reference: str) -> bool:
    """Whether a reference carries punctuation and case (LibriSpeech's does not)."""
    return any(ch in reference for ch in ".,?!") and reference != reference.upper()


def p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 3)


def error_fields(
    reference: str, text: str, offline: str, language: str = "en"
) -> dict[str, int | None]:
    """Errors and words after the last reference word, streamed and offline; None for each
    without a reference (a recording cut short)."""
    if not reference:
        return dict.fromkeys(
            (
                "errors",
                "errors_offline",
                "ref_words",
                "trailing_insertions",
                "trailing_insertions_offline",
            )
        )
    streamed = count_errors(reference, text, language)
    off = count_errors(reference, offline, language)
    return {
        "errors": streamed.errors,
        "errors_offline": off.errors,
        "ref_words": streamed.ref_words,
        "trailing_insertions": streamed.trailing_insertions,
        "trailing_insertions_offline": off.trailing_insertions,
    }


def run_recording(
    engine: Engine,
    cache: DecodeCache,
    audio: Float32Array,
    reference: str,
    offline: str,
    streaming: StreamingConfig,
    *,
    long: bool,
    language: str = "en",
) -> dict[str, Any]:
    """One recording streamed: its marks beside offline's and the reference's."""
    fired: dict[str, int] = {}
    result = simulate(
        engine,
        audio,
        streaming=streaming,
        decode_cost_s=modelled_cost_s,
        spare_lane=streaming.finals == "utterance",
        decoder=cache,
        on_session=lambda s: fired.update(s.rule_counts),
    )
    text = result.text
    row: dict[str, Any] = {
        "audio_s": round(audio.shape[0] / SAMPLE_RATE_HZ, 2),
        "long": long,
        "language": language,
        **error_fields(reference, text, offline, language),
        "final_p95_s": p95(result.final_latencies_s()),
        "rules_fired": {k: v for k, v in sorted(fired.items()) if not k.startswith("final:")},
        "text": text,
    }
    if long:
        row.update(marks_row(text, offline, reference))
        row["offline_text"] = offline
        row["reference_text"] = reference
    return row


def pooled(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The long recordings' marks summed; trailing insertions over every recording."""
    long = [r for r in rows if r["long"]]
    out: dict[str, Any] = {}
    for side in ("streamed", "offline"):
        out[side] = {k: sum(r[side][k] for r in long) for k in Marks.__dataclass_fields__}
    s, o = out["streamed"], out["offline"]
    out["ends_vs_offline"] = _share(s["sentence_ends"], o["sentence_ends"])
    out["commas_vs_offline"] = _share(s["commas"], o["commas"])
    out["capitalised_share"] = _share(s["capitalised"], s["sentences"])
    out["errors_long"] = sum(r["errors"] or 0 for r in long)
    out["trailing_insertions"] = sum(r["trailing_insertions"] or 0 for r in rows)
    out["trailing_insertions_offline"] = sum(r["trailing_insertions_offline"] or 0 for r in rows)
    out["recordings_with_trailing"] = [
        name for name, r in zip(_names(rows), rows, strict=True) if r["trailing_insertions"]
    ]
    return out


def _names(rows: Sequence[dict[str, Any]]) -> list[str]:
    return [r["name"] for r in rows]


def recording_line(name: str, row: dict[str, Any]) -> str:
    s, o = row["streamed"], row["offline"]
    ref = row.get("reference")
    ref_part = f"  ref {ref['sentence_ends']:3d} . {ref['commas']:3d} ," if ref else " " * 18
    return (
        f"{name[-40:]:40s} ends {s['sentence_ends']:3d}/{o['sentence_ends']:3d}"
        f" ({row['ends_vs_offline']})  commas {s['commas']:3d}/{o['commas']:3d}"
        f" ({row['commas_vs_offline']})  caps {s['capitalised']:3d}/{s['sentences']:3d}"
        f"{ref_part}  errors {row['errors']} (offline {row['errors_offline']})"
        f"  after last {row['trailing_insertions']}  final p95 {row['final_p95_s']}"
    )


def pooled_line(summary: dict[str, Any]) -> str:
    s, o = summary["streamed"], summary["offline"]
    return (
        f"pooled: ends {s['sentence_ends']}/{o['sentence_ends']}"
        f" ({summary['ends_vs_offline']})  commas {s['commas']}/{o['commas']}"
        f" ({summary['commas_vs_offline']})  caps {s['capitalised']}/{s['sentences']}"
        f"  errors (long) {summary['errors_long']}"
        f"  after last {summary['trailing_insertions']}"
        f" (offline {summary['trailing_insertions_offline']})"
        f" in {summary['recordings_with_trailing']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="finals: utterance, words")
    parser.add_argument("--set", action="append", default=[], help="streaming.FIELD=JSON")
    parser.add_argument("--disable", default="", help="comma-separated rules to switch off")
    parser.add_argument("--short", action="store_true", help="short clips too (trailing words)")
    parser.add_argument(
        "--max-s",
        type=float,
        default=0.0,
        help="stream only the first seconds of each recording but the test-other chapters "
        "(whose decodes the ablation runs made): no errors, nor trailing words, for those cut",
    )
    parser.add_argument("--only", default="", help="comma-separated substrings of names to run")
    parser.add_argument(
        "--languages",
        default="en",
        help="comma-separated languages of the recordings to run (manifest codes), or 'all'",
    )
    parser.add_argument(
        "--model",
        default=EngineConfig().model,
        help="the model (a multilingual one detects each stream's language, offline too)",
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--offline-cache", type=Path, default=DEFAULT_OFFLINE)
    parser.add_argument("--out", default="punctuation")
    parser.add_argument("--rescore", type=Path, help="count the marks of a results file again")
    args = parser.parse_args(argv)
    if args.rescore is not None:
        data = rescore(json.loads(args.rescore.read_text()))
        args.rescore.write_text(json.dumps(data, indent=1) + "\n")
        for mode, run in data["runs"].items():
            for row in run["recordings"]:
                if row["long"]:
                    print(f"{mode:9s} {recording_line(row['name'], row)}")
            print(f"{mode:9s} {pooled_line(run['pooled'])}")
        return 0
    base, _, _ = _overrides(args.set)
    modes = [m for m in args.modes.split(",") if m]
    only = [s for s in args.only.split(",") if s]

    engine = Engine.load(EngineConfig(model=args.model))
    engine.warmup()
    multilingual = engine.vocab.multilingual
    if multilingual and not any(s.startswith("streaming.language=") for s in args.set):
        base = dataclasses.replace(base, language=None)
    languages = _languages(args.languages)
    cache = DecodeCache(engine, args.cache)
    offline_texts: dict[str, str] = (
        json.loads(args.offline_cache.read_text()) if args.offline_cache.is_file() else {}
    )
    load_start = os.getloadavg()
    started = time.perf_counter()
    disabled = tuple(r for r in args.disable.split(",") if r)
    rows: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    # Recording by recording, every mode, the results file rewritten after each: a run cut
    # short keeps what it measured.
    for name, reference, long, language in recordings(args.short, languages):
        if only and not any(s in name for s in only):
            continue
        if name == NOPAUSE:
            audio, reference = nopause_recording()
        else:
            audio = load_speech(name)
        key = name
        if (
            args.max_s
            and audio.shape[0] > args.max_s * SAMPLE_RATE_HZ
            and not name.startswith(CHAPTERS)
        ):
            audio = audio[: round(args.max_s * SAMPLE_RATE_HZ)]
            reference = ""  # the words of the part streamed are not known
            key = f"{name}[:{args.max_s:g}s]"
        if key not in offline_texts:
            options = DecodeOptions(word_timestamps=False, language=None if multilingual else "en")
            offline_texts[key] = transcribe_audio(engine, audio, options).text
            args.offline_cache.parent.mkdir(parents=True, exist_ok=True)
            args.offline_cache.write_text(json.dumps(offline_texts, indent=1))
        for mode in modes:
            streaming = dataclasses.replace(
                base, finals=mode, rules=dataclasses.replace(base.rules, disabled=disabled)
            )
            row = run_recording(
                engine,
                cache,
                audio,
                reference,
                offline_texts[key],
                streaming,
                long=long,
                language=language,
            )
            row["name"] = key
            rows[mode].append(row)
            cache.save()
            if long:
                print(f"{mode:9s} {recording_line(key, row)}", flush=True)
        data = {
            "settings": args.set,
            "model": args.model,
            "languages": list(languages),
            "disabled": args.disable,
            "max_s": args.max_s,
            "runs": {mode: {"pooled": pooled(r), "recordings": r} for mode, r in rows.items()},
            "streams": 1,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "wall_s": round(time.perf_counter() - started, 1),
            "decodes_new": cache.misses,
            "decodes_cached": cache.hits,
        }
        write_results(args.out, data)
    for mode, mode_rows in rows.items():
        print(f"{mode:9s} {pooled_line(pooled(mode_rows))}", flush=True)
    print(f"wrote {RESULTS / args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
