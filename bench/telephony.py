"""Telephone speech against the same speech at 16 kHz: what a phone line costs in WER, and
which lever on the 8 kHz path wins some of it back.

    python -m bench.telephony                 # or: make bench-telephony
    python -m bench.telephony --limit 5 --lever vad_mode_3

Each of the 40 LibriSpeech test-other clips of ``manifest.tsv`` goes through a telephone line
in numpy (``bench/phone_line.py``: 300-3400 Hz band-pass, 8 kHz, G.711 mu-law) and is streamed
through ``Session`` as 8 kHz ``mulaw`` at a modelled decode cost (``bench.accuracy``'s
``modelled_cost_s``, ``bench/simulate.py``), so window positions, and so the text, are the
same on every run. Beside it, on the same clips:

- ``wide``: the clip streamed as it is, 16 kHz s16le (what the line is measured against);
- ``phone_offline`` / ``wide_offline``: our offline decode (``transcribe_audio``, greedy) of
  the telephone audio (decoded by the server's own ``PcmDecoder``) and of the 16 kHz clip.

Run-to-run noise: with a modelled cost a run repeats exactly, so the noise that matters is
how much the text moves when the decodes land elsewhere in the audio. ``phone_x1.1`` streams
the line again with the cost scaled by 1.1 (a slightly slower machine; ``--noise-scale`` for
others); its difference from ``phone`` is the noise floor.

Levers, each on its own against ``phone`` (``--lever`` picks some; default all):

- ``resample_vhq``: soxr's best quality for the 8 -> 16 kHz resampler of
  ``server/protocol/audio.py`` (``HQ`` by default: a steeper filter keeps more of 3.4-4 kHz);
- ``vad_mode_1`` / ``vad_mode_3``: webrtcvad's aggressiveness (the server's is 2).

A lever is kept when it removes more errors than the noise floor and the paired bootstrap
(clips resampled, 2000 times) puts its error difference below zero with 95% confidence.
Writes ``bench/results/telephony.json`` (``--out``) and prints one line per condition; the last
line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.accuracy import _overrides, modelled_cost_s
from bench.accuracy_metrics import count_errors
from bench.corpus import ManifestRow, read_manifest
from bench.engine import RESULTS, Float32Array, load_speech, speech_dir, write_results
from bench.phone_line import PHONE_BAND_HZ, PHONE_RATE_HZ, phone_line
from bench.simulate import simulate
from server.config import StreamingConfig, VadConfig
from server.engine.engine import Engine, EngineConfig
from server.engine.offline import transcribe_audio
from server.protocol import audio as audio_module
from server.protocol.audio import PcmDecoder
from server.protocol.formats import AudioFormat

HARD_FOLDER = "librispeech_test-other/"
LAW = "mulaw"
NOISE_SCALES = (1.1,)
BOOTSTRAP_ROUNDS = 2000
CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class Lever:
    """One change on the 8 kHz path: a resampler quality and the VAD it streams with."""

    name: str
    resample_quality: str = "HQ"
    vad: VadConfig = dataclasses.field(default_factory=VadConfig)


LEVERS = (
    Lever("vad_mode_1", vad=VadConfig(aggressiveness=1)),
    Lever("resample_vhq", resample_quality="VHQ"),
    Lever("vad_mode_3", vad=VadConfig(aggressiveness=3)),
)


@contextmanager
def resample_quality(quality: str) -> Iterator[None]:
    """Every ``PcmDecoder`` built inside uses soxr's ``quality`` (the server's is a module
    constant: the lever is tried here before it is changed there)."""
    saved = audio_module._RESAMPLE_QUALITY
    audio_module._RESAMPLE_QUALITY = quality
    try:
        yield
    finally:
        audio_module._RESAMPLE_QUALITY = saved


def decode_line(line: bytes) -> Float32Array:
    """The telephone bytes as the server hears them: 16 kHz float32."""
    decoder = PcmDecoder(AudioFormat(PHONE_RATE_HZ, LAW), max_frame_bytes=max(1, len(line)))
    return np.concatenate([decoder.decode(line), decoder.flush()])


@dataclasses.dataclass
class Clip:
    row: ManifestRow
    audio: Float32Array  # 16 kHz
    line: bytes  # the telephone line's G.711 bytes at 8 kHz


def stream(
    engine: Engine,
    clip: Clip,
    *,
    phone: bool,
    vad: VadConfig | None = None,
    cost_scale: float = 1.0,
    streaming: StreamingConfig | None = None,
) -> dict[str, Any]:
    """One clip streamed at a modelled cost: its errors, words and final latencies."""
    result = simulate(
        engine,
        clip.audio,
        streaming=streaming or StreamingConfig(),
        vad=vad,
        decode_cost_s=lambda job: cost_scale * modelled_cost_s(job),
        wire=(AudioFormat(PHONE_RATE_HZ, LAW), clip.line) if phone else None,
    )
    return clip_row(clip.row, result.text) | {
        "final_latencies_s": [round(x, 3) for x in result.final_latencies_s()]
    }


def clip_row(row: ManifestRow, text: str) -> dict[str, Any]:
    """A clip's figures in the results: its file, reference words, errors and text."""
    counts = count_errors(row.transcript, text)
    return {
        "file": row.file,
        "ref_words": counts.ref_words,
        "errors": counts.errors,
        "text": text,
    }


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """WER over all clips' words, and final latency p50 / p95 for streamed conditions."""
    ref = sum(r["ref_words"] for r in rows)
    errors = sum(r["errors"] for r in rows)
    out: dict[str, Any] = {"clips": len(rows), "ref_words": ref, "errors": errors}
    out["wer"] = round(errors / ref, 4) if ref else None
    latencies = [x for r in rows for x in r.get("final_latencies_s", [])]
    if latencies:
        q = statistics.quantiles(latencies, n=20, method="inclusive")
        out["final_latency_p50_s"] = round(statistics.median(latencies), 3)
        out["final_latency_p95_s"] = round(q[18], 3)
    return out


