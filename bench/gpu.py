"""Accelerator benchmark: the engine in its device's dtype, on MLX's default device.

    python -m bench.gpu            # or: make bench-gpu

Written for a GPU (the CUDA build of MLX, ``pip install -e '.[cuda]'``, or Apple silicon),
where the engine runs in float16; on a CPU it runs too, in float32. Measured, tiny.en:
- the device, the model's load (CTranslate2 conversion included) and the first-call warm-up;
- one window end to end (log-mel, encoder, greedy tokens, word times) for 1-30 s of speech,
  and beam 5 at 2 s and 5 s;
- throughput: distinct 5 s windows of different clips decoded as one batch of 1-64 (each row
  is one stream's re-decode, as the scheduler batches them): the batch's wall time and audio
  seconds per wall second;
- accuracy: each short English clip decoded offline (``transcribe_audio``, greedy and beam 5)
  in the device's dtype and in float32 on the same device: WER per source folder, and how
  many clips read the same in both dtypes.

Sections stop early once ``--budget-s`` is spent, and say so. Writes
``bench/results/<output>.json``; the last line printed is one JSON object with the headline.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from bench.corpus import load_clip, read_manifest, wer
from bench.engine import (
    LONG_CLIP,
    RESULTS,
    Float32Array,
    speech_dir,
    summary,
    timed,
    write_results,
)
from server.core.engine_api import DecodeOptions, DecodeRequest, Window
from server.engine.blas import check_blas, import_mlx
from server.engine.engine import Engine, EngineConfig
from server.engine.offline import transcribe_audio
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.gpu")

WINDOW_SECONDS = (1, 2, 5, 10, 30)
BEAM_SECONDS = (2, 5)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
BATCH_WINDOW_S = 5
MAX_CLIP_S = 30.0  # one offline window: what the accuracy section decodes


# Each section's share of --budget-s, in order: windows, throughput, accuracy (the rest).
SHARES = (0.2, 0.3, 0.5)


@dataclass
class Deadline:
    """When a section must stop starting new measurements."""

    ends_at: float

    def left_s(self) -> float:
        return self.ends_at - time.perf_counter()


def device_info(mx: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "mlx": getattr(mx, "__version__", "?"),
        "default_device": str(mx.default_device()),
        "cuda": bool(mx.cuda.is_available()),
        "metal": bool(mx.metal.is_available()),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if info["cuda"]:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]
        try:
            shown = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True)
            info["gpu"] = shown.stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError) as exc:
            info["gpu"] = f"nvidia-smi failed: {exc}"
    return info


def bench_windows(engine: Engine, repeats: int, deadline: Deadline) -> dict[str, Any]:
    audio = load_clip(speech_dir() / LONG_CLIP)
    cases = [(s, 1) for s in WINDOW_SECONDS] + [(s, 5) for s in BEAM_SECONDS]
    out: dict[str, Any] = {}
    for seconds, beam in cases:
        label = f"{seconds}s" if beam == 1 else f"{seconds}s_beam{beam}"
        if deadline.left_s() <= 0:
            out[label] = "skipped: out of time"
            continue
        window = audio[: seconds * SAMPLE_RATE_HZ]
        request = DecodeRequest(float(seconds), DecodeOptions(beam_size=beam))

        def decode(window: Float32Array = window, request: DecodeRequest = request) -> str:
            return engine.decode_windows([Window(engine.features(window), request)])[0].text

        times = timed(decode, repeats=repeats, budget_s=min(8.0, deadline.left_s()))
        out[label] = {**summary(times), "text": decode()}
        logger.info("window %s: %s", label, out[label])
    return out


def batch_windows(n: int) -> list[Float32Array]:
    """``n`` distinct 5 s windows: the start of each clip long enough, then later stretches."""
    rows = [r for r in read_manifest(speech_dir() / "manifest.tsv") if r.language == "en"]
    rows.sort(key=lambda r: (-r.seconds, r.file))
    size = BATCH_WINDOW_S * SAMPLE_RATE_HZ
    audios = [load_clip(speech_dir() / r.file) for r in rows if r.seconds >= BATCH_WINDOW_S]
    windows: list[Float32Array] = []
    offset = 0
    while len(windows) < n:
        fitting = [a[offset : offset + size] for a in audios if len(a) >= offset + size]
        if not fitting:
            raise SystemExit(f"the speech folder holds fewer than {n} distinct 5 s windows")
        windows.extend(fitting[: n - len(windows)])
        offset += size
    return windows


def bench_throughput(
    engine: Engine, batches: tuple[int, ...], repeats: int, deadline: Deadline
) -> dict[str, Any]:
    windows = batch_windows(max(batches))
    out: dict[str, Any] = {"window_s": BATCH_WINDOW_S}
    for batch in batches:
        if deadline.left_s() <= 0:
            out[f"b{batch}"] = "skipped: out of time"
            continue
        chosen = windows[:batch]

        def decode(chosen: list[Float32Array] = chosen) -> None:
            engine.decode_windows(
                [Window(engine.features(a), DecodeRequest(float(BATCH_WINDOW_S))) for a in chosen]
            )

        times = timed(decode, repeats=repeats, budget_s=min(8.0, deadline.left_s()))
        stats = summary(times)
        out[f"b{batch}"] = {
            **stats,
            "audio_s_per_s": round(batch * BATCH_WINDOW_S / (stats["p50_ms"] / 1000.0), 1),
        }
        logger.info("batch %d: %s", batch, out[f"b{batch}"])
    return out


def bench_accuracy(engines: dict[str, Engine], deadline: Deadline) -> dict[str, Any]:
    """Offline WER per source folder, per dtype and search; clips whose text the dtypes share."""
    rows = [
        r
        for r in read_manifest(speech_dir() / "manifest.tsv")
        if r.language == "en" and r.seconds <= MAX_CLIP_S
    ]
    rows.sort(key=lambda r: ("test-other" not in r.file, r.file))  # the hard clips first
    searches = {"greedy": None, "beam5": DecodeOptions(word_timestamps=False, beam_size=5)}
    texts: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)  # (dtype, search) -> texts
    done: list[str] = []
    for row in rows:
        if deadline.left_s() <= 0:
            break
        audio = load_clip(speech_dir() / row.file)
        for dtype, engine in engines.items():
            for search, options in searches.items():
                texts[(dtype, search)][row.file] = transcribe_audio(engine, audio, options).text
        done.append(row.file)
    refs = {r.file: r.transcript for r in rows}
    folders = sorted({f.split("/")[0] for f in done})
    out: dict[str, Any] = {"clips": len(done), "of": len(rows), "wer": {}, "same_text": {}}
    for (dtype, search), got in texts.items():
        for folder in folders:
            files = [f for f in done if f.startswith(folder + "/")]
            wer_pct = 100 * wer([refs[f] for f in files], [got[f] for f in files])
            out["wer"].setdefault(folder, {})[f"{dtype}_{search}"] = round(wer_pct, 2)
    if len(engines) == 2:
        low, high = list(engines)
        for search in searches:
            same = sum(texts[(low, search)][f] == texts[(high, search)][f] for f in done)
            out["same_text"][search] = f"{same}/{len(done)}"
    out["texts"] = {f"{d}_{s}": got for (d, s), got in texts.items()}
    logger.info("accuracy: %s", {k: out[k] for k in ("clips", "wer", "same_text")})
    return out


def report(results: dict[str, Any]) -> str:
    dev = results["device"]
    lines = [
        f"tiny.en {results['dtype']} on {dev.get('gpu') or dev['default_device']} "
        f"(MLX {dev['mlx']}); load {results['load_s']:.1f} s, warm-up {results['warmup_s']:.1f} s",
        "",
        "window          p50 ms   p95 ms",
    ]
    for label, row in results["windows"].items():
        if isinstance(row, dict):
            lines.append(f"{label:<14} {row['p50_ms']:>7.1f}  {row['p95_ms']:>7.1f}")
        else:
            lines.append(f"{label:<14} {row}")
    lines += ["", f"batch of {BATCH_WINDOW_S} s windows   p50 ms   audio s/s"]
    for label, row in results["throughput"].items():
        if isinstance(row, dict):
            lines.append(f"{label:<24} {row['p50_ms']:>7.1f}  {row['audio_s_per_s']:>9.1f}")
        elif label != "window_s":
            lines.append(f"{label:<24} {row}")
    acc = results.get("accuracy")
    if acc:
        lines += ["", f"offline WER %, {acc['clips']} of {acc['of']} clips"]
        for folder, by in acc["wer"].items():
            cells = "  ".join(f"{k} {v:.2f}" for k, v in sorted(by.items()))
            lines.append(f"{folder:<26} {cells}")
        if acc["same_text"]:
            lines.append(f"same text in both dtypes: {acc['same_text']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per figure")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time for the whole run")
    parser.add_argument("--max-batch", type=int, default=max(BATCHES), help="largest batch")
    parser.add_argument("--output", default="gpu", help="results name in bench/results")
    parser.add_argument(
        "--no-float32", action="store_true", help="skip the float32 comparison in accuracy"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.perf_counter()
    check_blas()
    mx = import_mlx()
    engine = Engine.load()
    warmup_s = engine.warmup()
    results: dict[str, Any] = {
        "device": device_info(mx),
        "dtype": engine.loaded.dtype,
        "load_s": round(engine.loaded.load_s, 2),
        "warmup_s": round(warmup_s, 2),
    }
    logger.info("%s", results)

    def deadline(section: int) -> Deadline:
        left = args.budget_s - (time.perf_counter() - started)
        return Deadline(time.perf_counter() + SHARES[section] / sum(SHARES[section:]) * left)

    results["windows"] = bench_windows(engine, args.repeats, deadline(0))
    batches = tuple(b for b in BATCHES if b <= args.max_batch)
    repeats = max(3, args.repeats // 2)
    results["throughput"] = bench_throughput(engine, batches, repeats, deadline(1))
    engines = {engine.loaded.dtype: engine}
    if engine.loaded.dtype != "float32" and not args.no_float32:
        engines["float32"] = Engine.load(EngineConfig(dtype="float32"))
    results["accuracy"] = bench_accuracy(engines, deadline(2))
    results["wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results(args.output, results)
    print(report(results))
    print(f"\nwrote {path.relative_to(RESULTS.parent.parent)} in {results['wall_s']:.0f} s")
    windows = results["windows"]
    throughput = results["throughput"]
    best = max(
        (row["audio_s_per_s"] for row in throughput.values() if isinstance(row, dict)),
        default=None,
    )
    headline = {
        "device": results["device"].get("gpu") or results["device"]["default_device"],
        "dtype": results["dtype"],
        "window_2s_ms_p50": windows["2s"]["p50_ms"] if isinstance(windows["2s"], dict) else None,
        "best_audio_s_per_s": best,
        "wer_test_other": results["accuracy"]["wer"].get("librispeech_test-other"),
    }
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
