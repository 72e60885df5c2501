"""webrtcvad against Silero VAD: where each finds speech starting and ending, what noise each
calls speech, what a frame costs; and the words the whole core makes of 30 s of noise.

    python -m bench.vad_compare                # or: make bench-vad
    python -m bench.vad_compare --quick        # 12 clips, two noise levels: a smoke run

1. Speech. Every English clip of shared/speech/manifest.tsv with 1 s of silence before it and
   1.5 s after, through each segmenter (server/core/vad.py's webrtcvad ``VadSegmenter`` at its
   default mode 2, 30 ms frames; server/turns/silero_vad.py's ``SileroSegmenter`` at threshold
   0.5), both with the default ``VadConfig`` timings but no pad, so the boundaries are the
   detectors' own. Then again with the clip and the silences under pink noise 10 dB below the
   clip's speech. Where the speech starts and ends is the clean clip's first and last 10 ms
   frame within 30 dB of its loudest (tests/test_vad.py's reference; the decode's word times
   are no use at the edges: Whisper's alignment stretches the first word back to the window's
   start and the last to its end): start error = the first segment's start minus that
   onset, end error = the last segment's end minus that offset. A word of the offline decode
   (tiny.en, greedy, word times from cross-attention) is missed when no segment overlaps it.
2. Noise. 30 s each of white, pink and brown noise, 50 Hz mains hum with harmonics and a room
   tone (brown rumble, pink air, a little hum), seeded, at -50, -40, -30 and -20 dBFS RMS: the
   seconds each segmenter calls speech. The shared clips' speech is at -21 dBFS (median of
   ``speech_dbfs``), so noise at -20 dBFS is as loud as the speech, at -30 dBFS 10 dB below.
3. Cost per frame, warmed up: wall and CPU time (the machine is shared: the wall time includes
   waiting for a core), and the share of one core a stream's VAD takes (CPU time).
4. The core on the noises: ``bench.simulate.simulate`` with the real tiny.en engine at the
   modelled decode cost (``bench.accuracy.modelled_cost_s``), the words that come out; with
   webrtcvad (today's core) and with Silero in its place (``Session``'s ``frame_voicing``).
5. The core on speech (``--parts accuracy``, not run by default: on this 2-core machine it
   takes about a minute a clip): the 40 test-other clips (``--accuracy-clips``, spread over
   the four chapters), 1 s before and 1.5 s after, clean and under pink noise 10 dB down,
   streamed through the core the same way with each VAD: word errors, end of speech to final
   as bench-accuracy counts it (from the last final word's decoded end), and the last final's
   arrival after the clip's speech ends (energy bounds; simulated clock).

Output: ``bench/results/vad-compare.json`` and tables; the last line is one JSON object with
the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.accuracy import modelled_cost_s
from bench.accuracy_metrics import count_errors
from bench.corpus import load_clip, read_manifest
from bench.engine import speech_dir, write_results
from bench.simulate import simulate
from server.config import VadConfig
from server.core.engine_api import DecodeOptions
from server.core.vad import SpeechEnded, SpeechStarted, VadEvent, VadSegmenter
from server.engine.engine import Engine, EngineConfig
from server.engine.offline import transcribe_audio
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import FinalMessage
from server.turns.silero_vad import (
    FRAME_SAMPLES,
    SileroModel,
    SileroVad,
    SileroVadConfig,
    SileroVoicing,
    silero_segmenter,
)

Float32Array = npt.NDArray[np.float32]
Segmenter = VadSegmenter

NOISES = ("white", "pink", "brown", "hum", "room")
LEVELS_DBFS = (-50, -40, -30, -20)
NOISE_S = 30
BEFORE_S, AFTER_S = 1.0, 1.5
NOISY_SNR_DB = 10.0
SEED = 62  # the number: every noise is the same on every run


# --- signals ----------------------------------------------------------------------------------


def speech_dbfs(clip: Float32Array) -> float:
    """The level of a clip's speech: RMS over its 10 ms frames within 30 dB of the loudest."""
    hop = SAMPLE_RATE_HZ // 100
    frames = clip[: clip.size - clip.size % hop].reshape(-1, hop).astype(np.float64)
    energy = np.square(frames).mean(axis=1) + 1e-20
    loud = energy[energy > energy.max() / 1000]
    return float(10 * np.log10(loud.mean()))


def at_level(x: npt.NDArray[np.float64] | Float32Array, dbfs: float) -> Float32Array:
    """``x`` scaled to an RMS of ``dbfs`` (0 dBFS: a full-scale square wave)."""
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
    return (np.asarray(x, np.float64) * (10 ** (dbfs / 20) / rms)).astype(np.float32)


