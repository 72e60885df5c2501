"""What beam search costs per engine call on this machine, beside greedy decoding.

    python -m bench.beam                 # or: make bench-beam

Two kinds of call, on test-other clips (the speech where beams disagree):

- a stream's closing decode: the window's last seconds (2, 5 and 10 s) at the engine's
  dynamic context, with the window's first words forced as its prefix, as the session sends
  it when an utterance ends;
- an offline 30 s window (full context), as ``transcribe_audio`` decodes it.

Each is timed greedy and with beams of 2 and 5 (MLX work evaluated inside the timed region;
warmed up first), with the tokens each search stepped and the extra cost over greedy.
Output: ``bench/results/beam.json`` and a table; the last line is one JSON object with the
headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench.engine import load_speech, summary, write_results
from server.core.engine_api import DecodeOptions, DecodeRequest
from server.engine.engine import Engine, EngineConfig
from server.engine.features import N_FRAMES
from server.protocol.formats import SAMPLE_RATE_HZ

CLIPS = (
    "librispeech_test-other/2609-156975-0004.wav",
    "librispeech_test-other/3080-5032-0006.wav",
    "librispeech_test-other/367-130732-0003.wav",
)
WINDOWS_S = (2.0, 5.0, 10.0)
WIDTHS = (1, 2, 5)
PREFIX_WORDS = 3  # committed words forced ahead of a closing decode's tail


def _time_call(engine: Engine, request: DecodeRequest, feats: Any, repeats: int) -> list[float]:
    engine.decode_encoded([request], feats)  # warm: shapes and caches
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.decode_encoded([request], feats)
        times.append(time.perf_counter() - started)
    return times


def measure(engine: Engine, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for clip in CLIPS:
        audio = load_speech(clip)
        offline_mel = engine.features(audio[: 30 * SAMPLE_RATE_HZ], N_FRAMES)
        full = engine.decode_encoded(
            [DecodeRequest(min(30.0, audio.shape[0] / SAMPLE_RATE_HZ))],
            engine.encode([offline_mel]),
        )[0]
        words = full.text.split()
        cases: list[tuple[str, float, Any, tuple[int, ...]]] = []
        for window_s in WINDOWS_S:
            piece = audio[: round(window_s * SAMPLE_RATE_HZ)]
            prefix = engine.encode_text(" " + " ".join(words[:PREFIX_WORDS]))
            cases.append(("closing", window_s, engine.encode([engine.features(piece)]), prefix))
        cases.append(("offline", 30.0, engine.encode([offline_mel]), ()))
        for kind, window_s, feats, prefix in cases:
            audio_s = min(window_s, audio.shape[0] / SAMPLE_RATE_HZ)
            greedy_p50 = None
            for width in WIDTHS:
                request = DecodeRequest(
                    audio_s,
                    DecodeOptions(word_timestamps=kind == "closing", beam_size=width),
                    prefix=prefix,
                )
                times = _time_call(engine, request, feats, repeats)
                result = engine.decode_encoded([request], feats)[0]
                stats = summary(times)
                greedy_p50 = greedy_p50 or stats["p50_ms"]
                rows.append(
                    {
                        "clip": clip,
                        "kind": kind,
                        "window_s": window_s,
                        "beam_size": width,
                        "tokens": result.n_generated,
                        "steps": result.n_steps,
                        **stats,
                        "x_greedy": round(stats["p50_ms"] / greedy_p50, 2),
                    }
                )
                print(
                    f"{kind:8s} {window_s:5.1f} s  beam {width}  {stats['p50_ms']:8.1f} ms "
                    f"({rows[-1]['x_greedy']:.2f}x greedy)  {result.n_generated:3d} tokens  {clip}",
                    flush=True,
                )
    return rows


def _headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, window_s in [("closing", w) for w in WINDOWS_S] + [("offline", 30.0)]:
        for width in WIDTHS[1:]:
            picked = [
                r
                for r in rows
                if (r["kind"], r["window_s"], r["beam_size"]) == (kind, window_s, width)
            ]
            greedy = [
                r for r in rows if (r["kind"], r["window_s"], r["beam_size"]) == (kind, window_s, 1)
            ]
            key = f"{kind}_{window_s:g}s_beam{width}"
            out[f"{key}_ms_p50"] = round(sorted(r["p50_ms"] for r in picked)[len(picked) // 2], 1)
            out[f"{key}_extra_ms_p50"] = round(
                sorted(p["p50_ms"] - g["p50_ms"] for p, g in zip(picked, greedy, strict=True))[
                    len(picked) // 2
                ],
                1,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per figure")
    parser.add_argument("--out", default="beam")
    args = parser.parse_args(argv)
    engine = Engine.load(EngineConfig())
    engine.warmup()
    load_start = os.getloadavg()
    started = time.perf_counter()
    rows = measure(engine, args.repeats)
    headline = _headline(rows)
    data = {
        "headline": headline,
        "rows": rows,
        "engine": {"model": engine.name, "device": str(engine.decoder.dtype)},
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
