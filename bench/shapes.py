"""What a large-v3-turbo-shaped model costs per streaming window on this CPU.

    python -m bench.shapes [--shape large-v3-turbo] [--dtype float32] [--repeats 5]

No real large weights reach these machines, so the checkpoint is built on the spot at the
shape's full size with seeded random weights (``bench/checkpoints.py``: 32 encoder layers,
4 decoder layers, 1280 wide, 128 mel bands, 51866 tokens), written in mlx-community's layout
and loaded through ``server.engine.store`` like a fetched one. Random weights emit random
tokens, so a window's decode runs to whatever its loop guards or its token cap allow: the
figures are the encoder's cost per window, the decoder's cost per token, and the whole
window's, with the tokens it took.

Measured: 2 s windows of real speech (the streaming policy's context: 3 s) through
``Engine.decode_windows``, one stream; and the same for tiny.en, beside it, for scale.
Writes ``bench/results/shapes-<shape>.json``; the last line printed is its headline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import shape, write_mlx
from bench.engine import load_speech, summary, timed, write_results
from server.core.engine_api import DecodeRequest, Window
from server.engine.blas import (
    check_blas,
    import_mlx,
    set_blas_threads,
    set_numpy_blas_threads,
)
from server.engine.engine import Engine, EngineConfig
from server.engine.store import load_model
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.shapes")

CLIP = "misc_en/jfk.wav"
WINDOW_S = 2.0


def measure(engine: Engine, repeats: int) -> dict[str, Any]:
    """Encoder, whole-window and per-token cost of a 2 s window, one stream."""
    mx = import_mlx()
    audio = load_speech(CLIP)[: int(WINDOW_S * SAMPLE_RATE_HZ)]
    mel = engine.features(audio)

    def encode() -> None:
        mx.eval(engine.encode([mel])[0])

    tokens: list[int] = []

    def window() -> None:
        (result,) = engine.decode_windows([Window(mel, DecodeRequest(WINDOW_S))])
        tokens.append(result.n_steps + 1)

    encoder = timed(encode, repeats=repeats, budget_s=120.0)
    whole = timed(window, repeats=repeats, budget_s=300.0)
    steps = sorted(tokens[1:])  # the first was the warm-up
    encode_ms = summary(encoder)["p50_ms"]
    window_ms = summary(whole)["p50_ms"]
    median_steps = steps[len(steps) // 2]
    return {
        "context_frames": int(mel.shape[0]),
        "encoder": summary(encoder),
        "window": summary(whole),
        "decoder_steps_p50": median_steps,
        "decoder_ms_per_step": round((window_ms - encode_ms) / max(1, median_steps), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="large-v3-turbo")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    blas = check_blas()
    # As a server's decode lane runs (``Engine.load``): one BLAS thread, numpy's included.
    threads = EngineConfig().blas_threads
    set_blas_threads(threads)
    set_numpy_blas_threads(threads)
    dims = shape(args.shape)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shape": args.shape,
        "dims": dims.__dict__,
        "dtype": args.dtype,
        "blas": dataclasses.asdict(blas),
        "blas_threads": threads,
        "window_s": WINDOW_S,
        "clip": CLIP,
        "load_average_before": list(os.getloadavg()),
    }
    folder = Path(tempfile.mkdtemp(prefix=f"whisperwire-{args.shape}-"))
    try:
        started = time.perf_counter()
        write_mlx(folder, dims, dtype=args.dtype)
        results["build_s"] = round(time.perf_counter() - started, 1)
        loaded = load_model(str(folder), dtype=args.dtype)
        results["load_s"] = round(loaded.load_s, 1)
        engine = Engine(loaded, EngineConfig(model=str(folder)))
        results["model"] = measure(engine, args.repeats)
        del engine, loaded
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    tiny = Engine(load_model("tiny.en", dtype="float32"), EngineConfig())
    results["tiny.en"] = measure(tiny, args.repeats)
    results["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    results["load_average_after"] = list(os.getloadavg())
    path = write_results(f"shapes-{args.shape}", results)
    logger.info("wrote %s", path)
    headline = {
        "shape": args.shape,
        "window_p50_ms": results["model"]["window"]["p50_ms"],
        "encoder_p50_ms": results["model"]["encoder"]["p50_ms"],
        "decoder_ms_per_step": results["model"]["decoder_ms_per_step"],
        "tiny.en_window_p50_ms": results["tiny.en"]["window"]["p50_ms"],
    }
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