def _coloured(rng: np.random.Generator, n: int, exponent: float) -> npt.NDArray[np.float64]:
    """Noise whose power falls as 1/f**exponent (0 white, 1 pink, 2 brown), flat below 10 Hz
    so brown noise does not wander off as a DC drift."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.maximum(np.fft.rfftfreq(n, 1 / SAMPLE_RATE_HZ), 10.0)
    return np.fft.irfft(spectrum * freqs ** (-exponent / 2), n)


def noise(kind: str, seconds: float, seed: int = SEED) -> npt.NDArray[np.float64]:
    """Unscaled noise of one kind (see the module docstring); scale with ``at_level``."""
    n = round(seconds * SAMPLE_RATE_HZ)
    rng = np.random.default_rng([seed, NOISES.index(kind)])
    t = np.arange(n) / SAMPLE_RATE_HZ
    # Mains hum: 50 Hz and its harmonics, falling, as a transformer or a ground loop gives.
    amplitudes = (1.0, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05)
    hum = sum(a * np.sin(2 * np.pi * 50 * k * t + k) for k, a in enumerate(amplitudes, 1))
    hum = np.asarray(hum, dtype=np.float64)
    if kind == "white":
        return rng.standard_normal(n)
    if kind == "pink":
        return _coloured(rng, n, 1.0)
    if kind == "brown":
        return _coloured(rng, n, 2.0)
    if kind == "hum":
        return hum
    if kind == "room":
        # Ventilation rumble, air 12 dB below it, hum 26 dB below.
        return np.asarray(
            at_level(_coloured(rng, n, 2.0), 0)
            + at_level(_coloured(rng, n, 1.0), -12)
            + at_level(hum, -26),
            np.float64,
        )
    raise ValueError(f"noise kind must be one of {NOISES}; got {kind!r}")


# --- segmenters -------------------------------------------------------------------------------


def _segments(events: list[VadEvent]) -> list[tuple[int, int]]:
    starts = [e.start_sample for e in events if isinstance(e, SpeechStarted)]
    ends = [e.end_sample for e in events if isinstance(e, SpeechEnded)]
    return list(zip(starts, ends, strict=True))


def run_segmenter(segmenter: Segmenter, audio: Float32Array) -> list[tuple[int, int]]:
    """Segments in samples, the stream fed 20 ms at a time as a client sends it."""
    step = SAMPLE_RATE_HZ // 50
    events: list[VadEvent] = []
    for pos in range(0, audio.size, step):
        events += segmenter.receive(audio[pos : pos + step])
    return _segments(events + segmenter.flush())


def segmenters(model: SileroModel, config: VadConfig) -> dict[str, Callable[[], Segmenter]]:
    return {
        "webrtcvad": lambda: VadSegmenter(config),
        "silero": lambda: silero_segmenter(config, model, SileroVadConfig()),
    }


def voicing_of(name: str, model: SileroModel) -> Callable[[], SileroVoicing] | None:
    """The session's detector by name: None (webrtcvad, the session's own) or Silero's."""
    return (lambda: SileroVoicing(model)) if name == "silero" else None


# --- 1. speech ----------------------------------------------------------------------------------


def reference_words(engine: Engine, clip: Float32Array) -> list[tuple[float, float]]:
    """(start, end) seconds of each word of the offline greedy decode."""
    transcript = transcribe_audio(engine, clip, DecodeOptions(word_timestamps=True))
    return [(w.start_s, w.end_s) for w in transcript.words if w.word.strip()]


def energy_bounds_s(clip: Float32Array) -> tuple[float, float]:
    """Start of the first and end of the last 10 ms frame within 30 dB of the loudest."""
    hop = SAMPLE_RATE_HZ // 100
    frames = clip[: clip.size - clip.size % hop].reshape(-1, hop).astype(np.float64)
    db = 10 * np.log10(np.square(frames).mean(axis=1) + 1e-12)
    loud = np.flatnonzero(db > db.max() - 30)
    return int(loud[0]) / 100, (int(loud[-1]) + 1) / 100


