"""Uploads: how long a POSTed recording takes, and what it does to live streams.

    python -m bench.uploads [--seconds 60] [--live 2] [--upload-s 600] [--beams 5,1]
    make bench-uploads   # BENCH_UPLOADS_ARGS="--beams 5 --upload-s 300"

For each beam size, a server of its own (``--file-beam-size B``, run as ``bench-capacity``
runs it):

1. Idle: a ``--seconds`` piece of a long English recording (cut at a pause) POSTed to
   ``/v1/audio/transcriptions`` three times, one after the other: wall time p50 and real-time
   factor, and whether the text is our offline decode's of the same audio (same beam size,
   temperature fallback, cut into the same parts at pauses as the idle server cuts it to
   decode them side by side, one per lane), word for word.
2. Live: ``--live`` real-time streams (``bench-capacity``'s) alone, then the same streams again
   while a ``--upload-s`` recording is POSTed as they start: their final-latency p95 both ways
   (the upload's windows yield to theirs) and the upload's wall time.

Writes ``bench/results/uploads.json``; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np

from bench.capacity import (
    Contender,
    SweepConfig,
    build_streams,
    measure_window_2s_ms,
    quiet_cut,
    run_count,
    window_2s_ms_p50,
)
from bench.corpus import wav_bytes
from bench.engine import speech_dir, write_results
from bench.latency_audio import Float32Array, long_recordings
from server.core.engine_api import DecodeOptions
from server.core.long_form import (
    FALLBACK_TEMPERATURES,
    LongForm,
    join_transcripts,
    split_recording,
)
from server.engine.engine import Engine, EngineConfig, default_decode_lanes
from server.protocol.audio import read_audio_file
from server.protocol.formats import SAMPLE_RATE_HZ
from server.serve.rest import MIN_PART_S

logger = logging.getLogger("bench.uploads")

IDLE_REPEATS = 3
UPLOAD_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class UploadConfig:
    seconds: float = 60.0  # the idle upload's length
    live: int = 2  # real-time streams beside the long upload
    upload_s: float = 600.0  # the long upload's length
    beams: tuple[int, ...] = (5, 1)
    live_seconds: float = 60.0  # speech per live stream

    def __post_init__(self) -> None:
        if self.seconds <= 0 or self.upload_s <= 0 or self.live < 1 or not self.beams:
            raise ValueError("seconds, upload_s > 0; live >= 1; at least one beam size")


def recordings(config: UploadConfig) -> tuple[Float32Array, Float32Array]:
    """The idle upload (a piece of the first long recording, cut at a pause) and the long one
    (the English long recordings back to back, cut at a pause)."""
    audio = [read_audio_file(speech_dir() / row.file) for row in long_recordings()]
    first = audio[0]
    piece = first[: quiet_cut(first, config.seconds)]
    joined = np.concatenate(audio)
    if joined.shape[0] < config.upload_s * SAMPLE_RATE_HZ:
        repeats = int(np.ceil(config.upload_s * SAMPLE_RATE_HZ / joined.shape[0]))
        joined = np.concatenate([joined] * repeats)
    return piece, joined[: quiet_cut(joined, config.upload_s)]


async def post(port: int, audio: bytes) -> tuple[float, str]:
    """One upload: its wall time and text."""
    url = f"http://127.0.0.1:{port}/v1/audio/transcriptions"
    async with httpx.AsyncClient(timeout=UPLOAD_TIMEOUT_S) as client:
        started = time.perf_counter()
        answer = await client.post(
            url, files={"file": ("a.wav", audio, "audio/wav")}, data={"model": "whisper-1"}
        )
        elapsed = time.perf_counter() - started
    answer.raise_for_status()
    return elapsed, str(answer.json()["text"])


async def one_beam(
    beam: int, config: UploadConfig, piece: Float32Array, long: Float32Array, offline: str
) -> dict[str, Any]:
    who = Contender(f"uploads_beam{beam}", None, extra_args=("--file-beam-size", str(beam)))
    sweep = SweepConfig(counts=(config.live,), seconds=config.live_seconds, peer=False)
    streams, _ = build_streams(sweep, config.live)
    out: dict[str, Any] = {"beam_size": beam}
    async with who.process() as server:
        piece_wav = wav_bytes(piece)
        idle = [await post(who.port, piece_wav) for _ in range(IDLE_REPEATS)]
        wall = statistics.median(t for t, _ in idle)
        out["idle"] = {
            "audio_s": round(piece.shape[0] / SAMPLE_RATE_HZ, 2),
            "wall_s": [round(t, 2) for t, _ in idle],
            "wall_s_p50": round(wall, 2),
            "realtime_x": round(piece.shape[0] / SAMPLE_RATE_HZ / wall, 1),
            "same_as_offline": all(text == offline for _, text in idle),
        }
        logger.info("beam %d idle: %s", beam, json.dumps(out["idle"]))
        alone = await run_count(who, server, streams, config.live)
        upload = asyncio.create_task(post(who.port, wav_bytes(long)))
        beside = await run_count(who, server, streams, config.live)
        upload_s, text = await upload
        out["live"] = {
            "streams": config.live,
            "alone_final_p95_ms": alone["final_latency"]["p95_ms"],
            "with_upload_final_p95_ms": beside["final_latency"]["p95_ms"],
            "alone_ttft_p95_ms": alone["ttft"]["p95_ms"],
            "with_upload_ttft_p95_ms": beside["ttft"]["p95_ms"],
            "alone_wer": alone["wer"],
            "with_upload_wer": beside["wer"],
            "upload_audio_s": round(long.shape[0] / SAMPLE_RATE_HZ, 1),
            "upload_wall_s": round(upload_s, 1),
            "upload_words": len(text.split()),
        }
        logger.info("beam %d live: %s", beam, json.dumps(out["live"]))
    return out


def offline_text(engine: Engine, audio: Float32Array, beam: int, lanes: int) -> str:
    """Our offline decode of ``audio`` in the parts an idle server with ``lanes`` lanes cuts
    it into (``server.serve.rest``)."""
    options = DecodeOptions(word_timestamps=False, beam_size=beam)
    whole = LongForm(audio, options, FALLBACK_TEMPERATURES)
    parts = split_recording(whole, max(1, min(lanes, int(whole.duration_s // MIN_PART_S))))
    for part in parts:
        while (job := part.next_window()) is not None:
            part.take(*engine.transcribe_window(job.audio, job.request, job.temperatures))
    return join_transcripts([p.transcript() for p in parts]).text


async def run(config: UploadConfig) -> dict[str, Any]:
    piece, long = recordings(config)
    engine = Engine.load(EngineConfig())
    engine.warmup()
    lanes = default_decode_lanes()  # the server's --decode-lanes auto
    offline = {beam: offline_text(engine, piece, beam, lanes) for beam in config.beams}
    measured_ms = measure_window_2s_ms(engine)
    del engine
    results: dict[str, Any] = {"config": asdict(config), "loadavg_start": os.getloadavg()}
    results["runs"] = [await one_beam(b, config, piece, long, offline[b]) for b in config.beams]
    results["loadavg_end"] = os.getloadavg()
    window_ms, source = window_2s_ms_p50(measured_ms)
    results["window_2s_ms_p50"] = window_ms
    results["window_2s_source"] = source
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=60.0, help="the idle upload's length")
    parser.add_argument("--live", type=int, default=2, help="real-time streams beside it")
    parser.add_argument("--upload-s", type=float, default=600.0, help="the long upload's length")
    parser.add_argument("--beams", default="5,1", help="comma-separated beam sizes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = UploadConfig(
        seconds=args.seconds,
        live=args.live,
        upload_s=args.upload_s,
        beams=tuple(int(b) for b in args.beams.split(",")),
    )
    started = time.perf_counter()
    results = asyncio.run(run(config))
    results["wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results("uploads", results)
    print(f"wrote {path} in {results['wall_s']:.0f} s")
    headline = {
        f"beam{r['beam_size']}": {
            "idle_wall_s_p50": r["idle"]["wall_s_p50"],
            "same_as_offline": r["idle"]["same_as_offline"],
            "live_final_p95_ms_alone": r["live"]["alone_final_p95_ms"],
            "live_final_p95_ms_with_upload": r["live"]["with_upload_final_p95_ms"],
            "upload_wall_s": r["live"]["upload_wall_s"],
        }
        for r in results["runs"]
    } | {"window_2s_ms_p50": results["window_2s_ms_p50"]}
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