def paired_bootstrap(
    base: list[dict[str, Any]], other: list[dict[str, Any]], seed: int = 0
) -> tuple[float, float]:
    """The ``CONFIDENCE`` interval of ``other``'s errors minus ``base``'s, in WER points, with
    the clips resampled (each keeps its pair)."""
    diff = np.array([o["errors"] - b["errors"] for b, o in zip(base, other, strict=True)])
    words = np.array([b["ref_words"] for b in base])
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, diff.size, size=(BOOTSTRAP_ROUNDS, diff.size))
    points = 100 * diff[picks].sum(axis=1) / words[picks].sum(axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(points, [tail, 1 - tail])
    return round(float(low), 2), round(float(high), 2)


def run(
    engine: Engine,
    clips: list[Clip],
    name: str,
    each: Callable[[Clip], dict[str, Any]],
) -> list[dict[str, Any]]:
    started = time.perf_counter()
    rows = [each(clip) for clip in clips]
    figures = pooled(rows)
    latency = figures.get("final_latency_p95_s")
    print(
        f"{name:16s} WER {figures['wer']:.4f}  errors {figures['errors']:4d}"
        + (f"  final p95 {latency:.2f} s" if latency is not None else "")
        + f"  ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return rows


def hard_rows(limit: int = 0) -> list[ManifestRow]:
    """The LibriSpeech test-other clips of ``manifest.tsv``; the first ``limit`` where given."""
    folder = speech_dir()
    rows = [r for r in read_manifest(folder / "manifest.tsv") if r.file.startswith(HARD_FOLDER)]
    return rows[:limit] if limit else rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=0, help="first N test-other clips only")
    parser.add_argument(
        "--lever",
        action="append",
        choices=[*(lever.name for lever in LEVERS), "none"],
        help="the levers to try (default: all; none: the conditions only)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="streaming.FIELD=JSON for every condition streamed (e.g. a rule's knob)",
    )
    parser.add_argument(
        "--noise-scale",
        action="append",
        type=float,
        help=f"decode cost scales for the noise floor (default: {NOISE_SCALES}; 1 skips it)",
    )
    parser.add_argument(
        "--no-references",
        action="store_true",
        help="stream only the phone line and the levers (wide and offline skipped: a second "
        "process can try levers beside a first that measures the rest)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="take the phone line's clip rows from this earlier result file instead of "
        "streaming them again (modelled costs make them the same)",
    )
    parser.add_argument("--out", default="telephony")
    args = parser.parse_args(argv)

    clips = []
    for row in hard_rows(args.limit):
        audio = load_speech(row.file)
        clips.append(Clip(row, audio, phone_line(audio, LAW)))
    levers = [lever for lever in LEVERS if not args.lever or lever.name in args.lever]
    streaming, _, _ = _overrides(args.set)
    scales = [s for s in (args.noise_scale or NOISE_SCALES) if s != 1.0]

    engine = Engine.load(EngineConfig())
    engine.warmup()
    load_start = os.getloadavg()
    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    lever_report: dict[str, Any] = {}

    def save() -> dict[str, Any]:
        """Everything measured so far, written out: a long run that is stopped keeps it."""
        summary = {name: pooled(rows) for name, rows in results.items()}
        wide, phone = summary.get("wide"), summary.get("phone")
        noise = [
            abs(summary[f"phone_x{s}"]["errors"] - phone["errors"]) * 100 / phone["ref_words"]
            for s in scales
            if phone is not None and f"phone_x{s}" in summary
        ]
        headline = {
            name: summary[name]["wer"] if name in summary else None
            for name in ("wide", "phone", "phone_offline", "wide_offline")
        }
        headline = {f"wer_{k}": v for k, v in headline.items()}
        if wide is not None and phone is not None:
            headline["points_phone_vs_wide"] = round(
                100 * (phone["errors"] - wide["errors"]) / wide["ref_words"], 2
            )
            headline["final_latency_p95_wide_s"] = wide.get("final_latency_p95_s")
            headline["final_latency_p95_phone_s"] = phone.get("final_latency_p95_s")
        headline["noise_points"] = round(max(noise), 2) if noise else None
        headline["kept"] = [name for name, r in lever_report.items() if r["beyond_noise"]]
        data = {
            "headline": headline,
            "summary": summary,
            "levers": lever_report,
            "clips": results,
            "channel": {"band_hz": list(PHONE_BAND_HZ), "rate_hz": PHONE_RATE_HZ, "law": LAW},
            "decode_cost": "modelled x1.0",
            "settings": args.set,
            "noise_scales": scales,
            "engine": dataclasses.asdict(engine.config),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "wall_s": round(time.perf_counter() - started, 1),
        }
        write_results(args.out, data)
        return data

    def measure(name: str, each: Callable[[Clip], dict[str, Any]]) -> None:
        results[name] = run(engine, clips, name, each)
        save()

    if not args.no_references:
        measure("wide", lambda c: stream(engine, c, phone=False, streaming=streaming))
    if args.baseline is not None:
        known = json.loads(args.baseline.read_text())["clips"]["phone"]
        results["phone"] = [r for r in known if r["file"] in {c.row.file for c in clips}]
        if len(results["phone"]) != len(clips):
            raise SystemExit(f"{args.baseline} lacks some of the clips' phone rows")
    else:
        measure("phone", lambda c: stream(engine, c, phone=True, streaming=streaming))
    if not args.no_references:
        measure(
            "phone_offline",
            lambda c: clip_row(c.row, transcribe_audio(engine, decode_line(c.line)).text),
        )
        measure("wide_offline", lambda c: clip_row(c.row, transcribe_audio(engine, c.audio).text))
    for scale in scales:
        measure(
            f"phone_x{scale}",
            lambda c, s=scale: stream(  # type: ignore[misc]
                engine, c, phone=True, cost_scale=s, streaming=streaming
            ),
        )
    noise_points = save()["headline"]["noise_points"] or 0.0
    for lever in levers:

        def each(c: Clip, lever: Lever = lever) -> dict[str, Any]:
            with resample_quality(lever.resample_quality):
                return stream(engine, c, phone=True, vad=lever.vad, streaming=streaming)

        results[lever.name] = run(engine, clips, lever.name, each)
        base, mine = pooled(results["phone"]), pooled(results[lever.name])
        points = round(100 * (mine["errors"] - base["errors"]) / base["ref_words"], 2)
        low, high = paired_bootstrap(results["phone"], results[lever.name])
        lever_report[lever.name] = {
            "points_vs_phone": points,
            "bootstrap_ci_points": [low, high],
            "beyond_noise": points < -noise_points and high < 0,
            "resample_quality": lever.resample_quality,
            "vad": dataclasses.asdict(lever.vad),
        }
        save()
        print(
            f"{lever.name:16s} {points:+.2f} points vs phone, 95% CI [{low:+.2f}, {high:+.2f}]"
            f"{'  kept' if lever_report[lever.name]['beyond_noise'] else ''}",
            flush=True,
        )
    data = save()
    print(f"wrote {RESULTS / args.out}.json")
    print(json.dumps(data["headline"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