def score_speech(
    segments: list[tuple[int, int]],
    bounds: tuple[float, float],
    words: list[tuple[float, float]],
    offset_s: float,
) -> dict[str, Any]:
    spans = [(a / SAMPLE_RATE_HZ - offset_s, b / SAMPLE_RATE_HZ - offset_s) for a, b in segments]
    missed = sum(not any(a < we and ws < b for a, b in spans) for ws, we in words)
    return {
        "segments": len(spans),
        "start_error_s": round(spans[0][0] - bounds[0], 3) if spans else None,
        "end_error_s": round(spans[-1][1] - bounds[1], 3) if spans else None,
        "words": len(words),
        "missed_words": missed,
    }


def _abs_stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median_abs_s": None, "p90_abs_s": None, "median_s": None}
    a = sorted(abs(v) for v in values)
    return {
        "median_abs_s": round(statistics.median(a), 3),
        "p90_abs_s": round(a[min(len(a) - 1, round(0.9 * (len(a) - 1)))], 3),
        "median_s": round(statistics.median(values), 3),
    }


def speech_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    found = [r for r in rows if r["segments"]]
    starts = [r["start_error_s"] for r in found]
    ends = [r["end_error_s"] for r in found]
    return {
        "clips": len(rows),
        "clips_with_no_segment": len(rows) - len(found),
        "start": _abs_stats(starts),
        "end": _abs_stats(ends),
        "starts_off_by_more_than_0.2s": sum(abs(s) > 0.2 for s in starts),
        "ends_off_by_more_than_0.3s": sum(abs(e) > 0.3 for e in ends),
        "missed_words": sum(r["missed_words"] for r in rows),
        "words": sum(r["words"] for r in rows),
        "segments_per_clip": round(statistics.fmean(r["segments"] for r in rows), 2),
    }


def measure_speech(
    engine: Engine, model: SileroModel, files: list[str]
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    folder = speech_dir()
    config = VadConfig(speech_pad_ms=0)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {"clean": {}, "pink_10db": {}}
    for i, file in enumerate(files):
        clip = load_clip(folder / file)
        words = reference_words(engine, clip)
        bounds = energy_bounds_s(clip)
        before = np.zeros(round(BEFORE_S * SAMPLE_RATE_HZ), np.float32)
        after = np.zeros(round(AFTER_S * SAMPLE_RATE_HZ), np.float32)
        stream = np.concatenate([before, clip, after])
        bed = noise("pink", stream.size / SAMPLE_RATE_HZ, SEED + i)
        noisy = stream + at_level(bed, speech_dbfs(clip) - NOISY_SNR_DB)
        for condition, audio in (("clean", stream), ("pink_10db", noisy)):
            for name, make in segmenters(model, config).items():
                row = score_speech(run_segmenter(make(), audio), bounds, words, BEFORE_S)
                out[condition].setdefault(name, []).append(
                    {"file": file, "speech_dbfs": round(speech_dbfs(clip), 1), **row}
                )
        print(
            f"{file:55s} "
            + "  ".join(
                f"{c}/{n}: {rows[-1]['start_error_s']} {rows[-1]['end_error_s']}"
                for c, by_name in out.items()
                for n, rows in by_name.items()
            ),
            flush=True,
        )
    return out


# --- 2. noise -----------------------------------------------------------------------------------


def measure_noise(model: SileroModel, levels: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for kind in NOISES:
        raw = noise(kind, NOISE_S)
        for level in levels:
            audio = at_level(raw, level)
            row: dict[str, Any] = {"noise": kind, "dbfs": level}
            for name, make in segmenters(model, VadConfig()).items():
                segments = run_segmenter(make(), audio)
                row[f"{name}_speech_s"] = round(sum(b - a for a, b in segments) / SAMPLE_RATE_HZ, 2)
                row[f"{name}_segments"] = len(segments)
            rows.append(row)
            print(
                f"{kind:6s} {level:4d} dBFS  webrtcvad {row['webrtcvad_speech_s']:5.1f} s "
                f"({row['webrtcvad_segments']})  silero {row['silero_speech_s']:5.1f} s "
                f"({row['silero_segments']})",
                flush=True,
            )
    return rows


# --- 3. cost ------------------------------------------------------------------------------------


def measure_cost(model: SileroModel, audio: Float32Array) -> dict[str, Any]:
    import webrtcvad

    frames_w = [pcm_s16le_bytes(audio[i : i + 480]) for i in range(0, audio.size - 480 + 1, 480)]
    frames_s = [
        audio[i : i + FRAME_SAMPLES]
        for i in range(0, audio.size - FRAME_SAMPLES + 1, FRAME_SAMPLES)
    ]
    vad = webrtcvad.Vad(2)
    silero = SileroVad(model)
    for f in frames_w[:50]:
        vad.is_speech(f, SAMPLE_RATE_HZ)
    for g in frames_s[:50]:
        silero.probability(g)
    silero.reset()
    cpu = time.process_time()
    started = time.perf_counter()
    for f in frames_w:
        vad.is_speech(f, SAMPLE_RATE_HZ)
    webrtc_s = (time.perf_counter() - started) / len(frames_w)
    webrtc_cpu_s = (time.process_time() - cpu) / len(frames_w)
    cpu = time.process_time()
    started = time.perf_counter()
    for g in frames_s:
        silero.probability(g)
    silero_s = (time.perf_counter() - started) / len(frames_s)
    silero_cpu_s = (time.process_time() - cpu) / len(frames_s)
    return {
        "webrtcvad_us_per_frame": round(webrtc_s * 1e6, 1),
        "webrtcvad_cpu_us_per_frame": round(webrtc_cpu_s * 1e6, 1),
        "webrtcvad_frame_ms": 30,
        "webrtcvad_core_share": round(webrtc_cpu_s / 0.030, 5),
        "silero_us_per_frame": round(silero_s * 1e6, 1),
        "silero_cpu_us_per_frame": round(silero_cpu_s * 1e6, 1),
        "silero_frame_ms": 32,
        "silero_core_share": round(silero_cpu_s / 0.032, 5),
        "frames": [len(frames_w), len(frames_s)],
    }


# --- 4. the core on noise -----------------------------------------------------------------------


def measure_core(
    engine: Engine, model: SileroModel, levels: tuple[int, ...]
) -> list[dict[str, Any]]:
    rows = []
    for kind in NOISES:
        raw = noise(kind, NOISE_S)
        for level in levels:
            audio = at_level(raw, level)
            row: dict[str, Any] = {"noise": kind, "dbfs": level}
            for name in ("webrtcvad", "silero"):
                result = simulate(
                    engine,
                    audio,
                    decode_cost_s=modelled_cost_s,
                    frame_voicing=voicing_of(name, model),
                )
                row[f"{name}_text"] = result.text
                row[f"{name}_words"] = len(result.text.split())
                row[f"{name}_decodes"] = len(result.decode_s)
            rows.append(row)
            print(
                f"{kind:6s} {level:4d} dBFS  webrtcvad: {row['webrtcvad_text']!r}  "
                f"silero: {row['silero_text']!r}",
                flush=True,
            )
    return rows


def measure_accuracy(engine: Engine, model: SileroModel, clips_n: int) -> dict[str, Any]:
    folder = speech_dir()
    rows = [r for r in read_manifest(folder / "manifest.tsv") if "test-other" in r.file]
    rows = rows[:: max(1, len(rows) // clips_n)][:clips_n]  # spread over the four chapters
    clips: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        clip = load_clip(folder / row.file)
        before = np.zeros(round(BEFORE_S * SAMPLE_RATE_HZ), np.float32)
        after = np.zeros(round(AFTER_S * SAMPLE_RATE_HZ), np.float32)
        stream = np.concatenate([before, clip, after])
        bed = noise("pink", stream.size / SAMPLE_RATE_HZ, SEED + 1000 + i)
        noisy = stream + at_level(bed, speech_dbfs(clip) - NOISY_SNR_DB)
        speech_end_s = BEFORE_S + energy_bounds_s(clip)[1]
        out: dict[str, Any] = {
            "file": row.file,
            "ref_words": count_errors(row.transcript, "").ref_words,
        }
        for condition, audio in (("clean", stream), ("pink_10db", noisy)):
            for name in ("webrtcvad", "silero"):
                result = simulate(
                    engine,
                    audio,
                    decode_cost_s=modelled_cost_s,
                    frame_voicing=voicing_of(name, model),
                )
                counts = count_errors(row.transcript, result.text)
                out[f"{condition}_{name}_errors"] = counts.errors
                out[f"{condition}_{name}_eos_to_final_s"] = [
                    round(x, 3) for x in result.end_of_speech_to_final_s()
                ]
                # The word-time figure above moves with the decode's alignment of the last
                # word, which differs between runs that cut different windows; the clock time
                # of the last final after where the speech really ends does not.
                finals = [e.at_s for e in result.events if isinstance(e.message, FinalMessage)]
                out[f"{condition}_{name}_last_final_after_speech_s"] = (
                    round(max(finals) - speech_end_s, 3) if finals else None
                )
        clips.append(out)
        print(
            f"{row.file:50s} "
            + " ".join(
                f"{k.removesuffix('_errors')}={v}" for k, v in out.items() if k.endswith("_errors")
            ),
            flush=True,
        )
    words = sum(c["ref_words"] for c in clips)
    summary_: dict[str, Any] = {"clips": len(clips), "ref_words": words}
    for condition in ("clean", "pink_10db"):
        for name in ("webrtcvad", "silero"):
            errors = sum(c[f"{condition}_{name}_errors"] for c in clips)
            waits = sorted(x for c in clips for x in c[f"{condition}_{name}_eos_to_final_s"])
            arrivals: list[float] = sorted(
                x
                for c in clips
                if (x := c[f"{condition}_{name}_last_final_after_speech_s"]) is not None
            )
            summary_[f"{condition}_{name}"] = {
                "errors": errors,
                "wer": round(errors / words, 4),
                "last_final_after_speech_p50_s": (
                    round(statistics.median(arrivals), 3) if arrivals else None
                ),
                "last_final_after_speech_max_s": arrivals[-1] if arrivals else None,
                "eos_to_final_p50_s": round(statistics.median(waits), 3) if waits else None,
                "eos_to_final_p95_s": (
                    round(waits[min(len(waits) - 1, round(0.95 * (len(waits) - 1)))], 3)
                    if waits
                    else None
                ),
            }
    return {"summary": summary_, "clips": clips}


PARTS = ("speech", "noise", "cost", "core", "accuracy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="12 clips (4 for accuracy), noise at -40/-20 dBFS"
    )
    parser.add_argument(
        "--parts",
        default="speech,noise,cost,core",
        help=f"comma-separated, of {','.join(PARTS)} (accuracy is not in the default)",
    )
    parser.add_argument(
        "--accuracy-clips", type=int, default=40, help="test-other clips for --parts accuracy"
    )
    parser.add_argument("--out", default="vad-compare")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(f"--parts must be of {', '.join(PARTS)}; got {args.parts}")
    folder = speech_dir()
    files = [r.file for r in read_manifest(folder / "manifest.tsv") if r.language == "en"]
    levels: tuple[int, ...] = LEVELS_DBFS
    if args.quick:
        files, levels = files[:: max(1, len(files) // 12)][:12], (-40, -20)
    engine = Engine.load(EngineConfig())
    engine.warmup()
    model = SileroModel()
    load_start = os.getloadavg()
    started = time.perf_counter()
    data: dict[str, Any] = {}
    headline: dict[str, Any] = {}
    if "cost" in parts:
        long = load_clip(folder / "ljspeech/long/LJ001-0001_to_0032.concat.wav")
        data["cost"] = cost = measure_cost(model, long)
        print(json.dumps(cost), flush=True)
        for name in ("webrtcvad", "silero"):
            headline[f"{name}_cpu_us_per_frame"] = cost[f"{name}_cpu_us_per_frame"]
    if "speech" in parts:
        speech = measure_speech(engine, model, files)
        summaries = {
            condition: {name: speech_summary(rows) for name, rows in by_name.items()}
            for condition, by_name in speech.items()
        }
        data["speech"], data["speech_clips"] = summaries, speech
        for condition, by_name in summaries.items():
            for name, s in by_name.items():
                print(f"{condition:10s} {name:10s} {json.dumps(s)}")
                headline[f"{condition}_{name}_start_median_abs_s"] = s["start"]["median_abs_s"]
                headline[f"{condition}_{name}_end_median_abs_s"] = s["end"]["median_abs_s"]
                headline[f"{condition}_{name}_missed_words"] = s["missed_words"]
    if "noise" in parts:
        data["noise"] = rows = measure_noise(model, levels)
        for name in ("webrtcvad", "silero"):
            headline[f"noise_speech_s_{name}"] = round(sum(r[f"{name}_speech_s"] for r in rows), 1)
    if "core" in parts:
        data["core_on_noise"] = rows = measure_core(engine, model, levels)
        for name in ("webrtcvad", "silero"):
            headline[f"noise_words_{name}"] = sum(r[f"{name}_words"] for r in rows)
    if "accuracy" in parts:
        data["accuracy"] = accuracy = measure_accuracy(
            engine, model, 4 if args.quick else args.accuracy_clips
        )
        for key, value in accuracy["summary"].items():
            if isinstance(value, dict):
                print(f"{key:20s} {json.dumps(value)}")
                headline[f"accuracy_{key}_errors"] = value["errors"]
    data = {
        "headline": headline,
        **data,
        "engine": {"model": engine.name},
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    path = write_results(args.out, data)
    print(f"wrote {path}")
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
